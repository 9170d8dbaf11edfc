// fp8 attention for Hopper (sm_90a): softmax(Q·Kᵀ/√D)·V with e4m3 Q, K, V, no mask, head dim 128, bf16 out.
// The fp8 tier's default attention on sm_90 with head dim 128 (`pan2cli.dit.cuda_fp8_attention` picks one of
// the fourteen instantiations by GPU and token count, from measurements); its own extension (binding.cpp).
//
// One CTA takes 128 query rows of one (batch, head): two consumer warpgroups of 64 rows each, and a producer
// warpgroup that fills a ring of shared-memory stages with K and Vᵀ tiles of 128 keys (or 224, below), in
// the 128-byte swizzle wgmma reads (an mbarrier pair per stage), either by cp.async (the whole warpgroup,
// 16-byte chunks) or by TMA (one thread: a copy of K and of each 128-key box of Vᵀ a tile). setmaxnreg gives
// the registers to the consumers. Each consumer issues P(j-1)·V(j-1) and S(j) = Q·K(j)ᵀ back to back, then
// runs the softmax of S(j); with the ping-pong schedule (named barriers) the two warpgroups take turns at the
// MMAs, so one's softmax overlaps the other's MMAs (FlashAttention-3's schedule; the exponentials are as
// much work as the MMAs, so overlapping them is the point).
//
// Per key tile, in a consumer warpgroup:
//   S = Q·Kᵀ         wgmma m64n128k32 e4m3, both operands in shared memory, float32 accumulators;
//   online softmax   float32, in log2 units (exp2 with the softmax scale and Q/K descales folded into one
//                    FMA), P made 2^P_SHIFT larger before its e4m3 cast so small probabilities stay normal;
//   T = P·V          wgmma with P in registers: S's accumulator fragment is reused as the A fragment with
//                    no shuffle, because the keys are permuted in one operand so that the two layouts agree
//                    (`key_of_row`): the cp.async producer writes K's rows in that order (V in key order),
//                    with TMA the keys of V come permuted (values_fp8's key_order="wgmma"), K in key order;
//   O = O·α + T      float32: each tile's P·V leaves the tensor core before it is summed across tiles
//                    (Hopper's fp8 MMA keeps fewer bits in its accumulator; over 10⁵ keys that would show).
// The row sum is taken from the float32 P (before its cast), as in the Triton kernel (fp8_attention_kernel.py).
//
// Wide key tiles (TMA, three stages; FlashAttention-3's configuration for fp8 at head dim 128): 224 keys a
// tile, so that the fixed costs of a tile (row maxima across a quad, α, O's rescale, the barriers) are paid
// 1.75x less often. The registers this needs come from O: it is accumulated in the tensor core across tiles
// (O·α first, then P·V onto it). That is as accurate as the float32 sum where V's tokens average to about
// zero (random V: 0.0191 against 0.0190 at 104,118 tokens, on an H100), not where they share a part, as a
// DiT's do (AdaLN's shift): the accumulator grows with the keys and each tile's P·V loses bits against it
// (Hopper's fp8 MMA keeps fewer bits in its accumulator), and the full model's velocity went from 5.0 % off
// bf16 to 12.6 %. So V comes smoothed for these tiles, quantised less its mean over the tokens (`v_mean`,
// values_fp8's `mean`), which the epilogue adds back: exact, a softmax row sums to 1, and the velocity is
// back at 5.0 % (H100, scripts/fp8_accuracy.py --full).
// S is one m64n224k32 wgmma a k-step; Vᵀ comes as two 128-key boxes (a 128-byte swizzle span holds 128
// keys; the second box's last 32 are read and not used). Its order is FlashAttention-3's: S(j) issued,
// O·α(j-1), P(j-1)·V(j-1) issued, the softmax of S(j) while P(j-1)·V(j-1) runs.
//
// Layouts: q, k `[B, S, H, 128]` e4m3 contiguous; v_t `[B, H, 128, S_pad]` e4m3 (keys contiguous, S_pad a
// multiple of 16, the padding zero); out `[B, S, H, 128]` bf16. Keys past S take no weight (masked in the
// last tile), query rows past S are computed on zeros and not stored.

#pragma nv_diag_suppress 177  // unused helpers in the passes for other GPUs, which compile an empty kernel
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fp8_attention.h"
#include "fp8_attention_layout.h"
#include "wgmma_e4m3.cuh"

