"""A non-finite total gradient norm is an overflow (Note [non-finite norm] in wrappers/overflow.py).

Finite gradients can have an infinite norm: the squares of fp32 elements above ~1.8e19 overflow an fp32
sum (torch's fp32 norm does, on CPU; the CUDA kernels did until they accumulated in double), and a true
norm above fp32's max (3.4e38) is inf in any accumulation. Clipping with such a norm used to compute
coef = max_norm / inf = 0 and step with every gradient zeroed. Now the step is skipped, bit for bit,
and the scaler backs off: through the wrappers' unfused path (torch's clip_grad_norm_), their fused
path (our one-pass norm), apex's clip_master_grads, and a Runner run with clip_grad.
"""
import copy
import itertools
import os

import pytest
import torch
from torch import nn

from mmengine.logging import MessageHub
from mmengine.model import BaseModel

from mp_wrappers import FP16OptimWrapper, FusedSGD
from mp_wrappers.ops import multi_tensor_l2norm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 64  # elements per parameter


def test_what_each_norm_returns_for_huge_finite_grads():
    # Elements of 1e30: squares (1e60) overflow fp32 but not double. torch's fp32 norm says inf;
    # ours accumulates in double and returns the exact norm, as a float64 oracle does.
    g = [torch.full((N,), 1e30), torch.full((3,), -1e30)]
    oracle = torch.linalg.vector_norm(torch.cat(g).double()).item()
    assert torch.isinf(torch.nn.utils.get_total_norm(g))
    total, _ = multi_tensor_l2norm(g)
    assert torch.isfinite(total) and total.item() == pytest.approx(oracle, rel=1e-6)
    # A norm beyond fp32's max is inf whatever the accumulation; no element is inf (no found_inf).
    big = [torch.full((N,), 1e38)]
    assert torch.isfinite(big[0]).all() and torch.isinf(multi_tensor_l2norm(big)[0])


def _wrapper(opt_cls, fused_path, **opt_kw):
    torch.manual_seed(0)
    # bf16 params (fp32 masters): their grads can hold 1e38, and the fused path applies.
    model = nn.Linear(N, 1, bias=False).to(torch.bfloat16)
    w = FP16OptimWrapper(opt_cls(model.parameters(), **opt_kw), dynamic_loss_scale=True,
                         dynamic_loss_args=dict(init_scale=2.0), clip_grad=dict(max_norm=1.0))
    if not fused_path:
        w._fusable = lambda: False
    return model, w


def _step_with_grad(model, w, value):
    """One backward, then the model's (scaled) gradient replaced by ``value`` * scale, and a step."""
    w.backward(model(torch.ones(1, N, dtype=torch.bfloat16)).float().sum(),
               update_master_grads=False)
    model.weight.grad.fill_(value * w.loss_scale)
    w.step()
    # Which path ran: the fused one keeps no fp32 master-gradient buffers.
    assert bool(w._stash._buffers) != (w.optimizer.__class__ is FusedSGD)
    w.zero_grad()


PATHS = [pytest.param(torch.optim.SGD, False, dict(lr=1.0, momentum=0.9), id='unfused-torch-sgd'),
         pytest.param(torch.optim.Adam, False, dict(lr=1e-3), id='unfused-torch-adam'),
         pytest.param(FusedSGD, True, dict(lr=1.0, momentum=0.9), id='fused-sgd')]


@pytest.mark.parametrize('opt_cls,fused_path,opt_kw', PATHS)
def test_norm_beyond_fp32_is_an_overflow(opt_cls, fused_path, opt_kw):
    model, w = _wrapper(opt_cls, fused_path, **opt_kw)
    _step_with_grad(model, w, 1e-3)  # a clean step first: moments and momentum exist
    before = w.master_params()[0].detach().clone()
    state_before = copy.deepcopy(w.optimizer.state_dict())
    _step_with_grad(model, w, 1e38)  # finite grads, norm 8e38: inf in fp32
    assert w.last_step_skipped and w.overflow
    assert w.loss_scale == 1.0  # backed off from 2.0
    assert torch.equal(w.master_params()[0], before)  # not stepped with zeroed grads
    assert str(w.optimizer.state_dict()['state']) == str(state_before['state'])
    # The next, ordinary step goes ahead.
    _step_with_grad(model, w, 1e-3)
    assert not w.last_step_skipped and not torch.equal(w.master_params()[0], before)


def test_fp32_overflowing_squares_are_clipped_exactly_by_the_fused_path():
    # 1e30 elements: the fused path's norm (double accumulation) is exact, so clipping with
    # max_norm=1 gives each element 1e30 / (sqrt(N) * 1e30): SGD lr=1 moves it by 1/8.
    model, w = _wrapper(FusedSGD, True, lr=1.0)
    before = w.master_params()[0].detach().clone()
    _step_with_grad(model, w, 1e30)
    assert not w.last_step_skipped
    torch.testing.assert_close(before - w.master_params()[0],
                               torch.full_like(before, 1 / N ** 0.5))


