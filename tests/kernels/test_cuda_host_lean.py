"""The lean CUDA kernels (cuda/multi_tensor_lean.cu) executed on the CPU (host-execution build).

Same pattern as tests/kernels/test_cuda_host.py: the entry points of multi_tensor_adam_lean_ and
multi_tensor_sgd_lean_ run through their real checks, launch planner and launches in both geometries,
for the three storages (split, kahan, stochastic), fp32 and bf16 state, with lists that need several
chunks and (tiny geometry) several launches. Compared bit for bit with the CPU kernels (the same IEEE
fp32 operations in the same order, the same stochastic-rounding hash); with ops/reference/lean.py bit for
bit for SGD and to TOL for Adam (torch's CPU sqrt is not always correctly rounded, as in
tests/ops/test_lean.py). A found_inf step must change no bit and write no byte.
"""
import pytest
import torch

from _tolerances import TOL
from mp_wrappers.ops import reference
from test_cuda_host import _bits_equal, host, representative  # noqa: F401 (host is a fixture)
from test_lean import ADAM, ADAM_L2, SGD, SGD_DAMP, Lean

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.mp_wrappers, 'multi_tensor_adam_lean_'),
                                reason='the C++ extension mp_wrappers._C is not built')

SGD_PLAIN = dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=1e-3, nesterov=False,
                 wd_after_momentum=False)
CASES = [('adam', 'adamw', ADAM), ('adam', 'adam_l2', ADAM_L2), ('sgd', 'sgd', SGD),
         ('sgd', 'sgd_damp', SGD_DAMP), ('sgd', 'sgd_plain', SGD_PLAIN)]


def _lean(storage, sizes, state_dtype, hp, seed):
    return Lean(storage, sizes, state_dtype, momentum=hp.get('momentum', 1.0) != 0.0, seed=seed)


def _call(lean, ops, opt, grads, hp, scale, found_inf):
    getattr(lean, opt)(getattr(ops, f'multi_tensor_{opt}_lean_'), grads, hp, scale, found_inf)