namespace pan2_fp8_attention {
namespace {

constexpr int kHeadDim = 128;
constexpr int kRowsPerWarpgroup = 64;
constexpr int kConsumers = 2;
constexpr int kBlockM = kRowsPerWarpgroup * kConsumers;
constexpr int kTileBytes = 128 * 128;  // a 128x128 e4m3 tile: Q's rows, a Vᵀ box of 128 keys
constexpr int kConsumerThreads = 128 * kConsumers;
constexpr int kThreads = kConsumerThreads + 128;  // + the producer warpgroup
constexpr int kNarrow = 128, kWide = 224;     // keys a tile

// What a key tile of kBlockN keys takes: K's rows (128 bytes each), Vᵀ's 128-key boxes, a thread's S
// accumulators, P·V's k32 steps, and the registers a thread, set with setmaxnreg once the roles split (the
// launch gives each 65536 / 384 = 168): the producer needs few; the consumers hold S (kBlockN / 2), O (64),
// P (kBlockN / 8) and, with 128-key tiles, P·V's own accumulators (64).
template <int kBlockN>
struct KeyTile {
    static_assert(kBlockN == kNarrow || kBlockN == kWide, "128 or 224 keys a tile");
    static constexpr int kKeyBytes = kBlockN * 128;
    static constexpr int kValueBoxes = (kBlockN + 127) / 128;
    static constexpr int kValueBytes = kValueBoxes * kTileBytes;
    static constexpr int kScores = kBlockN / 2;
    static constexpr int kKeyBlocks = kBlockN / 32;
    static constexpr int kProducerRegisters = kBlockN == kNarrow ? 40 : 24;
    static constexpr int kConsumerRegisters = kBlockN == kNarrow ? 232 : 240;
    static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= 65536, "register file");
};

template <int kStages, int kBlockN>
struct SharedStorage {
    static constexpr int kQ = 0;
    static constexpr int kK = kTileBytes;
    static constexpr int kV = kK + kStages * KeyTile<kBlockN>::kKeyBytes;
    static constexpr int kBarriers = kV + kStages * KeyTile<kBlockN>::kValueBytes;  // full[kStages], empty[kStages]
    static constexpr int kBytes = kBarriers + 2 * kStages * 8 + 1024;  // + room to align the base to 1024
};

__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void barrier_init(uint32_t barrier, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(barrier), "r"(count));
}

__device__ __forceinline__ void barrier_arrive(uint32_t barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
}

__device__ __forceinline__ bool barrier_try_wait(uint32_t barrier, uint32_t parity) {
    uint32_t done;
    asm volatile(
            "{\n.reg .pred done;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [%1], %2;\n"
            "selp.u32 %0, 1, 0, done;\n}\n"
            : "=r"(done)
            : "r"(barrier), "r"(parity)
            : "memory");
    return done != 0;
}

// Waits for the phase of `parity` to complete. (A spin counter with a trap after N tries, to fail a lost
// arrival instead of hanging, costs the consumers registers: ptxas then spills and serialises the wgmma.)
__device__ __forceinline__ void barrier_wait(uint32_t barrier, uint32_t parity) {
    while (!barrier_try_wait(barrier, parity)) {
    }
}

// 16 bytes global → shared, zero-filled where `valid` is false (nothing is read then).
__device__ __forceinline__ void copy_16(uint32_t destination, const void* source, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(destination), "l"(source),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void barrier_expect_bytes(uint32_t barrier, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(bytes) : "memory");
}

// A TMA copy of the box at (c0, c1, c2, c3) of `map` into shared memory; completes `bytes` on `barrier`.
__device__ __forceinline__ void tma_load(uint32_t destination, const CUtensorMap& map, int c0, int c1, int c2,
                                         int c3, uint32_t barrier) {
    asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
            "%5}], [%6];" ::"r"(destination),
            "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(barrier)
            : "memory");
}

// The wgmma shared-memory descriptor of a K-major, 128-byte-swizzled operand (rows of 128 bytes, 8-row
// groups 1024 bytes apart), starting `k_bytes` into each row.
__device__ __forceinline__ uint64_t descriptor(uint32_t tile, int k_bytes) {
    const uint64_t start = ((tile + k_bytes) & 0x3FFFF) >> 4;
    constexpr uint64_t leading = 1;       // unused by swizzled K-major layouts (assumed 1)
    constexpr uint64_t stride = 1024 >> 4;
    constexpr uint64_t swizzle_128b = 1;
    return start | (leading << 16) | (stride << 32) | (swizzle_128b << 62);
}

__device__ __forceinline__ uint32_t pack_e4m3(float x0, float x1, float x2, float x3) {
    uint16_t low, high;  // cvt puts its first source in the upper byte
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(low) : "f"(x0), "f"(x1));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(high) : "f"(x2), "f"(x3));
    return static_cast<uint32_t>(low) | (static_cast<uint32_t>(high) << 16);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Pins the accumulators in place around an asynchronous wgmma: the compiler may not move their reads or
