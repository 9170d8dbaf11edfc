// Index math of the fp8 attention (fp8_attention.cu) that the host can run too: the 128-byte swizzle of its
// shared-memory tiles, the key order of K's rows, and where each byte of P's A fragment comes from.
// tests/dit/test_fp8_attention_cuda.py checks them on the CPU against CuTe's wgmma layouts.
#pragma once

#if defined(__CUDACC__)
#define PAN2_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PAN2_HOST_DEVICE inline
#endif

namespace pan2_fp8_attention {

// Byte offset of (row, 16-byte chunk) in a tile of 128-byte rows with a 1024-aligned base, swizzled as a
// K-major wgmma descriptor with SWIZZLE_128B reads it: the chunk index XOR the row mod 8.
PAN2_HOST_DEVICE constexpr int swizzled(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// The key (within its tile) that row `row` of a K tile in shared memory holds. S's accumulator fragment
// (m64n128, float32) gives the lane with quad index q the columns 8i + 2q + {0, 1}; the 8-bit A fragment of
// m64nNk32 wants k = 4q + {0..3} and 16 + 4q + {0..3} of each 32-key block. With key 32b + κ(c) at row
// 32b + c, S's column c is the score of exactly the key that A's position κ(c) multiplies: P goes from the
// accumulators to A registers in place, with no shuffle, and V is read in its natural order.
PAN2_HOST_DEVICE constexpr int key_of_row(int row) {
    const int c = row & 31, i = c >> 3, q = (c & 7) >> 1, e = c & 1;
    return (row & ~31) + 16 * (i >> 1) + 4 * q + 2 * (i & 1) + e;
}

// Which of a thread's 64 S accumulators (register 4i + 2·half + e: row g + 8·half, column 8i + 2q + e)
// goes into byte `byte` of A register `reg` of k-block `block` (registers: 0 row g, k 4q..4q+3; 1 row g+8;
// 2 row g, k 16+4q..; 3 row g+8, k 16+4q..; byte j is k + j).
PAN2_HOST_DEVICE constexpr int p_source(int block, int reg, int byte) {
    return 16 * block + 4 * (2 * (reg >> 1) + (byte >> 1)) + 2 * (reg & 1) + (byte & 1);
}

}  // namespace pan2_fp8_attention
