"""The lean masters' one-pass collection (Note [collect in one pass] in mp_wrappers/optim/buckets.py)
through mmengine's Runner, under our tools/train.py and a toolbox's own train script.

A config users would write: ApexOptimWrapper O2 bf16 with ``master_weights='split'|'kahan'|
'stochastic'`` over FusedAdam, gradient accumulation, EMAHook, mmengine's LinearLR and a head whose
params get their first gradient at iteration 3 (a first step mid-run, collected one by one). The run
takes the one pass after its first steps, and ends bitwise equal to the same run collecting one by
one: weights, the storage's full-precision weights and the optimizer state.
"""
import pytest
import torch

from _compat import needs_extension
from _workflow import train_recorded
from mp_wrappers.optim import base

pytestmark = needs_extension


def _run(work_dir, mode):
    return train_recorded(work_dir, dict(type='mp_wrappers.FusedAdam', lr=1e-2, weight_decay=0.01),
                          dict(master_weights=mode))


@pytest.mark.parametrize('launcher, mode', [('toolbox', 'split'), ('toolbox', 'kahan'),
                                            ('toolbox', 'stochastic'), ('tools_train', 'kahan')],
                         indirect=['launcher'])
def test_lean_masters_train_in_one_pass_as_one_by_one(tmp_path, monkeypatch, launcher, mode):
    found = []
    real = base.collect_in_one_pass

    def spy(*args):
        result = real(*args)
        found.append(result is not None)
        return result

    monkeypatch.setattr(base, 'collect_in_one_pass', spy)
    runner, one_pass = _run(tmp_path / 'one_pass', mode)
    assert runner.optim_wrapper.optimizer.bf16_storage == mode
    assert any(found) and not all(found)  # first steps one by one, the others in one pass
    monkeypatch.setattr(base, 'one_pass_applies', lambda opt, with_models: False)
    twin, one_by_one = _run(tmp_path / 'one_by_one', mode)
    assert len(one_pass.weights) == len(one_by_one.weights) == 8
    for a, b in zip(one_pass.weights + one_pass.masters, one_by_one.weights + one_by_one.masters):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    states = [runner.optim_wrapper.optimizer.state, twin.optim_wrapper.optimizer.state]
    for (p, s), (q, t) in zip(*(list(st.items()) for st in states)):
        assert sorted(s) == sorted(t)
        for key in s:
            assert torch.equal(s[key], t[key]), key
