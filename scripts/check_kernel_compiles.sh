#!/usr/bin/env bash
# Compile every source of the kernels that ship, each with its binding, for Hopper (sm_90a) and Blackwell
# (sm_100a, sm_103a) without a GPU: nvcc compiles for an architecture the machine does not have. Catches code
# that would fail to build on a user's first run. The decode kernel (kernels/wan22_vae_decode) for all three;
# the fp8 attention (kernels/fp8_attention: wgmma, empty kernels on Blackwell) for sm_90a and sm_100a.
# Usage: bash scripts/check_kernel_compiles.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
torch_include=$($python -c "import torch.utils.cpp_extension as e; print(e.include_paths()[0])")
py_include=$($python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A CPU build of torch ships the c10/cuda headers without their generated CMake macro header.
if [ ! -f "$torch_include/c10/cuda/impl/cuda_cmake_macros.h" ]; then
    mkdir -p "$work/stub/c10/cuda/impl"
    echo '#pragma once' > "$work/stub/c10/cuda/impl/cuda_cmake_macros.h"
fi
check() {  # folder, extension name, archs...
    local folder=$1 src=kernels/$1 name=$2
    shift 2
    for arch in "$@"; do
        for cu in "$src"/*.cu; do
            nvcc -std=c++17 -O3 -gencode=arch=compute_$arch,code=sm_$arch -c "$cu" -o "$work/$(basename "$cu").o"
        done
        nvcc -std=c++17 -O3 -x cu -gencode=arch=compute_$arch,code=sm_$arch -c "$src/binding.cpp" -o "$work/binding.o" \
            -I"$work/stub" -I"$torch_include" -I"$torch_include/torch/csrc/api/include" -I"$py_include" \
            -DTORCH_EXTENSION_NAME="$name"
        echo "$folder, sm_$arch: every source compiles"
    done
}
check wan22_vae_decode wan22_vae_decode 90a 100a 103a
check fp8_attention pan2_fp8_attention 90a 100a
