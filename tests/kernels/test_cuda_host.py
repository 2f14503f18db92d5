"""The CUDA kernels executed on the CPU (host-execution build, tests/cuda_host.py).

The same .cu lines nvcc compiles run here through their real entry points (checks, the launch
planner, dtype dispatch, launches with real block barriers and warp shuffles), on CPU tensors, in
two launch geometries: ``real`` (64K chunks, 512 threads, 320 blocks per launch) and ``tiny`` (448
chunks, 64 threads, 7 blocks), where a few thousand elements already need many chunks and launches.

Comparisons: the element-wise ops are compared bit for bit with the CPU C++ kernels (which repeat
the same IEEE fp32 operations in the same order) and to TOL with the pure-PyTorch references (torch's
CPU sqrt is not always correctly rounded); norms (double accumulation in a different order) with a
float64 oracle to one fp32 rounding (NORM_RTOL). Run with ``bash tools/cuda_host_check.sh`` (or
``MP_WRAPPERS_CUDA_ON_HOST=1 python -m pytest tests/kernels/test_cuda_host.py``, which builds the modules);
skipped otherwise. ``MP_WRAPPERS_CUDA_HOST_VARIANTS=asan`` runs them on the sanitizer build.
"""
import math
import os
import shutil

import pytest
import torch

from _guards import checked, flat, guarded, guarded_empty
from _tolerances import TOL
import cuda_host
from mp_wrappers.ops import backend, reference
from test_cpu_kernels import DTYPES as OPT_DTYPES
from test_cpu_kernels import OPS as OPT_OPS
from test_cpu_kernels import VARIANTS as OPT_VARIANTS
from test_cpu_kernels import State

VARIANT_NAMES = os.environ.get('MP_WRAPPERS_CUDA_HOST_VARIANTS', 'real,tiny').split(',')
HALF = (torch.float16, torch.bfloat16)
STORAGE = (torch.float32, torch.float16, torch.bfloat16)
# Double accumulation, one rounding to fp32 at the end (two for a per-tensor norm summed again).
NORM_RTOL = 3 * 2.0 ** -24

pytestmark = pytest.mark.skipif(not backend()['extension'],
                                reason='the C++ extension mp_wrappers._C is not built')


class Host:
    """One built variant: its ops, geometry and traffic log."""

    def __init__(self, variant):
        self.variant = variant
        self.module = cuda_host.load(variant)
        if self.module is None:
            pytest.skip(f'cuda host module {variant!r} is not built: run `bash '
                        'tools/cuda_host_check.sh` or set MP_WRAPPERS_CUDA_ON_HOST=1')
        # Every launch is followed by the check of every guard canary of the test (tests/_guards.py).
        self.ops = checked(getattr(torch.ops, self.module.namespace))
        self.geometry = self.module.geometry
        self.chunk = self.geometry['chunk_size']

    def launches(self):
        return self.module.traffic_log()

    def sizes(self):
        """Sizes around chunk boundaries, a tensor of several chunks, an empty one."""
        c = self.chunk
        return [1, c - 1, c, 0, c + 1, 3 * c + 5, 7]


_hosts = {}


def representative(host, keep):
    """The real geometry runs 512 threads per block (fibers, switched at every barrier) and 64K
    chunks, far slower than the tiny one: broad matrices run there only for their representative
    cases (`keep`); the tiny geometry runs all."""
    if host.variant == 'real' and not keep:
        pytest.skip('real geometry: representative cases only (the tiny geometry runs this one)')


@pytest.mark.skipif(shutil.which('g++') is None, reason='g++ is not installed')
def test_sanitizer_preload_puts_libstdcxx_after_libasan():
    # libasan must come first (its interceptors), libstdc++ after it, or a C++ exception thrown out
    # of the sanitized module aborts the process (cuda_host.sanitizer_preload).
    libs = cuda_host.sanitizer_preload().split()
    assert [os.path.basename(lib).split('.so')[0] for lib in libs] == ['libasan', 'libstdc++']
    assert all(os.path.isfile(lib) for lib in libs)


@pytest.fixture(params=VARIANT_NAMES)
def host(request):
    if request.param not in _hosts:
        _hosts[request.param] = Host(request.param)
    h = _hosts[request.param]
    h.module.traffic_reset()
    return h


