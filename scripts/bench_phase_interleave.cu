// The four-phase resampler epilogue on the decode's shapes (issue 16): this tree's kernel against an
// earlier commit's, bit for bit on the same inputs, and TB/s (phases and shortcut read once, output
// written once). Built and run by scripts/bench_phase_interleave.sh on a CUDA machine (no torch).
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "../kernels/wan22_vae_decode/resample.cu"
#include "resample_old.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

struct Case { const char* name; int frames_out, frames_in, h, w, C, C_in, factor_t, frame_offset; };

__global__ void fill(__nv_bfloat16* p, int64_t n, unsigned seed) {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        unsigned v = unsigned(i) * 2654435761u ^ seed;
        v ^= v >> 13; v *= 0x5bd1e995u; v ^= v >> 15;
        p[i] = __float2bfloat16(float(int(v & 0xffff) - 32768) / 16384.f);
    }
}

template <class F>
float time_ms(F launch, int repeats) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    launch();
    CK(cudaEventRecord(a));
    for (int r = 0; r < repeats; ++r) launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms / repeats;
}

int main() {
    const Case cases[] = {
        {"up0 upsample3d C 1024, 44x78, 2 frames of 1", 2, 1, 44, 78, 1024, 1024, 2, 0},
        {"up1 upsample3d C 1024, 88x156, 4 frames of 2", 4, 2, 88, 156, 1024, 1024, 2, 0},
        {"up2 upsample2d C 512 (shortcut 1024), a band of 88 rows of 176x312", 1, 1, 88, 312, 512, 1024, 1, 0},
        {"up2 upsample2d C 512, no shortcut", 1, 1, 88, 312, 512, 1024, 1, 0},
    };
    for (int ci = 0; ci < 4; ++ci) {
        const Case& c = cases[ci];
        const bool with_shortcut = ci != 3;
        const int64_t n_phases = int64_t(c.frames_out) * (c.h + 1) * (c.w + 1) * 4 * c.C;
        const int64_t n_short = int64_t(c.frames_in) * c.h * c.w * c.C_in;
        const int64_t n_out = int64_t(c.frames_out) * 4 * c.h * c.w * c.C;
        __nv_bfloat16 *phases, *shortcut, *out_new, *out_old;
        float* bias;
        CK(cudaMalloc(&phases, n_phases * 2)); CK(cudaMalloc(&shortcut, n_short * 2));
        CK(cudaMalloc(&out_new, n_out * 2)); CK(cudaMalloc(&out_old, n_out * 2));
        CK(cudaMalloc(&bias, c.C * 4));
        fill<<<1024, 256>>>(phases, n_phases, 1); fill<<<1024, 256>>>(shortcut, n_short, 2);
        std::vector<float> hb(c.C);
        for (int k = 0; k < c.C; ++k) hb[k] = 0.01f * (k % 17);
        CK(cudaMemcpy(bias, hb.data(), c.C * 4, cudaMemcpyHostToDevice));
        wan22::PhaseInterleaveParams p{};
        p.phases = phases; p.bias = bias; p.shortcut = with_shortcut ? shortcut : nullptr;
        p.batch = 1; p.frames_out = c.frames_out; p.frames_in = c.frames_in; p.height = c.h; p.width = c.w;
        p.channels = c.C; p.shortcut_channels = with_shortcut ? c.C_in : c.C; p.factor_t = c.factor_t;
        p.repeats = with_shortcut ? c.C * c.factor_t * 4 / c.C_in : 1; p.frame_offset = c.frame_offset;
        auto p_new = p; p_new.out = out_new;
        auto p_old = p; p_old.out = out_old;
        const float ms_new = time_ms([&] { wan22::phase_interleave(p_new, 0); }, 20);
        const float ms_old = time_ms([&] { wan22_old::phase_interleave(p_old, 0); }, 20);
        CK(cudaDeviceSynchronize());
        std::vector<uint16_t> a(n_out), b(n_out);
        CK(cudaMemcpy(a.data(), out_new, n_out * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b.data(), out_old, n_out * 2, cudaMemcpyDeviceToHost));
        const bool same = a == b;
        const double bytes = 2.0 * (n_phases + (with_shortcut ? n_short : 0) + n_out);
        printf("%-70s old %.3f ms %.2f TB/s | new %.3f ms %.2f TB/s | bit-identical %s\n", c.name, ms_old,
               bytes / ms_old / 1e9, ms_new, bytes / ms_new / 1e9, same ? "yes" : "NO");
        CK(cudaFree(phases)); CK(cudaFree(shortcut)); CK(cudaFree(out_new)); CK(cudaFree(out_old)); CK(cudaFree(bias));
    }
    return 0;
}
