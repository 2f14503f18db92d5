#!/usr/bin/env bash
# Compile-check every CUDA source with the local nvcc, without a GPU and without a CUDA torch.
#
# A CUDAExtension cannot be built against the CPU torch (see REFERENCE.md section 8), so this only
# compiles each .cu to an object file, for sm_80 and sm_90, with the flags torch's build would use
# (its include dirs and its __CUDA_NO_HALF_*__ defines). Kept out of CI: it needs nvcc.
#
# Usage: tools/check_cuda_compile.sh [file.cu ...]   (default: every mp_wrappers/csrc/cuda/*.cu)
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "nvcc not found (set NVCC=...)" >&2; exit 2; }
mapfile -t INCLUDES < <(python -c 'from torch.utils.cpp_extension import include_paths
for p in include_paths(): print("-I" + p)')
FILES=("$@")
[ ${#FILES[@]} -gt 0 ] || FILES=(mp_wrappers/csrc/cuda/*.cu)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

status=0
for arch in sm_80 sm_90; do
  for f in "${FILES[@]}"; do
    if "$NVCC" -c "$f" -o "$OUT/$(basename "$f").$arch.o" -arch="$arch" -std=c++20 -O2 \
        -Xcompiler -fPIC --expt-relaxed-constexpr -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE \
        -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
        -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
        -DMP_WRAPPERS_WITH_CUDA=1 -Imp_wrappers/csrc/include "${INCLUDES[@]}" \
        -Xcudafe --diag_suppress=186 ; then
      echo "ok    $arch $f"
    else
      echo "FAIL  $arch $f"
      status=1
    fi
  done
done
exit $status
