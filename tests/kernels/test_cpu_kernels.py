"""The compiled fused-optimizer kernels (torch.ops.mp_wrappers.multi_tensor_*_) against their
pure-PyTorch references in mp_wrappers/ops/reference/.

Both are run side by side from the same state for several steps with scaled grads, over apex's fuzz
sizes (chunk boundaries at 65536, odd tails), fp32/fp16/bf16 params, grads and model copies. fp32
results agree to TOL (the kernels repeat the reference's fp32 operations; they differ only where
torch.sqrt on CPU is not correctly rounded and where the references reduce norms in fp32), half
results to one rounding. A found_inf step must leave every tensor bit-identical. The kernel-vs-
reference tests run once per CPU flavour the machine supports (the ``cpu_isa`` fixture, conftest.py),
and the narrower flavours must give the same bits as the widest. CUDA cases are the same tests,
skipped without a GPU.
"""
import pytest
import torch

from _compat import needs_opcheck, opcheck
from _guards import checked, flat, guarded
from _tolerances import TOL
from mp_wrappers.ops import backend, reference
from mp_wrappers.ops._dispatch import _op_has_kernel

OPS = ['multi_tensor_adam_', 'multi_tensor_sgd_', 'multi_tensor_lamb_', 'multi_tensor_adagrad_',
       'multi_tensor_novograd_']
SIZES = [777, 555, 65535, 65536, 65537, 33333]
# (param, grad, model copy or None): fp32; the O2 fused step (fp32 masters, scaled half grads,
# half model); half params stepped directly.
DTYPES = [
    (torch.float32, torch.float32, None),
    (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16, None),
    (torch.float16, torch.float32, torch.float32),
]
DEVICES = [
    'cpu',
    pytest.param('cuda', marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason='no CUDA device')),
]

# Hyperparameter variants per op: (name, kwargs). Every branch of each kernel is covered.
VARIANTS = {
    'multi_tensor_adam_': [
        ('adamw', dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                       adam_w_mode=True, bias_correction=True)),
        ('adam_l2_nobc', dict(lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1,
                              adam_w_mode=False, bias_correction=False)),
    ],
    'multi_tensor_sgd_': [
        ('nesterov', dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=True,
                          wd_after_momentum=False)),
        ('dampening_wd_after', dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=1e-2,
                                    nesterov=False, wd_after_momentum=True)),
        ('plain', dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                       wd_after_momentum=False)),
    ],
    'multi_tensor_lamb_': [
        ('trust_ratio', dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                             adam_w_mode=True, bias_correction=True, grad_averaging=True,
                             max_grad_norm=1.0, use_nvlamb=False)),
        ('no_decay_single_pass', dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6,
                                      weight_decay=0.0, adam_w_mode=True, bias_correction=False,
                                      grad_averaging=False, max_grad_norm=0.0,
                                      use_nvlamb=False)),
        ('nvlamb_l2', dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0,
                           adam_w_mode=False, bias_correction=True, grad_averaging=True,
                           max_grad_norm=1e9, use_nvlamb=True)),
    ],
    'multi_tensor_adagrad_': [
        ('l2', dict(lr=1e-2, eps=1e-10, weight_decay=0.01, adagrad_w_mode=False)),
        ('decoupled', dict(lr=1e-2, eps=1e-10, weight_decay=0.01, adagrad_w_mode=True)),
    ],
    'multi_tensor_novograd_': [
        ('l2', dict(lr=1e-3, beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.01,
                    bias_correction=True, grad_averaging=True, reg_inside_moment=False,
                    norm_type=2, init_zero=False)),
        ('inf_reg_inside_init_zero', dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                          weight_decay=0.0, bias_correction=False,
                                          grad_averaging=False, reg_inside_moment=True,
                                          norm_type=0, init_zero=True)),
    ],
}


def _kernel_available(op: str, device: str) -> bool:
    """Whether ``op`` has a compiled kernel for ``device`` (not the reference fallback).

    A CUDA case only gets here with our CUDA kernels built (tests/conftest.py skips it otherwise),
    and then every op must have one: a missing CUDA kernel fails instead of skipping.
    """
    b = backend()
    if not b['extension']:
        return False
    if device == 'cuda':
        assert b['cuda'] == 'cuda' and _op_has_kernel(op, 'cuda'), \
            f'{op}: the build has CUDA kernels but none registered for this op ({b})'
        return True
    return _op_has_kernel(op, device)