// writes across this point (CUTLASS's warpgroup_fence_operand), whatever it can prove about the waits.
template <int N>
__device__ __forceinline__ void fence_registers(float (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
}

template <int kPending>  // wait until at most kPending committed groups of wgmma are still running
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

struct Params {
    // The TMA variant's tensor maps (encoded on the host; unused by the cp.async variant), 4-D, innermost
    // first: Q and K (128 bytes, H, S tokens, B) in boxes of 128 tokens (K: of a key tile's) of one head, Vᵀ
    // (S_pad keys in wgmma order, see values_fp8; 128 channels, H, B) in boxes of 128 keys; 128-byte
    // swizzled, tokens and keys out of range read as zeros.
    CUtensorMap q_map, k_map, v_map;
    const uint8_t* q;
    const uint8_t* k;
    const uint8_t* v_t;
    const float* qk_descale;  // [1]
    const float* v_descale;   // [H]
    const float* v_mean;      // [B, H·128] or null: added to the output (V smoothed, `values_fp8`'s mean)
    __nv_bfloat16* out;
    int n_tokens;
    int n_heads;
    int s_pad;
    float sm_scale_log2;  // log2(e) / √D
    float p_shift;
};

// The TMA producer: one thread issues a copy of K and one of Vᵀ a tile, two with wide tiles (Q once, with the
// first tile).
template <int kStages, int kBlockN>
__device__ __forceinline__ void produce_tma(const Params& p, uint8_t* smem, int batch, int head, int start_m,
                                            int n_tiles) {
    using Smem = SharedStorage<kStages, kBlockN>;
    using Tile = KeyTile<kBlockN>;
    if (threadIdx.x != kConsumerThreads) return;
    const uint32_t base = smem_address(smem);
    const uint32_t full = base + Smem::kBarriers, empty = full + kStages * 8;
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int stage = tile % kStages, start_n = tile * kBlockN;
        if (tile >= kStages) barrier_wait(empty + stage * 8, ((tile / kStages) - 1) & 1);
        // A box counts in full, the parts out of range (zeros) too.
        barrier_expect_bytes(full + stage * 8, (tile == 0 ? kTileBytes : 0) + Tile::kKeyBytes + Tile::kValueBytes);
        if (tile == 0) tma_load(base + Smem::kQ, p.q_map, 0, head, start_m, batch, full);
        tma_load(base + Smem::kK + stage * Tile::kKeyBytes, p.k_map, 0, head, start_n, batch, full + stage * 8);
        const uint32_t v_tile = base + Smem::kV + stage * Tile::kValueBytes;
#pragma unroll
        for (int box = 0; box < Tile::kValueBoxes; ++box) {
            tma_load(v_tile + box * kTileBytes, p.v_map, start_n + 128 * box, 0, head, batch, full + stage * 8);
        }
    }
}

// The cp.async producer: the whole warpgroup copies 16-byte chunks, K's rows in `key_of_row` order.
template <int kStages>
__device__ __forceinline__ void produce(const Params& p, uint8_t* smem, int batch, int head, int start_m,
                                        int n_tiles) {
    using Smem = SharedStorage<kStages, kNarrow>;
    constexpr int kBlockN = kNarrow;
    const int thread = threadIdx.x - kConsumerThreads;  // 0..127: one warp on each of the SM's 4 schedulers
    const uint32_t base = smem_address(smem);
    const size_t row_stride = static_cast<size_t>(p.n_heads) * kHeadDim;  // bytes between tokens
    const uint8_t* q_head = p.q + static_cast<size_t>(batch) * p.n_tokens * row_stride + head * kHeadDim;
    const uint8_t* k_head = p.k + static_cast<size_t>(batch) * p.n_tokens * row_stride + head * kHeadDim;
    const uint8_t* v_head = p.v_t + (static_cast<size_t>(batch) * p.n_heads + head) * kHeadDim * p.s_pad;

    // Each thread copies one 16-byte chunk column of 8 rows, 16 apart: rows r0 + 16i hold keys key_of_row(r0)
    // + 16i (the permutation keeps 16-row steps), so every address below is a base plus a constant stride.
    const int row0 = thread >> 3, chunk = thread & 7;
    const uint32_t smem_offset = swizzled(row0, chunk);  // + 16i rows = + 2048i bytes (row0 & 7 is unchanged)
    const int key0 = key_of_row(row0);
    const uint8_t* k_chunk = k_head + static_cast<size_t>(key0) * row_stride + chunk * 16;
    const uint8_t* v_chunk = v_head + static_cast<size_t>(row0) * p.s_pad + chunk * 16;

    // Q's 128 rows go with the first tile's group (its full barrier covers them).
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int token = start_m + row0 + 16 * i;
        const bool valid = token < p.n_tokens;
        const uint8_t* source = q_head + static_cast<size_t>(token) * row_stride + chunk * 16;
        copy_16(base + Smem::kQ + smem_offset + 2048 * i, valid ? source : q_head, valid);
    }
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int stage = tile % kStages, start_n = tile * kBlockN;
        if (tile >= kStages) barrier_wait(base + Smem::kBarriers + (kStages + stage) * 8, ((tile / kStages) - 1) & 1);
        const uint32_t k_tile = base + Smem::kK + stage * kTileBytes + smem_offset;
        const uint32_t v_tile = base + Smem::kV + stage * kTileBytes + smem_offset;
        const bool v_valid = start_n + chunk * 16 < p.s_pad;  // Vᵀ: row = channel, 16 keys a chunk
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const bool k_valid = start_n + key0 + 16 * i < p.n_tokens;
            const uint8_t* k_source = k_chunk + static_cast<size_t>(start_n + 16 * i) * row_stride;
            copy_16(k_tile + 2048 * i, k_valid ? k_source : k_head, k_valid);
            const uint8_t* v_source = v_chunk + static_cast<size_t>(16 * i) * p.s_pad + start_n;
            copy_16(v_tile + 2048 * i, v_valid ? v_source : v_head, v_valid);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        if (tile > 0) {  // one group stays in flight: the previous tile is signalled once it has landed
            asm volatile("cp.async.wait_group 1;" ::: "memory");
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async writes → wgmma reads
            barrier_arrive(base + Smem::kBarriers + ((tile - 1) % kStages) * 8);
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    barrier_arrive(base + Smem::kBarriers + ((n_tiles - 1) % kStages) * 8);
}

