"""The wrappers' fused mixed-precision step (FusedAdam & co.) against their unfused path."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper, FusedAdam, FusedSGD, cast_model


def _base():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 5))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g))
            for _ in range(n)]


OPTIMIZERS = [(FusedAdam, dict(lr=1e-2, weight_decay=0.01)),
              (FusedSGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-4))]


def _run(opt_cls, opt_kw, dtype, fused, clip=None, accum=1, steps=6):
    model = cast_model(_base(), dtype)
    w = FP16OptimWrapper(opt_cls(model.parameters(), **opt_kw), dynamic_loss_scale=True,
                         clip_grad=clip, accumulative_counts=accum)
    if not fused:
        w._fusable = lambda: False
    for x, y in _batches(steps):
        w.update_params(F.cross_entropy(model(x.to(dtype)).float(), y))
    return model, w


@pytest.mark.parametrize('opt_cls, opt_kw', OPTIMIZERS)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('accum', [1, 2])
def test_fused_equals_unfused(opt_cls, opt_kw, dtype, accum):
    m1, w1 = _run(opt_cls, opt_kw, dtype, True, accum=accum)
    m2, w2 = _run(opt_cls, opt_kw, dtype, False, accum=accum)
    for a, b in zip(list(m1.parameters()) + w1.master_params(),
                    list(m2.parameters()) + w2.master_params()):
        assert torch.equal(a, b)
    # The fused path keeps no fp32 master-gradient buffers for the half params.
    assert not any(p.dtype == torch.float32 and p.numel() > 32 for p in w1._stash._buffers.values())
    assert w2._stash._buffers


@pytest.mark.parametrize('opt_cls, opt_kw', OPTIMIZERS)
def test_fused_norm_clipping_matches_unfused(opt_cls, opt_kw):
    m1, _ = _run(opt_cls, opt_kw, torch.bfloat16, True, clip=dict(max_norm=0.3))
    m2, _ = _run(opt_cls, opt_kw, torch.bfloat16, False, clip=dict(max_norm=0.3))
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('opt_cls, opt_kw', OPTIMIZERS)
def test_fused_overflow_is_bit_identical_skip(opt_cls, opt_kw):
    model = cast_model(_base(), torch.float16)
    w = FP16OptimWrapper(opt_cls(model.parameters(), **opt_kw), dynamic_loss_scale=True)
    (x, y), (x2, y2) = _batches(2)
    w.update_params(F.cross_entropy(model(x.half()).float(), y))
    snap = [t.detach().clone() for t in list(model.parameters()) + w.master_params()]
    snap += [v.clone() for st in w.optimizer.state.values() for v in st.values()
             if isinstance(v, torch.Tensor)]
    w.backward(F.cross_entropy(model(x2.half()).float(), y2), update_master_grads=False)
    model[3].weight.grad[0, 0] = float('nan')
    w.step()
    w.zero_grad()
    after = [t.detach().clone() for t in list(model.parameters()) + w.master_params()]
    after += [v.clone() for st in w.optimizer.state.values() for v in st.values()
              if isinstance(v, torch.Tensor)]
    assert w.last_step_skipped and w.loss_scale == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(snap, after))


def test_apex_o2_with_fused_adam_tracks_fp32():
    # No bias before BatchNorm here: its gradient is pure rounding noise, which Adam turns into
    # full-size steps of either sign.
    def _base():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))

    batches = _batches(10)
    ref = _base()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in batches:
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = _base()
    w = ApexOptimWrapper(FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                         opt_level='O2', dtype='bfloat16', verbosity=0)
    for x, y in batches:
        with w.optim_context(model):
            loss = F.cross_entropy(model(x), y)
        w.update_params(loss)
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q.float(), p, rtol=5e-2, atol=5e-2)