def _shifted(t, shift):
    """A copy of t that starts `shift` elements past an aligned start of its storage (misaligned
    for shift % 4), between guard canaries (tests/_guards.py)."""
    return guarded(t, shift)


def _rand(sizes, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * scale).to(dtype) for n in sizes]


def _bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.int16 if a.element_size() == 2 else torch.int32),
        b.view(torch.int16 if b.element_size() == 2 else torch.int32))


# ---- multi_tensor_scale_ / axpby_ -------------------------------------------------------------------

@pytest.mark.parametrize('shift', [0, 1])
@pytest.mark.parametrize('din', STORAGE)
@pytest.mark.parametrize('dout', STORAGE)
def test_scale_bitwise(host, din, dout, shift):
    """Every (input, output) dtype instantiation, aligned and misaligned (guarded path), a tensor
    over several chunks; bit-identical to the reference; the flag stays 0 for finite inputs."""
    representative(host, din == dout or (din, dout) == (torch.float32, torch.bfloat16))
    xs = [_shifted(t, shift) for t in _rand(host.sizes(), din, 1)]
    outs = [_shifted(torch.full_like(t, 7.0, dtype=dout), shift) for t in xs]
    want = [torch.empty_like(o) for o in outs]
    scale = torch.tensor([0.3])
    fi, fi_ref = guarded(torch.zeros(1)), torch.zeros(1)
    host.ops.multi_tensor_scale_(xs, outs, scale, fi)
    reference.multi_tensor_scale_(xs, want, scale, fi_ref)
    for i, (o, w) in enumerate(zip(outs, want)):
        assert _bits_equal(o, w), f'output {i}'
    assert fi.item() == 0.0
    assert len(host.launches()) >= 1


