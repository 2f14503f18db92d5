"""wrappers/compiled_step: the fused step's device stages through torch.compile, whole.

Note [compiled step]: with ``compile_step`` the check, norm, clip, fused update and scaler update of
a fused step are one ``torch.compile(fullgraph=True)`` graph (compiling fails on any graph break);
the bookkeeping stays eager. Each case trains a tiny model for five steps, the third one with an
inf loss (an overflow), once eagerly and once compiled, and compares model, masters, optimizer
state and the scalers' counters bitwise. Costs on the 2-core dev machine: ~3 s per case with the
counting backend (dynamo's trace, graphs run eagerly), ~5 s with 'aot_eager'; the errors are
milliseconds.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter

from _compat import needs_extension, requires
from mp_wrappers import (ApexOptimWrapper, FP16OptimWrapper, FusedAdam, FusedLAMB, FusedSGD,
                         cast_model, compat)
from mp_wrappers.compat import FeatureUnavailableError
from mp_wrappers.step_outcomes import simulate_accelerator
from mp_wrappers.wrappers.compiled_step import DeviceStages, check_compile_step

_COMPILE_MARKS = (
    requires('fake_kernels'),
    requires('compile_list_ops'),
    needs_extension,
)


def needs_compile(test):
    for mark in _COMPILE_MARKS:
        test = mark(test)
    return test
OVERFLOW_STEP = 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))


def _apex_o2(model, compile_step):
    return ApexOptimWrapper(FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01,
                                      capturable=True),
                            opt_level='O2', dtype='bfloat16', loss_scale='dynamic', verbosity=0,
                            compile_step=compile_step)


def _fp16_sgd(model, compile_step):
    model = cast_model(model, torch.float16)
    return FP16OptimWrapper(FusedSGD(model.parameters(), lr=0.1, momentum=0.9, capturable=True),
                            dynamic_loss_scale=True, verbose=False, compile_step=compile_step)


def _fp16_static_clip(model, compile_step):
    model = cast_model(model, torch.bfloat16)
    lr = torch.tensor([1e-2], device=next(model.parameters()).device)
    return FP16OptimWrapper(FusedLAMB(model.parameters(), lr=lr),
                            static_loss_scale=128.0,
                            clip_grad=dict(max_norm=0.5), verbose=False, compile_step=compile_step)


def _apex_o2_int8(model, compile_step):
    # Every param with 8-bit moments (the tiny model's are all under the default min_8bit_size).
    return ApexOptimWrapper(FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01,
                                      capturable=True, state_dtype='int8', min_8bit_size=0),
                            opt_level='O2', dtype='bfloat16', loss_scale='dynamic', verbosity=0,
                            compile_step=compile_step)


WRAPPERS = {
    'apex-o2-adam-bf16': _apex_o2,
    'apex-o2-adam-int8-states': _apex_o2_int8,
    'fp16-sgd-dynamic': _fp16_sgd,
    'fp16-lamb-static-clip': _fp16_static_clip,
}


def _train(make, compile_step, steps=5, device='cpu'):
    model = _model().to(device)
    w = make(model, compile_step)
    w.prepare_for_training(model)
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(1)
    skipped = []
    for i in range(steps):
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        x, y = x.to(device), y.to(device)
        with w.optim_context(model):
            loss = F.cross_entropy(model(x.to(dtype)).float(), y)
        w.update_params(loss * float('inf') if i == OVERFLOW_STEP else loss)
        skipped.append(w.last_step_skipped)
    return model, w, skipped


def _everything(model, w):
    state = [v for st in w.optimizer.state.values() for v in st.values()
             if isinstance(v, torch.Tensor)]
    return list(model.parameters()) + w.master_params() + state


def _scaler_counts(w):
    s = w.loss_scalers[0]
    return s.loss_scale, s.skipped_steps, s.steps, s.unskipped


def _compare(make, backend, device='cpu', **compile_kw):
    m1, w1, skipped1 = _train(make, False, device=device)
    m2, w2, skipped2 = _train(make, dict(backend=backend, **compile_kw), device=device)
    assert skipped1 == skipped2 == [i == OVERFLOW_STEP for i in range(5)]
    assert _scaler_counts(w1) == _scaler_counts(w2)
    for a, b in zip(_everything(m1, w1), _everything(m2, w2)):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize('case', sorted(WRAPPERS))
@pytest.mark.filterwarnings('ignore:FP16OptimWrapper.*without native float16')  # fp16 on CPU
@needs_compile
def test_fused_step_compiles_whole_and_matches_eager(case):
    counter = CompileCounter()
    _compare(WRAPPERS[case], counter)
    # The first step runs eagerly (the state is made outside any graph), the second compiles
    # whole and the rest reuse its graph.
    assert counter.frame_count == 1


CUDA = [pytest.param('cuda', marks=pytest.mark.cuda)]


@pytest.mark.parametrize('device', CUDA)
@pytest.mark.parametrize('case', sorted(WRAPPERS))
@pytest.mark.parametrize('mode', ['default', 'reduce-overhead'])
@needs_compile
def test_fused_step_on_cuda_matches_eager(case, mode, device):
    """On a GPU with inductor, also replayed as a CUDA graph (mode='reduce-overhead'): the device
    stages hold no host read, so inductor records them whole, and skips no CUDA graph."""
    from torch._dynamo.utils import counters
    counters.clear()
    _compare(WRAPPERS[case], 'inductor', device, mode=mode)
    assert counters['inductor']['cudagraph_skips'] == 0, dict(counters['inductor'])


@needs_compile
def test_functionalized_fused_step_matches_eager():
    _compare(_apex_o2, 'aot_eager')


@pytest.mark.parametrize('make', [_apex_o2, _apex_o2_int8], ids=['fp32-states', 'int8-states'])
@needs_compile
def test_mmengine_lr_schedule_reuses_the_graph(make):
    """mmengine's schedulers assign a new lr tensor every step: no recompilation either, and the
    kernels read each new value (the compiled steps equal the eager ones, whose lrs change)."""
    from mmengine.optim.scheduler import CosineAnnealingLR
    counter = CompileCounter()

    def scheduled(model, compile_step):
        w = make(model, compile_step)
        w.scheduler = CosineAnnealingLR(w, T_max=20, by_epoch=False)
        w.update_params = _then(w.update_params, w.scheduler.step)
        return w
    _compare(scheduled, counter)
    assert counter.frame_count == 1  # the first step eager, one graph for the other four


def _then(first, second):
    def both(*args, **kwargs):
        first(*args, **kwargs)
        second()
    return both


@needs_compile
def test_deferred_outcomes_after_a_compiled_step():
    """Where host reads are deferred (CUDA; simulated here) the compiled step queues its outcome
    with the scales it saw before updating the scaler."""
    with simulate_accelerator(lag=1):
        _compare(_apex_o2, CompileCounter())


@pytest.mark.parametrize('value, error, match', [
    ('yes', TypeError, r"compile_step must be True, False or a dict .* got 'yes'"),
    (dict(fullgraph=False), ValueError, 'fullgraph is always True'),
    # What torch.compile itself would refuse only when the first step compiles:
    (dict(bogus=1), ValueError,
     r"compile_step has unknown torch.compile keywords \['bogus'\]; allowed: \[.*'backend'"),
    (dict(mode='nonsense'), ValueError,
     r"compile_step mode='nonsense' is not an inductor mode of this torch; allowed: \['default'"),
    (dict(backend='nope'), ValueError,
     r"compile_step backend='nope' is not a registered torch.compile backend"),
    (dict(backend=3), TypeError, r'compile_step backend must be a backend name or a callable, '
                                 r'got 3'),
    (dict(mode='default', options={}), ValueError, r'takes mode or options, not both'),
])
def test_wrong_compile_step_is_refused(value, error, match):
    with pytest.raises(error, match=match):
        _apex_o2(_model(), value)


@pytest.mark.parametrize('value', [dict(backend=None), dict(mode='max-autotune'),
                                   dict(backend='eager', mode='anything-eager-ignores'),
                                   dict(backend=CompileCounter())])
def test_what_torch_compile_takes_is_taken(value):
    _apex_o2(_model(), value)


def test_compile_step_needs_the_lr_on_the_device():
    model = _model()
    with pytest.raises(ValueError, match=r'float lr is a constant.*capturable=True'):
        ApexOptimWrapper(FusedAdam(model.parameters(), lr=1e-2), opt_level='O2',
                         dtype='bfloat16', compile_step=True)


@pytest.mark.parametrize('mode', ['split', 'kahan', 'stochastic'])
def test_compile_step_refuses_the_lean_master_modes(mode):
    model = _model()
    with pytest.raises(ValueError, match=f"does not combine with master_weights='{mode}'.*"
                                         'master_weights=True'):
        ApexOptimWrapper(FusedAdam(model.parameters(), lr=1e-2), opt_level='O2',
                         dtype='bfloat16', master_weights=mode, compile_step=True)


@pytest.mark.parametrize('adam, what', [
    (dict(bf16_storage='kahan'), "bf16_storage='kahan'"),
    (dict(bf16_storage='stochastic', state_dtype='int8'), "bf16_storage='stochastic'"),
])
def test_compile_step_refuses_optimizers_taking_the_lr_as_a_number(adam, what):
    model = cast_model(_model(), torch.bfloat16)
    with pytest.raises(ValueError, match=f'does not combine with {what}'):
        FP16OptimWrapper(FusedAdam(model.parameters(), lr=1e-2, **adam), compile_step=True)


def test_compile_step_with_int8_states_needs_the_lr_on_the_device():
    """8-bit moments take a tensor lr like float32 ones: a float lr is refused for that reason."""
    model = _model()
    groups = [dict(params=[model[0].weight], state_dtype='int8'),
              dict(params=[p for n, p in model.named_parameters() if n != '0.weight'])]
    with pytest.raises(ValueError, match='needs the learning rate on the device.*capturable=True'):
        ApexOptimWrapper(FusedAdam(groups, lr=1e-2), opt_level='O2', dtype='bfloat16',
                         compile_step=True)


def test_compile_step_needs_the_fused_master_step():
    model = _model()
    with pytest.raises(ValueError, match=r"AdamW has none.*type='mp_wrappers.FusedAdam'"):
        ApexOptimWrapper(torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level='O2',
                         dtype='bfloat16', compile_step=True)


@needs_compile
def test_compile_step_refuses_fsdp_at_the_first_step():
    stages = DeviceStages(True)
    with pytest.raises(NotImplementedError, match='sharded .FSDP. model yet; set compile_step=False'):
        stages(None, None, None, None, None, object(), lambda: None)


def test_compile_step_needs_list_functionalization(monkeypatch):
    monkeypatch.setattr(compat, 'has', lambda feature: feature != 'compile_list_ops')
    with pytest.raises(FeatureUnavailableError, match=r'torch.compile of the fused steps .* needs '
                                                      r'torch >= 2\.6'):
        check_compile_step(True)


def test_compile_step_needs_fake_kernels(monkeypatch):
    monkeypatch.setattr(compat, 'has', lambda feature: feature != 'fake_kernels')
    with pytest.raises(FeatureUnavailableError, match=r'torch.compile .* needs torch >= 2\.4'):
        check_compile_step(True)
    assert check_compile_step(False) is None  # eager needs nothing
    assert not DeviceStages(False).compiled


@needs_compile
def test_compile_step_keeps_inductor_graphs_of_an_aten_cpu_capability_apart(monkeypatch):
    """Note [inductor's cache and ATEN_CPU_CAPABILITY] (mp_wrappers/compat.py): with the variable
    set, compile_step compiles into a cache directory of that value and says so in the log."""
    from mp_wrappers.wrappers import compiled_step
    logged = []
    monkeypatch.setattr(compiled_step, 'print_log', lambda msg, **kw: logged.append(msg))
    monkeypatch.delenv('TORCHINDUCTOR_CACHE_DIR', raising=False)
    monkeypatch.setenv('ATEN_CPU_CAPABILITY', 'avx2')
    model = _model()
    _apex_o2(model, dict(backend=CompileCounter()))  # set at construction, before any step
    directory = compat.os.environ['TORCHINDUCTOR_CACHE_DIR']
    assert directory.endswith('_aten_avx2')
    assert any(f'inductor caches in {directory}' in m for m in logged), logged