// Named barriers 1 and 2: "warpgroup 0 (1) may issue its MMAs" (the ping-pong schedule; 0 is __syncthreads).
__device__ __forceinline__ void wait_turn(int warpgroup) {  // constant ids: ptxas then reserves only these two
    if (warpgroup == 0) {
        asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory");
    } else {
        asm volatile("bar.sync 2, %0;" ::"n"(kConsumerThreads) : "memory");
    }
}
__device__ __forceinline__ void pass_turn(int warpgroup) {
    if (warpgroup == 0) {
        asm volatile("bar.arrive 2, %0;" ::"n"(kConsumerThreads) : "memory");
    } else {
        asm volatile("bar.arrive 1, %0;" ::"n"(kConsumerThreads) : "memory");
    }
}

// The online softmax of one tile of scores, in place: s becomes P (≤ 2^P_SHIFT), row_max and row_sum are
// updated (the sum rescaled by α, which is returned per row for the output).
// kKeysInRowOrder: K's shared-memory rows hold keys in `key_of_row` order (the cp.async producer), else in
// their own order (TMA; V carries the permutation then).
template <bool kKeysInRowOrder, int kBlockN>
__device__ __forceinline__ void softmax_tile(float (&s)[kBlockN / 2], float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2], float qk_scale, float p_shift, int quad,
                                             int keys_left) {
    if (keys_left < kBlockN) {  // the last tile: keys past the sequence take no weight
#pragma unroll
        for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int column = 8 * i + 2 * quad + e;
                const int key = kKeysInRowOrder ? key_of_row(column) : column;
                if (key >= keys_left) s[4 * i + e] = s[4 * i + 2 + e] = -INFINITY;
            }
        }
    }
    // Row maxima of the raw scores (qk_scale > 0), over the 4 lanes of a quad that share a row.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
        tile_max[0] = fmaxf(tile_max[0], fmaxf(s[4 * i], s[4 * i + 1]));
        tile_max[1] = fmaxf(tile_max[1], fmaxf(s[4 * i + 2], s[4 * i + 3]));
    }
    float bias[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 2));
        const float new_max = fmaxf(row_max[r], tile_max[r] * qk_scale);
        alpha[r] = exp2f(row_max[r] - new_max);  // 0 on the first tile (row_max = -inf)
        bias[r] = new_max - p_shift;             // exp2(s·scale − bias) ≤ 2^P_SHIFT
        row_max[r] = new_max;
        row_sum[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) {
        const int r = (i >> 1) & 1;
        s[i] = exp2f(fmaf(s[i], qk_scale, -bias[r]));
        row_sum[r] += s[i];
    }
}