@pytest.mark.parametrize('where', ['first', 'middle', 'last'])
@pytest.mark.parametrize('bad', [math.inf, -math.inf, math.nan])
def test_scale_flags_nonfinite(host, where, bad):
    """apex's fuzz places: first element, the middle, the last element of the last tensor; the
    output is still written (inf * 0 must be reported: the input is checked, not the product)."""
    representative(host, bad != math.inf and where == 'last')
    xs = _rand(host.sizes(), torch.float32, 2)
    t = {'first': 0, 'middle': 5, 'last': len(xs) - 1}[where]
    i = {'first': 0, 'middle': xs[t].numel() // 2, 'last': xs[t].numel() - 1}[where]
    xs[t][i] = bad
    outs = [guarded_empty(x.shape, torch.float16) for x in xs]
    fi = guarded(torch.zeros(1))
    host.ops.multi_tensor_scale_(xs, outs, torch.tensor([0.0]), fi)
    assert fi.item() == 1.0
    want = [torch.empty_like(o) for o in outs]
    reference.multi_tensor_scale_(xs, want, torch.tensor([0.0]), torch.zeros(1))
    assert all(_bits_equal(o, w) for o, w in zip(outs, want))


@pytest.mark.parametrize('arg_to_check', [-1, 0, 1])
@pytest.mark.parametrize('dtypes', [(torch.float32,) * 3, (torch.float16, torch.bfloat16,
                                                          torch.float32),
                                    (torch.bfloat16, torch.float32, torch.float16)])
def test_axpby(host, dtypes, arg_to_check):
    """out = a*x + b*y bit for bit; the flag follows arg_to_check (inf in y only)."""
    representative(host, arg_to_check == -1)
    sizes = host.sizes()
    # Aligned (vector path) and shifted by one element (guarded path).
    x = [_shifted(t, int(arg_to_check == 1)) for t in _rand(sizes, dtypes[0], 3)]
    y = _rand(sizes, dtypes[1], 4)
    y[-2][3] = math.inf
    out = [guarded_empty(n, dtypes[2]) for n in sizes]
    want = [torch.empty_like(o) for o in out]
    fi, fi_ref = guarded(torch.zeros(1)), torch.zeros(1)
    host.ops.multi_tensor_axpby_(x, y, out, 0.7, -1.3, arg_to_check, fi)
    reference.multi_tensor_axpby_(x, y, want, 0.7, -1.3, arg_to_check, fi_ref)
    assert all(_bits_equal(o, w) for o, w in zip(out, want))
    assert fi.item() == fi_ref.item() == (0.0 if arg_to_check == 0 else 1.0)


def test_axpby_rejects_bad_arg_to_check(host):
    with pytest.raises(RuntimeError, match='arg_to_check=2'):
        host.ops.multi_tensor_axpby_([torch.ones(3)], [torch.ones(3)], [torch.ones(3)], 1.0, 1.0,
                                     2, torch.zeros(1))


# ---- norms ---------------------------------------------------------------------------------------------

def _oracle_norms(tensors, inv_scale=1.0):
    per = [torch.linalg.vector_norm((t.float() * inv_scale).double()) for t in tensors]
    total = torch.linalg.vector_norm(torch.stack(per)) if per else torch.zeros((), dtype=torch.float64)
    return total, per


@pytest.mark.parametrize('per_tensor', [True, False])
@pytest.mark.parametrize('dtype', STORAGE)
def test_l2norm(host, dtype, per_tensor):
    representative(host, per_tensor)
    xs = [_shifted(t, s % 2) for s, t in enumerate(_rand(host.sizes(), dtype, 5))]
    total, norms = host.ops.multi_tensor_l2norm(xs, per_tensor)
    want_total, want_per = _oracle_norms(xs)
    assert total.dtype == torch.float32 and total.dim() == 0
    torch.testing.assert_close(total.double(), want_total, rtol=NORM_RTOL, atol=0)
    if per_tensor:
        torch.testing.assert_close(norms.double(), torch.stack(want_per), rtol=NORM_RTOL, atol=0)
    else:
        assert norms.numel() == 0


def test_l2norm_does_not_overflow(host):
    """Finite elements above sqrt(FLT_MAX) ~ 1.8e19: the squares are summed in double, so the norm
    is finite and right (fp32 accumulation would give inf)."""
    xs = [torch.full((host.chunk + 3,), 3e19), torch.full((5,), -4e19)]
    total, norms = host.ops.multi_tensor_l2norm(xs, True)
    want_total, want_per = _oracle_norms(xs)
    assert math.isfinite(total.item())
    torch.testing.assert_close(total.double(), want_total, rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close(norms.double(), torch.stack(want_per), rtol=NORM_RTOL, atol=0)
    fi = guarded(torch.zeros(1))
    total, _ = host.ops.multi_tensor_unscale_l2norm(xs, torch.tensor([0.5]), fi, False)
    assert fi.item() == 0.0 and math.isfinite(total.item())


@pytest.mark.parametrize('bad', [math.inf, math.nan])
def test_unscale_l2norm(host, bad):
    xs = [t.half() for t in _rand(host.sizes(), torch.float32, 6, scale=100.0)]
    inv = torch.tensor([1.0 / 1000.0])
    fi = guarded(torch.zeros(1))
    total, norms = host.ops.multi_tensor_unscale_l2norm(xs, inv, fi, True)
    want_total, want_per = _oracle_norms(xs, inv.item())
    assert fi.item() == 0.0
    torch.testing.assert_close(total.double(), want_total, rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close(norms.double(), torch.stack(want_per), rtol=NORM_RTOL, atol=0)
    xs[4][-1] = bad
    host.ops.multi_tensor_unscale_l2norm(xs, inv, fi, True)
    assert fi.item() == 1.0


def test_norms_of_empty_lists_and_tensors(host):
    """Empty list: the CPU kernel's result (0 and an empty per-tensor tensor), no launch, no error
    (only unscale_l2norm can get there: multi_tensor_l2norm([]) has no tensor for the dispatcher
    to route by, on any device); empty tensors have norm 0."""
    args = (torch.ones(1), torch.zeros(1), True)
    total, norms = host.ops.multi_tensor_unscale_l2norm([], *args)
    want_total, want_norms = torch.ops.mp_wrappers.multi_tensor_unscale_l2norm([], *args)
    assert total.item() == want_total.item() == 0.0 and norms.shape == want_norms.shape == (0,)
    assert host.launches() == []
    lst = [torch.zeros(0), torch.ones(4), torch.zeros(0)]
    for total, norms in (host.ops.multi_tensor_l2norm(lst, True),
                         host.ops.multi_tensor_unscale_l2norm(lst, *args)):
        assert total.item() == 2.0 and norms.tolist() == [0.0, 2.0, 0.0]


# ---- update_scale_hysteresis_ -----------------------------------------------------------------------

@pytest.mark.parametrize('itype', [torch.int32, torch.int64])
def test_update_scale_hysteresis(host, itype):
    """A sequence of overflows and clean steps: bit-identical to the reference at every step."""
    representative(host, itype == torch.int32)
    got = [guarded(t) for t in (torch.tensor([65536.0]), torch.zeros(1, dtype=itype),
                                torch.full((1,), 2, dtype=itype))]
    want = [t.clone() for t in got]
    for flag in [1, 0, 0, 1, 1, 1, 0, 0, 0, 0]:
        fi = guarded(torch.tensor([float(flag)]))
        args = (fi, 2.0, 0.5, 3, 2, 1.0, 2.0 ** 24)
        host.ops.update_scale_hysteresis_(*got, *args)
        reference.update_scale_hysteresis_(*want, *args)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (flag, got, want)


# ---- fused optimizer updates ------------------------------------------------------------------------

OPT_CASES = [(op, name, hp) for op in OPT_OPS for name, hp in OPT_VARIANTS[op]]
# Element-wise ops are IEEE per element: bit-identical to the CPU kernels. LAMB's trust ratio and
# NovoGrad's norms are reductions in another order: TOL.
BITWISE_OPS = ('multi_tensor_adam_', 'multi_tensor_sgd_', 'multi_tensor_adagrad_')


def _host_state(op, sizes, dtypes, seed, shift, scale=1000.0):
    st = State(op, sizes, dtypes, 'cpu', seed=seed, scale=scale)
    st.params = [_shifted(t, shift) for t in st.params]
    st.grads = [_shifted(t, shift) for t in st.grads]
    st.model = [_shifted(t, shift) for t in st.model]
    st.state = [[_shifted(t, shift) for t in lst] for lst in st.state]
    return st  # the 1-element tensors and NovoGrad's norms are guarded by State itself


def _compare(op, got, want, what, bitwise):
    for (name, a), b in zip(got.tensors().items(), want.tensors().values()):
        if bitwise:
            assert _bits_equal(a, b), f'{what}: {name} differs from the CPU kernel'
        else:
            tol = dict(rtol=1e-5, atol=1e-6) if a.dtype == torch.float32 else TOL[a.dtype]
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f'{what}: {name}: {m}')


@pytest.mark.parametrize('shift', [0, 1])
@pytest.mark.parametrize('dtypes', OPT_DTYPES, ids=lambda d: '-'.join(
    str(t).replace('torch.', '') for t in d))
@pytest.mark.parametrize('op,variant,hp', OPT_CASES, ids=[f'{c[0]}{c[1]}' for c in OPT_CASES])
def test_optimizer_matches_cpu_kernel(host, op, variant, hp, dtypes, shift):
    """Three steps (non-power-of-two grad scale: a real divide; then powers of two; clipping on
    from step 2) against the CPU kernel from the same state, and against the reference to TOL;
    then a found_inf step that must change no bit."""
    representative(host, dtypes == OPT_DTYPES[1] and shift == 0
                   and variant == OPT_VARIANTS[op][0][0])
    sizes = host.sizes()
    got = _host_state(op, sizes, dtypes, seed=11, shift=shift)
    cpu = got.clone()
    for i, scale in enumerate([1000.0, 1024.0, 2048.0]):
        for st in (got, cpu):
            st.grad_scale.fill_(scale)
            st.gnorm.fill_(0.5 + i)
        ref = got.clone()
        getattr(host.ops, op)(*got.args(op, hp))
        getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, hp))
        _compare(op, got, cpu, f'{op} {variant} step {i + 1}', op in BITWISE_OPS)
        # The reference's vector_norm(ord=inf) refuses the empty tensor of the list.
        if hp.get('norm_type', 2) == 2:
            getattr(reference, op)(*ref.args(op, hp))
            _compare(op, got, ref, f'{op} {variant} step {i + 1} (reference)', False)
        cpu = got.clone()
    assert got.step.item() == 3.0
    before = got.clone()
    got.found_inf.fill_(1.0)
    host.module.traffic_reset()
    getattr(host.ops, op)(*got.args(op, hp))
    for (name, a), b in zip(got.tensors().items(), before.tensors().values()):
        assert _bits_equal(a, b), f'{op} {variant} skipped step changed {name}'
    # A skipped step still launches (the decision is on the device) but writes nothing.
    assert sum(r[4] for r in host.launches()) == 0


