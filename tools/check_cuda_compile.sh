#!/usr/bin/env bash
# Compile-check every CUDA source (mp_wrappers/csrc/cuda/**/*.cu) with exactly setup.py's flags and
# defines (build_config.py), for sm_70, sm_80, sm_90 and the toolkit's newest arch, reporting
# registers and spills (-Xptxas -v); 2 files at a time (JOBS=N to change). Every file's device code,
# one file's host half too (tools/check_cuda_compile.py says why). No GPU and no CUDA torch needed.
# CI runs it; without nvcc it prints "skipped: no nvcc" and succeeds. See docs/cuda.md.
#
# Usage: tools/check_cuda_compile.sh [--fail-on-spill] [file.cu ...]
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "check_cuda_compile: skipped: no nvcc"
  exit 0
fi
PY=${PYTHON:-python}
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  echo "check_cuda_compile: skipped: torch is not installed (its headers are needed; bash tools/install.sh)"
  exit 0
fi
exec "$PY" -u tools/check_cuda_compile.py --nvcc "$NVCC" "$@"
