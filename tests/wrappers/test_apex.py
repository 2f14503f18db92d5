"""ApexOptimWrapper: the opt-level table, overrides and their errors, casting, scalers, checkpoints."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from mmengine.optim import OptimWrapper, OptimWrapperDict, build_optim_wrapper
from torch import nn

from _compat import needs_cpu_grad_scaler
import mp_wrappers
from _tolerances import TRAIN_TOL
from mp_wrappers import ApexOptimWrapper, resolve_properties
from mp_wrappers.autocast import active_autocast

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g))
            for _ in range(n)]


def _wrapper(model, **kw):
    kw.setdefault('verbosity', 0)
    return ApexOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), **kw)


def _train(model, wrapper, batches, loss_id=0):
    for x, y in batches:
        with wrapper.optim_context(model):
            loss = F.cross_entropy(model(x).float(), y)
        if loss_id:
            wrapper.update_params(loss, loss_id=loss_id)
        else:
            wrapper.update_params(loss)


# ---- the property table --------------------------------------------------------------------------
@pytest.mark.parametrize('level, expected', [
    ('O0', (F32, False, None, False, 'dynamic')),
    ('O1', (None, True, None, None, 'dynamic')),
    ('O2', (F16, False, True, True, 'dynamic')),
    ('O3', (F16, False, False, False, 'dynamic')),
])
def test_property_table_fp16_with_mmengine_default_loss_scale(level, expected):
    p = resolve_properties(level)
    assert (p.cast_model_type, p.patch_torch_functions, p.keep_batchnorm_fp32, p.master_weights,
            p.loss_scale) == expected


@pytest.mark.parametrize('level, scale', [('O0', 1.0), ('O3', 1.0), ('O2', 128.0)])
def test_explicit_loss_scale_wins(level, scale):
    assert resolve_properties(level, loss_scale=scale).loss_scale == scale
    assert resolve_properties(level, loss_scale=str(scale)).loss_scale == scale


def test_bf16_is_unscaled_unless_asked():
    p = resolve_properties('O2', dtype='bfloat16')
    assert p.cast_model_type == BF16 and p.loss_scale == 1.0
    assert resolve_properties('O2', dtype='bfloat16', loss_scale='dynamic').loss_scale == 'dynamic'


def test_overrides_and_string_forms():
    p = resolve_properties('O2', keep_batchnorm_fp32='False', master_weights=False,
                           cast_model_outputs=F16)
    assert p.keep_batchnorm_fp32 is False and p.master_weights is False
    assert p.cast_model_outputs == F16
    assert resolve_properties('O1', cast_model_type=torch.float32).cast_model_type == F32
    assert resolve_properties('O1', cast_model_type=False).cast_model_type is None
    assert resolve_properties('O3', keep_batchnorm_fp32='True').keep_batchnorm_fp32 is True


@pytest.mark.parametrize('level, kwargs, match', [
    ('O1', dict(cast_model_type=F16), 'O1 inserts casts'),
    ('O1', dict(keep_batchnorm_fp32=True), 'keep_batchnorm_fp32 should be None'),
    ('O1', dict(master_weights=True), 'master_weights with O1'),
    ('O1', dict(master_weights=False), 'master_weights with O1'),
    ('O0', dict(patch_torch_functions=True), 'patch_torch_functions'),
    ('O2', dict(patch_torch_functions=True), 'patch_torch_functions'),
    ('O3', dict(patch_torch_functions=True), 'patch_torch_functions'),
    ('O4', {}, 'Options are "O0"'),
    ('02', {}, 'letter "O"'),
    ('o2', {}, 'Options are'),
])
def test_rejected_overrides_raise_runtime_error(level, kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        resolve_properties(level, **kwargs)


@pytest.mark.parametrize('kwargs, match', [
    (dict(dtype='fp17'), "dtype='fp17'"),
    (dict(loss_scale='dynamik'), "loss_scale='dynamik'"),
    (dict(loss_scale=-1.0), 'loss_scale=-1.0'),
    (dict(loss_scale=float('inf')), 'loss_scale'),
    (dict(keep_batchnorm_fp32='yes'), "keep_batchnorm_fp32='yes'"),
    (dict(enabled='no'), 'enabled'),
    (dict(cast_model_type='int8'), 'cast_model_type'),
])
def test_bad_values_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_properties('O2', **kwargs)


@pytest.mark.parametrize('kwargs, match', [
    (dict(num_losses=0), 'num_losses'),
    (dict(verbosity=-1), 'verbosity'),
    (dict(min_loss_scale=8.0, max_loss_scale=4.0), 'min_loss_scale'),
    (dict(min_loss_scale=8.0, max_loss_scale=4.0, loss_scale=1.0), 'min_loss_scale'),
    (dict(hysteresis=0), 'hysteresis'),
])
def test_bad_wrapper_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _wrapper(_model(), **kwargs)


def test_verbosity_one_logs_properties(capsys):
    from mmengine.logging import MMLogger
    MMLogger.get_instance('mp_wrappers_test_verbosity')
    model = _model()
    w = _wrapper(model, opt_level='O2', dtype='bfloat16', verbosity=1)
    with w.optim_context(model):
        pass
    assert 'keep_batchnorm_fp32' in capsys.readouterr().out
    assert w.properties.opt_level == 'O2'


# ---- casting under each level ----------------------------------------------------------------------
@pytest.mark.parametrize('dtype', [BF16, F16])
def test_op_dtypes_under_each_level(dtype):
    name = 'bfloat16' if dtype == BF16 else 'float16'
    seen = {}
    for level in ('O0', 'O1', 'O2', 'O3'):
        model = _model()
        w = _wrapper(model, opt_level=level, dtype=name)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            with w.optim_context(model):
                x = torch.randn(2, 1, 8, 8)
                conv = model[0](x.to(model[0].weight.dtype) if level in ('O2', 'O3') else x)
                out = model(x)
                soft = torch.softmax(out, dim=-1)
                summed = torch.sum(model[4].weight)
        seen[level] = (conv.dtype, out.dtype, soft.dtype, model[1].weight.dtype, summed.dtype)
    assert seen['O0'] == (F32, F32, F32, F32, F32)
    assert seen['O1'][0] == dtype and seen['O1'][1] == dtype  # conv/linear run in half
    assert seen['O1'][3] == F32 and seen['O1'][4] == F32  # weights stay fp32; sum in fp32
    assert seen['O2'] == (dtype, F32, F32, F32, dtype)  # outputs cast to fp32; BN fp32
    assert seen['O3'] == (dtype, F32, F32, dtype, dtype)  # BN cast too


def test_o1_leaves_no_autocast_behind():
    model = _model()
    w = _wrapper(model, opt_level='O1', dtype='bfloat16')
    with w.optim_context(model):
        assert active_autocast() == [('cpu', BF16)]
    assert active_autocast() == []


class _Batch:
    """A user batch class: apex cast any object with a .to method."""

    def __init__(self, x):
        self.x = x

    def to(self, dtype):
        return _Batch(self.x.to(dtype))


class _DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen = None

    def forward(self, batch, extra=None):
        self.seen = (batch['a'][0].dtype, batch['a'][1].dtype, batch['b'].x.dtype,
                     extra['c'].dtype, batch['idx'].dtype)
        return {'out': self.lin(batch['a'][0]), 'idx': batch['idx']}


def test_o2_casts_nested_inputs_and_outputs():
    model = _DictModel()
    w = _wrapper(model, opt_level='O2', dtype='bfloat16')
    batch = {'a': [torch.randn(2, 4), (torch.randn(2),)[0]], 'b': _Batch(torch.randn(2)),
             'idx': torch.arange(2)}
    with w.optim_context(model):
        out = model(batch, extra={'c': torch.randn(1)})
    assert model.seen == (BF16, BF16, BF16, BF16, torch.int64)
    assert out['out'].dtype == F32 and out['idx'].dtype == torch.int64


def test_cast_model_outputs_and_fp32_state_dict():
    model = _model()
    w = _wrapper(model, opt_level='O3', dtype='bfloat16', cast_model_outputs=BF16)
    with w.optim_context(model):
        assert model(torch.randn(2, 1, 8, 8)).dtype == BF16
    assert all(v.dtype in (F32, torch.int64) for v in model.state_dict().values())
    w.release()
    assert model[0].weight.dtype == BF16 and model.state_dict()['0.weight'].dtype == BF16


def test_o1_refuses_half_parameters():
    model = _model().half()
    w = _wrapper(model, opt_level='O1')
    with pytest.raises(ValueError, match='O1 expects fp32 model weights'):
        with w.optim_context(model):
            pass


def test_fp16_on_cpu_warns_once_with_the_bf16_alternative(monkeypatch):
    # An AVX-512 CPU with native bf16 but no AVX512-FP16/AMX-FP16.
    cap = mp_wrappers.hardware.cpu_capability(
        {'avx2', 'fma', 'f16c', 'avx512f', 'avx512bw', 'avx512vl', 'avx512_bf16'}, arch='x86_64',
        torch_isa='AVX512', onednn_max_isa='')
    monkeypatch.setattr(mp_wrappers.hardware.probe, '_probe_cpu', lambda: cap)
    model = _model()
    w = _wrapper(model, opt_level='O2')
    with pytest.warns(UserWarning, match="dtype='bfloat16'"):
        with w.optim_context(model):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with w.optim_context(model):
            pass


def test_backward_before_initialize_is_refused_for_casting_levels():
    model = _model()
    w = _wrapper(model, opt_level='O2', dtype='bfloat16')
    loss = model(torch.randn(2, 1, 8, 8)).sum()
    with pytest.raises(RuntimeError, match='optim_context'):
        w.backward(loss)


def test_one_wrapper_per_model():
    a, b = _model(), _model()
    w = _wrapper(a, opt_level='O2', dtype='bfloat16')
    with w.optim_context(a):
        pass
    with pytest.raises(RuntimeError, match='another model'):
        with w.optim_context(b):
            pass


# ---- training against fp32 ---------------------------------------------------------------------------
def test_enabled_false_is_exactly_fp32():
    batches = _batches(5)
    ref = _model()
    ref_w = OptimWrapper(torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9))
    model = _model()
    w = _wrapper(model, opt_level='O2', enabled=False)
    _train(ref, ref_w, batches)
    for x, y in batches:
        with w.optim_context(model):
            loss = F.cross_entropy(model(x), y)
        w.update_params(loss)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert 'apex_amp' not in w.state_dict()


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_o2_tracks_fp32_for_20_sgd_steps(dtype):
    batches = _batches(20)
    ref = _model()
    _train(ref, OptimWrapper(torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)), batches)
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        _train(model, _wrapper(model, opt_level='O2', dtype=dtype), batches)
    tol = TRAIN_TOL[BF16 if dtype == 'bfloat16' else F16]
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q.float(), p, **tol)


@pytest.mark.parametrize('level', ['O0', 'O1', 'O3'])
def test_other_levels_train(level):
    batches = _batches(6)
    model = _model()
    w = _wrapper(model, opt_level=level, dtype='bfloat16')
    before = copy.deepcopy(model)
    _train(model, w, batches)
    assert not w.last_step_skipped
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), model.parameters()))


# ---- several losses ----------------------------------------------------------------------------------
def test_overflow_in_one_of_two_losses_skips_that_iteration_and_lowers_only_its_scaler():
    model = _model()
    w = _wrapper(model, opt_level='O2', num_losses=2, dtype='bfloat16', loss_scale='dynamic')
    batches = _batches(3)
    skipped = []
    for i, (x, y) in enumerate(batches):
        with w.optim_context(model):
            out = model(x)
            loss_a = F.cross_entropy(out, y)
            loss_b = out.pow(2).mean()
        w.backward(loss_a, loss_id=0, retain_graph=True)
        if i == 1:
            loss_b = loss_b * float('inf')
        w.backward(loss_b, loss_id=1)
        w.step()
        w.zero_grad()
        skipped.append(w.last_step_skipped)
    assert skipped == [False, True, False]
    assert w.loss_scalers[0].loss_scale == 2.0**16
    assert w.loss_scalers[1].loss_scale == 2.0**15
    assert [s.skipped_steps for s in w.loss_scalers] == [0, 1]
    assert w.state_dict()['apex_amp']['loss_scaler1'] == {'loss_scale': 2.0**15, 'unskipped': 1}


def test_two_losses_with_different_scales_sum_like_fp32():
    torch.manual_seed(0)
    ref = nn.Linear(6, 3)
    model = copy.deepcopy(ref)
    x = torch.randn(4, 6)
    (ref(x).pow(2).mean() + ref(x).abs().mean()).backward()
    w = _wrapper(model, opt_level='O0', num_losses=2, loss_scale='dynamic')
    w.loss_scalers[1].loss_scale = 2.0**5
    with w.optim_context(model):
        out = model(x)
    # Two accumulation iterations, each with two losses: grads add up across scalers.
    w.backward(out.pow(2).mean() / 2, loss_id=0, retain_graph=True)
    w.backward(out.abs().mean() / 2, loss_id=1, retain_graph=True)
    w.backward(out.pow(2).mean() / 2, loss_id=0, retain_graph=True)
    w.backward(out.abs().mean() / 2, loss_id=1)
    w._unscale_pending()
    w._stash.hand_to_optimizer(w._master_params())
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)


def test_gan_style_optim_wrapper_dict_with_overflow_in_one():
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    wrappers = OptimWrapperDict(
        generator=_wrapper(gen, opt_level='O2', dtype='bfloat16', loss_scale='dynamic'),
        discriminator=_wrapper(disc, opt_level='O1', dtype='bfloat16', loss_scale='dynamic'))
    for step in range(3):
        with wrappers['generator'].optim_context(gen):
            fake = gen(torch.randn(8, 4))
        with wrappers['discriminator'].optim_context(disc):
            d_loss = disc(fake.detach()).float().mean()
        if step == 1:
            d_loss = d_loss * float('nan')
        wrappers['discriminator'].update_params(d_loss)
        with wrappers['discriminator'].optim_context(disc):
            g_loss = -disc(fake).float().mean()
        wrappers['generator'].update_params(g_loss)
        assert wrappers['discriminator'].last_step_skipped == (step == 1)
        assert not wrappers['generator'].last_step_skipped
    assert wrappers['discriminator'].loss_scale == 2.0**15
    assert wrappers['generator'].loss_scale == 2.0**16
    assert gen.weight.dtype == BF16 and disc.weight.dtype == F32


# ---- checkpoints -------------------------------------------------------------------------------------
def test_state_dict_has_apex_format_and_loads_before_first_forward(tmp_path):
    batches = _batches(8)
    kw = dict(opt_level='O2', dtype='float16', scale_window=2)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        full = _model()
        w_full = _wrapper(full, **kw)
        _train(full, w_full, batches)

        part = _model()
        w_part = _wrapper(part, **kw)
        _train(part, w_part, batches[:3])
        torch.save({'model': part.state_dict(), 'optim': w_part.state_dict()}, tmp_path / 'c.pt')
        ckpt = torch.load(tmp_path / 'c.pt', weights_only=True)
        assert set(ckpt['optim']['apex_amp']) == {'loss_scaler0'}
        # Runner.resume order: model weights, then optimizer state, then the first forward.
        resumed = _model(seed=5)
        resumed.load_state_dict(ckpt['model'])
        w_res = _wrapper(resumed, **kw)
        w_res.load_state_dict(ckpt['optim'])
        assert w_res.state_dict()['apex_amp'] == ckpt['optim']['apex_amp']
        _train(resumed, w_res, batches[3:])
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert w_full.state_dict()['apex_amp'] == w_res.state_dict()['apex_amp']


def test_loads_a_real_apex_state_dict():
    model = _model()
    w = _wrapper(model, opt_level='O2', dtype='bfloat16', loss_scale='dynamic', num_losses=2)
    apex_made = torch.optim.SGD(_model().parameters(), lr=0.05, momentum=0.9).state_dict()
    apex_made['apex_amp'] = {'loss_scaler0': {'loss_scale': 1024.0, 'unskipped': 5},
                             'loss_scaler1': {'loss_scale': 64.0, 'unskipped': 0}}
    w.load_state_dict(apex_made)
    with w.optim_context(model):
        pass
    assert [s.loss_scale for s in w.loss_scalers] == [1024.0, 64.0]
    assert w.loss_scalers[0].unskipped == 5


def test_mismatched_scaler_count_warns_like_apex():
    model = _model()
    w = _wrapper(model, opt_level='O1', loss_scale='dynamic')
    state = w.state_dict()
    del state['mp_wrappers']
    state['apex_amp']['loss_scaler1'] = {'loss_scale': 8.0, 'unskipped': 0}
    with pytest.warns(UserWarning, match='num_losses=1'):
        w.load_state_dict(state)


@needs_cpu_grad_scaler
def test_loads_amp_optim_wrapper_checkpoint():
    model = _model()
    w = _wrapper(model, opt_level='O1', loss_scale='dynamic')
    state = torch.optim.SGD(_model().parameters(), lr=0.05, momentum=0.9).state_dict()
    state['loss_scaler'] = torch.amp.GradScaler('cpu', init_scale=4096.).state_dict()
    w.load_state_dict(state)
    assert w.loss_scale == 4096.0


# ---- O1 function annotations and the BCE ban ----------------------------------------------------------
def test_bce_is_refused_under_fp16_o1_with_advice():
    model = nn.Linear(4, 1)
    w = _wrapper(model, opt_level='O1')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with w.optim_context(model):
            probs = torch.sigmoid(model(torch.randn(2, 4)))
            with pytest.raises(RuntimeError, match='BCEWithLogitsLoss'):
                F.binary_cross_entropy(probs, torch.rand(2, 1))
            with pytest.raises(RuntimeError, match='BCEWithLogitsLoss'):
                nn.BCELoss()(probs, torch.rand(2, 1))
            F.binary_cross_entropy_with_logits(model(torch.randn(2, 4)), torch.rand(2, 1))
            ok = mp_wrappers.float_function(F.binary_cross_entropy)(probs, torch.rand(2, 1))
    assert ok.dtype == F32


def test_function_annotations():
    seen = {}

    @mp_wrappers.half_function
    def h(x):
        seen['h'] = (x.dtype, mp_wrappers.compat.autocast_enabled('cpu'))
        return x

    @mp_wrappers.float_function
    def f(x):
        seen['f'] = x.dtype
        return x

    @mp_wrappers.promote_function
    def p(a, b):
        seen['p'] = (a.dtype, b.dtype)
        return a

    x32, x16 = torch.randn(2), torch.randn(2).bfloat16()
    h(x32)
    assert seen['h'] == (F32, False)  # outside O1: untouched
    model = nn.Linear(2, 2)
    w = _wrapper(model, opt_level='O1', dtype='bfloat16')
    with w.optim_context(model):
        h(x32)
        f(x16)
        p(x32, x16)
        with mp_wrappers.disable_casts():
            assert model(x32).dtype == F32
        assert model(x32).dtype == BF16
    assert seen == {'h': (BF16, False), 'f': F32, 'p': (F32, F32)}


# ---- registry ----------------------------------------------------------------------------------------
def test_builds_from_config_and_does_not_shadow_mmengine():
    from mmengine.registry import OPTIM_WRAPPERS
    model = _model()
    w = build_optim_wrapper(model, dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2',
                                        dtype='bfloat16', verbosity=0,
                                        optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
                                        accumulative_counts=4))
    assert type(w) is ApexOptimWrapper and w._accumulative_counts == 4
    assert OPTIM_WRAPPERS.get('ApexOptimWrapper') is not ApexOptimWrapper


def test_second_wrapper_in_one_process_is_independent():
    a, b = _model(), _model()
    wa = _wrapper(a, opt_level='O2', dtype='bfloat16')
    wb = _wrapper(b, opt_level='O1', dtype='bfloat16')
    _train(a, wa, _batches(2))
    _train(b, wb, _batches(2))
    assert a[0].weight.dtype == BF16 and b[0].weight.dtype == F32
    assert not b._forward_pre_hooks and active_autocast() == []