@pytest.mark.parametrize('op', OPT_OPS)
def test_optimizer_without_scale_and_flag(host, op):
    """grad_scale and found_inf absent (None): grads used as they are, the update applied."""
    representative(host, op == 'multi_tensor_adam_')
    hp = OPT_VARIANTS[op][0][1]
    got = _host_state(op, host.sizes(), OPT_DTYPES[0], seed=12, shift=0, scale=1.0)
    got.grad_scale, got.found_inf = None, None
    cpu = _host_state(op, host.sizes(), OPT_DTYPES[0], seed=12, shift=0, scale=1.0)
    cpu.grad_scale, cpu.found_inf = None, None
    getattr(host.ops, op)(*got.args(op, hp))
    getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, hp))
    _compare(op, got, cpu, f'{op} no scale', op in BITWISE_OPS)
    assert got.step.item() == 1.0


@pytest.mark.parametrize('op,variant,hp', OPT_CASES, ids=[f'{c[0]}{c[1]}' for c in OPT_CASES])
def test_optimizer_reads_lr_tensor_when_it_runs(host, op, variant, hp):
    """Note [capturable]: the kernels read lr_tensor on the device (thread 0 of each block, and
    LAMB's ratio pass), at run time: each value written into it in place is the lr of the next
    call, as the CPU kernel with that float lr computes it."""
    representative(host, variant == OPT_VARIANTS[op][0][0])
    got = _host_state(op, host.sizes(), OPT_DTYPES[1], seed=13, shift=0)
    cpu = got.clone()
    lr = torch.zeros(1)
    for factor in (1.0, 0.25, 3.0):
        lr.fill_(hp['lr'] * factor)
        getattr(host.ops, op)(*got.args(op, hp, lr_tensor=lr))
        getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, dict(hp, lr=hp['lr'] * factor)))
        _compare(op, got, cpu, f'{op} {variant} lr x{factor}', op in BITWISE_OPS)
        cpu = got.clone()


