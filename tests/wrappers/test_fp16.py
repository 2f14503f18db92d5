"""FP16OptimWrapper against plain fp32 training, apex FP16_Optimizer semantics, mmengine's contract."""
import copy

import pytest
import torch
import torch.nn.functional as F
from mmengine.optim import OptimWrapper, build_optim_wrapper
from mmengine.registry import DefaultScope
from torch import nn

from _compat import needs_cpu_grad_scaler
from _tolerances import TRAIN_TOL
from mp_wrappers import FP16OptimWrapper, cast_model


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 5))


def _batches(n, seed=1, batch=16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g))
            for _ in range(n)]


def _loss(model, x, y, dtype=torch.float32):
    return F.cross_entropy(model(x.to(dtype)).float(), y)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


def _fp32_run(batches, **wrapper_kw):
    model = _model()
    wrapper = OptimWrapper(_sgd(model.parameters()), **wrapper_kw)
    for x, y in batches:
        wrapper.update_params(_loss(model, x, y))
    return model


def _half_run(batches, dtype, **wrapper_kw):
    model = cast_model(_model(), dtype) if dtype != torch.float32 else _model()
    wrapper = FP16OptimWrapper(_sgd(model.parameters()), **wrapper_kw)
    for x, y in batches:
        wrapper.update_params(_loss(model, x, y, dtype))
    return model, wrapper


def _assert_params_close(a, b, dtype):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.float(), p, **TRAIN_TOL[dtype], msg=name)


def test_fp32_params_with_dynamic_scale_match_plain_fp32_bitwise():
    # Power-of-two scales commute exactly with every rounding in backward: bitwise equal.
    batches = _batches(10)
    ref = _fp32_run(batches)
    model, wrapper = _half_run(batches, torch.float32, dynamic_loss_scale=True)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert wrapper.loss_scale == 2.0**16


@pytest.mark.parametrize('dtype, kw', [
    (torch.bfloat16, dict()),
    (torch.float16, dict(dynamic_loss_scale=True)),
    (torch.float16, dict(static_loss_scale=128.0)),
])
def test_half_model_tracks_fp32_run(dtype, kw):
    batches = _batches(20)
    ref = _fp32_run(batches)
    model, wrapper = _half_run(batches, dtype, **kw)
    _assert_params_close(ref, model, dtype)
    # The masters stay fp32 and are what the half model was rounded from.
    for master, p in wrapper._master_params().half_pairs():
        assert master.dtype == torch.float32
        assert torch.equal(master.to(dtype), p)


def test_optimizer_steps_fp32_masters_and_keeps_norm_params():
    model = cast_model(_model(), torch.float16)
    wrapper = FP16OptimWrapper(_sgd(model.parameters()))
    dtypes = [p.dtype for p in wrapper.param_groups[0]['params']]
    assert dtypes == [torch.float32] * 6
    assert model[1].weight.dtype == torch.float32  # BatchNorm kept fp32, stepped directly
    assert wrapper.param_groups[0]['params'][2] is model[1].weight


def _snapshot(model, wrapper):
    snap = [p.detach().clone() for p in model.parameters()]
    snap += [m.detach().clone() for m in wrapper.master_params()]
    for st in wrapper.optimizer.state.values():
        snap += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return snap


@pytest.mark.parametrize('bad', [float('inf'), float('nan')])
@pytest.mark.parametrize('dynamic', [True, False])
def test_overflow_skips_step_bit_identically(bad, dynamic):
    model = cast_model(_model(), torch.float16)
    wrapper = FP16OptimWrapper(_sgd(model.parameters()), dynamic_loss_scale=dynamic,
                               static_loss_scale=8.0)
    batches = _batches(4)
    for x, y in batches[:2]:
        wrapper.update_params(_loss(model, x, y, torch.float16))
    before = _snapshot(model, wrapper)
    scale = wrapper.loss_scale
    x, y = batches[2]
    wrapper.backward(_loss(model, x, y, torch.float16), update_master_grads=False)
    model[3].weight.grad[1, 2] = bad  # planted in a half grad
    wrapper.step()
    wrapper.zero_grad()
    after = _snapshot(model, wrapper)
    assert all(torch.equal(a, b) for a, b in zip(before, after) if not a.isnan().any())
    assert wrapper.overflow and wrapper.last_step_skipped
    assert wrapper.loss_scale == (scale / 2 if dynamic else scale)
    assert wrapper.loss_scalers[0].skipped_steps == 1
    # The next clean step goes through.
    wrapper.update_params(_loss(model, *batches[3], torch.float16))
    assert not wrapper.overflow
    assert not all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, wrapper)))