// O / row sum · V's descale (+ V's mean) → the warpgroup's 64 rows of `out` (bf16), the rows past the
// sequence left out.
__device__ __forceinline__ void store_output(const Params& p, const float (&o)[64], float (&row_sum)[2], int batch,
                                             int head, int start_m) {
    const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    const int quad = lane & 3, group = lane >> 2;
    const float v_descale = __ldg(p.v_descale + head);
    float out_scale[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_sum[r] += __shfl_xor_sync(0xffffffff, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffff, row_sum[r], 2);
        out_scale[r] = v_descale / row_sum[r];  // the row sum carries P's 2^P_SHIFT
    }
    const size_t row_stride = static_cast<size_t>(p.n_heads) * kHeadDim;
    const float* mean =
            p.v_mean == nullptr ? nullptr : p.v_mean + static_cast<size_t>(batch) * row_stride + head * kHeadDim;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int token = start_m + warpgroup * kRowsPerWarpgroup + warp * 16 + group + 8 * r;
        if (token >= p.n_tokens) continue;
        __nv_bfloat16* row = p.out + (static_cast<size_t>(batch) * p.n_tokens + token) * row_stride + head * kHeadDim;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const float2 shift = mean == nullptr ? make_float2(0.f, 0.f)
                                                 : __ldg(reinterpret_cast<const float2*>(mean + 8 * i + 2 * quad));
            const __nv_bfloat162 pair = __floats2bfloat162_rn(fmaf(o[4 * i + 2 * r], out_scale[r], shift.x),
                                                              fmaf(o[4 * i + 2 * r + 1], out_scale[r], shift.y));
            *reinterpret_cast<__nv_bfloat162*>(row + 8 * i + 2 * quad) = pair;
        }
    }
}

// What both consumers start from: their shared-memory addresses and the scale of the scores.
struct ConsumerSetup {
    uint32_t base, q_tile, full, empty;  // shared memory, this warpgroup's Q rows, the stages' barriers
    int warpgroup, quad;
    float qk_scale;  // log2(e)/√D times Q·K's descale
};

template <int kStages, int kBlockN>
__device__ __forceinline__ ConsumerSetup consumer_setup(const Params& p, uint8_t* smem) {
    using Smem = SharedStorage<kStages, kBlockN>;
    ConsumerSetup c;
    c.base = smem_address(smem);
    c.warpgroup = threadIdx.x / 128;
    c.quad = threadIdx.x & 3;
    c.qk_scale = p.sm_scale_log2 * __ldg(p.qk_descale);
    c.q_tile = c.base + Smem::kQ + c.warpgroup * kRowsPerWarpgroup * 128;
    c.full = c.base + Smem::kBarriers;
    c.empty = c.full + kStages * 8;
    return c;
}

// O zeroed and the softmax state of its two rows before any key: maximum −∞, sum 0.
__device__ __forceinline__ void start_rows(float (&o)[64], float (&row_max)[2], float (&row_sum)[2],
                                           float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_max[r] = -INFINITY;
        row_sum[r] = 0.f;
        alpha[r] = 0.f;
    }
}

// Phase 0 of both consumers: S(0) = Q·K(0)ᵀ alone, waited for. Warpgroup 0 takes the first turn.
template <bool kPingPong, class IssueScores>
__device__ __forceinline__ void first_scores(const ConsumerSetup& c, IssueScores&& issue_scores) {
    if (kPingPong && c.warpgroup == 1) pass_turn(c.warpgroup);
    barrier_wait(c.full, 0);
    if (kPingPong) wait_turn(c.warpgroup);
    issue_scores(0);
    if (kPingPong) pass_turn(c.warpgroup);
    wgmma_wait<0>();
}

// P of a tile (the softmax's output in s) as the A fragments of its k32 steps: registers {row g, row g+8} x
// {k 4q.., k 16+4q..}, 4 consecutive k each, lowest byte first (see key_of_row).
template <int kKeyBlocks, int kScores>
__device__ __forceinline__ void pack_p(uint32_t (&a)[kKeyBlocks][4], const float (&s)[kScores]) {
#pragma unroll
    for (int b = 0; b < kKeyBlocks; ++b) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            a[b][r] = pack_e4m3(s[p_source(b, r, 0)], s[p_source(b, r, 1)], s[p_source(b, r, 2)],
                                s[p_source(b, r, 3)]);
        }
    }
}

