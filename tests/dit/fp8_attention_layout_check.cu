// Host-side check of the fp8 attention's index math (kernels/fp8_attention/fp8_attention_layout.h) against
// CuTe's definitions of the wgmma register fragments and of the 128-byte swizzle. Built and run by
// tests/dit/test_fp8_attention_cuda.py; prints "ok" or the first mismatch (exit status 1).
#include <cstdio>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/swizzle.hpp>

#include "fp8_attention_layout.h"

using namespace pan2_fp8_attention;

// (row, column) of a linear index into an M = 64 column-major tile, as CuTe's wgmma layouts number them.
struct Coord {
  int row, column;
};
static Coord coord(int linear) { return {linear % 64, linear / 64}; }

int main() {
  const auto accumulators = cute::SM90::GMMA::CLayout_64x128{};  // (thread, value) → m + 64·n
  const auto a_fragment = cute::SM90::GMMA::ALayout_64x32{};     // (thread, value) → m + 64·k
  int failures = 0;
  auto fail = [&](const char* what, int t, int v, int got, int want) {
    if (failures++ < 8) std::printf("%s: thread %d value %d: %d, expected %d\n", what, t, v, got, want);
  };
  for (int t = 0; t < 128; ++t) {
    const int warp = t / 32, group = (t % 32) / 4, quad = t % 4;
    // The kernel's reading of S: register 4i + 2·half + e is row 16·warp + group + 8·half, column 8i + 2q + e.
    for (int v = 0; v < 64; ++v) {
      const Coord c = coord(accumulators(t, v));
      const int half = (v >> 1) & 1, i = v >> 2, e = v & 1;
      if (c.row != 16 * warp + group + 8 * half) fail("S row", t, v, c.row, 16 * warp + group + 8 * half);
      if (c.column != 8 * i + 2 * quad + e) fail("S column", t, v, c.column, 8 * i + 2 * quad + e);
    }
    // P's A fragment: byte j of register r of k-block b holds the accumulator p_source(b, r, j); it must be
    // the same row, and the key that A's k position multiplies (32b + k, V's natural order) must be the key
    // K's shared-memory row for that S column holds.
    for (int b = 0; b < 4; ++b) {
      for (int r = 0; r < 4; ++r) {
        for (int j = 0; j < 4; ++j) {
          const Coord a = coord(a_fragment(t, 4 * r + j));  // 8-bit values: 4 a register, lowest byte first
          const int source = p_source(b, r, j);
          const Coord s = coord(accumulators(t, source));
          if (a.row != s.row) fail("P row", t, source, s.row, a.row);
          if (key_of_row(s.column) != 32 * b + a.column) fail("P key", t, source, key_of_row(s.column), 32 * b + a.column);
        }
      }
    }
  }
  // K's rows hold each key of the tile once.
  int seen[128] = {};
  for (int row = 0; row < 128; ++row) ++seen[key_of_row(row)];
  for (int key = 0; key < 128; ++key) {
    if (seen[key] != 1) fail("key_of_row permutation", key, 0, seen[key], 1);
  }
  // The 128-byte swizzle: chunk index XOR row mod 8, as CuTe's Swizzle<3, 4, 3> maps byte offsets.
  const auto swizzle = cute::Swizzle<3, 4, 3>{};
  for (int row = 0; row < 128; ++row) {
    for (int chunk = 0; chunk < 8; ++chunk) {
      const int want = swizzle(row * 128 + chunk * 16);
      if (swizzled(row, chunk) != want) fail("swizzle", row, chunk, swizzled(row, chunk), want);
    }
  }
  std::printf(failures ? "%d mismatches\n" : "ok\n", failures);
  return failures ? 1 : 0;
}