def test_overflow_in_fp32_param_grad_is_caught():
    model = cast_model(_model(), torch.bfloat16)
    wrapper = FP16OptimWrapper(_sgd(model.parameters()))
    x, y = _batches(1)[0]
    wrapper.backward(_loss(model, x, y, torch.bfloat16), update_master_grads=False)
    model[1].weight.grad[0] = float('nan')  # BatchNorm weight: fp32, no master
    before = [p.detach().clone() for p in model.parameters()]
    wrapper.step()
    assert wrapper.overflow
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_accumulation_loss_factors_with_remainder():
    model = _model()
    wrapper = FP16OptimWrapper(_sgd(model.parameters()), accumulative_counts=3)
    wrapper.initialize_count_status(model, 0, 8)
    factors = []
    for _ in range(8):
        one = torch.tensor(1.0, requires_grad=True)
        factors.append(round(1 / wrapper.scale_loss(one).item()))
        wrapper.backward(wrapper.scale_loss(one * model[0].weight.sum() * 0), update_master_grads=False)
        if wrapper.should_update():
            wrapper.step()
            wrapper.zero_grad()
    assert factors == [3, 3, 3, 3, 3, 3, 2, 2]


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_accumulation_matches_large_batch(dtype):
    # Two accumulated half-batches equal one step on the full batch (no BatchNorm: it is batch
    # dependent).
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))
    big, acc = copy.deepcopy(base), copy.deepcopy(base)
    if dtype != torch.float32:
        cast_model(big, dtype)
        cast_model(acc, dtype)
    w_big = FP16OptimWrapper(_sgd(big.parameters()), dynamic_loss_scale=True)
    w_acc = FP16OptimWrapper(_sgd(acc.parameters()), dynamic_loss_scale=True,
                             accumulative_counts=2)
    for x, y in _batches(3, batch=32):
        w_big.update_params(_loss(big, x, y, dtype))
        for half in (slice(0, 16), slice(16, 32)):
            w_acc.update_params(_loss(acc, x[half], y[half], dtype))
    tol = TRAIN_TOL[dtype] if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-6)
    for p, q in zip(w_big.master_params(), w_acc.master_params()):
        torch.testing.assert_close(p, q, **tol)


def test_clip_grad_uses_unscaled_master_grads():
    batches = _batches(6)
    ref = _fp32_run(batches, clip_grad=dict(max_norm=0.5))
    model, _ = _half_run(batches, torch.float32, dynamic_loss_scale=True,
                         clip_grad=dict(max_norm=0.5))
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_clip_grad_config_is_not_mutated():
    cfg = dict(type='norm', max_norm=1.0)
    FP16OptimWrapper(_sgd(_model().parameters()), clip_grad=cfg)
    assert cfg == dict(type='norm', max_norm=1.0)


# ---- apex FP16_Optimizer API -------------------------------------------------------------------------
def test_backward_update_master_grads_and_inspect():
    model = cast_model(_model(), torch.float16)
    wrapper = FP16OptimWrapper(_sgd(model.parameters()), static_loss_scale=4.0)
    x, y = _batches(1)[0]
    wrapper.backward(_loss(model, x, y, torch.float16))
    grads = wrapper.inspect_master_grad_data()
    assert all(g.dtype == torch.float32 for g in grads[0])
    fp32 = _model()
    F.cross_entropy(fp32(x), y).backward()
    for g, p in zip(grads[0], fp32.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=3e-2, atol=3e-3)


