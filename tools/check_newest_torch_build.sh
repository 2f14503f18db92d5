#!/usr/bin/env bash
# Build mp_wrappers against the newest torch pip offers here, in a throwaway venv, and say which
# torch it built against. See docs/cuda.md. The CPU build against the newest torch is also checked in
# CI, pinned, with the tests: the `newest` stack of tools/compat_matrix.sh (.ci/compat_lanes.sh,
# docs/compatibility.md); this script stays for the unpinned try and for the CUDA-mode build.
#
#   tools/check_newest_torch_build.sh cpu    # MP_WRAPPERS_CUDA=0: the C++ standard follows torch's
#   tools/check_newest_torch_build.sh cuda   # MP_WRAPPERS_CUDA=1 (needs nvcc; no GPU needed): the
#                                            # toolkit root behind an nvcc wrapper, the arch list
# VENV=dir picks the venv (default /tmp/mp_wrappers_newest_torch; reused when it exists, so a second
# run skips the download); KEEP_VENV=0 removes it afterwards. The build runs on a copy of the working
# tree (tracked and untracked, not ignored files), so the checkout is left untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-cpu}
case "$MODE" in cpu|cuda) ;; *) echo "usage: $0 [cpu|cuda]" >&2; exit 2 ;; esac
VENV=${VENV:-/tmp/mp_wrappers_newest_torch}
[ -x "$VENV/bin/python" ] || "${PYTHON:-python}" -m venv "$VENV"
PY="$VENV/bin/python"
[ "${KEEP_VENV:-1}" = 0 ] && trap 'rm -rf "$VENV"' EXIT
# Unpinned on purpose: this script exists to try the newest torch (pip's constraints still apply).
"$PY" -m pip install -q --upgrade torch "setuptools>=64" wheel "pybind11>=2.10" ninja numpy
TORCH=$("$PY" -c 'import torch; print(torch.__version__, "(CUDA", torch.version.cuda, end=")")')
echo "check_newest_torch_build: newest torch pip offers here: $TORCH"

SRC=$(mktemp -d)
trap 'rm -rf "$SRC"; [ "${KEEP_VENV:-1}" = 0 ] && rm -rf "$VENV"; true' EXIT
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$SRC"
cd "$SRC"
start=$(date +%s)
if [ "$MODE" = cpu ]; then
  export MP_WRAPPERS_CUDA=0
else
  export MP_WRAPPERS_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  unset CUDA_HOME CUDA_PATH  # the build must find the toolkit root itself
fi
MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py -q build_ext --inplace 2>&1 | grep -v '^\[' | grep -E 'mp_wrappers build|error|Error' || true
SO=$(ls mp_wrappers/_C*.so)
# Load the extension alone (the package imports mmengine, which this venv does not have) and run one
# op against torch, then report what was built.
"$PY" - "$SO" <<'PYEOF'
import importlib.machinery, importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location(
    'mp_wrappers._C', sys.argv[1], loader=importlib.machinery.ExtensionFileLoader('mp_wrappers._C', sys.argv[1]))
ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ext)
x = [torch.randn(1000), torch.randn(77)]
total, _ = torch.ops.mp_wrappers.multi_tensor_l2norm(x, False)
ref = torch.linalg.vector_norm(torch.cat(x).double()).float()
assert torch.allclose(total, ref, rtol=1e-6), (total, ref)
print(f'check_newest_torch_build: built and loaded against torch {torch.__version__}: '
      f'cuda_built={ext.cuda_built}, cpu isa {ext.cpu_isa()}, l2norm matches torch')
PYEOF
if [ "$MODE" = cuda ]; then
  ldd "$SO" | grep -E 'cudart|c10_cuda' || true
fi
echo "check_newest_torch_build: $MODE build against torch $TORCH took $(( $(date +%s) - start )) s"