pytestmark = pytest.mark.skipif(not backend()['extension'],
                                reason='the C++ extension is not built')


# ---- state ------------------------------------------------------------------------------------------

class State:
    """Every tensor one optimizer op reads or writes, built from a seed."""

    def __init__(self, op, sizes, dtypes, device, seed=0, scale=1000.0):
        pd, gd, md = dtypes
        gen = torch.Generator().manual_seed(seed)

        def rnd(n, mul=1.0):
            return (torch.randn(n, generator=gen) * mul).to(device)

        masters = [rnd(n, 0.5) for n in sizes]
        self.params = [m.to(pd) for m in masters]
        self.grads = [(rnd(n, 1e-2) * scale).to(gd) for n in sizes]
        self.model = [m.to(md) for m in masters] if md is not None else []
        self.state = []  # the op's state lists, in schema order
        if op in ('multi_tensor_adam_', 'multi_tensor_lamb_'):
            self.state = [[rnd(n, 1e-3) for n in sizes], [rnd(n, 1e-3).abs() for n in sizes]]
        elif op == 'multi_tensor_sgd_':
            self.state = [[rnd(n, 1e-2) for n in sizes]]
        elif op == 'multi_tensor_adagrad_':
            self.state = [[rnd(n, 1e-2).abs() for n in sizes]]
        elif op == 'multi_tensor_novograd_':
            self.state = [[rnd(n, 1e-3) for n in sizes]]
            self.norms = torch.zeros(len(sizes), device=device)
        self.step = torch.zeros(1, device=device)
        self.grad_scale = torch.full((1,), scale, device=device)
        self.found_inf = torch.zeros(1, device=device)
        self.gnorm = torch.ones(1, device=device)
        self._guard(self)

    @staticmethod
    def _guard(st, copy=guarded):
        """Every tensor (grads and model copies, written or not, too) between guard canaries
        (tests/_guards.py): a kernel writing past one is caught at the next check."""
        for k, v in st.__dict__.items():
            if isinstance(v, torch.Tensor):
                st.__dict__[k] = copy(v)
            elif k == 'state':
                st.state = [[copy(t) for t in lst] for lst in v]
            else:
                st.__dict__[k] = [copy(t) for t in v]

    def clone(self):
        other = object.__new__(State)
        other.__dict__.update(self.__dict__)
        self._guard(other)
        return other

    def flat(self, shift=0):
        """A copy whose every list is adjacent views of one flat buffer (tests/_guards.py
        ``flat``: no gap between tensors, guards at the buffer's ends), as FSDP's flat parameters
        and flat master or state buffers are: a write past one tensor lands in its neighbour."""
        other = self.clone()

        def one(lst):
            return flat(lst, shift) if lst else []
        other.params, other.grads, other.model = map(one, (self.params, self.grads, self.model))
        other.state = [one(lst) for lst in self.state]
        return other

    def tensors(self):
        """name -> tensor, for comparisons."""
        out = {}
        for name, lst in (('params', self.params), ('model', self.model)):
            out.update({f'{name}[{i}]': t for i, t in enumerate(lst)})
        for j, lst in enumerate(self.state):
            out.update({f'state{j}[{i}]': t for i, t in enumerate(lst)})
        if hasattr(self, 'norms'):
            out['norms'] = self.norms
        out['step'] = self.step
        return out

    def args(self, op, hp, lr_tensor=None):
        """Positional arguments of the op schema; with ``lr_tensor`` the lr comes from it (the
        float lr argument is then 0, which a kernel reading it would show)."""
        if lr_tensor is not None:
            return (*self.args(op, dict(hp, lr=0.0)), lr_tensor)
        if op == 'multi_tensor_adam_':
            return (self.params, self.grads, *self.state, self.model, self.step, hp['lr'],
                    hp['beta1'], hp['beta2'], hp['eps'], hp['weight_decay'], hp['adam_w_mode'],
                    hp['bias_correction'], self.grad_scale, self.found_inf)
        if op == 'multi_tensor_sgd_':
            bufs = self.state[0] if hp['momentum'] != 0 else []
            return (self.params, self.grads, bufs, self.model, self.step, hp['lr'],
                    hp['momentum'], hp['dampening'], hp['weight_decay'], hp['nesterov'],
                    hp['wd_after_momentum'], self.grad_scale, self.found_inf)
        if op == 'multi_tensor_lamb_':
            return (self.params, self.grads, *self.state, self.model, self.step, hp['lr'],
                    hp['beta1'], hp['beta2'], hp['eps'], hp['weight_decay'], hp['adam_w_mode'],
                    hp['bias_correction'], hp['grad_averaging'], hp['max_grad_norm'],
                    hp['use_nvlamb'], self.gnorm, self.grad_scale, self.found_inf)
        if op == 'multi_tensor_adagrad_':
            return (self.params, self.grads, *self.state, self.model, self.step, hp['lr'],
                    hp['eps'], hp['weight_decay'], hp['adagrad_w_mode'], self.grad_scale,
                    self.found_inf)
        return (self.params, self.grads, *self.state, self.norms, self.model, self.step,
                hp['lr'], hp['beta1'], hp['beta2'], hp['eps'], hp['weight_decay'],
                hp['bias_correction'], hp['grad_averaging'], hp['reg_inside_moment'],
                hp['norm_type'], hp['init_zero'], self.grad_scale, self.found_inf)


