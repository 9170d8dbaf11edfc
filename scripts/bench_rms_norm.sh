#!/usr/bin/env bash
# The fused RMS norm kernel against an earlier commit's, on the decode's shapes (one CUDA GPU, nvcc).
# Usage: bash scripts/bench_rms_norm.sh [OLD_COMMIT]   (default 2ef6a98, the kernel before issue 16's v10)
# Prints one row per case: TB/s of this tree's kernel and of the old one, in place (sum stored over x),
# a copy of the same bytes, the best of the sweep, and whether the two kernels give the same bits.
set -euo pipefail
cd "$(dirname "$0")/.."
old="${1:-2ef6a98}"
work="$(mktemp -d)"
git show "$old:kernels/wan22_vae_decode/rms_norm_silu.cu" \
    | sed 's/namespace wan22 {/namespace wan22_old { using namespace wan22;/' \
    | sed "s|#include \"decode_kernels.h\"|#include \"$PWD/kernels/wan22_vae_decode/decode_kernels.h\"|" >"$work/rms_old.cuh"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math -DNDEBUG -I"$work" \
    -o "$work/bench_rms_norm" scripts/bench_rms_norm.cu
"$work/bench_rms_norm"
