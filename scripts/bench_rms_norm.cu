// The fused RMS norm on the decode's shapes (issue 16): the kernel of this tree against an earlier
// commit's (bit for bit on the same inputs, and TB/s), a copy of the same bytes, and a sweep of launch
// shapes and memory instructions of a simplified kernel. Built and run by scripts/bench_rms_norm.sh on a
// CUDA machine (no torch). Bytes: each input read once, each output written once.
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "../kernels/wan22_vae_decode/rms_norm_silu.cu"
#include "rms_old.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

struct alignas(16) V8 { __nv_bfloat162 v[4]; };

template <bool NC>
__device__ __forceinline__ void ld8(const __nv_bfloat16* p, float (&o)[8]) {
    uint4 raw;
    if (NC) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w) : "l"(p));
    } else {
        raw = *reinterpret_cast<const uint4*>(p);
    }
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(h[i]); o[2*i] = f.x; o[2*i+1] = f.y; }
}
template <bool CS>
__device__ __forceinline__ void st8(__nv_bfloat16* p, const float (&in)[8]) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2*i], in[2*i+1]);
    if (CS) asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(raw.x), "r"(raw.y), "r"(raw.z), "r"(raw.w));
    else *reinterpret_cast<uint4*>(p) = raw;
}

// Simplified: one dense frame block of rows; x (+res) (+bias) -> (sum_out) out = silu(norm(v) * g)
template <int NV, int R, int WARPS, bool NC, bool CS, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB) norm_v(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ res,
        const float* __restrict__ bias, const float* __restrict__ gamma, __nv_bfloat16* __restrict__ sum_out,
        __nv_bfloat16* __restrict__ out, int64_t rows, int C) {
    const int lane = threadIdx.x & 31;
    const int64_t first = (int64_t(blockIdx.x) * WARPS + (threadIdx.x >> 5)) * R;
    float v[R][NV][8];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = (k * 32 + lane) * 8;
            const int64_t row = first + r;
            if (row < rows && c < C) {
                ld8<NC>(x + row * C + c, v[r][k]);
                if (res) { float t[8]; ld8<NC>(res + row * C + c, t);
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[r][k][i] += t[i]; }
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) v[r][k][i] = 0.f;
            }
        }
    float ss[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        ss[r] = 0.f;
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = (k * 32 + lane) * 8;
            if (first + r < rows && c < C) {
                if (bias) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[r][k][i] += __ldg(bias + c + i);
                }
                if (bias || res) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[r][k][i] = __bfloat162float(__float2bfloat16_rn(v[r][k][i]));
                    if (sum_out) st8<CS>(sum_out + (first + r) * C + c, v[r][k]);
                }
#pragma unroll
                for (int i = 0; i < 8; ++i) ss[r] += v[r][k][i] * v[r][k][i];
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int r = 0; r < R; ++r) ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], o);
#pragma unroll
    for (int r = 0; r < R; ++r) ss[r] = 1.f / fmaxf(sqrtf(ss[r]), 1e-12f);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = (k * 32 + lane) * 8;
        if (c >= C) continue;
        float g[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) g[i] = __ldg(gamma + c + i);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (first + r >= rows) continue;
            float y[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) { const float n = v[r][k][i] * ss[r] * g[i]; y[i] = n / (1.f + __expf(-n)); }
            st8<CS>(out + (first + r) * C + c, y);
        }
    }
}

__global__ void copy_v(const uint4* __restrict__ a, const uint4* __restrict__ b, uint4* __restrict__ o1, uint4* __restrict__ o2, int64_t n) {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        uint4 va = a[i]; uint4 vb = b ? b[i] : va;
        va.x ^= vb.y;
        if (o1) o1[i] = vb;
        o2[i] = va;
    }
}

struct Case { const char* name; int64_t rows; int C; bool res, bias, sum; };

template <class F>
float time_ms(F f, int reps = 20) {
    cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) f();
    CK(cudaDeviceSynchronize());
    std::vector<float> ts;
    for (int i = 0; i < reps; ++i) { CK(cudaEventRecord(a)); f(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b)); float t; CK(cudaEventElapsedTime(&t, a, b)); ts.push_back(t); }
    std::sort(ts.begin(), ts.end());
    CK(cudaGetLastError());
    return ts[ts.size() / 2];
}