# NovoGrad's running grad norms: the reference reduces 65K-element tensors with fp32 vector_norm
# (measured 1.6e-6 relative off the float64 value), the kernels in double (5e-8, one rounding).
# Kernel vs reference therefore uses the reference's error; test_novograd_norms_are_exact checks the
# kernel's norms against float64 with the fp32 TOL.
NORM_TOL = dict(rtol=1e-5, atol=1e-6)


def _assert_states_close(got: State, want: State, what: str) -> None:
    for (name, a), b in zip(got.tensors().items(), want.tensors().values()):
        tol = NORM_TOL if name == 'norms' else TOL[a.dtype]
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f'{what}: {name}: {m}')


def _assert_states_equal(a: State, b: State, what: str) -> None:
    for (name, x), y in zip(a.tensors().items(), b.tensors().values()):
        assert torch.equal(x, y), f'{what}: {name} changed'


def _kernel(op):
    """The compiled op, followed by the check of every guard canary (tests/_guards.py)."""
    return getattr(checked(torch.ops.mp_wrappers), op)


# ---- kernel vs reference ------------------------------------------------------------------------------

CASES = [(op, name, hp) for op in OPS for name, hp in VARIANTS[op]]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtypes', DTYPES, ids=lambda d: '-'.join(
    str(t).replace('torch.', '') for t in d))
@pytest.mark.parametrize('op,variant,hp', CASES, ids=[f'{c[0]}{c[1]}' for c in CASES])
def test_kernel_matches_reference(op, variant, hp, dtypes, device, cpu_isa):
    """Fuzz sizes in one list, 3 steps (each compared with one reference step from the same inputs)
    with a non-power-of-two grad scale (a real divide), then a power of two (the exact-reciprocal
    fast path); then a skipped step that must change no bit."""
    if not _kernel_available(op, device):
        pytest.skip(f'no {device} kernel built')
    got = State(op, SIZES, dtypes, device, seed=1)
    want = got.clone()
    for i, scale in enumerate([1000.0, 1024.0, 1024.0]):
        for st in (got, want):
            st.grad_scale.fill_(scale)
            st.gnorm.fill_(0.5 + i)  # crosses max_grad_norm=1.0: clipping on from step 2
        _kernel(op)(*got.args(op, hp))
        getattr(reference, op)(*want.args(op, hp))
        _assert_states_close(got, want, f'{op} {variant} step {i + 1}')
        # Restart the reference from the kernel's state: a half param one rounding apart would
        # otherwise make the next step's inputs differ, and the comparison would measure drift.
        want = got.clone()
    assert got.step.item() == 3.0
    before = got.clone()
    got.found_inf.fill_(1.0)
    _kernel(op)(*got.args(op, hp))
    _assert_states_equal(got, before, f'{op} {variant} skipped step')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('impl', ['kernel', 'reference'])
