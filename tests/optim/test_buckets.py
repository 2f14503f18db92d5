"""How a fused step gathers its params into op calls (mp_wrappers.optim.buckets and
FusedOptimizer._collect): the slot state worked out once per group, dtype and step (Note [collect
fast path]) following changes between steps, the exact state-dtype check behind it, and the slot
errors, checked once per bucket, still naming the param."""
import pytest
import torch
from torch import nn

from _tolerances import TOL
from mp_wrappers import compat
from mp_wrappers.ops import reference
from mp_wrappers.optim import FusedAdam, FusedSGD, base


def _reference(op, device):
    return getattr(reference, op)


@pytest.fixture
def strided_calls(monkeypatch):
    """The slots that took the strided path (re-laid out), per step taken."""
    calls = []
    real = base.add_strided

    def spy(bucket, keys, target, *args):
        calls.append(target.shape)
        return real(bucket, keys, target, *args)

    monkeypatch.setattr(base, 'add_strided', spy)
    return calls


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _run(opt, params, steps, start=0):
    for t in range(start, start + steps):
        for p, g in zip(params, _grads(params, t)):
            p.grad = g
        opt.step()


def test_a_state_of_another_dtype_or_layout_is_laid_out_again(strided_calls):
    ps = [nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    twins = [nn.Parameter(p.detach().clone()) for p in ps]
    opt, twin = FusedAdam(ps, lr=1e-2), FusedAdam(twins, lr=1e-2)
    _run(opt, ps, 2)
    _run(twin, twins, 2)
    state = opt.state[ps[1]]  # e.g. what a user or another loader put there
    state['exp_avg'] = state['exp_avg'].double()
    state['exp_avg_sq'] = state['exp_avg_sq'].t().contiguous().t()
    _run(opt, ps, 2, start=2)
    _run(twin, twins, 2, start=2)
    assert strided_calls == [(4, 3)]  # once, at the first step after the change
    assert state['exp_avg'].dtype == torch.float32 and state['exp_avg_sq'].is_contiguous()
    for p, q in zip(ps, twins):
        assert torch.equal(p, q)


@pytest.mark.parametrize('big_first', [True, False])
def test_8bit_and_float32_moments_share_a_bucket(big_first, strided_calls):
    """One group and dtype, one bucket: the first slot's state dtype is no rule for the others,
    which take the contiguous path too."""
    big, small = torch.randn(64, 64), torch.randn(16)
    ps = [nn.Parameter(t.clone()) for t in ((big, small) if big_first else (small, big))]
    opt = FusedAdam(ps, lr=1e-2, state_dtype='int8', min_8bit_size=4096)
    _run(opt, ps, 3)
    assert strided_calls == []
    for p in ps:
        want = torch.uint8 if p.numel() >= 4096 else torch.float32
        assert opt.state[p]['exp_avg'].dtype == want, p.shape
    i = 1 if big_first else 0
    ref = nn.Parameter(small.clone())
    ref_opt = FusedAdam([ref], lr=1e-2)
    for t in range(3):
        ref.grad = _grads(ps, t)[i]
        ref_opt.step()
    torch.testing.assert_close(ps[i], ref, **TOL[torch.float32])


def test_slot_state_keys_follow_the_group_every_step():
    """SGD momentum switched on after two steps: the buffer is created then, as torch does."""
    ps = [nn.Parameter(torch.randn(5)) for _ in range(2)]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = FusedSGD(ps, lr=0.1), torch.optim.SGD(qs, lr=0.1)
    for t in range(4):
        if t == 2:
            opt.param_groups[0]['momentum'] = ref.param_groups[0]['momentum'] = 0.9
        for p, q, g in zip(ps, qs, _grads(ps, t)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p, q, **TOL[torch.float32])
    assert opt.state[ps[0]]['momentum_buffer'].dtype == torch.float32


def test_lean_storage_set_between_steps():
    """The bf16 param's aux state appears when a storage is set after some steps; the fp32 param
    of the same group gets none."""
    w32, w16 = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6).bfloat16())
    opt = FusedAdam([w32, w16], lr=1e-2)
    _run(opt, [w32, w16], 2)
    assert 'kahan_comp' not in opt.state[w16]
    opt.set_bf16_storage('kahan')
    _run(opt, [w32, w16], 2, start=2)
    assert opt.state[w16]['kahan_comp'].dtype == torch.bfloat16
    assert 'kahan_comp' not in opt.state[w32]
    if compat.has('uint16'):
        opt.set_bf16_storage('split')
        _run(opt, [w32, w16], 1, start=4)
        assert opt.state[w16]['master_low'].dtype == torch.uint16


@pytest.mark.skipif(not compat.has('uint16'), reason="'split' needs torch.uint16")
def test_a_storage_switched_back_to_starts_its_aux_state_anew():
    """split -> kahan -> split: the low halves of the first split steps belong to a param that the
    kahan steps moved since; the switch away drops them, so the switch back steps exactly as a
    storage set for the first time (zero low halves: the param is its bf16 value)."""
    w = nn.Parameter(torch.randn(300).bfloat16())
    opt = FusedAdam([w], lr=1e-2, bf16_storage='split')
    _run(opt, [w], 2)
    opt.set_bf16_storage('kahan')
    assert 'master_low' not in opt.state[w]
    _run(opt, [w], 2, start=2)
    opt.set_bf16_storage('split')
    assert 'kahan_comp' not in opt.state[w] and 'master_low' not in opt.state[w]
    twin = nn.Parameter(w.detach().clone())
    twin_opt = FusedAdam([twin], lr=1e-2, bf16_storage='split')
    twin_opt.load_state_dict(opt.state_dict())  # the moments and step, no aux state
    _run(opt, [w], 2, start=4)
    _run(twin_opt, [twin], 2, start=4)
    assert torch.equal(w, twin)
    assert torch.equal(opt.state[w]['master_low'], twin_opt.state[twin]['master_low'])
    opt.set_bf16_storage('split')  # the same storage again: nothing dropped
    assert 'master_low' in opt.state[w]