def test_two_backwards_then_update_master_grads():
    torch.manual_seed(0)
    model = cast_model(_model(), torch.bfloat16)
    wrapper = FP16OptimWrapper(_sgd(model.parameters()), dynamic_loss_scale=True)
    (x1, y1), (x2, y2) = _batches(2)
    wrapper.backward(_loss(model, x1, y1, torch.bfloat16), update_master_grads=False)
    wrapper.backward(_loss(model, x2, y2, torch.bfloat16), update_master_grads=True)
    stepwise = [g.clone() for g in wrapper.inspect_master_grad_data()[0]]
    wrapper.zero_grad()
    wrapper.backward(_loss(model, x1, y1, torch.bfloat16))
    wrapper.backward(_loss(model, x2, y2, torch.bfloat16))
    for a, b in zip(stepwise, wrapper.inspect_master_grad_data()[0]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)


def test_clip_master_grads_returns_norm_or_minus_one():
    model = cast_model(_model(), torch.float16)
    wrapper = FP16OptimWrapper(_sgd(model.parameters()), static_loss_scale=16.0)
    x, y = _batches(1)[0]
    wrapper.backward(_loss(model, x, y, torch.float16))
    norm = wrapper.clip_master_grads(1e-3)
    total = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad) for p in wrapper.master_params()]))
    assert norm > 1e-3 and total.item() == pytest.approx(1e-3, rel=1e-3)
    wrapper.zero_grad()
    wrapper.backward(_loss(model, x, y, torch.float16), update_master_grads=False)
    model[0].weight.grad.fill_(float('inf'))
    assert wrapper.clip_master_grads(1.0) == -1
    assert wrapper.inspect_master_grad_data() is None


def test_step_with_closure_retries_on_overflow():
    model = cast_model(_model(), torch.float16)
    wrapper = FP16OptimWrapper(_sgd(model.parameters()), dynamic_loss_scale=True)
    x, y = _batches(1)[0]
    calls = []

    def closure():
        loss = _loss(model, x, y, torch.float16)
        calls.append(wrapper.loss_scale)
        # The first evaluation overflows: an fp16 loss scaled by 2**16 past fp16's range.
        wrapper.backward(loss.half() * (1e4 if len(calls) == 1 else 1.0))
        return loss

    before = model[0].weight.detach().clone()
    loss = wrapper.step(closure)
    assert calls == [2.0**16, 2.0**15]
    assert torch.is_tensor(loss) and not torch.equal(before, model[0].weight)


def test_loss_scale_property_get_and_set():
    wrapper = FP16OptimWrapper(_sgd(_model().parameters()), static_loss_scale=32.0)
    assert wrapper.loss_scale == 32.0
    wrapper.loss_scale = 64.0
    assert wrapper.loss_scale == 64.0


