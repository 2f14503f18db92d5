#!/usr/bin/env bash
# Compile-check the CUDA fused-optimizer kernels (mp_wrappers/csrc/cuda/multi_tensor_{adam,sgd,lamb,
# adagrad,novograd}.cu) for sm_80 and sm_90 with the local nvcc, without a GPU and without a CUDA
# build of torch: torch's headers plus the defines its CUDAExtension passes. The files include
# c10/cuda/{CUDAStream,CUDAGuard,CUDAException}.h and not ATen/cuda/CUDAContext.h, which needs
# cuBLAS/cuSPARSE headers this toolkit lacks (REFERENCE.md section 8).
#
# Usage: tools/check_cuda_compile_optim.sh [file.cu ...]   (default: the five optimizer kernels)
# Exit status 0 when every file compiles for every architecture.
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "nvcc not found (set NVCC=...)" >&2; exit 2; }
mapfile -t INCLUDES < <(python -c 'from torch.utils.cpp_extension import include_paths
for p in include_paths(): print("-I" + p)')
FLAGS=(-c -std=c++17 -Xcompiler -fPIC -Xcompiler -Wno-c++20-extensions --expt-relaxed-constexpr -O3 --use_fast_math
       -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -D__CUDA_NO_HALF_OPERATORS__
       -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
       -D__CUDA_NO_HALF2_OPERATORS__ -DMP_WRAPPERS_WITH_CUDA=1
       -diag-suppress 3306 "${INCLUDES[@]}" -Imp_wrappers/csrc/include)
# (3306: torch's own headers use a C++20 bit-field initialiser; not our code.)

if [ $# -gt 0 ]; then
  FILES=("$@")
else
  FILES=()
  for op in adam sgd lamb adagrad novograd; do
    FILES+=("mp_wrappers/csrc/cuda/multi_tensor_${op}.cu")
  done
fi

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
status=0
# Both architectures in one nvcc call: the host side is parsed once, device code is built twice.
ARCHS=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90)
for f in "${FILES[@]}"; do
  if "$NVCC" "${FLAGS[@]}" "${ARCHS[@]}" "$f" -o "$OUT/$(basename "$f" .cu).o"; then
    echo "ok    sm_80 sm_90  $f"
  else
    echo "FAIL  sm_80 sm_90  $f" >&2
    status=1
  fi
done
exit $status