// A consumer warpgroup's 64 query rows. Its MMAs come in phases: phase j issues P(j-1)·V(j-1) and then
// S(j) = Q·K(j)ᵀ, folds P(j-1)·V(j-1) into O as soon as that is done, and runs the softmax of S(j) once S(j)
// is. With kPingPong the two warpgroups take turns at the phases (named barriers), so one's softmax overlaps
// the other's MMAs; without it they run as the warp schedulers interleave them.
template <int kStages, bool kPingPong, bool kTma>
__device__ __forceinline__ void consume(const Params& p, uint8_t* smem, int batch, int head, int start_m,
                                        int n_tiles) {
    using Smem = SharedStorage<kStages, kNarrow>;
    constexpr int kBlockN = kNarrow;
    const ConsumerSetup c = consumer_setup<kStages, kNarrow>(p, smem);
    float o[64], row_max[2], row_sum[2], alpha[2];
    start_rows(o, row_max, row_sum, alpha);
    uint32_t a[4][4];  // P of the previous tile as the A fragment of four k32 steps (see key_of_row)
    float s[64];

    // T = P·V of a stage into a fresh accumulator (summed into O in float32 after it: never across tiles
    // inside the tensor core); S = Q·Kᵀ of a stage. Each is one commit group.
    auto issue_values = [&](float (&t)[64], int stage) {
        fence_registers(t);
        wgmma_fence();
#pragma unroll
        for (int b = 0; b < 4; ++b) wgmma_rs(t, a[b], descriptor(c.base + Smem::kV + stage * kTileBytes, b * 32), b);
        wgmma_commit();
    };
    auto issue_scores = [&](int stage) {
        fence_registers(s);
        wgmma_fence();
        const uint32_t k_tile = c.base + Smem::kK + stage * kTileBytes;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_ss(s, descriptor(c.q_tile, kk * 32), descriptor(k_tile, kk * 32), kk);
        wgmma_commit();
    };
    auto fold_values = [&](float (&t)[64], int stage) {
        fence_registers(t);
        barrier_arrive(c.empty + stage * 8);  // this warpgroup is done with the stage
#pragma unroll
        for (int i = 0; i < 64; ++i) o[i] = fmaf(o[i], alpha[(i >> 1) & 1], t[i]);
    };
    auto softmax_and_pack = [&](int tile) {
        fence_registers(s);
        softmax_tile<!kTma, kNarrow>(s, row_max, row_sum, alpha, c.qk_scale, p.p_shift, c.quad,
                                     p.n_tokens - tile * kBlockN);
        pack_p(a, s);
    };

    first_scores<kPingPong>(c, issue_scores);
    softmax_and_pack(0);
    // Phases 1 .. n-1: P(j-1)·V(j-1) and S(j) issued back to back, so the tensor cores run them together.
    for (int tile = 1; tile < n_tiles; ++tile) {
        const int stage = tile % kStages, previous = (tile - 1) % kStages;
        barrier_wait(c.full + stage * 8, (tile / kStages) & 1);
        if (kPingPong) wait_turn(c.warpgroup);
        float t[64];
        issue_values(t, previous);
        issue_scores(stage);
        if (kPingPong) pass_turn(c.warpgroup);
        wgmma_wait<1>();  // groups complete in order: T is done, S may still run
        fold_values(t, previous);
        wgmma_wait<0>();
        softmax_and_pack(tile);
    }
    // Phase n: the last P·V. Warpgroup 1 passes no turn after it: warpgroup 0 has no more.
    {
        float t[64];
        if (kPingPong) wait_turn(c.warpgroup);
        issue_values(t, (n_tiles - 1) % kStages);
        if (kPingPong && c.warpgroup == 0) pass_turn(c.warpgroup);
        wgmma_wait<0>();
        fold_values(t, (n_tiles - 1) % kStages);
    }

    store_output(p, o, row_sum, batch, head, start_m);
}