def test_lr_scheduler_drives_master_updates():
    from mmengine.optim import MultiStepLR
    model = cast_model(_model(), torch.bfloat16)
    wrapper = FP16OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    sched = MultiStepLR(wrapper, milestones=[1], gamma=0.0)
    x, y = _batches(1)[0]
    wrapper.update_params(_loss(model, x, y, torch.bfloat16))
    sched.step()
    assert wrapper.get_lr()['lr'] == [0.0]
    frozen = [p.detach().clone() for p in wrapper.master_params()]
    wrapper.update_params(_loss(model, x, y, torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(frozen, wrapper.master_params()))


def test_add_param_group_creates_masters():
    model = cast_model(_model(), torch.float16)
    extra = nn.Linear(3, 3).half()
    wrapper = FP16OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    wrapper.add_param_group(dict(params=list(extra.parameters()), lr=0.01))
    assert [p.dtype for p in wrapper.optimizer.param_groups[1]['params']] == [torch.float32] * 2
    extra(torch.randn(2, 3).half()).float().sum().backward()
    wrapper.step()
    assert not wrapper.overflow


# ---- checkpoints -----------------------------------------------------------------------------------
def _train(model, wrapper, batches):
    for x, y in batches:
        wrapper.update_params(_loss(model, x, y, torch.float16))


def test_state_dict_round_trip_continues_exactly(tmp_path):
    batches = _batches(12)
    kw = dict(dynamic_loss_scale=True, dynamic_loss_args=dict(scale_window=3))
    m1 = cast_model(_model(), torch.float16)
    w1 = FP16OptimWrapper(_sgd(m1.parameters()), **kw)
    _train(m1, w1, batches)

    m2 = cast_model(_model(), torch.float16)
    w2 = FP16OptimWrapper(_sgd(m2.parameters()), **kw)
    _train(m2, w2, batches[:5])
    torch.save({'model': m2.state_dict(), 'optim': w2.state_dict()}, tmp_path / 'ckpt.pt')
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    m3 = cast_model(_model(seed=3), torch.float16)
    m3.load_state_dict(ckpt['model'])
    w3 = FP16OptimWrapper(_sgd(m3.parameters()), **kw)
    w3.load_state_dict(ckpt['optim'])
    assert w3.loss_scale == w2.loss_scale
    _train(m3, w3, batches[5:])
    for a, b in zip(m1.parameters(), m3.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(w1.master_params(), w3.master_params()):
        assert torch.equal(a, b)
    assert w1.state_dict()['mp_wrappers']['loss_scalers'] == \
        w3.state_dict()['mp_wrappers']['loss_scalers']


def test_load_without_masters_rederives_them_from_model():
    m = cast_model(_model(), torch.float16)
    w = FP16OptimWrapper(_sgd(m.parameters()))
    state = w.state_dict()
    del state['mp_wrappers']
    with torch.no_grad():
        m[0].weight.add_(1.0)
    w.load_state_dict(state)
    assert torch.equal(w.master_params()[0], m[0].weight.float())


@needs_cpu_grad_scaler
def test_adopts_amp_optim_wrapper_and_apex_scaler_state():
    m = cast_model(_model(), torch.float16)
    w = FP16OptimWrapper(_sgd(m.parameters()), dynamic_loss_scale=True)
    state = _sgd(_model().parameters()).state_dict()
    w.load_state_dict(dict(state, loss_scaler=torch.amp.GradScaler('cpu', init_scale=256.).state_dict()))
    assert w.loss_scale == 256.0
    w.load_state_dict(dict(state, apex_amp={'loss_scaler0': {'loss_scale': 512.0, 'unskipped': 9}}))
    assert w.loss_scale == 512.0 and w.loss_scalers[0].unskipped == 9


def test_mismatched_scaler_count_warns():
    m = cast_model(_model(), torch.float16)
    w = FP16OptimWrapper(_sgd(m.parameters()), dynamic_loss_scale=True)
    state = w.state_dict()
    state['apex_amp'] = {'loss_scaler0': {'loss_scale': 8.0, 'unskipped': 0},
                         'loss_scaler1': {'loss_scale': 4.0, 'unskipped': 0}}
    del state['mp_wrappers']
    with pytest.warns(UserWarning, match='2 loss scaler states'):
        w.load_state_dict(state)
    assert w.loss_scale == 8.0


@pytest.mark.parametrize('mutate, match', [
    (lambda s: s['param_groups'].append(dict(s['param_groups'][0])), 'param groups'),
    (lambda s: s['param_groups'][0]['params'].pop(), 'parameters'),
    (lambda s: s['state'][0].__setitem__('momentum_buffer', torch.zeros(3, 3)), 'shape'),
    (lambda s: s['mp_wrappers']['fp32_master_params'][0].pop(), 'fp32 master'),
    (lambda s: s['mp_wrappers']['fp32_master_params'][0].__setitem__(0, torch.zeros(2)), 'shape'),
    (lambda s: s['mp_wrappers'].__setitem__('version', 7), 'version'),
    (lambda s: s.pop('state'), "'state'"),
])
def test_mismatched_state_dict_is_refused_and_nothing_changes(mutate, match):
    m = cast_model(_model(), torch.float16)
    w = FP16OptimWrapper(_sgd(m.parameters()))
    x, y = _batches(1)[0]
    w.update_params(_loss(m, x, y, torch.float16))
    state = w.state_dict()
    mutate(state)
    before = _snapshot(m, w)
    with pytest.raises((ValueError, KeyError), match=match):
        w.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(m, w)))


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize('kwargs, error, match', [
    (dict(static_loss_scale=0.0), ValueError, 'static_loss_scale'),
    (dict(static_loss_scale=float('nan')), ValueError, 'static_loss_scale'),
    (dict(dynamic_loss_scale=True, dynamic_loss_args=dict(window=3)), ValueError, 'unknown keys'),
    (dict(dynamic_loss_scale=True, dynamic_loss_args=dict(min_loss_scale=4., max_loss_scale=2.)),
     ValueError, 'min_loss_scale'),
    (dict(dynamic_loss_scale='yes'), TypeError, 'dynamic_loss_scale'),
    (dict(accumulative_counts=0), ValueError, 'accumulative_counts'),
    (dict(clip_grad=1.0), TypeError, 'clip_grad'),
])
def test_bad_arguments_name_the_option(kwargs, error, match):
    with pytest.raises(error, match=match):
        FP16OptimWrapper(_sgd(_model().parameters()), **kwargs)