@pytest.mark.parametrize('state_dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('storage', ['split', 'kahan', 'stochastic'])
@pytest.mark.parametrize('opt,name,hp', CASES, ids=[c[1] for c in CASES])
def test_lean_matches_cpu_kernel(host, opt, name, hp, storage, state_dtype):
    """Three steps (a real divide by the grad scale, then powers of two) against the CPU kernel
    (bitwise) and ops/reference/lean.py, then a found_inf step that must change nothing."""
    # Real geometry (512 threads per block): two cases, the tiny geometry runs all.
    representative(host, state_dtype == torch.float32 and (name, storage) in (
        ('adamw', 'stochastic'), ('sgd', 'kahan')))
    sizes = host.sizes()
    got = _lean(storage, sizes, state_dtype, hp, seed=21)
    cpu, ref = got.clone(), got.clone()
    g = torch.Generator().manual_seed(22)
    found_inf = torch.zeros(1)
    for i, s in enumerate([1000.0, 1024.0, 2048.0]):
        grads = [(torch.randn(n, generator=g) * 64).bfloat16() for n in sizes]
        scale = torch.full((1,), s)
        host.module.traffic_reset()
        _call(got, host.ops, opt, grads, hp, scale, found_inf)
        _call(cpu, torch.ops.mp_wrappers, opt, grads, hp, scale, found_inf)
        _call(ref, reference, opt, grads, hp, scale, found_inf)
        what = f'{opt} {name} {storage} step {i + 1}'
        for a, b in zip(got.tensors(), cpu.tensors()):
            assert _bits_equal(a, b), f'{what}: differs from the CPU kernel'
        if opt == 'sgd':  # no sqrt: the same fp32 operations give the same bits
            for a, b in zip(got.tensors(), ref.tensors()):
                assert _bits_equal(a, b), f'{what}: differs from the reference'
        else:
            tol = TOL[torch.bfloat16] if storage == 'stochastic' else TOL[torch.float32]
            for a, b in zip(got.value(), ref.value()):
                torch.testing.assert_close(a, b, **tol)
            for a, b in zip(got.m + got.v, ref.m + ref.v):
                torch.testing.assert_close(a.float(), b.float(), **TOL[state_dtype])
        ref = got.clone()  # the reference follows the kernel's state (Adam: within TOL only)
        launches = [r for r in host.launches() if r[0] != 'increment_step']
        if host.geometry['name'] == 'TinyGeometry':
            assert len(launches) > 1, 'the tiny geometry must need several launches here'
    assert got.step.item() == 5.0  # Lean starts at step 2
    before = [t.clone() for t in got.tensors()]
    host.module.traffic_reset()
    _call(got, host.ops, opt, [torch.ones(n).bfloat16() for n in sizes], hp,
          torch.full((1,), 1024.0), torch.ones(1))
    for a, b in zip(got.tensors(), before):
        assert _bits_equal(a, b), f'{opt} {name} {storage}: a skipped step changed a tensor'
    # A skipped step still launches (the decision is on the device) but writes nothing.
    assert sum(r[4] for r in host.launches()) == 0


@pytest.mark.parametrize('opt,hp', [('adam', ADAM), ('sgd', SGD)], ids=['adam', 'sgd'])
def test_lean_without_scale_and_flag_and_empty_lists(host, opt, hp):
    """grad_scale and found_inf absent: the grads as they are, bitwise as the CPU kernel; empty
    lists: only the step counter moves."""
    representative(host, opt == 'adam')
    sizes = host.sizes()
    got = _lean('stochastic', sizes, torch.float32, hp, seed=23)
    cpu = got.clone()
    grads = [(torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.1).bfloat16()
             for n in sizes]
    _call(got, host.ops, opt, grads, hp, None, None)
    _call(cpu, torch.ops.mp_wrappers, opt, grads, hp, None, None)
    for a, b in zip(got.tensors(), cpu.tensors()):
        assert _bits_equal(a, b)
    step = torch.zeros(1)
    host.module.traffic_reset()
    if opt == 'adam':
        host.ops.multi_tensor_adam_lean_([], [], [], [], [], step, **hp, storage='split', seed=0,
                                         grad_scale=None, found_inf=None)
    else:
        host.ops.multi_tensor_sgd_lean_([], [], [], [], step, **hp, storage='split', seed=0,
                                        grad_scale=None, found_inf=None)
    assert step.item() == 1.0
    assert [r[0] for r in host.launches()] == ['increment_step']


def test_lean_host_rejects_bad_arguments_naming_them(host):
    """The entry points' checks run on the host too: a bad storage and aux for 'stochastic'."""
    lean = _lean('split', [5], torch.float32, ADAM, seed=25)
    grads = [torch.ones(5).bfloat16()]
    op = host.ops.multi_tensor_adam_lean_
    with pytest.raises(RuntimeError, match="storage='bogus' is not allowed"):
        op(lean.params, lean.aux, grads, lean.m, lean.v, lean.step, **ADAM, storage='bogus',
           seed=0, grad_scale=None, found_inf=None)
    with pytest.raises(RuntimeError, match="storage='stochastic' keeps no aux"):
        op(lean.params, lean.aux, grads, lean.m, lean.v, lean.step, **ADAM, storage='stochastic',
           seed=0, grad_scale=None, found_inf=None)


@pytest.mark.parametrize('shift', [0, 1])
@pytest.mark.parametrize('storage', ['split', 'kahan', 'stochastic'])
@pytest.mark.parametrize('opt,name,hp', CASES[::2], ids=[c[1] for c in CASES[::2]])
def test_lean_on_flat_buffers(host, opt, name, hp, storage, shift):
    """Every list as adjacent views of one flat buffer (tests/_guards.py ``flat``): two steps give
    the CPU kernel's bits on separate tensors; a write past a tensor lands in its neighbour."""
    representative(host, (name, storage, shift) == ('adamw', 'kahan', 1))
    sizes = host.sizes()
    cpu = _lean(storage, sizes, torch.float32, hp, seed=26)
    got = cpu.flat(shift)
    g = torch.Generator().manual_seed(27)
    for i in range(2):
        grads = [(torch.randn(n, generator=g) * 64).bfloat16() for n in sizes]
        scale, found_inf = torch.full((1,), 1024.0), torch.zeros(1)
        _call(got, host.ops, opt, grads, hp, scale, found_inf)
        _call(cpu, torch.ops.mp_wrappers, opt, grads, hp, scale, found_inf)
        for a, b in zip(got.tensors(), cpu.tensors()):
            assert _bits_equal(a, b), f'{opt} {name} {storage} flat step {i + 1}'
