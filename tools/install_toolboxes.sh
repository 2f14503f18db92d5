#!/usr/bin/env bash
# Install the OpenMMLab toolboxes that tests/toolboxes trains through their own train scripts
# (docs/openmmlab_toolboxes.md), into the python that has mp_wrappers and its torch:
#   bash tools/install_toolboxes.sh
# Pinned, pip only, never touching torch, mmengine or numpy. What the toolboxes' metadata asks for
# cannot all be installed on a CPU-only machine, so their wheels go in with --no-deps and their real
# pure-Python dependencies are listed here:
#   - mmpretrain and mmaction2 want the compiled `mmcv` (no CPU wheel; building it takes far longer
#     than CI has). `mmcv-lite` is the same package without the compiled ops (`mmcv.ops`); the
#     classification and recognition models tested here never import them.
#   - mmaction2 wants decord (video decoding) and opencv-contrib-python (clashes with mmengine's
#     opencv-python): the tests read raw frames, so neither is needed.
#   - torchvision (mmpretrain's transforms; mmaction2 needs it too) must match torch exactly; its
#     PyPI wheels link CUDA torch libraries, so on a CPU torch its compiled ops (nms, roi_align...)
#     do not load. Its Python parts work without them, except that torchvision 0.28 registers fake
#     kernels for two of those ops unconditionally and then fails at import: the two registrations
#     are made conditional below, as all its others already are.
#   - mmaction2 1.2.0's wheel (and sdist) lack mmaction/models/localizers/drn, which
#     localizers/__init__.py imports (upstream issue 2714): that import is removed (the DRN
#     localizer is then not registered; recognisers are unaffected).
# numpy stays as it is (2.x): the code paths the tests use run on it (what fails on numpy 2 in these
# releases, e.g. np.trapz in mmaction2's proposal AUC or np.in1d in retrieval metrics, is not used).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
pip_q() { "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }

# torchvision X.Y matches torch 2.(Y-15): 0.28 <-> 2.13. Keep one that already imports.
if ! "$PY" -c 'import torchvision' 2>/dev/null; then
  tv=$("$PY" -c 'import torch; v = torch.__version__.split("+")[0].split("."); print(f"0.{int(v[1]) + 15}.{v[2]}")')
  echo "install_toolboxes: torchvision==$tv (--no-deps: pip must not replace torch)"
  pip_q --no-deps "torchvision==$tv"
fi
# --no-warn-conflicts: pip would call the requirements left out on purpose (above) an ERROR.
pip_q --no-deps --no-warn-conflicts mmcv-lite==2.1.0 mmpretrain==1.2.0 mmaction2==1.2.0
# Their pure-Python requirements that mp_wrappers' own install lacks (mmengine brings matplotlib,
# rich and opencv-python; scikit-learn, a test requirement, brings scipy).
pip_q einops==0.8.2 importlib-metadata==10.2.0 mat4py==0.6.0 modelindex==0.0.2

site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
meta="$site/torchvision/_meta_registrations.py"
if ! "$PY" -c 'import torchvision' 2>/dev/null && [ -f "$meta" ]; then
  sed -i 's/^@torch\.library\.register_fake("torchvision::/@(torch.library.register_fake if torchvision.extension._has_ops() else (lambda *a, **k: lambda f: f))("torchvision::/' "$meta"
  echo "install_toolboxes: torchvision's compiled ops do not load with this torch; its fake-kernel registrations made conditional"
fi
localizers="$site/mmaction/models/localizers/__init__.py"
if [ ! -d "$site/mmaction/models/localizers/drn" ] && grep -q '^from \.drn\.drn import DRN$' "$localizers"; then
  sed -i -e '/^from \.drn\.drn import DRN$/d' -e "s/, 'DRN'\]/]/" "$localizers"
  echo "install_toolboxes: mmaction2's wheel lacks models/localizers/drn (upstream issue 2714); its import removed"
fi

"$PY" -W ignore - <<'PY'
import importlib.metadata as md
import mmaction.models  # noqa: F401  (the recognisers, with mmcv-lite)
import mmpretrain.models  # noqa: F401
import numpy
import torch
import torchvision
print('install_toolboxes:', ', '.join(f'{d} {md.version(d)}' for d in (
    'mmpretrain', 'mmaction2', 'mmcv-lite', 'mmengine', 'torchvision')),
      f'| torch {torch.__version__}, numpy {numpy.__version__}')
PY
