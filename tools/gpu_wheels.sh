#!/usr/bin/env bash
# Wheels a GPU session carries to the lent machine, whose image has torch but no mmengine and no
# package index (docs/cuda.md, "A GPU session, step by step"): mmengine and the pure-Python
# packages it needs that the image lacks, pinned, for the machine's Python 3.12, into .whl/
# (ignored by git; name it in the device tool's `carry`). tools/gpu_check.sh installs them.
#   bash tools/gpu_wheels.sh          # from the repository root, on a machine with pip access
#   bash tools/gpu_wheels.sh peers    # ... and the 8-bit peers of bench-quantized in .whl/peers/
#                                     # (bitsandbytes, whose CUDA 13.0 kernels come in its wheel,
#                                     # and torchao: 47 MB of the 64 MiB a call carries)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# mmengine 0.10.7 requires addict, matplotlib, numpy, opencv-python, pyyaml, rich, termcolor, yapf;
# the image has matplotlib, numpy, opencv-python-headless (cv2), pyyaml and rich. yapf needs
# platformdirs.
WHEELS=(mmengine==0.10.7 addict==2.4.0 termcolor==3.3.0 yapf==0.43.0 platformdirs==4.14.7)
# .gitignore lists /.whl/; a checkout without that line gets it in its own exclude file (in a git
# worktree .git is a file, so ask git where that lives).
if ! grep -qx '/.whl/' .gitignore 2>/dev/null; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
fi
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
if [ "${1:-}" = peers ]; then
  # Versions whose wheels hold kernels for the GPU image's torch 2.11 / CUDA 13.0.
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
    -d .whl/peers bitsandbytes==0.50.2 torchao==0.18.0
fi
ls -lR .whl
echo "gpu_wheels: $(ls .whl | wc -l) wheels in .whl/ ($(du -sh .whl | cut -f1)); carry: [\".whl\"]"