@pytest.mark.skipif(not compat.has('uint16'), reason="'split' needs torch.uint16")
def test_a_checkpoint_of_another_storage_leaves_no_dead_aux_state():
    w = nn.Parameter(torch.randn(300).bfloat16())
    kahan = FusedAdam([w], lr=1e-2, bf16_storage='kahan')
    _run(kahan, [w], 2)
    split = FusedAdam([w], lr=1e-2, bf16_storage='split')
    split.load_state_dict(kahan.state_dict())
    assert 'kahan_comp' not in split.state[w]  # it would load as 4 B/param of float32
    _run(split, [w], 1, start=2)
    assert sorted(split.state_dict()['state'][0]) == ['exp_avg', 'exp_avg_sq', 'master_low',
                                                       'step']
    # No storage set yet (a wrapper's master_weights sets it after building the optimizer): a
    # loaded aux state stays for the storage set next, and the others' go then.
    saved = split.state_dict()
    saved['state'][0]['kahan_comp'] = torch.zeros(300, dtype=torch.bfloat16)
    later = FusedAdam([w], lr=1e-2)
    later.load_state_dict(saved)
    assert {'master_low', 'kahan_comp'} <= set(later.state[w])
    later.set_bf16_storage('split')
    assert torch.equal(later.state[w]['master_low'], split.state[w]['master_low'])
    assert 'kahan_comp' not in later.state[w]


def test_state_dtypes_per_param_dtype_in_one_group():
    w32, w16 = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6).bfloat16())
    ref32 = nn.Parameter(w32.detach().clone())
    opt = FusedAdam([w16, w32], lr=1e-2, bf16_storage='kahan', state_dtype='bfloat16')
    _run(opt, [w16, w32], 3)
    ref_opt = FusedAdam([ref32], lr=1e-2)
    for t in range(3):
        ref32.grad = _grads([w16, w32], t)[1]
        ref_opt.step()
    assert [opt.state[w16][k].dtype for k in ('exp_avg', 'exp_avg_sq', 'kahan_comp')] == \
        [torch.bfloat16] * 3
    assert [opt.state[w32][k].dtype for k in ('exp_avg', 'exp_avg_sq')] == [torch.float32] * 2
    assert torch.equal(w32, ref32)


def test_params_losing_their_grad_are_left_alone():
    ps = [nn.Parameter(torch.randn(3)) for _ in range(3)]
    opt = FusedAdam(ps, lr=1e-2)
    _run(opt, ps, 2)
    before = ps[1].detach().clone()
    ps[1].grad = None
    opt.step()
    assert torch.equal(ps[1], before) and not torch.equal(ps[0], before)


@pytest.mark.parametrize('position', [0, 1])
def test_slot_errors_name_the_param(position):
    """The first slot of a bucket and a later one alike (the later one is checked only where the
    bucket key does not vouch for it)."""
    masters = [torch.randn(4, requires_grad=True) for _ in range(2)]
    opt = FusedAdam(masters, lr=1e-2)

    def with_bad(good, bad):
        return [[bad if i == position else good.clone() for i in range(2)]]

    where = f'param {position} of group 0'
    with pytest.raises(ValueError, match=f'the gradient of {where} is \\(5,\\) on cpu'):
        opt.fused_master_step(with_bad(torch.randn(4), torch.randn(5)), None)
    with pytest.raises(TypeError, match=f'the gradient of {where} has dtype torch.int64'):
        opt.fused_master_step(with_bad(torch.randn(4), torch.ones(4, dtype=torch.int64)), None)
    with pytest.raises(ValueError, match=f'the gradient of {where} is \\(4,\\) on meta'):
        opt.fused_master_step(with_bad(torch.randn(4), torch.empty(4, device='meta')), None)
    with pytest.raises(ValueError, match=f'the model param of {where} is \\(2, 3\\) on cpu'):
        opt.fused_master_step(with_bad(torch.randn(4), torch.randn(4)),
                              with_bad(torch.randn(4).bfloat16(), torch.randn(2, 3).bfloat16()))


@pytest.mark.parametrize('kernels', [True, False], ids=['kernels', 'references'])
def test_a_grad_of_another_shape_and_the_same_size(kernels, strided_calls, monkeypatch):
    """A (2, 6) grad for a (3, 4) master steps as the (3, 4) grad would, with the kernels and with
    the pure-PyTorch references (which broadcast: such a slot goes as flat views)."""
    if not kernels:
        monkeypatch.setattr(base, 'implementation', _reference)
    masters = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    twins = [m.detach().clone().requires_grad_() for m in masters]
    opt, twin = FusedAdam(masters, lr=1e-2), FusedAdam(twins, lr=1e-2)
    for t in range(2):
        grads = _grads(masters, t)
        opt.fused_master_step([[g.reshape(2, 6) for g in grads]], None)
        twin.fused_master_step([grads], None)
    assert strided_calls == [(3, 4)] * 4
    for m, q in zip(masters, twins):
        assert torch.equal(m, q)
