#!/usr/bin/env bash
# The four-phase resampler epilogue against an earlier commit's, on the decode's shapes (one CUDA GPU, nvcc).
# Usage: bash scripts/bench_phase_interleave.sh [OLD_COMMIT]   (default c6280b1, the kernel before session 10)
# Prints one row per case: ms and TB/s of the old kernel and of this tree's, and whether they give the same bits.
set -euo pipefail
cd "$(dirname "$0")/.."
old="${1:-c6280b1}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git show "$old:kernels/wan22_vae_decode/resample.cu" \
    | sed 's/namespace wan22 {/namespace wan22_old { using namespace wan22;/' \
    | sed "s|#include \"decode_kernels.h\"|#include \"$PWD/kernels/wan22_vae_decode/decode_kernels.h\"|" >"$work/resample_old.cuh"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math -DNDEBUG -I"$work" \
    -o "$work/bench_phase_interleave" scripts/bench_phase_interleave.cu
"$work/bench_phase_interleave"