@pytest.mark.parametrize('op,variant,hp', CASES, ids=[f'{c[0]}{c[1]}' for c in CASES])
def test_lr_tensor_is_read_when_the_op_runs(op, variant, hp, impl, device, cpu_isa):
    """Note [capturable]: an lr given as a 1-element tensor gives the bits of the same float lr,
    and a new value written into the tensor in place is used by the next call (as a replayed CUDA
    graph needs); a skipped step still changes nothing."""
    if impl == 'kernel' and not _kernel_available(op, device):
        pytest.skip(f'no {device} kernel built')
    run = _kernel(op) if impl == 'kernel' else getattr(reference, op)
    dtypes = DTYPES[1]  # the O2 fused step: fp32 masters, half grads, half model copy
    got = State(op, SIZES, dtypes, device, seed=3)
    want = got.clone()
    lr = torch.full((1,), hp['lr'], device=device)
    for i, factor in enumerate([1.0, 1.0, 0.25]):
        lr.fill_(hp['lr'] * factor)  # an LR scheduler updating the tensor in place
        run(*got.args(op, hp, lr_tensor=lr))
        run(*want.args(op, dict(hp, lr=hp['lr'] * factor)))
        for (name, a), b in zip(got.tensors().items(), want.tensors().values()):
            assert torch.equal(a, b), f'{op} {variant} step {i + 1}: {name} differs'
    before = got.clone()
    got.found_inf.fill_(1.0)
    run(*got.args(op, hp, lr_tensor=lr))
    _assert_states_equal(got, before, f'{op} {variant} skipped step')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('op', OPS)
def test_many_small_tensors(op, device):
    """Lists of the small fuzz sizes repeated 55 times (many tensors per chunk plan)."""
    if not _kernel_available(op, device):
        pytest.skip(f'no {device} kernel built')
    hp = VARIANTS[op][0][1]
    got = State(op, [777, 555] * 55, DTYPES[1], device, seed=2, scale=1024.0)
    want = got.clone()
    for i in range(2):
        _kernel(op)(*got.args(op, hp))
        getattr(reference, op)(*want.args(op, hp))
        _assert_states_close(got, want, f'{op} x55 step {i + 1}')
        want = got.clone()


# Element-wise updates: the same bits whatever the alignment; LAMB's and NovoGrad's norms may be
# summed in another order when the vector path starts elsewhere.
BITWISE_OPS = ('multi_tensor_adam_', 'multi_tensor_sgd_', 'multi_tensor_adagrad_')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('shift', [0, 1])
@pytest.mark.parametrize('op', OPS)
def test_flat_buffers_match_separate_tensors(op, shift, device):
    """Every list as adjacent views of one flat buffer (FSDP's flat parameters, flat master and
    state buffers): two steps give what separate tensors give, so no kernel writes past a tensor
    into its neighbour (which the neighbour's own update or value would then show)."""
    if not _kernel_available(op, device):
        pytest.skip(f'no {device} kernel built')
    hp = VARIANTS[op][0][1]
    sep = State(op, [777, 65537, 1, 31, 555], DTYPES[1], device, seed=7)
    got = sep.flat(shift)
    for i in range(2):
        _kernel(op)(*got.args(op, hp))
        _kernel(op)(*sep.args(op, hp))
        if op in BITWISE_OPS:
            _assert_states_equal(got, sep, f'{op} flat step {i + 1}')
        else:
            _assert_states_close(got, sep, f'{op} flat step {i + 1}')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('op', OPS)
def test_skip_on_first_step_keeps_everything(op, device):
    """found_inf set before any applied step: no bit moves, the step stays 0 (so SGD's and
    NovoGrad's first-step initialisation happens on the next applied step, as in the reference)."""
    if not _kernel_available(op, device):
        pytest.skip(f'no {device} kernel built')
    hp = VARIANTS[op][0][1]
    st = State(op, [65537, 3], DTYPES[2], device, seed=3)
    st.found_inf.fill_(1.0)
    before = st.clone()
    _kernel(op)(*st.args(op, hp))
    _assert_states_equal(st, before, f'{op} skipped first step')
    st.found_inf.zero_()
    want = st.clone()
    _kernel(op)(*st.args(op, hp))
    getattr(reference, op)(*want.args(op, hp))
    _assert_states_close(st, want, f'{op} first applied step')


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('norm_type', [2, 0])
def test_novograd_norms_are_exact(norm_type, device):
    """The per-tensor grad norms (first step: the norm itself) against float64."""
    op = 'multi_tensor_novograd_'
    if not _kernel_available(op, device):
        pytest.skip(f'no {device} kernel built')
    hp = dict(VARIANTS[op][0][1], norm_type=norm_type)
    st = State(op, SIZES, DTYPES[1], device, seed=6)
    unscaled = [g.double() / st.grad_scale.double() for g in st.grads]
    ord_ = 2 if norm_type == 2 else float('inf')
    want = torch.stack([torch.linalg.vector_norm(g, ord=ord_) for g in unscaled])
    _kernel(op)(*st.args(op, hp))
    torch.testing.assert_close(st.norms.double(), want, **TOL[torch.float32])


