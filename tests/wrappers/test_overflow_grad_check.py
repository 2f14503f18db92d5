"""``grad_check``: at a static scale of 1.0 the default checks the loss, not every gradient.

Note [unit-scale check] in ``mp_wrappers/wrappers/overflow.py``: reading every gradient at a unit scale
is a pass of its own (the whole O1 gap to mmengine's ``AmpOptimWrapper``), so ``'auto'`` skips steps
whose loss is not finite and reads gradients only for the published norm; ``'always'`` reads them at
every step. Gradient faults under ``'always'`` are covered by ``tests/wrappers/test_fault_injection.py``.
"""
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from mmengine.logging import MessageHub
from torch import nn

import mp_wrappers
from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper
from mp_wrappers.casting import cast_model
from mp_wrappers.wrappers import unscale

from _workflow import RecordHook, losses, make_runner, train


def _model(dtype=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    if dtype is not None:
        cast_model(model, dtype, keep_norm_fp32=True)
    return model


def _wrapper(kind, model, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == 'FP16':
        return FP16OptimWrapper(opt, static_loss_scale=1.0, verbose=False, **kwargs)
    return ApexOptimWrapper(opt, opt_level=kind, dtype='bfloat16', verbosity=0, **kwargs)


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)


def _step(model, wrapper, i, nan_loss=False):
    x, y = _batch(i)
    with wrapper.optim_context(model):
        loss = F.cross_entropy(model(x.to(model[0].weight.dtype)).float(), y)
    if nan_loss:
        loss = loss * float('nan')
    wrapper.update_params(loss)


def test_rejects_an_unknown_grad_check():
    with pytest.raises(ValueError, match=r"grad_check='sometimes' is not allowed; expected one of "
                                         r"\('auto', 'always'\)"):
        _wrapper('O1', _model(), grad_check='sometimes')


# O1/O3 and FP16OptimWrapper over fp32 weights step in place (the loss-only check); O2 and
# FP16OptimWrapper over a bf16 model pass through fp32 masters (the gradients are read anyway).
@pytest.mark.parametrize('kind,model_dtype', [('O1', None), ('O3', None), ('O2', None),
                                              ('FP16', None), ('FP16', torch.bfloat16)])
@pytest.mark.parametrize('grad_check', ['auto', 'always'])
@pytest.mark.filterwarnings('ignore:FP16OptimWrapper got an optimizer over fp32')
def test_a_nonfinite_loss_skips_the_step_at_a_unit_scale(kind, model_dtype, grad_check):
    model = _model(model_dtype)
    wrapper = _wrapper(kind, model, grad_check=grad_check)
    _step(model, wrapper, 0)
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, wrapper, 1, nan_loss=True)
    assert wrapper.last_step_skipped
    assert wrapper.loss_scalers[0].skipped_steps == 1
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    _step(model, wrapper, 2)
    assert not wrapper.last_step_skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_a_nonfinite_loss_in_one_accumulated_batch_skips_the_step():
    model = _model()
    wrapper = _wrapper('O1', model, accumulative_counts=2)
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, wrapper, 0, nan_loss=True)  # the first of two accumulated batches
    _step(model, wrapper, 1)
    assert wrapper.last_step_skipped
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize('grad_check,reads', [('auto', 2), ('always', 10)])
def test_auto_reads_the_gradients_only_to_publish_their_norm(grad_check, reads):
    """10 steps in a training loop, publishing every 5th: 'auto' reads the gradients twice."""
    model = _model()
    wrapper = _wrapper('O1', model, grad_check=grad_check, log_interval=5)
    calls = []

    def counting(name, op):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return op(*args, **kwargs)
        return wrapped

    hub = MessageHub.get_current_instance()
    with mock.patch.object(unscale, 'multi_tensor_unscale_l2norm',
                           counting('check', unscale.multi_tensor_unscale_l2norm)), \
            mock.patch.object(unscale, 'multi_tensor_l2norm',
                              counting('norm', unscale.multi_tensor_l2norm)):
        try:
            for i in range(10):
                hub.update_info('iter', i)
                _step(model, wrapper, i)
        finally:
            hub.runtime_info.pop('iter', None)
    assert len(calls) == reads, calls
    assert hub.get_scalar('train/amp_gnorm').current() > 0


def test_runner_o1_skips_the_nan_loss_iteration_and_trains_on(tmp_path):
    """Through mmengine's Runner: O1 bf16 (unit scale, default grad_check) meets a NaN loss at
    iteration 3: that step is skipped, the run ends finite and equal to grad_check='always'."""
    results = {}
    for grad_check in ('auto', 'always'):
        record = RecordHook()
        runner = make_runner(tmp_path / grad_check, 'O1', 'bfloat16', iters=8,
                             model=dict(nan_loss_iters=(3,)),
                             extra_wrapper=dict(grad_check=grad_check))
        runner.register_hook(record, priority='LOWEST')
        train(runner)
        results[grad_check] = record.weights
        wrapper = runner.optim_wrapper
        assert wrapper.loss_scalers[0].skipped_steps == 1
        assert runner.message_hub.get_scalar('train/amp_skipped').current() == 1
        w = record.weights
        assert all(torch.equal(w[2][n], w[3][n]) for n in w[2])  # iteration 3 changed nothing
        assert not all(torch.equal(w[3][n], w[4][n]) for n in w[3])
        assert all(torch.isfinite(t).all() for t in w[-1].values())
        finite = [v for v in losses(runner) if v == v]
        assert finite[-1] < finite[0]
    for a, b in zip(results['auto'], results['always']):
        assert all(torch.equal(a[n], b[n]) for n in a)
