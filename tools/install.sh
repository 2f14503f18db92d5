#!/usr/bin/env bash
# Install mp_wrappers (building its C++/CUDA extension) and what it needs, without ever letting pip
# pick a torch: an unpinned torch resolves to the newest CUDA build (several GB) on a CPU machine.
#   bash tools/install.sh          # the package, and what the demo workloads (projects/) need
#   bash tools/install.sh test     # ... plus what the test suite needs
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
TORCH_VERSION=${MP_WRAPPERS_TORCH_VERSION:-2.13.0}

if "$PY" -c 'import torch' 2>/dev/null; then
  # Keep the torch that is there (a CUDA build on a GPU machine, say) if it is in the supported
  # range; refuse an older one, warn about one newer than the newest tested (tools/torch_range.py).
  "$PY" tools/torch_range.py --installed || exit 1
  echo "mp_wrappers install: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  "$PY" tools/torch_range.py "$TORCH_VERSION" || exit 1
  echo "mp_wrappers install: installing torch==$TORCH_VERSION"
  "$PY" -m pip install -q "torch==$TORCH_VERSION"
fi

# Build requirements by hand: the build runs without isolation, against the torch above.
"$PY" -m pip install -q "setuptools>=64" wheel "pybind11>=2.10" ninja
extras=examples
[ "${1:-}" = test ] && extras=examples,test
"$PY" -m pip install -q --no-build-isolation -e ".[$extras]"
# pip -q hides the build's output: repeat its one line on whether CUDA kernels were built, and why.
"$PY" build_config.py decide
"$PY" -c 'import mp_wrappers; print("mp_wrappers", mp_wrappers.__version__, mp_wrappers.ops.backend())'