@needs_opcheck
@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('op', OPS)
def test_opcheck(op, device):
    if not _kernel_available(op, device):
        pytest.skip(f'no {device} kernel built')
    hp = VARIANTS[op][0][1]
    st = State(op, [37, 5], DTYPES[1], device, seed=4)
    opcheck(getattr(torch.ops.mp_wrappers, op), st.args(op, hp))


@needs_opcheck
@pytest.mark.parametrize('op', OPS)
def test_fake_kernel_runs_on_meta_tensors(op):
    """opcheck passes without a fake kernel (the ops return nothing), but meta tensors and traces
    need one; it validates the lists like eager mode does."""
    hp = VARIANTS[op][0][1]
    st = State(op, [37, 5], DTYPES[1], 'cpu', seed=4)

    def to_meta(a):
        if isinstance(a, list):
            return [t.to('meta') for t in a]
        return a.to('meta') if isinstance(a, torch.Tensor) else a
    args = [to_meta(a) for a in st.args(op, hp)]
    _kernel(op)(*args)  # no error, nothing to compute
    args[1] = args[1][:1]  # grads no longer parallel to params
    with pytest.raises(ValueError, match='grads has 1 tensors but params has 2'):
        _kernel(op)(*args)


def test_kernels_reject_bad_arguments():
    """Direct torch.ops calls are checked in C++ with messages naming the argument."""
    hp = VARIANTS['multi_tensor_adam_'][0][1]
    st = State('multi_tensor_adam_', [10, 20], DTYPES[0], 'cpu')
    args = list(st.args('multi_tensor_adam_', hp))
    bad = list(args)
    bad[2] = [t.to(torch.bfloat16) for t in st.state[0]]
    with pytest.raises(RuntimeError, match=r'exp_avgs\[0\] has dtype BFloat16'):
        _kernel('multi_tensor_adam_')(*bad)
    bad = list(args)
    bad[1] = [st.grads[0], st.grads[0]]
    with pytest.raises(RuntimeError, match=r'grads\[1\] has 10 elements but params\[1\] has 20'):
        _kernel('multi_tensor_adam_')(*bad)
    bad = list(args)
    bad[5] = torch.zeros(2)
    with pytest.raises(RuntimeError, match='step must be a 1-element float32 tensor'):
        _kernel('multi_tensor_adam_')(*bad)
    nv = State('multi_tensor_novograd_', [10, 20], DTYPES[0], 'cpu')
    nargs = list(nv.args('multi_tensor_novograd_', VARIANTS['multi_tensor_novograd_'][0][1]))
    nargs[14] = 1
    with pytest.raises(RuntimeError, match='norm_type=1'):
        _kernel('multi_tensor_novograd_')(*nargs)


# ---- the ISA flavours ---------------------------------------------------------------------------------

def _run_isa(isa: str, threads: int) -> dict:
    """Two steps of every case with the kernels switched to ``isa`` in this process."""
    from mp_wrappers.ops._extension import extension
    ext = extension()
    previous, before_threads = ext._set_cpu_isa(isa), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {}
        for op, variant, hp in CASES:
            st = State(op, [65537, 33, 777], DTYPES[1], 'cpu', seed=5)
            for _ in range(2):
                _kernel(op)(*st.args(op, hp))
            out[op + variant] = {k: v.clone() for k, v in st.tensors().items()}
        return out
    finally:
        ext._set_cpu_isa(previous)
        torch.set_num_threads(before_threads)


_ISAS = ('avx512', 'avx2', 'baseline')


@pytest.mark.skipif(backend()['cpu'] not in ('cpp-avx512', 'cpp-avx2'),
                    reason='needs a CPU with at least AVX2 (two flavours to compare)')
def test_isa_flavours_agree():
    """Every flavour the CPU runs gives the same bits as the widest (no FMA contraction, correctly
    rounded sqrt/div in every flavour, SumSq32's flavour-independent norm layout, one thread vs
    two). The ISA is switched in this process (``_C._set_cpu_isa``)."""
    from mp_wrappers.ops._extension import extension
    widest = extension().cpu_isa_hardware()
    isas = _ISAS[_ISAS.index(widest):]
    results = {isa: _run_isa(isa, 2 if i == 0 else 1) for i, isa in enumerate(isas)}
    for isa in isas[1:]:
        for case, tensors in results[widest].items():
            for name, want in tensors.items():
                got = results[isa][case][name]
                assert torch.equal(got, want), f'{isa} differs from {widest}: {case} {name}'
