"""The fused optimizers: against torch.optim or float64 references, skipped steps, loss scaling,
state round trips, LR schedules, validation, the fused master step and config building."""
import io
import math

import pytest
import torch
from torch import nn

from _compat import needs_cpu_grad_scaler
from _tolerances import TOL
import mp_wrappers
from mp_wrappers.optim import (FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedOptimizer,
                               FusedSGD)

SHAPES = [(16, 8), (8,), (4, 3, 3, 3), (1,)]
STEPS = 8
SCALE = 256.0  # a power of two, so scaled grads divide back exactly


def make_params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]


def grads_at(step, dtype=torch.float32, scale=1.0):
    """Deterministic gradients of step ``step`` (growing, so LAMB clips some steps and not others)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=gen) * (0.5 + 0.2 * step) * scale).to(dtype)
            for s in SHAPES]


def groups(params, **second):
    """Two param groups; the second overrides some hyperparameters."""
    return [dict(params=params[:2]), dict(params=params[2:], **second)]


def assert_params_close(actual, expected, dtype=torch.float32, what='param'):
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a.detach().double(), e.detach().to(dtype).double(),
                                   **TOL[dtype], msg=lambda m: f'{what} {i}: {m}')


def run(opt, params, steps=STEPS, start=0, scale=None):
    for t in range(start, start + steps):
        for p, g in zip(params, grads_at(t, scale=scale or 1.0)):
            p.grad = g.to(p.dtype)
        if scale is None:
            opt.step()
        else:
            opt.step(grad_scale=torch.tensor(scale))


# ---- against torch.optim -------------------------------------------------------------------------

TORCH_PAIRS = [
    ('adam-L2', lambda ps: FusedAdam(groups(ps, lr=5e-3), lr=1e-2, weight_decay=0.1,
                                     adam_w_mode=False),
     lambda ps: torch.optim.Adam(groups(ps, lr=5e-3), lr=1e-2, weight_decay=0.1)),
    ('adamw', lambda ps: FusedAdam(groups(ps, weight_decay=0.0), lr=1e-2, betas=(0.8, 0.99),
                                   weight_decay=0.1),
     lambda ps: torch.optim.AdamW(groups(ps, weight_decay=0.0), lr=1e-2, betas=(0.8, 0.99),
                                  weight_decay=0.1)),
    ('sgd-nesterov', lambda ps: FusedSGD(groups(ps, lr=0.05), lr=0.1, momentum=0.9,
                                         weight_decay=1e-2, nesterov=True),
     lambda ps: torch.optim.SGD(groups(ps, lr=0.05), lr=0.1, momentum=0.9, weight_decay=1e-2,
                                nesterov=True)),
    ('sgd-dampening', lambda ps: FusedSGD(groups(ps, momentum=0.5), lr=0.1, momentum=0.9,
                                          dampening=0.3, weight_decay=1e-2),
     lambda ps: torch.optim.SGD(groups(ps, momentum=0.5), lr=0.1, momentum=0.9, dampening=0.3,
                                weight_decay=1e-2)),
    ('sgd-plain', lambda ps: FusedSGD(ps, lr=0.1),
     lambda ps: torch.optim.SGD(ps, lr=0.1)),
    ('adagrad', lambda ps: FusedAdagrad(groups(ps, lr=5e-2), lr=1e-1, weight_decay=0.1),
     lambda ps: torch.optim.Adagrad(groups(ps, lr=5e-2), lr=1e-1, weight_decay=0.1)),
]


@pytest.mark.parametrize('name, fused, reference', TORCH_PAIRS, ids=[p[0] for p in TORCH_PAIRS])
def test_fp32_matches_torch(name, fused, reference):
    ps, qs = make_params(), make_params()
    opt, ref = fused(ps), reference(qs)
    for t in range(STEPS):
        for p, q, g in zip(ps, qs, grads_at(t)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        assert_params_close(ps, qs, what=f'{name} step {t}')


@pytest.mark.parametrize('half', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
@pytest.mark.parametrize('name, fused, reference', TORCH_PAIRS, ids=[p[0] for p in TORCH_PAIRS])
def test_fused_master_step_matches_torch(name, fused, reference, half):
    """fp32 masters in the optimizer, half model params, scaled half grads (O2 without apex)."""
    model = make_params(half)
    masters = [p.detach().float().requires_grad_() for p in model]
    qs = [m.detach().clone().requires_grad_() for m in masters]
    opt, ref = fused(masters), reference(qs)
    nested = [[model[0], model[1]], [model[2], model[3]]] if len(opt.param_groups) == 2 else [model]
    for t in range(STEPS):
        scaled = grads_at(t, half, SCALE)
        for q, g in zip(qs, scaled):
            q.grad = g.float() / SCALE  # what the composed pipeline would hand torch
        grads = [scaled[:2], scaled[2:]] if len(nested) == 2 else [scaled]
        opt.fused_master_step(grads, nested, grad_scale=torch.tensor([SCALE]))
        ref.step()
        assert_params_close(masters, qs, what=f'{name} master step {t}')
        assert_params_close(model, qs, half, what=f'{name} model step {t}')
        for p, m in zip(model, masters):
            assert torch.equal(p, m.to(half))  # the model copy is the master, rounded once


# ---- LAMB and NovoGrad against written-out float64 optimizers --------------------------------------

def lamb_float64(params, steps, group_hp, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, max_norm=1.0,
                 adam_w=True, averaging=True, nvlamb=False):
    ps = [p.detach().double() for p in params]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    b1, b2 = betas
    for t in range(1, steps + 1):
        gs = [g.double() for g in grads_at(t - 1)]
        total = math.sqrt(sum(float(g.pow(2).sum()) for g in gs))
        clip = total / max_norm if max_norm > 0 and total > max_norm else 1.0
        for i, g in enumerate(gs):
            wd = group_hp[i]
            g = g / clip
            if not adam_w:
                g = g + wd * ps[i]
            m[i] = b1 * m[i] + ((1 - b1) if averaging else 1.0) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            update = (m[i] / (1 - b1 ** t)) / (torch.sqrt(v[i] / (1 - b2 ** t)) + eps)
            if adam_w:
                update = update + wd * ps[i]
            ratio = lr
            if nvlamb or wd != 0:
                pn, un = float(ps[i].norm()), float(update.norm())
                if pn != 0 and un != 0:
                    ratio = lr * pn / un
            ps[i] = ps[i] - ratio * update
    return ps


def novograd_float64(params, steps, lr=1e-2, betas=(0.95, 0.98), eps=1e-8, wd=0.01,
                     reg_inside=False, averaging=True, norm_type=2, init_zero=False):
    ps = [p.detach().double() for p in params]
    m = [torch.zeros_like(p) for p in ps]
    norms = [0.0] * len(ps)
    b1, b2 = betas
    for t in range(1, steps + 1):
        for i, g in enumerate(grads_at(t - 1)):
            g = g.double()
            n = float(g.norm()) if norm_type == 2 else float(g.abs().max())
            if t == 1 and not init_zero:
                norms[i] = n
            elif norm_type == 2:
                norms[i] = math.sqrt(b2 * norms[i] ** 2 + (1 - b2) * n ** 2)
            else:
                norms[i] = b2 * norms[i] + (1 - b2) * n
            denom = norms[i] / math.sqrt(1 - b2 ** t) + eps
            beta3 = (1 - b1) if averaging else 1.0
            if reg_inside:
                m[i] = b1 * m[i] + beta3 * (g / denom + wd * ps[i])
                ps[i] = ps[i] - lr * m[i] / (1 - b1 ** t)
            else:
                m[i] = b1 * m[i] + beta3 * g
                ps[i] = ps[i] - lr * (m[i] / (1 - b1 ** t) / denom + wd * ps[i])
    return ps


LAMB_CASES = [
    dict(kw=dict(), wd=(0.01, 0.0)),
    dict(kw=dict(use_nvlamb=True, max_grad_norm=0.0), wd=(0.01, 0.0)),
    dict(kw=dict(adam_w_mode=False, grad_averaging=False, max_grad_norm=50.0), wd=(0.05, 0.02)),
]


@pytest.mark.parametrize('case', LAMB_CASES, ids=['default', 'nvlamb-noclip', 'l2-noavg'])
def test_lamb_matches_float64(case):
    ps = make_params()
    opt = FusedLAMB(groups(ps, weight_decay=case['wd'][1]), lr=1e-2, weight_decay=case['wd'][0],
                    **case['kw'])
    run(opt, ps)
    kw = case['kw']
    expected = lamb_float64(make_params(), STEPS, [case['wd'][0]] * 2 + [case['wd'][1]] * 2,
                            max_norm=kw.get('max_grad_norm', 1.0),
                            adam_w=kw.get('adam_w_mode', True),
                            averaging=kw.get('grad_averaging', True),
                            nvlamb=kw.get('use_nvlamb', False))
    assert_params_close(ps, expected)


NOVOGRAD_CASES = [dict(), dict(reg_inside_moment=True, norm_type=0),
                  dict(init_zero=True, grad_averaging=False)]


@pytest.mark.parametrize('kw', NOVOGRAD_CASES, ids=['default', 'reg-inside-inf', 'init-zero'])
def test_novograd_matches_float64(kw):
    ps = make_params()
    opt = FusedNovoGrad(groups(ps), lr=1e-2, betas=(0.95, 0.98), weight_decay=0.01, **kw)
    run(opt, ps)
    expected = novograd_float64(make_params(), STEPS,
                                reg_inside=kw.get('reg_inside_moment', False),
                                averaging=kw.get('grad_averaging', True),
                                norm_type=kw.get('norm_type', 2),
                                init_zero=kw.get('init_zero', False))
    assert_params_close(ps, expected)


@pytest.mark.parametrize('half', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
def test_lamb_and_novograd_fused_master_step(half):
    for make_opt, expected in (
            (lambda ps: FusedLAMB(ps, lr=1e-2), lamb_float64(make_params(), STEPS, [0.01] * 4)),
            (lambda ps: FusedNovoGrad(ps, lr=1e-2, betas=(0.95, 0.98), weight_decay=0.01),
             novograd_float64(make_params(), STEPS))):
        # The model starts from the same fp32 values the reference starts from (masters), so only
        # the grads are half: scaled half grads of values exactly representable after unscaling.
        masters = make_params()
        model = [m.detach().to(half) for m in masters]
        opt = make_opt(masters)
        for t in range(STEPS):
            opt.fused_master_step([[g.to(half) for g in grads_at(t, scale=SCALE)]], [model],
                                  grad_scale=torch.tensor([SCALE]))
        # Half grads differ from the fp32 grads of the reference by one rounding each.
        assert_params_close(masters, expected, half)
        assert_params_close(model, expected, half)


# ---- skipped steps and loss scaling -----------------------------------------------------------------

ALL = [
    ('adam', lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1)),
    ('adam-master-weights', lambda ps: FusedAdam(ps, lr=1e-2, master_weights=True)),
    ('sgd', lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2)),
    ('lamb', lambda ps: FusedLAMB(ps, lr=1e-2)),
    ('adagrad', lambda ps: FusedAdagrad(ps, lr=1e-2)),
    ('novograd', lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01)),
]
IDS = [a[0] for a in ALL]


def state_tensors(opt):
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize('name, make', ALL, ids=IDS)
def test_found_inf_leaves_every_bit(name, make):
    dtype = torch.bfloat16 if name == 'adam-master-weights' else torch.float32
    ps = make_params(dtype)
    opt = make(ps)
    run(opt, ps, steps=2)
    model = [p.detach().to(torch.float16) for p in ps]
    before = [t.clone() for t in ps + model + state_tensors(opt)]
    for p, g in zip(ps, grads_at(5, scale=SCALE)):
        p.grad = g.to(p.dtype)
    ps[0].grad[0, 0] = float('inf')
    flag = torch.ones(())
    opt.step(grad_scale=torch.tensor(SCALE), found_inf=flag)
    if name != 'adam-master-weights':  # that one owns its masters: no model copies to pass
        opt.fused_master_step(None, [model], grad_scale=torch.tensor(SCALE), found_inf=flag)
    after = ps + model + state_tensors(opt)
    assert len(before) == len(after)
    for b, a in zip(before, after):
        assert torch.equal(b, a)


@pytest.mark.parametrize('name, make', ALL, ids=IDS)
def test_grad_scale_equals_unscaled(name, make):
    dtype = torch.bfloat16 if name == 'adam-master-weights' else torch.float32
    ps, qs = make_params(dtype), make_params(dtype)
    a, b = make(ps), make(qs)
    run(a, ps, steps=4)
    run(b, qs, steps=4, scale=SCALE)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    for x, y in zip(state_tensors(a), state_tensors(b)):
        assert torch.equal(x, y)


def _toy_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


@needs_cpu_grad_scaler
def test_grad_scaler_contract():
    """torch.amp.GradScaler hands its scale and flag to the optimizer instead of unscaling."""
    model, ref_model = _toy_model(), _toy_model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=0.0)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10)
    ref_scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10)
    x, y = torch.randn(32, 6), torch.randn(32, 3)
    for it in range(7):
        for m, o, s in ((model, opt, scaler), (ref_model, ref, ref_scaler)):
            o.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            s.scale(loss).backward()
            s.step(o)
            s.update()
        assert_params_close(list(model.parameters()), list(ref_model.parameters()))
    # An overflow: the scaler sees inf, the step is skipped on the device, the scale backs off.
    before = [t.clone() for t in list(model.parameters()) + state_tensors(opt)]
    opt.zero_grad()
    scale = scaler.get_scale()
    loss = nn.functional.mse_loss(model(x), y) * float('inf')
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == scale / 2
    for b, a in zip(before, list(model.parameters()) + state_tensors(opt)):
        assert torch.equal(b, a)
    assert not hasattr(opt, 'grad_scale') and not hasattr(opt, 'found_inf')


@needs_cpu_grad_scaler
def test_grad_scaler_with_explicit_unscale_and_clipping():
    """After scaler.unscale_(opt) the scaler passes no scale, only the flag."""
    model, ref_model = _toy_model(), _toy_model()
    opt = FusedAdam(model.parameters(), lr=1e-2, adam_w_mode=False)
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    scalers = [torch.amp.GradScaler('cpu', init_scale=2.0 ** 10) for _ in range(2)]
    x, y = torch.randn(32, 6), torch.randn(32, 3)
    for it in range(5):
        for m, o, s in ((model, opt, scalers[0]), (ref_model, ref, scalers[1])):
            o.zero_grad()
            s.scale(nn.functional.mse_loss(m(x), y)).backward()
            s.unscale_(o)
            nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            s.step(o)
            s.update()
        assert_params_close(list(model.parameters()), list(ref_model.parameters()))


# ---- state ---------------------------------------------------------------------------------------

@pytest.mark.parametrize('name, make', ALL, ids=IDS)
def test_state_dict_round_trip(name, make):
    dtype = torch.bfloat16 if name == 'adam-master-weights' else torch.float32
    ps = make_params(dtype)
    opt = make(ps)
    run(opt, ps, steps=3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    qs = [p.detach().clone().requires_grad_() for p in ps]
    opt2 = make(qs)
    opt2.load_state_dict(loaded)
    for s in opt2.state.values():
        for k, v in s.items():
            assert v.dtype == torch.float32, k  # fp32 state even where the param is bf16
    run(opt, ps, steps=4, start=3)
    run(opt2, qs, steps=4, start=3)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    # Counters of one cohort are one tensor again after loading (one op call per bucket).
    assert len({id(s['step']) for s in opt2.state.values()}) == 1
    assert float(next(iter(opt2.state.values()))['step']) == 7


def test_half_params_keep_fp32_state_through_load():
    ps = make_params(torch.bfloat16)
    opt = FusedAdam(ps, lr=1e-2)
    run(opt, ps, steps=2)
    qs = [p.detach().clone().requires_grad_() for p in ps]
    opt2 = FusedAdam(qs, lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    for p, q in zip(ps, qs):
        for k in ('exp_avg', 'exp_avg_sq'):
            assert opt2.state[q][k].dtype == torch.float32
            assert torch.equal(opt2.state[q][k], opt.state[p][k])
            assert opt2.state[q][k] is not opt.state[p][k]  # a copy, not the caller's tensor


def test_load_rejects_mismatched_state():
    ps = make_params()
    adagrad = FusedAdagrad(ps, lr=0.1)  # its groups have no momentum, its state no buffers
    run(adagrad, ps, steps=1)
    with pytest.raises(ValueError, match='momentum_buffer'):
        FusedSGD(ps, lr=0.1, momentum=0.9).load_state_dict(adagrad.state_dict())
    state = FusedAdam(ps).state_dict()
    state['mp_wrappers_fused_optimizer_version'] = 99
    with pytest.raises(ValueError, match='version'):
        FusedAdam(ps).load_state_dict(state)


def test_loads_torch_adam_state():
    ps, qs = make_params(), make_params()
    ref = torch.optim.AdamW(ps, lr=1e-2)
    run(ref, ps, steps=3)
    opt = FusedAdam([q for q in qs], lr=1e-2)
    for p, q in zip(ps, qs):
        q.data.copy_(p.data)
    opt.load_state_dict(ref.state_dict())
    run(ref, ps, steps=3, start=3)
    run(opt, qs, steps=3, start=3)
    assert_params_close(qs, ps)


# ---- LR schedules, buckets, late params, layouts -----------------------------------------------------

def test_lr_scheduler_changes_take_effect():
    ps, qs = make_params(), make_params()
    opt = FusedSGD(ps, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(qs, lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.1)
    ref_sched = torch.optim.lr_scheduler.MultiStepLR(ref, milestones=[2, 4], gamma=0.1)
    for t in range(STEPS):
        for p, q, g in zip(ps, qs, grads_at(t)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
    assert_params_close(ps, qs)
    frozen = [p.detach().clone() for p in ps]
    opt.param_groups[0]['lr'] = 0.0
    run(opt, ps, steps=1)
    for a, b in zip(ps, frozen):
        assert torch.equal(a, b)


def test_late_params_and_mixed_dtypes_follow_torch_per_param_semantics():
    """A param whose first grad comes later starts its own count (SGD buffer = grad, Adam bias
    correction from 1), as torch.optim does; a group mixing dtypes advances its counter once."""
    for fused, reference in ((lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
                              lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5)),
                             (lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=False),
                              lambda ps: torch.optim.Adam(ps, lr=1e-2))):
        ps, qs = make_params(), make_params()
        opt, ref = fused(ps), reference(qs)
        for t in range(5):
            for i, (p, q, g) in enumerate(zip(ps, qs, grads_at(t))):
                late = i == 1 and t < 2
                p.grad = None if late else g.clone()
                q.grad = None if late else g.clone()
            opt.step()
            ref.step()
            assert_params_close(ps, qs)
    ps = [torch.randn(4, requires_grad=True), torch.randn(4).bfloat16().requires_grad_()]
    opt = FusedAdam(ps, lr=1e-2)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(4).to(p.dtype)
        opt.step()
    assert [float(opt.state[p]['step']) for p in ps] == [3.0, 3.0]


def test_channels_last_param_matches_contiguous():
    conv, conv_cl = nn.Conv2d(3, 8, 3), nn.Conv2d(3, 8, 3)
    conv_cl.load_state_dict(conv.state_dict())
    conv_cl = conv_cl.to(memory_format=torch.channels_last)
    assert not conv_cl.weight.is_contiguous()
    a, b = FusedAdam(conv.parameters(), lr=1e-2), FusedAdam(conv_cl.parameters(), lr=1e-2)
    x = torch.randn(2, 3, 9, 9)
    for _ in range(3):
        for m, o in ((conv, a), (conv_cl, b)):
            o.zero_grad()
            m(x.contiguous(memory_format=torch.channels_last) if m is conv_cl else x).square() \
                .mean().backward()
            o.step()
    torch.testing.assert_close(conv_cl.weight, conv.weight, **TOL[torch.float32])
    assert conv_cl.weight.is_contiguous(memory_format=torch.channels_last)


def test_fused_master_step_with_model_copy_in_another_layout():
    master = torch.randn(8, 3, 3, 3, requires_grad=True)
    model = master.detach().bfloat16().contiguous(memory_format=torch.channels_last)
    grad = torch.randn(8, 3, 3, 3).bfloat16().contiguous(memory_format=torch.channels_last)
    opt = FusedAdam([master], lr=1e-2)
    for _ in range(2):
        opt.fused_master_step([[grad]], [[model]])
    assert torch.equal(model, master.detach().bfloat16())
    assert model.is_contiguous(memory_format=torch.channels_last)


def test_fused_master_step_mixes_given_grads_and_own_grads():
    masters = [torch.randn(5, requires_grad=True), torch.randn(3, requires_grad=True)]
    model = [masters[0].detach().bfloat16(), None]
    masters[1].grad = torch.randn(3)  # an fp32 param stepped as it is, from its own .grad
    ref = [m.detach().clone().requires_grad_() for m in masters]
    g0 = torch.randn(5).bfloat16()
    ref[0].grad, ref[1].grad = g0.float(), masters[1].grad.clone()
    opt = FusedAdam(masters, lr=1e-2)
    opt.fused_master_step([[g0, None]], [model])
    torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0).step()
    assert_params_close(masters, ref)
    assert torch.equal(model[0], masters[0].bfloat16())
    with pytest.raises(ValueError, match='entries'):
        opt.fused_master_step([[g0]], None)


# ---- API surface ---------------------------------------------------------------------------------

BAD = [
    (FusedAdam, dict(lr=-1.0), 'learning rate: -1.0'),
    (FusedAdam, dict(betas=(1.5, 0.9)), 'beta parameter at index 0: 1.5; expected 0 <= beta < 1'),
    (FusedAdam, dict(betas=(0.9, -0.1)), 'beta parameter at index 1'),
    (FusedAdam, dict(eps=-1e-8), 'eps'),
    (FusedAdam, dict(weight_decay=-0.1), 'weight_decay'),
    (FusedAdam, dict(amsgrad=True), 'amsgrad'),
    (FusedAdam, dict(capturable=True, bf16_storage='kahan'),
     "is not supported with bf16_storage='kahan': the lean kernels take lr as a number"),
    (FusedSGD, dict(lr=0.1, capturable=True, bf16_storage='split'),
     "is not supported with bf16_storage='split'"),
    (FusedAdam, dict(lr=torch.tensor([-1.0])), 'the tensor lr holds -1.0; expected lr >= 0'),
    (FusedLAMB, dict(lr=torch.ones(2)), 'a tensor lr must be a 1-element float32 tensor, got '
                                        'dtype torch.float32 and shape [(]2,[)]'),
    (FusedAdagrad, dict(lr=torch.ones(1, dtype=torch.float64)), 'got dtype torch.float64'),
    (FusedLAMB, dict(amsgrad=True), 'amsgrad'),
    (FusedLAMB, dict(max_grad_norm=-1.0), 'max_grad_norm'),
    (FusedLAMB, dict(betas=(0.9, 1.0)), 'beta parameter at index 1'),
    (FusedNovoGrad, dict(amsgrad=True), 'amsgrad'),
    (FusedNovoGrad, dict(norm_type=1), 'norm_type'),
    (FusedAdagrad, dict(lr=-0.1), 'learning rate'),
    (FusedAdagrad, dict(eps=-1.0), 'eps'),
    (FusedSGD, dict(lr=0.1, nesterov=True), 'nesterov'),
    (FusedSGD, dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), 'nesterov'),
    (FusedSGD, dict(lr=0.1, momentum=-0.9), 'momentum'),
    (FusedSGD, dict(lr=-0.1), 'learning rate'),
]


@pytest.mark.parametrize('cls, kwargs, match', BAD,
                         ids=[f'{c.__name__}-{list(k)[-1]}' for c, k, _ in BAD])
def test_bad_arguments_raise_naming_the_option(cls, kwargs, match):
    with pytest.raises(ValueError, match=match.replace('(', r'\(').replace('.', r'\.')):
        cls(make_params(), **kwargs)


def test_bad_param_group_and_sparse_grad_raise():
    ps = make_params()
    opt = FusedAdam(ps[:2])
    with pytest.raises(ValueError, match='learning rate'):
        opt.add_param_group(dict(params=ps[2:], lr=-1.0))
    emb = nn.Embedding(10, 4, sparse=True)
    opt = FusedAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match='sparse'):
        opt.step()


def test_zero_grad_defaults_and_keyword():
    ps = make_params()
    for p in ps:
        p.grad = torch.ones_like(p)
    FusedSGD(ps, lr=0.1).zero_grad()  # apex default set_grad_none=False: zeros
    assert all(p.grad is not None and not p.grad.any() for p in ps)
    FusedSGD(ps, lr=0.1).zero_grad(set_to_none=True)
    assert all(p.grad is None for p in ps)
    for p in ps:
        p.grad = torch.ones_like(p)
    FusedAdam(ps).zero_grad()  # set_grad_none=True
    assert all(p.grad is None for p in ps)


def test_protocol_attributes():
    for cls in (FusedAdam, FusedSGD, FusedLAMB, FusedAdagrad, FusedNovoGrad):
        assert issubclass(cls, FusedOptimizer)
        assert cls._step_supports_amp_scaling is True
        assert cls.supports_fused_master_step is True
        assert getattr(mp_wrappers, cls.__name__) is cls


@pytest.mark.parametrize('name', ['FusedAdam', 'FusedSGD', 'FusedLAMB', 'FusedAdagrad',
                                  'FusedNovoGrad'])
def test_build_from_mmengine_config(name):
    from mmengine.optim import build_optim_wrapper
    from mmengine.registry import DefaultScope
    model = _toy_model()
    cfg = dict(type='OptimWrapper', optimizer=dict(type=f'mp_wrappers.{name}', lr=1e-3))
    scope = DefaultScope.get_instance(f'test-optim-{name}', scope_name='mmengine')
    assert DefaultScope.get_current_instance() is scope
    wrapper = build_optim_wrapper(model, cfg)
    assert type(wrapper.optimizer).__name__ == name
    loss = model(torch.randn(4, 6)).sum()
    wrapper.update_params(loss)
    assert wrapper.get_lr()['lr'] == [1e-3]
