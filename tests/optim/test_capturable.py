"""capturable=True and tensor learning rates (Note [capturable] in mp_wrappers.optim.base).

A CUDA graph replays kernel launches with the arguments they were captured with, so a captured
optimizer step must read its lr from a device tensor. These tests check on the CPU what capture
relies on: the kernels read the tensor's current value at every call (an LR scheduler writing into
it in place is followed bit for bit), capturable=True turns every group's lr into such a tensor at
the first step, checkpoints carry it, mmengine's schedulers (which assign floats) still train
exactly, and the combinations that cannot work are refused. tests/kernels/test_cuda_paths.py captures and
replays the step on a GPU.
"""
import io

import pytest
import torch
from torch import nn

import mp_wrappers.optim.base as optim_base
from _compat import needs_schedulers_writing_1_element_lr
from _workflow import RecordHook, make_runner, train
from mp_wrappers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

OPTIMIZERS = {
    'FusedAdam': lambda ps, **kw: FusedAdam(ps, lr=1e-2, weight_decay=0.01, **kw),
    'FusedSGD': lambda ps, **kw: FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True, **kw),
    'FusedLAMB': lambda ps, **kw: FusedLAMB(ps, lr=1e-2, weight_decay=0.01, **kw),
    'FusedAdagrad': lambda ps, **kw: FusedAdagrad(ps, lr=1e-2, **kw),
    'FusedNovoGrad': lambda ps, **kw: FusedNovoGrad(ps, lr=1e-2, **kw),
}


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _run_schedule(model, opt, steps, last_epoch=-1):
    """``steps`` steps under a LambdaLR schedule (torch's schedulers fill a tensor lr in place);
    returns the group-0 lr after each."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i), last_epoch=last_epoch)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    lrs = []
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        lrs.append(opt.param_groups[0]['lr'])
    return lrs


def _train(opt_name, steps=6, **kw):
    model = _model()
    opt = OPTIMIZERS[opt_name](model.parameters(), **kw)
    return model, opt, _run_schedule(model, opt, steps)


@pytest.mark.parametrize('opt_name', sorted(OPTIMIZERS))
def test_capturable_follows_the_schedule_bit_for_bit(opt_name):
    plain, _, plain_lrs = _train(opt_name)
    model, opt, lrs = _train(opt_name, capturable=True)
    lr = opt.param_groups[0]['lr']
    assert isinstance(lr, torch.Tensor) and lr.shape == (1,) and lr.dtype == torch.float32
    # One tensor from the first step on, rewritten in place by the scheduler: what a replayed
    # graph reads.
    assert all(t is lr for t in lrs)
    assert float(lr) == pytest.approx(plain_lrs[-1], rel=1e-7)
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize('shape', [
    (), pytest.param((1,), marks=needs_schedulers_writing_1_element_lr)])
def test_a_tensor_lr_works_without_capturable(shape):
    plain, _, _ = _train('FusedAdam')
    model = _model()
    opt = FusedAdam(model.parameters(), lr=torch.full(shape, 1e-2), weight_decay=0.01)
    _run_schedule(model, opt, 6)
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_round_trip_keeps_training_exact():
    """state_dict with a tensor lr loads under weights_only=True, into a capturable optimizer and
    into a plain one, and both continue exactly as the uninterrupted run."""
    full, _, _ = _train('FusedAdam', steps=6, capturable=True)
    model, opt, _ = _train('FusedAdam', steps=3, capturable=True)
    buf = io.BytesIO()
    torch.save({'model': model.state_dict(), 'opt': opt.state_dict()}, buf)
    for capturable in (True, False):
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
        resumed = _model(seed=1)
        resumed.load_state_dict(ckpt['model'])
        opt2 = FusedAdam(resumed.parameters(), lr=1e-2, weight_decay=0.01, capturable=capturable)
        opt2.load_state_dict(ckpt['opt'])
        _run_schedule(resumed, opt2, 3, last_epoch=2)
        for a, b in zip(full.parameters(), resumed.parameters()):
            assert torch.equal(a, b), f'capturable={capturable}'


def test_float_lr_under_capture_is_refused(monkeypatch):
    """A float lr while a CUDA graph is captured would be replayed forever: refused, naming the
    fix (the capture itself needs a GPU: tests/kernels/test_cuda_paths.py)."""
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    monkeypatch.setattr(optim_base, '_capturing', lambda device: True)
    with pytest.raises(RuntimeError, match=r'being captured in a CUDA graph with a float lr '
                                           r'\(0\.01\).*capturable=True'):
        opt.step()
    # capturable=True after its first (eager) step: the lr is a tensor, capture may proceed.
    opt = FusedAdam(model.parameters(), lr=1e-2, capturable=True)
    monkeypatch.setattr(optim_base, '_capturing', lambda device: False)
    opt.step()
    monkeypatch.setattr(optim_base, '_capturing', lambda device: True)
    opt.step()


def test_tensor_lr_with_a_lean_storage_is_refused_at_the_step():
    model = _model().to(torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-2, bf16_storage='kahan')
    opt.param_groups[0]['lr'] = torch.tensor([1e-2])
    model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    with pytest.raises(ValueError, match="a tensor lr .capturable=True. is not supported with "
                                         "bf16_storage='kahan'"):
        opt.step()
    with pytest.raises(ValueError, match="bf16_storage='split'"):
        FusedAdam(model.parameters(), capturable=True).set_bf16_storage('split')


def test_a_wrong_tensor_lr_in_a_group_is_refused_naming_it():
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    opt.param_groups[0]['lr'] = torch.tensor([1e-2], dtype=torch.float64)  # e.g. set by hand
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(ValueError, match=r"FusedAdam: param_groups\[0\]\['lr'\] is a tensor of "
                                         r'dtype torch.float64 and shape \(1,\) on cpu; a tensor lr '
                                         r"must be a 1-element float32 tensor on the params' device"):
        opt.step()
    # Named by position among several groups (found by identity, not by comparing groups).
    model = _model()
    opt = FusedAdam([{'params': model[0].parameters()}, {'params': model[2].parameters()}],
                    lr=1e-2)
    opt.param_groups[1]['lr'] = torch.ones(2)
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\] is a tensor of dtype "
                                         r'torch.float32 and shape \(2,\)'):
        opt.step()


def test_op_rejects_an_lr_tensor_on_another_device_or_dtype():
    from mp_wrappers.ops import multi_tensor_adam
    p, g = [torch.zeros(4)], [torch.ones(4)]
    m, v = [torch.zeros(4)], [torch.zeros(4)]
    for bad, what in ((torch.ones(1, dtype=torch.float64), 'float64'), (torch.ones(2), '(2,)')):
        with pytest.raises(ValueError, match=r'multi_tensor_adam: lr must be a 1-element float32 '
                                             r'tensor on cpu, got'):
            multi_tensor_adam(p, g, m, v, [], torch.zeros(1), bad, 0.9, 0.999, 1e-8, 0.0, True,
                              True)
    multi_tensor_adam(p, g, m, v, [], torch.zeros(1), torch.tensor([0.5]), 0.9, 0.999, 1e-8, 0.0,
                      True, True)
    assert torch.allclose(p[0], torch.full((4,), -0.5))


@pytest.mark.parametrize('wrapper', ['O2', 'FP16'])
def test_runner_capturable_with_mmengine_schedule_equals_float_lr(tmp_path, wrapper):
    """Through mmengine's Runner (fused master step, a LinearLR warm-up, whose scheduler assigns
    float lrs): capturable=True trains to the same weights as capturable=False at every iteration."""
    runs = {}
    for capturable in (False, True):
        record = RecordHook()
        runner = make_runner(
            tmp_path / f'{wrapper}_{capturable}', wrapper, 'bfloat16', iters=6,
            optimizer=dict(type='mp_wrappers.FusedAdam', lr=1e-2, capturable=capturable),
            param_scheduler=dict(type='LinearLR', start_factor=0.25, by_epoch=False, begin=0,
                                 end=4))
        runner.register_hook(record, priority='LOWEST')
        train(runner)
        runs[capturable] = record.weights
    for a, b in zip(runs[False], runs[True]):
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(runs[True][0][n], runs[True][-1][n]) for n in runs[True][0])


def test_runner_resume_with_capturable_is_exact(tmp_path):
    """mmengine resume (checkpoint loaded with map_location='cpu', weights_only) of an O2 run with
    FusedAdam(capturable=True): the tensor lr comes back, and the resumed run ends on the
    uninterrupted run's weights bit for bit."""
    optimizer = dict(type='mp_wrappers.FusedAdam', lr=1e-2, capturable=True)
    # (No LR schedule: make_runner's checkpoints leave the schedulers out.)
    full_record = RecordHook()
    full = make_runner(tmp_path / 'full', 'O2', 'bfloat16', iters=6, optimizer=optimizer,
                       ckpt_interval=3)
    full.register_hook(full_record, priority='LOWEST')
    train(full)
    resumed_record = RecordHook()
    resumed = make_runner(tmp_path / 'resumed', 'O2', 'bfloat16', iters=6, optimizer=optimizer,
                          resume=True,
                          load_from=str(tmp_path / 'full' / 'iter_3.pth'))
    resumed.register_hook(resumed_record, priority='LOWEST')
    train(resumed)
    lr = resumed.optim_wrapper.optimizer.param_groups[0]['lr']
    assert isinstance(lr, torch.Tensor)
    assert len(resumed_record.weights) == 3
    for name, value in full_record.weights[-1].items():
        assert torch.equal(value, resumed_record.weights[-1][name]), name