// The same with wide key tiles (TMA, three stages; the header): phase j issues S(j) = Q·K(j)ᵀ, rescales O by
// α(j-1), issues P(j-1)·V(j-1) onto O in the tensor core, runs the softmax of S(j) while that runs, waits for
// it and makes P(j) the A fragments. With kPingPong the two warpgroups take turns at issuing their MMAs.
template <bool kPingPong>
__device__ __forceinline__ void consume_wide(const Params& p, uint8_t* smem, int batch, int head, int start_m,
                                             int n_tiles) {
    constexpr int kStages = 3;
    using Smem = SharedStorage<kStages, kWide>;
    using Tile = KeyTile<kWide>;
    const ConsumerSetup c = consumer_setup<kStages, kWide>(p, smem);
    float o[64], row_max[2], row_sum[2], alpha[2];
    start_rows(o, row_max, row_sum, alpha);
    uint32_t a[Tile::kKeyBlocks][4];  // P of the previous tile as the A fragments of its k32 steps
    float s[Tile::kScores];

    // Each is one commit group.
    auto issue_scores = [&](int stage) {
        fence_registers(s);
        wgmma_fence();
        const uint32_t k_tile = c.base + Smem::kK + stage * Tile::kKeyBytes;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_ss_n224(s, descriptor(c.q_tile, kk * 32), descriptor(k_tile, kk * 32), kk);
        wgmma_commit();
    };
    auto issue_values = [&](int stage) {  // O += P·V, k32 step b reading keys 32b.. of the tile's Vᵀ boxes
        fence_registers(o);
        wgmma_fence();
        const uint32_t v_tile = c.base + Smem::kV + stage * Tile::kValueBytes;
#pragma unroll
        for (int b = 0; b < Tile::kKeyBlocks; ++b) {
            wgmma_rs(o, a[b], descriptor(v_tile + (b / 4) * kTileBytes, (b % 4) * 32), 1);
        }
        wgmma_commit();
    };
    auto rescale = [&] {  // O·α of the softmax that made the P about to be multiplied
        fence_registers(o);
#pragma unroll
        for (int i = 0; i < 64; ++i) o[i] *= alpha[(i >> 1) & 1];
    };
    auto softmax = [&](int tile) {
        fence_registers(s);
        softmax_tile<false, kWide>(s, row_max, row_sum, alpha, c.qk_scale, p.p_shift, c.quad, p.n_tokens - tile * kWide);
    };
    // Keeps P's registers live and in place until the P·V that reads them has completed (the compiler would
    // otherwise reuse them once the asynchronous wgmma is issued).
    auto hold_p = [&] {
#pragma unroll
        for (int b = 0; b < Tile::kKeyBlocks; ++b) {
#pragma unroll
            for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[b][r])::"memory");
        }
    };

    first_scores<kPingPong>(c, issue_scores);
    softmax(0);
    pack_p(a, s);
    for (int tile = 1; tile < n_tiles; ++tile) {
        const int stage = tile % kStages, previous = (tile - 1) % kStages;
        barrier_wait(c.full + stage * 8, (tile / kStages) & 1);
        if (kPingPong) wait_turn(c.warpgroup);
        issue_scores(stage);
        rescale();  // O is not in flight: P(j-2)·V(j-2) has completed
        issue_values(previous);
        if (kPingPong) pass_turn(c.warpgroup);
        wgmma_wait<1>();  // groups complete in order: S(j) is done, P(j-1)·V(j-1) may still run
        softmax(tile);
        fence_registers(s);
        asm volatile("fence.acq_rel.cta;" ::: "memory");  // keeps ptxas from hoisting the wait above the softmax
        wgmma_wait<0>();
        hold_p();
        fence_registers(o);
        barrier_arrive(c.empty + previous * 8);  // this warpgroup is done with the stage
        pack_p(a, s);
    }
    // The last P·V. Warpgroup 1 passes no turn after it: warpgroup 0 has no more.
    if (kPingPong) wait_turn(c.warpgroup);
    rescale();
    issue_values((n_tiles - 1) % kStages);
    if (kPingPong && c.warpgroup == 0) pass_turn(c.warpgroup);
    wgmma_wait<0>();
    hold_p();
    fence_registers(o);
    store_output(p, o, row_sum, batch, head, start_m);
}

template <int kStages, bool kPingPong, bool kTma, int kBlockN>
__global__ void __launch_bounds__(kThreads, 1) fp8_attention_kernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma: sm_90a only (the launcher refuses other GPUs)
    static_assert(kBlockN == kNarrow || (kTma && kStages == 3), "wide key tiles: TMA, three stages");
    using Smem = SharedStorage<kStages, kBlockN>;
    using Tile = KeyTile<kBlockN>;
    extern __shared__ uint8_t raw_smem[];
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
    const int start_m = blockIdx.x * kBlockM;
    const int batch = blockIdx.y / p.n_heads, head = blockIdx.y % p.n_heads;
    const int n_tiles = (p.n_tokens + kBlockN - 1) / kBlockN;
    const uint32_t barriers = smem_address(smem) + Smem::kBarriers;
    if (threadIdx.x == 0) {
        for (int stage = 0; stage < kStages; ++stage) {
            barrier_init(barriers + stage * 8, kTma ? 1 : 128);  // full: the TMA thread, or every producer thread
            barrier_init(barriers + (kStages + stage) * 8, kConsumerThreads);  // empty: every consumer thread
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x >= kConsumerThreads) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Tile::kProducerRegisters));
        if constexpr (kTma) {
            produce_tma<kStages, kBlockN>(p, smem, batch, head, start_m, n_tiles);
        } else {
            produce<kStages>(p, smem, batch, head, start_m, n_tiles);
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Tile::kConsumerRegisters));
        if constexpr (kBlockN == kWide) {
            consume_wide<kPingPong>(p, smem, batch, head, start_m, n_tiles);
        } else {
            consume<kStages, kPingPong, kTma>(p, smem, batch, head, start_m, n_tiles);
        }
    }
#endif
}

}  // namespace
}  // namespace pan2_fp8_attention

namespace {

// cuTensorMapEncodeTiled from the driver, through the runtime (no libcuda link needed); null if missing.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* function = nullptr;
        cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
        const cudaError_t error = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                                                   cudaEnableDefault, &status);
#else
        const cudaError_t error = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &function, cudaEnableDefault,
                                                          &status);
#endif
        const bool found = error == cudaSuccess && status == cudaDriverEntryPointSuccess;
        return found ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function) : nullptr;
    }();
    return encode;
}