@pytest.mark.parametrize('op', OPT_OPS)
def test_optimizer_empty_lists(host, op):
    """Empty lists: as the CPU kernel (only the step counter moves), no update launch, no error."""
    hp = OPT_VARIANTS[op][0][1]
    got = _host_state(op, [], OPT_DTYPES[0], seed=13, shift=0)
    cpu = _host_state(op, [], OPT_DTYPES[0], seed=13, shift=0)
    getattr(host.ops, op)(*got.args(op, hp))
    getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, hp))
    assert got.step.item() == cpu.step.item() == 1.0
    assert [r[0] for r in host.launches()] == ['increment_step']


@pytest.mark.parametrize('op', OPT_OPS)
def test_optimizer_empty_tensors(host, op):
    """Only empty tensors: no update launch, step still counted, norms of NovoGrad as the CPU's."""
    hp = OPT_VARIANTS[op][0][1]
    got = _host_state(op, [0, 0], OPT_DTYPES[1], seed=14, shift=0)
    cpu = got.clone()
    getattr(host.ops, op)(*got.args(op, hp))
    getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, hp))
    _compare(op, got, cpu, f'{op} empty tensors', True)
    update_launches = [r for r in host.launches() if r[4] > 0 and r[0] != 'increment_step'
                       and not r[0].endswith(('_norms', '_ratio'))]
    assert update_launches == []