def test_bad_optimizer_and_params():
    with pytest.raises(TypeError, match='optimizer'):
        FP16OptimWrapper(object())
    frozen = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match='dtype torch.int64'):
        FP16OptimWrapper(torch.optim.SGD([frozen], lr=0.1))


def test_bad_loss_id():
    w = FP16OptimWrapper(_sgd(_model().parameters()))
    with pytest.raises(ValueError, match='loss_id=1'):
        w.backward(torch.tensor(1.0, requires_grad=True), loss_id=1)


# ---- registry ----------------------------------------------------------------------------------------
@pytest.mark.parametrize('scope', ['mmengine', 'mp_wrappers'])
def test_builds_from_config_in_any_scope(scope):
    model = cast_model(_model(), torch.bfloat16)
    cfg = dict(type='mp_wrappers.FP16OptimWrapper', optimizer=dict(type='SGD', lr=0.1),
               dynamic_loss_scale=True, accumulative_counts=2)
    with DefaultScope.overwrite_default_scope(scope):
        wrapper = build_optim_wrapper(model, cfg)
    assert type(wrapper) is FP16OptimWrapper and wrapper._accumulative_counts == 2


def test_does_not_shadow_mmengine_names():
    from mmengine.registry import OPTIM_WRAPPERS
    assert 'FP16OptimWrapper' not in OPTIM_WRAPPERS.module_dict
    assert OPTIM_WRAPPERS.get('OptimWrapper') is OptimWrapper


@pytest.mark.parametrize('dtype,cast', [('bf16', torch.bfloat16), ('fp16', torch.float16),
                                        ('half', torch.float16), (torch.bfloat16, torch.bfloat16),
                                        ('float16', torch.float16), ('float32', None), (None, None),
                                        ('auto', None), ('bogus', None)])
def test_config_reading_knows_every_dtype_spelling_the_wrapper_takes(dtype, cast):
    # The launcher casts the model before DDP wraps it when the config says the wrapper will; a
    # spelling the wrapper takes but the config reader missed would make the wrapper cast after DDP.
    from mp_wrappers.optim_config import model_cast_of, optim_cfg_properties
    assert model_cast_of(dict(type='mp_wrappers.FP16OptimWrapper', dtype=dtype)) == (cast, True)
    # ApexOptimWrapper refuses dtype=None; so does the reader, not the level's default silently.
    with pytest.raises(ValueError, match=r"dtype=None is not supported"):
        optim_cfg_properties(dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype=None))