// A 4-D byte tensor (dims innermost first, strides in bytes of dims 1-3, increasing) in boxes of `box`.
bool encode_tiles(CUtensorMap* map, const void* data, const cuuint64_t (&dims)[4], const cuuint64_t (&strides)[3],
                  const cuuint32_t (&box)[4]) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const cuuint32_t element_strides[4] = {1, 1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(data), dims, strides, box,
                  element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

cudaError_t pan2_fp8_attention_launch(const uint8_t* q, const uint8_t* k, const uint8_t* v_t, const float* qk_descale,
                                      const float* v_descale, const float* v_mean, __nv_bfloat16* out, int batch,
                                      int n_tokens, int n_heads, int s_pad, float sm_scale_log2, float p_shift,
                                      int stages, bool ping_pong, bool tma, int key_tile, cudaStream_t stream) {
    using namespace pan2_fp8_attention;
    Params params{};
    params.q = q;
    params.k = k;
    params.v_t = v_t;
    params.qk_descale = qk_descale;
    params.v_descale = v_descale;
    params.v_mean = v_mean;
    params.out = out;
    params.n_tokens = n_tokens;
    params.n_heads = n_heads;
    params.s_pad = s_pad;
    params.sm_scale_log2 = sm_scale_log2;
    params.p_shift = p_shift;
    if (key_tile != kNarrow && (key_tile != kWide || !tma || stages != 3)) return cudaErrorInvalidValue;
    if (tma) {
        // Q, K: (128 bytes, H, S, B) in boxes of one head's 128 tokens (K: key_tile tokens); Vᵀ: (S_pad, 128,
        // H, B) in boxes of 128 keys of all 128 channels. Either way a box lands as rows of 128 bytes.
        const cuuint64_t heads = n_heads, tokens = n_tokens, keys = s_pad, row = heads * kHeadDim;
        const cuuint64_t token_dims[4] = {kHeadDim, heads, tokens, cuuint64_t(batch)};
        const cuuint64_t token_strides[3] = {kHeadDim, row, tokens * row};
        const cuuint32_t query_box[4] = {kHeadDim, 1, kBlockM, 1};
        const cuuint32_t key_box[4] = {kHeadDim, 1, cuuint32_t(key_tile), 1};
        const cuuint64_t key_dims[4] = {keys, kHeadDim, heads, cuuint64_t(batch)};
        const cuuint64_t key_strides[3] = {keys, keys * kHeadDim, keys * kHeadDim * heads};
        const cuuint32_t value_box[4] = {128, kHeadDim, 1, 1};
        if (!encode_tiles(&params.q_map, q, token_dims, token_strides, query_box) ||
            !encode_tiles(&params.k_map, k, token_dims, token_strides, key_box) ||
            !encode_tiles(&params.v_map, v_t, key_dims, key_strides, value_box)) {
            return cudaErrorInvalidValue;
        }
    }
    const dim3 grid((n_tokens + kBlockM - 1) / kBlockM, batch * n_heads);
    auto launch = [&](auto kernel, int bytes) {
        cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
        if (error != cudaSuccess) return error;
        kernel<<<grid, kThreads, bytes, stream>>>(params);
        return cudaGetLastError();
    };
    if (key_tile == kWide) {  // three stages of 60 KB (K 28, Vᵀ 32): a fourth would not fit
        constexpr int bytes = SharedStorage<3, kWide>::kBytes;
        return ping_pong ? launch(fp8_attention_kernel<3, true, true, kWide>, bytes)
                         : launch(fp8_attention_kernel<3, false, true, kWide>, bytes);
    }
    // Three stages at least: a consumer holds two (K of tile j, V of tile j-1) and the cp.async producer
    // signals a tile once the next one's copies are issued, so with two stages each would wait for the other.
#define PAN2_FP8_ATTENTION_CASE(STAGES)                                                                       \
    if (stages == STAGES) {                                                                                   \
        constexpr int bytes = SharedStorage<STAGES, kNarrow>::kBytes;                                         \
        if (tma) {                                                                                            \
            return ping_pong ? launch(fp8_attention_kernel<STAGES, true, true, kNarrow>, bytes)               \
                             : launch(fp8_attention_kernel<STAGES, false, true, kNarrow>, bytes);             \
        }                                                                                                     \
        return ping_pong ? launch(fp8_attention_kernel<STAGES, true, false, kNarrow>, bytes)                  \
                         : launch(fp8_attention_kernel<STAGES, false, false, kNarrow>, bytes);                \
    }
    PAN2_FP8_ATTENTION_CASE(3)
    PAN2_FP8_ATTENTION_CASE(4)
    PAN2_FP8_ATTENTION_CASE(5)
#undef PAN2_FP8_ATTENTION_CASE
    return cudaErrorInvalidValue;
}