def test_optimizer_rejects_mixed_dtype_lists(host):
    """A launch dispatches on the list's first dtype, so a mixed list is refused with its index."""
    op, hp = 'multi_tensor_adam_', OPT_VARIANTS['multi_tensor_adam_'][0][1]
    st = _host_state(op, [5, 6], OPT_DTYPES[0], seed=15, shift=0)
    st.grads[1] = st.grads[1].half()
    with pytest.raises(RuntimeError, match=r'grads mixes dtypes Float and Half \(index 1\)'):
        getattr(host.ops, op)(*st.args(op, hp))
    st = _host_state(op, [5, 6], OPT_DTYPES[0], seed=15, shift=0)
    st.state[0][0] = st.state[0][0].half()
    with pytest.raises(RuntimeError, match='optimizer state must be float32'):
        getattr(host.ops, op)(*st.args(op, hp))


def test_lamb_overflowing_norms_stay_finite(host):
    """LAMB's trust-ratio norms are summed in double: params above sqrt(FLT_MAX) give a finite
    ratio, the same as the CPU kernel's."""
    op, hp = 'multi_tensor_lamb_', OPT_VARIANTS['multi_tensor_lamb_'][0][1]
    st = _host_state(op, [host.chunk + 9, 4], OPT_DTYPES[0], seed=16, shift=0, scale=1.0)
    st.params = [p.fill_(2e19) for p in st.params]
    cpu = st.clone()
    getattr(host.ops, op)(*st.args(op, hp))
    getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, hp))
    assert all(torch.isfinite(p).all() for p in st.params)
    _compare(op, st, cpu, 'lamb large params', False)


def test_novograd_overflowing_grad_norm_stays_finite(host):
    op, hp = 'multi_tensor_novograd_', OPT_VARIANTS['multi_tensor_novograd_'][0][1]
    st = _host_state(op, [host.chunk + 9, 4], OPT_DTYPES[0], seed=17, shift=0, scale=1.0)
    st.grads = [g.fill_(3e19) for g in st.grads]
    cpu = st.clone()
    getattr(host.ops, op)(*st.args(op, hp))
    getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, hp))
    assert torch.isfinite(st.norms).all()
    _compare(op, st, cpu, 'novograd large grads', False)


@pytest.mark.parametrize('shift', [0, 1])
@pytest.mark.parametrize('op', OPT_OPS)
def test_optimizer_on_flat_buffers(host, op, shift):
    """Every list as adjacent views of one flat buffer (no gap; FSDP's flat parameters, flat
    master and state buffers), sizes around chunk boundaries: two steps against the CPU kernel on
    separate tensors. A write past a tensor's end lands in its neighbour's first element before the
    neighbour reads it, so its update differs; past the last tensor, in the trailing guard."""
    representative(host, op == 'multi_tensor_adam_' and shift == 1)
    hp = OPT_VARIANTS[op][0][1]
    cpu = _host_state(op, host.sizes(), OPT_DTYPES[1], seed=18, shift=0)
    got = cpu.flat(shift)
    for i in range(2):
        getattr(host.ops, op)(*got.args(op, hp))
        getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, hp))
        _compare(op, got, cpu, f'{op} flat buffers step {i + 1}', op in BITWISE_OPS)
        cpu = got.clone()


@pytest.mark.parametrize('shift', [0, 1])
def test_scale_and_axpby_on_flat_buffers(host, shift):
    """In place on one flat buffer (scale: out is x; axpby: out is y): a stray write changes the
    neighbour's input before it is read."""
    representative(host, shift == 1)
    xs = _rand(host.sizes(), torch.float32, 19)
    got = flat(xs, shift)
    fi = guarded(torch.zeros(1))
    host.ops.multi_tensor_scale_(got, got, torch.tensor([0.3]), fi)
    want = [x.clone() for x in xs]
    reference.multi_tensor_scale_(want, want, torch.tensor([0.3]), torch.zeros(1))
    assert all(_bits_equal(a, b) for a, b in zip(got, want))
    x = flat(_rand(host.sizes(), torch.bfloat16, 20), shift)
    host.ops.multi_tensor_axpby_(x, got, got, 0.7, -1.3, -1, fi)
    reference.multi_tensor_axpby_(x, want, want, 0.7, -1.3, -1, torch.zeros(1))
    assert all(_bits_equal(a, b) for a, b in zip(got, want))
    assert fi.item() == 0.0
