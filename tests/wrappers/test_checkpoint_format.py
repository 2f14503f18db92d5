"""What our wrappers and fused optimizers add to a checkpoint is plain data, and --resume refuses code.

tests/base/test_checkpoint.py covers the loader itself (Runner checkpoints, malicious files via
the API, the switch). This file adds: every state our wrappers write (FP16OptimWrapper, ApexOptimWrapper
with ``num_losses=2``, every fused optimizer's state, FusedAdam's internal masters) loads with a
plain ``torch.load(weights_only=True)``, no allow-list, and round-trips; and a crafted checkpoint
handed to ``tools/train.py --resume`` is refused with a clear error before anything in it runs.
"""
import io
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp_wrappers
from _compat import requires
from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper, cast_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.filterwarnings('ignore:ApexOptimWrapper.*without native fp16:UserWarning')


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _fp16(opt_cls, **kw):
    model = cast_model(_model(), torch.float16)
    return model, FP16OptimWrapper(opt_cls(model.parameters(), **kw), dynamic_loss_scale=True,
                                   verbose=False)


def _apex(opt_cls, level, dtype, num_losses=1, **kw):
    model = _model()
    return model, ApexOptimWrapper(opt_cls(model.parameters(), **kw), opt_level=level,
                                   dtype=dtype, num_losses=num_losses, verbosity=0,
                                   loss_scale='dynamic')


SETUPS = {
    'fp16-FusedAdam': lambda: _fp16(mp_wrappers.FusedAdam, lr=1e-3),
    'fp16-FusedAdam-master_weights': lambda: _fp16(mp_wrappers.FusedAdam, lr=1e-3,
                                                   master_weights=True),
    'fp16-torch-SGD': lambda: _fp16(torch.optim.SGD, lr=0.1, momentum=0.9),
    'O2-fp16-losses2-FusedLAMB': lambda: _apex(mp_wrappers.FusedLAMB, 'O2', 'float16', 2),
    'O1-bf16-losses2-FusedNovoGrad': lambda: _apex(mp_wrappers.FusedNovoGrad, 'O1', 'bfloat16', 2),
    'O3-fp16-FusedSGD': lambda: _apex(mp_wrappers.FusedSGD, 'O3', 'float16', lr=0.01, momentum=0.9),
    'O0-FusedAdagrad': lambda: _apex(mp_wrappers.FusedAdagrad, 'O0', 'float16'),
    'O2-bf16-torch-Adam': lambda: _apex(torch.optim.Adam, 'O2', 'bfloat16'),
}


def _train(model, wrapper, steps=3):
    n = getattr(wrapper, 'num_losses', 1)
    for step in range(steps):
        x, y = torch.randn(6, 4), torch.randn(6, 3)
        for k in range(n):
            with wrapper.optim_context(model):
                inp = x.half() if isinstance(wrapper, FP16OptimWrapper) else x
                loss = F.mse_loss(model(inp).float(), y)
            handle = None
            if step == 1 and k == n - 1:  # one skipped step, so the skip counters are not 0
                handle = next(model.parameters()).register_hook(
                    lambda g: torch.full_like(g, float('inf')))
            wrapper.backward(loss, loss_id=k)
            if handle is not None:
                handle.remove()
        wrapper.step()
        wrapper.zero_grad()


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b) and a.dtype == b.dtype
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@requires('safe_globals')  # get_unsafe_globals_in_checkpoint
@pytest.mark.parametrize('setup', list(SETUPS))
def test_wrapper_state_loads_with_plain_weights_only(setup):
    model, wrapper = SETUPS[setup]()
    _train(model, wrapper)
    ckpt = {'state_dict': model.state_dict(), 'optimizer': wrapper.state_dict()}
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(buf) == []
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # torch's own safe set only: no allow-list of ours
    assert _equal(loaded, ckpt)
    ours = loaded['optimizer']['mp_wrappers']
    assert sum(s['skipped_steps'] for s in ours['loss_scalers']) == 1
    assert len(ours['loss_scalers']) == getattr(wrapper, 'num_losses', 1)
    if setup.startswith('O'):
        assert len(loaded['optimizer']['apex_amp']) == wrapper.num_losses
    # ...and it round-trips into a fresh wrapper of the same configuration.
    model2, wrapper2 = SETUPS[setup]()
    model2.load_state_dict(loaded['state_dict'])
    wrapper2.load_state_dict(loaded['optimizer'])
    if isinstance(wrapper2, ApexOptimWrapper):
        wrapper2.initialize(model2)
    assert _equal(wrapper2.state_dict(), ckpt['optimizer'])


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'echo pwned > {self.marker}',))


@requires('safe_globals')  # the weights_only loader is what refuses it
@requires('cpu_fp16')  # the config trains in fp16
@pytest.mark.parametrize('how', ['explicit', 'auto'])
def test_train_tool_resume_refuses_a_crafted_checkpoint(tmp_path, how):
    """``tools/train.py --resume`` in a fresh process: refused, non-zero exit, the code never ran."""
    marker = tmp_path / 'pwned.txt'
    work_dir = tmp_path / 'wd'
    work_dir.mkdir()
    evil = work_dir / 'iter_4.pth'
    torch.save({'state_dict': {}, 'meta': {'iter': 4}, 'optimizer': _RunsCode(marker)}, evil)
    args = ['--resume', str(evil)] if how == 'explicit' else ['--resume']
    if how == 'auto':
        (work_dir / 'last_checkpoint').write_text(str(evil))
    proc = subprocess.run(
        [sys.executable, 'tools/train.py', 'tests/configs/fp16_dynamic.py', '--work-dir',
         str(work_dir), *args], cwd=REPO, capture_output=True, text=True, timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert proc.returncode != 0
    assert 'UnsafeCheckpointError' in proc.stderr and 'Refused to load checkpoint' in proc.stderr
    assert str(evil) in proc.stderr and 'system' in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()
    assert 'Iter(train)' not in proc.stdout  # refused before any training
