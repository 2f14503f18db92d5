"""torch.compile(fullgraph=True) of every fused optimizer's step: one graph, eager's bits.

Each case steps two copies of tiny params for four steps, one eagerly and one through
``torch.compile(fullgraph=True)`` (which fails on any graph break), with a loss scale and an
overflow at the third step, and compares params and state bitwise. ``CompileCounter`` also counts the
compiled frames: two (the first step creates the state, the second finds it), then none.
Costs on the 2-core dev machine: ~1 s per 'eager'-backend case (dynamo's trace only), ~2 s per
'aot_eager' case, ~5-40 s for the inductor case (C++ code generation; cached across runs).
The CUDA cases (skipped without a GPU, tests/conftest.py) compile with inductor, and once more with
``mode='reduce-overhead'``: the step replayed as a CUDA graph, which must not be skipped.
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from _compat import needs_extension, needs_schedulers_writing_1_element_lr, requires
from mp_wrappers.optim import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

pytestmark = [
    requires('fake_kernels'),
    requires('compile_list_ops'),
    needs_extension,
]

F32, BF16 = torch.float32, torch.bfloat16
CASES = {
    'adam': (FusedAdam, dict(lr=1e-2, weight_decay=0.01), F32),
    'adam-l2': (FusedAdam, dict(lr=1e-2, weight_decay=0.01, adam_w_mode=False), F32),
    'sgd': (FusedSGD, dict(lr=0.1, momentum=0.9, nesterov=True), F32),
    'sgd-plain': (FusedSGD, dict(lr=0.1), F32),
    'lamb': (FusedLAMB, dict(lr=1e-2), F32),
    'novograd': (FusedNovoGrad, dict(lr=1e-2), F32),
    'adagrad': (FusedAdagrad, dict(lr=1e-2), F32),
    'adam-bf16': (FusedAdam, dict(lr=1e-2), BF16),
    'adam-master-weights': (FusedAdam, dict(lr=1e-2, master_weights=True), BF16),
    'adam-kahan': (FusedAdam, dict(lr=1e-2, bf16_storage='kahan'), BF16),
    'adam-split': (FusedAdam, dict(lr=1e-2, bf16_storage='split'), BF16),
    'adam-stochastic': (FusedAdam, dict(lr=1e-2, bf16_storage='stochastic'), BF16),
    'adam-kahan-bf16-states': (FusedAdam, dict(lr=1e-2, bf16_storage='kahan',
                                               state_dtype='bfloat16'), BF16),
    'sgd-kahan': (FusedSGD, dict(lr=0.1, momentum=0.9, bf16_storage='kahan'), BF16),
    'adam-int8': (FusedAdam, dict(lr=1e-2, state_dtype='int8', min_8bit_size=16), F32),
}
OVERFLOW_STEP = 2
CUDA = [pytest.param('cuda', marks=pytest.mark.cuda)]


def _params(dtype, seed=0, device='cpu'):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype).to(device))
            for shape in ((8, 4), (5,))]


def _grads(params, steps=4):
    g = torch.Generator().manual_seed(1)
    out = [[(torch.randn(p.shape, generator=g).to(p.dtype) * 2).to(p.device) for p in params]
           for _ in range(steps)]
    out[OVERFLOW_STEP][0][0, 0] = float('inf')
    return out


def _step(opt, scale, flag):
    opt.step(grad_scale=scale, found_inf=flag)


def _state_tensors(opt, params):
    return [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]


def _compare(case, backend, device='cpu', **compile_kw):
    cls, kw, dtype = CASES[case]
    eager_params, compiled_params = _params(dtype, device=device), _params(dtype, device=device)
    eager, compiled = cls(eager_params, **kw), cls(compiled_params, **kw)
    step = torch.compile(_step, fullgraph=True, backend=backend, **compile_kw)
    for i, grads in enumerate(_grads(eager_params)):
        for p, q, g in zip(eager_params, compiled_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        flag = torch.full((1,), float(i == OVERFLOW_STEP), device=device)
        _step(eager, torch.full((1,), 2.0, device=device), flag.clone())
        step(compiled, torch.full((1,), 2.0, device=device), flag.clone())
    for a, b in zip(eager_params + _state_tensors(eager, eager_params),
                    compiled_params + _state_tensors(compiled, compiled_params)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    return eager_params


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize('case', sorted(CASES))
def test_step_compiles_whole_and_matches_eager(case):
    counter = CompileCounter()
    _compare(case, counter)
    assert counter.frame_count == 2  # the step before and after the state exists, no break


@pytest.mark.parametrize('case', ['adam', 'lamb', 'adam-kahan'])
def test_functionalized_step_matches_eager(case):
    # aot_eager functionalizes the in-place custom ops (what inductor compiles) and runs them back.
    _compare(case, 'aot_eager')


def test_inductor_step_matches_eager():
    _compare('sgd', 'inductor')


def test_skipped_step_leaves_everything_bitwise():
    """The overflow step of the compiled run changed nothing: the run equals one without it."""
    cls, kw, dtype = CASES['adam']
    params = _params(dtype)
    opt = cls(params, **kw)
    step = torch.compile(_step, fullgraph=True, backend=CompileCounter())
    grads = _grads(params)
    for i in range(OVERFLOW_STEP + 1):
        for p, g in zip(params, grads[i]):
            p.grad = g.clone()
        if i == OVERFLOW_STEP:
            before = [t.clone() for t in params + _state_tensors(opt, params)]
        step(opt, torch.full((1,), 2.0), torch.full((1,), float(i == OVERFLOW_STEP)))
    assert all(torch.equal(a, b) for a, b in zip(before, params + _state_tensors(opt, params)))


@needs_schedulers_writing_1_element_lr
@pytest.mark.parametrize('capturable', [True, False])
def test_lr_schedule_on_a_device_lr_reuses_the_graph(capturable):
    """torch's scheduler writes a tensor lr in place: the step compiles twice, whatever the lr."""
    eager_params, compiled_params = _params(F32), _params(F32)
    lr = dict(lr=1e-2, capturable=True) if capturable else dict(lr=torch.tensor([1e-2]))
    eager, compiled = FusedAdam(eager_params, **lr), FusedAdam(compiled_params, **lr)
    counter = CompileCounter()
    step = torch.compile(compiled.step, fullgraph=True, backend=counter)  # before the scheduler
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, 20) for o in (eager, compiled)]
    for i, grads in enumerate(_grads(eager_params, steps=6)):
        for p, q, g in zip(eager_params, compiled_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        flag = torch.full((1,), float(i == OVERFLOW_STEP))
        eager.step(grad_scale=torch.full((1,), 2.0), found_inf=flag.clone())
        step(grad_scale=torch.full((1,), 2.0), found_inf=flag.clone())
        for s in schedulers:
            s.step()
    assert counter.frame_count == 2
    assert all(torch.equal(a, b) for a, b in zip(eager_params, compiled_params))


CUDA_CASES = ['adam', 'sgd', 'lamb', 'adam-master-weights']


@pytest.mark.parametrize('device', CUDA)
@pytest.mark.parametrize('case', CUDA_CASES)
def test_inductor_step_on_cuda_matches_eager(case, device):
    _compare(case, 'inductor', device)


@pytest.mark.parametrize('device', CUDA)
@pytest.mark.parametrize('opt_name', ['adam', 'sgd'])
def test_step_replays_as_a_cuda_graph_under_an_lr_schedule(opt_name, device):
    """mode='reduce-overhead': inductor records the compiled step as a CUDA graph and replays it. The
    lr lives on the device (capturable=True) and torch's scheduler writes it in place, so each replay
    reads the new value: the params follow eager's bitwise, and no CUDA graph is skipped. The first
    step is eager, as before any capture: it makes the state and the lr tensor outside the graph
    (made inside, they would be graph outputs that the next replay overwrites) and marks them
    static addresses, which the graph may update in place."""
    from torch._dynamo.utils import counters
    cls, kw, dtype = CASES[opt_name]
    kw = dict(kw, capturable=True)
    eager_params, compiled_params = _params(dtype, device=device), _params(dtype, device=device)
    eager, compiled = cls(eager_params, **kw), cls(compiled_params, **kw)
    counters.clear()
    step = torch.compile(compiled.step, fullgraph=True, mode='reduce-overhead')
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, 20) for o in (eager, compiled)]
    for i, grads in enumerate(_grads(eager_params, steps=8)):
        for p, q, g in zip(eager_params, compiled_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        flag = torch.full((1,), float(i == OVERFLOW_STEP), device=device)
        scale = torch.full((1,), 2.0, device=device)
        eager.step(grad_scale=scale, found_inf=flag.clone())
        (compiled.step if i == 0 else step)(grad_scale=scale, found_inf=flag.clone())
        for s in schedulers:
            s.step()
        for a, b in zip(eager_params, compiled_params):
            assert torch.equal(a, b), f'step {i}'
    assert counters['inductor']['cudagraph_skips'] == 0, dict(counters['inductor'])
    for a, b in zip(_state_tensors(eager, eager_params), _state_tensors(compiled, compiled_params)):
        assert torch.equal(a, b)


def test_the_capture_query_stays_out_of_the_graph():
    """The float-lr refusal asks whether a CUDA graph is being captured; under torch.compile that
    query (a bool from torch.cuda) broke the graph of every CUDA step (found on an H100). Traced, the
    question is not asked: inductor records its CUDA graphs after tracing."""
    from mp_wrappers.optim import base

    def step(x):
        return x + float(base._capturing(torch.device('cuda')))
    assert torch.equal(torch.compile(step, fullgraph=True, backend='eager')(torch.zeros(1)),
                       torch.zeros(1))