def test_fp32_overflowing_squares_skip_the_unfused_path():
    # torch's clip_grad_norm_ computes this norm in fp32 (inf): a skip and a back-off, never a
    # step with zeroed gradients.
    model, w = _wrapper(torch.optim.SGD, False, lr=1.0, weight_decay=0.1)
    before = w.master_params()[0].detach().clone()
    _step_with_grad(model, w, 1e30)
    assert w.last_step_skipped and w.loss_scale == 1.0
    assert torch.equal(w.master_params()[0], before)


def test_clip_master_grads_reports_an_overflow():
    model, w = _wrapper(torch.optim.SGD, False, lr=1.0)
    w.backward(model(torch.ones(1, N, dtype=torch.bfloat16)).float().sum(),
               update_master_grads=False)
    model.weight.grad.fill_(1e38 * w.loss_scale)
    before = w.master_params()[0].detach().clone()
    assert w.clip_master_grads(1.0) == -1.0
    w.step()
    assert w.last_step_skipped and w.loss_scale == 1.0
    assert torch.equal(w.master_params()[0], before)


# ---- through mmengine's Runner --------------------------------------------------------------------

WIDE = 2048  # 2048 elements of 1e37: finite, also times the scale 16, but their norm 4.5e38 is inf


class _HugeGradModel(BaseModel):
    """A bf16 linear regressor whose weight gradient gains 1e37 per element at chosen iterations."""

    def __init__(self, huge_iters=()):
        super().__init__()
        self.fc = nn.Linear(WIDE, 1, bias=False)
        self.huge_iters = tuple(huge_iters)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        out = self.fc(torch.stack(inputs).to(self.fc.weight.dtype)).float().squeeze(1)
        if mode != 'loss':
            return out
        loss = ((out - torch.stack(data_samples)) ** 2).mean()
        if MessageHub.get_current_instance().get_info('iter') in self.huge_iters:
            w = self.fc.weight
            loss = loss + 1e37 * (w - w.detach()).float().sum()  # adds 0 to the loss, 1e37 to grads
        return dict(loss=loss)


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return dict(inputs=torch.randn(WIDE, generator=g), data_samples=torch.randn((), generator=g))


_RUN_IDS = itertools.count()


def _runner_run(tmp_path, optimizer, huge_iters, max_iters=6):
    from mmengine.runner import Runner
    torch.manual_seed(0)
    runner = Runner(
        model=_HugeGradModel(huge_iters).to(torch.bfloat16), work_dir=str(tmp_path),
        train_dataloader=dict(dataset=_Data(), batch_size=8,
                              sampler=dict(type='DefaultSampler', shuffle=False)),
        train_cfg=dict(by_epoch=False, max_iters=max_iters, val_interval=1000),
        optim_wrapper=dict(type='mp_wrappers.FP16OptimWrapper', optimizer=optimizer,
                           dynamic_loss_scale=True, dynamic_loss_args=dict(init_scale=16.0),
                           clip_grad=dict(max_norm=1.0)),
        default_hooks=dict(logger=dict(type='LoggerHook', interval=1),
                           checkpoint=dict(type='CheckpointHook', interval=1000)),
        experiment_name=f'nonfinite_norm_{next(_RUN_IDS)}')
    threads = torch.get_num_threads()
    try:
        runner.train()
    finally:
        torch.set_num_threads(threads)
    return runner


@pytest.mark.parametrize('optimizer', [dict(type='SGD', lr=0.01),
                                       dict(type='mp_wrappers.FusedSGD', lr=0.01)],
                         ids=['torch-sgd-unfused', 'fused-sgd'])
def test_runner_with_clip_grad_skips_steps_whose_norm_is_inf(tmp_path, optimizer):
    clean = _runner_run(tmp_path / 'clean', optimizer, huge_iters=())
    planted = _runner_run(tmp_path / 'planted', optimizer, huge_iters=(2,))
    assert clean.optim_wrapper.loss_scalers[0].skipped_steps == 0
    assert clean.optim_wrapper.loss_scale == 16.0
    # One skip and one back-off (16 -> 8); before, the step ran with every gradient zeroed.
    assert planted.optim_wrapper.loss_scalers[0].skipped_steps == 1
    assert planted.optim_wrapper.loss_scale == 8.0
    assert torch.isfinite(planted.model.fc.weight).all()
    assert torch.isfinite(planted.optim_wrapper.master_params()[0]).all()
