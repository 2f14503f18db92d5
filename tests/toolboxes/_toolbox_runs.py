"""Run an OpenMMLab toolbox's own ``tools/train.py`` on tiny synthetic data (tests/toolboxes).

The toolboxes ship their train scripts inside the installed package (``<package>/.mim/tools/
train.py``) and their configs beside them (``<package>/.mim/configs``). A test writes a config that
inherits a shipped one and changes only what makes it tiny and offline (a few generated images or
frames, a small image size, no pretrained download, a handful of iterations) plus the one line a user
changes (``optim_wrapper``, ``custom_imports``), then runs the script in a subprocess, exactly as a
user would, and reads the checkpoints and mmengine's ``scalars.json``.
"""
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTALL_HINT = 'bash tools/install_toolboxes.sh'
# Set by .ci/run after the install: a toolbox that is missing there fails its tests instead of
# skipping them, so CI cannot pass by skipping the lane it installed.
REQUIRE_ENV = 'MP_WRAPPERS_REQUIRE_TOOLBOXES'
CUSTOM_IMPORTS = "custom_imports = dict(imports=['mp_wrappers'], allow_failed_imports=False)\n"


def mim_dir(package: str) -> Optional[str]:
    """``<package>/.mim`` of an installed toolbox, or None when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), '.mim')
    return path if os.path.isdir(path) else None


def require_toolbox(package: str, distribution: str, version: str) -> str:
    """The ``.mim`` folder of ``package``; skips the test, saying how to install it, when absent
    (fails under ``MP_WRAPPERS_REQUIRE_TOOLBOXES=1``)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version
    path = mim_dir(package)
    try:
        found = installed_version(distribution)
    except PackageNotFoundError:
        found = None
    reason = None
    if path is None or found is None:
        reason = f'{distribution} {version} is not installed (run `{INSTALL_HINT}`; CI does)'
    elif found != version:
        reason = f'{distribution} {found} is installed, these tests pin {version} (run `{INSTALL_HINT}`)'
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == '1':
            pytest.fail(f'{REQUIRE_ENV}=1 but {reason}')
        pytest.skip(reason)
    return path


def write_config(path, text: str) -> str:
    with open(path, 'w') as f:
        f.write(text)
    return str(path)


def run_script(script: str, config: str, work_dir, *args: str, cwd=None,
               check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python <script> <config> --work-dir <work_dir> <args>`` in a fresh interpreter.

    ``PYTHONPATH`` starts with this checkout, so the subprocess imports the ``mp_wrappers`` under test
    (not another installed copy). One thread: the tiny models gain nothing from two, the runs stay
    bitwise reproducible, and a loaded machine does not slow them down further.
    """
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1', CUDA_VISIBLE_DEVICES='')
    env['PYTHONPATH'] = os.pathsep.join([REPO] + [p for p in env.get('PYTHONPATH', '').split(
        os.pathsep) if p])
    proc = subprocess.run([sys.executable, script, config, '--work-dir', str(work_dir), *args],
                          cwd=str(cwd or os.path.dirname(str(work_dir))),
                          capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        owner = script.split(os.sep + '.mim' + os.sep)[0] if '.mim' in script else REPO
        raise AssertionError(f'{os.path.basename(owner)} train script failed '
                             f'(exit {proc.returncode}):\n'
                             f'{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}')
    return proc


def resume_from_epoch_1(toolbox, full, name: str, variant) -> str:
    """``--resume`` with the toolbox's own script, in a fresh work dir holding only epoch 1 of the
    uninterrupted run ``full`` (as its last checkpoint); returns the new work dir."""
    resumed = toolbox.root / name
    resumed.mkdir()
    shutil.copy(full / 'epoch_1.pth', resumed / 'epoch_1.pth')
    (resumed / 'last_checkpoint').write_text(str(resumed / 'epoch_1.pth'))
    run_script(toolbox.script, toolbox.config(name, variant), resumed, '--resume')
    assert 'resumed epoch: 1, iter: 8' in log_text(resumed)
    return resumed


def scalars(work_dir) -> List[dict]:
    """The records of mmengine's ``vis_data/scalars.json`` (full-precision values) of the latest run
    in ``work_dir``."""
    files = sorted(glob.glob(os.path.join(str(work_dir), '*', 'vis_data', 'scalars.json')))
    assert files, f'no scalars.json under {work_dir}'
    with open(files[-1]) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_records(work_dir) -> List[dict]:
    return [r for r in scalars(work_dir) if 'loss' in r]


def val_records(work_dir) -> List[dict]:
    return [r for r in scalars(work_dir) if 'loss' not in r and any('acc' in k for k in r)]


def log_text(work_dir) -> str:
    files = sorted(glob.glob(os.path.join(str(work_dir), '*', '*.log')))
    assert files, f'no log under {work_dir}'
    with open(files[-1]) as f:
        return f.read()


def load_checkpoint(path) -> dict:
    from mp_wrappers.checkpoint import secure_torch_load
    return secure_torch_load(str(path), map_location='cpu')


def float_state(ckpt: dict, key: str = 'state_dict') -> Dict[str, torch.Tensor]:
    return {k: v for k, v in ckpt[key].items() if v.is_floating_point()}


# ---- synthetic data --------------------------------------------------------------------------
# Four classes told apart by colour: a few iterations of SGD separate them, so accuracy is a signal
# (well above the 25% of chance) after a few seconds of training.
COLOURS = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 40]], dtype=np.float32)


def _image(rng, label: int, size: int) -> np.ndarray:
    noise = rng.normal(0, 40, size=(size, size, 3))
    return np.clip(COLOURS[label] + noise, 0, 255).astype(np.uint8)


def make_image_folder(root, per_class: Dict[str, int], size: int = 32, seed: int = 0) -> str:
    """``root/<split>/class_<k>/<i>.png``: mmpretrain's ``CustomDataset`` layout."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for split, count in per_class.items():
        for label in range(len(COLOURS)):
            folder = os.path.join(str(root), split, f'class_{label}')
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                Image.fromarray(_image(rng, label, size)).save(os.path.join(folder, f'{i}.png'))
    return str(root)


def make_rawframes(root, videos: Dict[str, int], frames: int = 4, size: int = 32,
                   seed: int = 0) -> str:
    """mmaction2's rawframes layout: ``root/<split>/v<k>/img_00001.jpg ...`` and
    ``root/<split>.txt`` lines ``v<k> <frames> <label>``."""
    import cv2
    rng = np.random.default_rng(seed)
    for split, per_class in videos.items():
        lines = []
        for label in range(len(COLOURS)):
            for i in range(per_class):
                name = f'v{label}_{i}'
                folder = os.path.join(str(root), split, name)
                os.makedirs(folder, exist_ok=True)
                for t in range(1, frames + 1):
                    cv2.imwrite(os.path.join(folder, f'img_{t:05d}.jpg'), _image(rng, label, size))
                lines.append(f'{name} {frames} {label}')
        order = rng.permutation(len(lines))
        with open(os.path.join(str(root), f'{split}.txt'), 'w') as f:
            f.write(''.join(lines[i] + '\n' for i in order))
    return str(root)