int main() {
    const Case cases[] = {
        {"up3 norm1 C256 x+res->sum,out (1 fr)", 219648, 256, true, false, true},
        {"up3 norm2 C256 x+bias->out (1 fr)", 219648, 256, false, true, false},
        {"up3 norm2 C256 x->out (1 fr)", 219648, 256, false, false, false},
        {"up3 head C256 x+res->out (1 fr)", 219648, 256, true, false, false},
        {"up3 blk0 C512 x->out (1 fr)", 219648, 512, false, false, false},
        {"up1 C1024 x+bias->out (8 fr)", 8 * 13728, 1024, false, true, false},
        {"up2 C1024 x->out (2 fr)", 2 * 54912, 1024, false, false, false},
        {"up2 norm1 C512 x+res->sum,out (2 fr)", 2 * 54912, 512, true, false, true},
    };
    const size_t maxe = size_t(2 * 219648) * 512; // also >= 8*13728*1024
    __nv_bfloat16 *x, *res, *sum, *out, *out2, *sum2; float *bias, *gamma;
    CK(cudaMalloc(&out2, maxe * 2)); CK(cudaMalloc(&sum2, maxe * 2));
    CK(cudaMalloc(&x, maxe * 2)); CK(cudaMalloc(&res, maxe * 2)); CK(cudaMalloc(&sum, maxe * 2)); CK(cudaMalloc(&out, maxe * 2));
    CK(cudaMalloc(&bias, 4096 * 4)); CK(cudaMalloc(&gamma, 4096 * 4));
    { std::vector<__nv_bfloat16> h(maxe); for (size_t i = 0; i < maxe; ++i) h[i] = __float2bfloat16(float((i * 2654435761u) % 1000) / 500.f - 1.f);
      CK(cudaMemcpy(x, h.data(), maxe * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(res, h.data(), maxe * 2, cudaMemcpyHostToDevice));
      std::vector<float> g(4096, 1.3f); CK(cudaMemcpy(gamma, g.data(), 4096 * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(bias, g.data(), 4096 * 4, cudaMemcpyHostToDevice)); }
    printf("| case | GB | new ms | new TB/s | old TB/s | in-place new TB/s | copy TB/s | best variant | best TB/s | new==old |\n");
    for (const Case& cs : cases) {
        const double bytes = double(cs.rows) * cs.C * 2 * (2 + cs.res + cs.sum);
        wan22::RmsNormParams p{};
        p.x = x; p.residual = cs.res ? res : nullptr; p.bias = cs.bias ? bias : nullptr; p.gamma = gamma;
        p.sum_out = cs.sum ? sum : nullptr; p.out = out; p.x_frame_stride = 219648LL * cs.C; p.out_batch_stride = 0; p.out_frame_stride = p.x_frame_stride;
        p.rows_per_frame = cs.rows / 2; p.frames_per_batch = 2; p.num_frames = 2; p.channels = cs.C; p.silu = true; p.normalize = true;
        p.x_frame_stride = p.rows_per_frame * cs.C; p.out_frame_stride = p.x_frame_stride;
        const int frames = cs.rows == 219648 ? 1 : 2;
        p.rows_per_frame = cs.rows / frames; p.frames_per_batch = frames; p.num_frames = frames;
        p.x_frame_stride = p.rows_per_frame * cs.C; p.out_frame_stride = p.x_frame_stride;
        float prod = time_ms([&] { wan22::rms_norm_silu(p, 0); });
        float old = time_ms([&] { wan22_old::rms_norm_silu(p, 0); });
        // bits: old vs new on the same inputs (in place like the decoder when the sum is kept)
        const size_t n = size_t(cs.rows) * cs.C;
        std::vector<uint16_t> a(n), bb(n), sa(n), sb(n);
        wan22::RmsNormParams q = p; q.out = out2; q.sum_out = cs.sum ? sum2 : nullptr;
        wan22_old::rms_norm_silu(p, 0); wan22::rms_norm_silu(q, 0); CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(a.data(), out, n * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(bb.data(), out2, n * 2, cudaMemcpyDeviceToHost));
        size_t diff = 0; for (size_t i = 0; i < n; ++i) diff += a[i] != bb[i];
        if (cs.sum) { CK(cudaMemcpy(sa.data(), sum, n * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(sb.data(), sum2, n * 2, cudaMemcpyDeviceToHost)); for (size_t i = 0; i < n; ++i) diff += sa[i] != sb[i]; }
        // in place: sum_out = x (the decoder's keep_sum), through a copy of x
        float inplace = 0;
        if (cs.sum) { wan22::RmsNormParams r = p; r.x = (const __nv_bfloat16*)sum2; r.sum_out = sum2;
            inplace = time_ms([&] { wan22::rms_norm_silu(r, 0); }); }
        const int64_t n16 = cs.rows * cs.C / 8;
        float cp = time_ms([&] { copy_v<<<132 * 8, 256>>>((const uint4*)x, cs.res ? (const uint4*)res : nullptr, cs.sum ? (uint4*)sum : nullptr, (uint4*)out, n16); });
        double cp_bytes = double(cs.rows) * cs.C * 2 * ((cs.res ? 2 : 1) + (cs.sum ? 2 : 1));
        const char* best = "prod"; float bt = prod;
#define TRY(NV, R, W, NC, CS, MB) { \
            const int64_t blocks = (cs.rows + (W * R) - 1) / (W * R); \
            float t = time_ms([&] { norm_v<NV, R, W, NC, CS, MB><<<unsigned(blocks), W * 32>>>(x, cs.res ? res : nullptr, cs.bias ? bias : nullptr, gamma, cs.sum ? sum : nullptr, out, cs.rows, cs.C); }); \
            printf("    %-34s NV%d R%d W%d NC%d CS%d MB%d: %.4f ms %.2f TB/s\n", cs.name, NV, R, W, NC, CS, MB, t, bytes / t / 1e9); \
            if (t < bt) { bt = t; static char buf[64]; snprintf(buf, 64, "NV%d R%d W%d NC%d CS%d MB%d", NV, R, W, NC, CS, MB); best = buf; } }
        if (cs.C == 256) {
            TRY(1, 4, 8, false, false, 1) TRY(1, 4, 8, true, false, 1) TRY(1, 4, 8, true, true, 1) TRY(1, 4, 8, false, true, 1)
            TRY(1, 8, 8, true, false, 1) TRY(1, 2, 8, true, false, 1) TRY(1, 4, 4, true, false, 1) TRY(1, 4, 8, true, false, 4)
            TRY(1, 8, 4, true, true, 1) TRY(1, 2, 16, true, false, 1)
        } else if (cs.C == 512) {
            TRY(2, 2, 8, false, false, 1) TRY(2, 2, 8, true, false, 1) TRY(2, 2, 8, true, true, 1) TRY(2, 4, 8, true, false, 1)
            TRY(2, 1, 8, true, false, 1) TRY(2, 2, 4, true, false, 1) TRY(2, 2, 8, true, false, 3)
        } else if (cs.rows < 8 * 13728) {
            TRY(4, 1, 8, false, false, 1) TRY(4, 1, 8, true, false, 1) TRY(4, 1, 8, true, true, 1) TRY(4, 2, 8, true, false, 1) TRY(4, 1, 4, true, false, 1)
        }
        if (0) {}
        printf("| %s | %.2f | %.4f | %.2f | %.2f | %.2f | %.2f | %s | %.2f | %s (%zu) |\n", cs.name, bytes / 1e9, prod, bytes / prod / 1e9, bytes / old / 1e9, inplace > 0 ? bytes / inplace / 1e9 : 0.0, cp_bytes / cp / 1e9, best, bytes / bt / 1e9, diff == 0 ? "yes" : "NO", diff);
    }
    // plain D2D copy
    float t = time_ms([&] { CK(cudaMemcpyAsync(out, x, maxe * 2, cudaMemcpyDeviceToDevice)); });
    printf("cudaMemcpy D2D %.2f GB: %.2f TB/s (read+write)\n", maxe * 2 / 1e9, 2.0 * maxe * 2 / t / 1e9);
    return 0;
}
