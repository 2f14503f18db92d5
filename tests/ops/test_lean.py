"""The lean bf16 optimizer ops (Note [lean bf16 storage]): kernels against their references, and the
'split' storage against the fused O2 step with fp32 masters, bit for bit.

* 'split' (bf16 high half + uint16 low half) must evolve exactly the fp32 master the O2 step
  (``multi_tensor_adam_`` / ``multi_tensor_sgd_`` with fp32 params, bf16 grads and a bf16 model copy)
  evolves from the same gradients, kernel against kernel and reference against reference; its bf16
  half is that master rounded toward zero.
* Kernel vs reference: SGD bit for bit; Adam within TOL (torch's CPU sqrt is not correctly rounded,
  see tests/kernels/test_cpu_kernels.py), compared on the fp32 value each storage represents ('kahan'
  within KAHAN_TOL: its bf16 compensation turns a one-ulp difference into one of its own ulps).
* A found_inf step leaves every tensor bit-identical; the AVX2 and baseline kernels give the same bits
  as AVX-512.
"""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from _compat import needs_opcheck, opcheck
from mp_wrappers import compat
from _guards import checked, flat, guarded
from _tolerances import KAHAN_TOL, TOL
from mp_wrappers.ops import (backend, multi_tensor_adam, multi_tensor_adam_lean, multi_tensor_sgd,
                             multi_tensor_sgd_lean, reference)
from mp_wrappers.ops.reference.lean import (bf16_join, bf16_split, round_stochastic,
                                            stochastic_bits)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIZES = [777, 65537 + 33]
HAS_KERNELS = backend()['extension']
needs_kernels = pytest.mark.skipif(not HAS_KERNELS, reason='extension not built')

ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, adam_w_mode=True,
            bias_correction=True)
ADAM_L2 = dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, adam_w_mode=False,
               bias_correction=False)
SGD = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=True,
           wd_after_momentum=False)
SGD_DAMP = dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=1e-2, nesterov=False,
                wd_after_momentum=True)


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _assert_same_bits(a, b, what=''):
    assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), what


class Lean:
    """One call's tensors for a storage, from a seed (fp32 master -> the storage's params/aux)."""

    def __init__(self, storage, sizes, state_dtype=torch.float32, momentum=True, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.storage = storage
        self.master = [torch.randn(n, generator=g) for n in sizes]
        if storage == 'split':
            self.params, self.aux = map(list, zip(*[bf16_split(m) for m in self.master]))
        else:
            self.params = [m.bfloat16() for m in self.master]
            self.aux = ([(m - p.float()).bfloat16() for m, p in zip(self.master, self.params)]
                        if storage == 'kahan' else [])
        self.m = [(torch.randn(n, generator=g) * 0.1).to(state_dtype) for n in sizes]
        self.v = [torch.rand(n, generator=g).to(state_dtype) * 0.01 for n in sizes]
        self.step = torch.full((1,), 2.0)
        self._guard(self)
        self.bufs = self.m if momentum else []
        self.gen = g
        self.sizes = sizes

    def grads(self):
        return [(torch.randn(n, generator=self.gen) * 64).bfloat16() for n in self.sizes]

    @staticmethod
    def _guard(lean):
        """Every tensor a kernel writes between guard canaries (tests/_guards.py)."""
        for k in ('master', 'params', 'aux', 'm', 'v'):
            setattr(lean, k, [guarded(t) for t in getattr(lean, k)])
        lean.step = guarded(lean.step)

    def clone(self):
        c = Lean.__new__(Lean)
        c.__dict__.update(self.__dict__)
        self._guard(c)
        c.bufs = c.m if self.bufs else []
        return c

    def flat(self, shift=0):
        """A copy whose every list is adjacent views of one flat buffer (tests/_guards.py
        ``flat``: no gap, guards at the ends): a write past one tensor lands in its neighbour."""
        c = self.clone()
        for k in ('params', 'aux', 'm', 'v'):
            lst = getattr(self, k)
            setattr(c, k, flat(lst, shift) if lst else [])
        c.bufs = c.m if self.bufs else []
        return c

    def value(self):
        """The fp32 weight the storage represents (split: exact; kahan: p + comp)."""
        if self.storage == 'split':
            return [bf16_join(p, a) for p, a in zip(self.params, self.aux)]
        if self.storage == 'kahan':
            return [p.float() + a.float() for p, a in zip(self.params, self.aux)]
        return [p.float() for p in self.params]

    def tensors(self):
        return self.params + self.aux + self.m + self.v + [self.step]

    def adam(self, fn, grads, hp, scale=None, found_inf=None, seed=3):
        fn(self.params, self.aux, grads, self.m, self.v, self.step, **hp, storage=self.storage,
           seed=seed, grad_scale=scale, found_inf=found_inf)

    def sgd(self, fn, grads, hp, scale=None, found_inf=None, seed=3):
        fn(self.params, self.aux, grads, self.bufs, self.step, **hp, storage=self.storage,
           seed=seed, grad_scale=scale, found_inf=found_inf)


def _kernel_or_ref(use_kernel, name):
    if use_kernel:  # followed by the check of every guard canary (tests/_guards.py)
        return getattr(checked(torch.ops.mp_wrappers), name)
    return getattr(reference, name)


# ---- 'split' is the O2 step, bit for bit ----------------------------------------------------------

@pytest.mark.parametrize('use_kernel', [pytest.param(True, marks=needs_kernels), False],
                         ids=['kernel', 'reference'])
@pytest.mark.parametrize('opt,hp', [('adam', ADAM), ('adam', ADAM_L2), ('sgd', SGD),
                                    ('sgd', SGD_DAMP)], ids=['adamw', 'adam_l2', 'sgd', 'sgd_damp'])
def test_split_masters_equal_o2_bitwise(use_kernel, opt, hp):
    lean = Lean('split', SIZES)
    lean.step.zero_()
    o2_master = [guarded(m) for m in lean.master]
    o2_model = [guarded(torch.empty(n, dtype=torch.bfloat16)) for n in SIZES]
    o2_m, o2_v = [guarded(t) for t in lean.m], [guarded(t) for t in lean.v]
    o2_step = guarded(lean.step)
    scale = torch.full((1,), 1024.0)
    o2_op = _kernel_or_ref(use_kernel, f'multi_tensor_{opt}_')
    lean_op = _kernel_or_ref(use_kernel, f'multi_tensor_{opt}_lean_')
    for _ in range(4):
        grads = lean.grads()
        if opt == 'adam':
            o2_op(o2_master, grads, o2_m, o2_v, o2_model, o2_step, *hp.values(), scale, None)
            lean.adam(lean_op, grads, hp, scale)
        else:
            o2_op(o2_master, grads, o2_m, o2_model, o2_step, *hp.values(), scale, None)
            lean.sgd(lean_op, grads, hp, scale)
    for want, got, hi in zip(o2_master, lean.value(), lean.params):
        _assert_same_bits(got, want, 'split master differs from the O2 fp32 master')
        # The forward weight is the master rounded toward zero (O2's model copy: to nearest).
        _assert_same_bits(hi, bf16_split(want)[0])
    for a, b in zip(o2_m, lean.m):
        _assert_same_bits(a, b)
    assert torch.equal(o2_step, lean.step)


# ---- kernels against references -------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize('state_dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('storage', ['split', 'kahan', 'stochastic'])
@pytest.mark.parametrize('opt,hp', [('adam', ADAM), ('adam', ADAM_L2), ('sgd', SGD),
                                    ('sgd', SGD_DAMP)], ids=['adamw', 'adam_l2', 'sgd', 'sgd_damp'])
def test_kernel_matches_reference(opt, hp, storage, state_dtype):
    ker = Lean(storage, SIZES, state_dtype)
    ref = ker.clone()
    scale = torch.full((1,), 64.0)
    for _ in range(3):
        grads = ker.grads()
        getattr(ker, opt)(getattr(checked(torch.ops.mp_wrappers), f'multi_tensor_{opt}_lean_'),
                          grads, hp, scale)
        getattr(ref, opt)(getattr(reference, f'multi_tensor_{opt}_lean_'), grads, hp, scale)
    if opt == 'sgd':  # no sqrt: the same fp32 operations give the same bits
        for a, b in zip(ker.tensors(), ref.tensors()):
            _assert_same_bits(a, b, f'{storage} sgd kernel differs from the reference')
        return
    value_tol = dict(split=TOL[torch.float32], kahan=KAHAN_TOL, stochastic=TOL[torch.bfloat16])
    for a, b in zip(ker.value(), ref.value()):
        torch.testing.assert_close(a, b, **value_tol[storage])
    for a, b in zip(ker.m + ker.v, ref.m + ref.v):
        torch.testing.assert_close(a.float(), b.float(), **TOL[state_dtype])
    assert torch.equal(ker.step, ref.step)


ADAMW_NO_BC = dict(ADAM, bias_correction=False)


@needs_kernels
@pytest.mark.parametrize('state_dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('storage', ['split', 'kahan', 'stochastic'])
@pytest.mark.parametrize('opt', ['adam', 'sgd'])
@pytest.mark.parametrize('device', ['cuda'])
def test_cuda_lean_kernels_match_the_cpu_kernels(device, opt, storage, state_dtype):
    """The lean CUDA kernels (csrc/cuda/multi_tensor_lean.cu) through the public ops, on a GPU with
    a build that has them (skipped otherwise; the conftest fails a CUDA case that falls back to a
    reference): three steps on CUDA copies of the tensors against the CPU kernel, bit for bit, Adam
    without bias correction (the float64 pow of the bias corrections is the device's own) and
    with a real divide by the grad scale; then a found_inf step that changes nothing."""
    cpu = Lean(storage, SIZES, state_dtype, momentum=opt == 'sgd')
    gpu = cpu.clone()
    for k in ('params', 'aux', 'm', 'v'):
        setattr(gpu, k, [t.to(device) for t in getattr(cpu, k)])
    gpu.bufs = gpu.m if cpu.bufs else []
    gpu.step = cpu.step.to(device)
    scale = torch.full((1,), 48.0)
    hps = (ADAM_L2, ADAMW_NO_BC) if opt == 'adam' else (SGD, SGD_DAMP)
    ours = {'adam': multi_tensor_adam_lean, 'sgd': multi_tensor_sgd_lean}[opt]
    for i in range(3):
        grads, hp = cpu.grads(), hps[i % 2]
        getattr(cpu, opt)(getattr(checked(torch.ops.mp_wrappers), f'multi_tensor_{opt}_lean_'),
                          grads, hp, scale)
        getattr(gpu, opt)(ours, [g.to(device) for g in grads], hp, scale.to(device))
        for a, b in zip(gpu.tensors(), cpu.tensors()):
            _assert_same_bits(a.cpu(), b, f'{opt} {storage} step {i + 1}: CUDA differs from CPU')
    before = [t.clone() for t in gpu.tensors()]
    getattr(gpu, opt)(ours, [g.to(device) for g in cpu.grads()], hps[0], scale.to(device),
                      found_inf=torch.ones(1, device=device))
    for a, b in zip(gpu.tensors(), before):
        assert torch.equal(a, b)


@pytest.mark.parametrize('use_kernel', [pytest.param(True, marks=needs_kernels), False],
                         ids=['kernel', 'reference'])
@pytest.mark.parametrize('storage', ['split', 'kahan', 'stochastic'])
@pytest.mark.parametrize('opt', ['adam', 'sgd'])
def test_found_inf_leaves_everything_bit_identical(use_kernel, storage, opt):
    lean = Lean(storage, SIZES)
    before = [t.clone() for t in lean.tensors()]
    fn = _kernel_or_ref(use_kernel, f'multi_tensor_{opt}_lean_')
    getattr(lean, opt)(fn, lean.grads(), ADAM if opt == 'adam' else SGD,
                       found_inf=torch.ones(1))
    for a, b in zip(before, lean.tensors()):
        assert torch.equal(a, b)


def _isa_results():
    out = {}
    # 'split' needs torch.uint16 (torch >= 2.3); the other storages are compared on any torch.
    storages = ('split', 'kahan', 'stochastic') if compat.has('uint16') else ('kahan', 'stochastic')
    for storage in storages:
        for opt, hp in (('adam', ADAM), ('sgd', SGD_DAMP)):
            for sd in (torch.float32, torch.bfloat16):
                st = Lean(storage, [65537, 33], sd, seed=5)
                for _ in range(2):
                    getattr(st, opt)(getattr(torch.ops.mp_wrappers, f'multi_tensor_{opt}_lean_'),
                                     st.grads(), hp, torch.full((1,), 8.0))
                # As bit patterns: torch < 2.6 cannot torch.save a uint16 tensor (the subprocesses
                # below send theirs back that way; "dtype torch.uint16 is not recognized").
                out[f'{storage}-{opt}-{sd}'] = [_bits(t).clone() for t in st.tensors()]
    return out


_ISA_SCRIPT = r'''
import sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r}); sys.path.insert(0, {here!r})
import test_lean as T
from mp_wrappers.ops import backend
assert backend()['cpu'] == 'cpp-' + {isa!r}, backend()
torch.save(T._isa_results(), {path!r})
'''


@pytest.mark.skipif(backend()['cpu'] != 'cpp-avx512', reason='needs an AVX-512 CPU')
def test_isa_flavours_agree(tmp_path):
    results = {}
    for isa in ('avx2', 'baseline'):  # avx512 is this process's own flavour
        path = tmp_path / f'{isa}.pt'
        script = _ISA_SCRIPT.format(root=str(ROOT), tests=str(ROOT / 'tests'),
                                    here=os.path.dirname(os.path.abspath(__file__)), isa=isa,
                                    path=str(path))
        env = dict(os.environ, MP_WRAPPERS_CPU_ISA=isa, OMP_NUM_THREADS='1')
        subprocess.run([sys.executable, '-c', script], check=True, env=env, timeout=120)
        results[isa] = torch.load(path)
    results['avx512'] = _isa_results()
    for isa in ('avx2', 'baseline'):
        for case, tensors in results['avx512'].items():
            for i, (want, got) in enumerate(zip(tensors, results[isa][case])):
                assert torch.equal(_bits(got), _bits(want)), f'{isa} differs: {case} tensor {i}'


# ---- the bit helpers ------------------------------------------------------------------------------

def test_split_join_roundtrip_and_round_toward_zero():
    x = torch.cat([torch.randn(1000), torch.tensor([0.0, -0.0, float('inf'), -float('inf'),
                                                    3.4e38, 1e-40, -1e-45])])
    hi, lo = bf16_split(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.uint16
    _assert_same_bits(bf16_join(hi, lo), x)
    finite = torch.isfinite(x)
    # Round toward zero: |hi| <= |x| and hi is the nearest such bf16.
    assert (hi.float()[finite].abs() <= x[finite].abs()).all()


def test_stochastic_rounding_is_unbiased_and_reproducible():
    x = torch.full((200000,), 1.0 + 2 ** -9)  # a quarter of the way between two bf16 neighbours
    bits = stochastic_bits(11, torch.full((1,), 5.0), 0, x.numel())
    r = round_stochastic(x, bits).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs((r == 1.0 + 2 ** -7).float().mean().item() - 0.25) < 0.01
    assert abs(r.mean().item() - x[0].item()) < 1e-4
    _assert_same_bits(round_stochastic(x, stochastic_bits(11, torch.full((1,), 5.0), 0, x.numel())),
                      r.bfloat16())
    other = round_stochastic(x, stochastic_bits(11, torch.full((1,), 6.0), 0, x.numel()))
    assert not torch.equal(other.float(), r)  # a new stream at the next update
    assert round_stochastic(torch.tensor([float('nan')]), bits[:1]).isnan().all()


def test_kahan_keeps_updates_that_bf16_alone_loses():
    """1000 updates of 1e-4 on a weight of 1.0: plain bf16 never moves (ulp 2**-7), Kahan does."""
    for storage, want in (('kahan', 1.1), ('stochastic', 1.1)):
        lean = Lean(storage, [4096])
        lean.params = [torch.ones(4096, dtype=torch.bfloat16)]
        lean.aux = [torch.zeros(4096, dtype=torch.bfloat16)] if storage == 'kahan' else []
        lean.step.zero_()
        hp = dict(lr=1e-4, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                  wd_after_momentum=False)
        for _ in range(1000):  # noqa: B007
            multi_tensor_sgd_lean(lean.params, lean.aux, [-torch.ones(4096)], [], lean.step, **hp,
                                  storage=storage, seed=1)
        value = lean.value()[0]
        assert abs(value.mean().item() - want) < 5e-3, (storage, value.mean().item())


# ---- argument errors name the option and what is allowed ------------------------------------------

def _lean_args(storage='split'):
    lean = Lean(storage, [8])
    return lean, [torch.zeros(8, dtype=torch.bfloat16)]


@pytest.mark.parametrize('mutate,err,match', [
    (lambda l: setattr(l, 'storage', 'fp8'), ValueError, "storage='fp8' is not allowed"),
    (lambda l: setattr(l, 'aux', [a.view(torch.int16) for a in l.aux]), TypeError,
     'needs torch.uint16'),
    (lambda l: setattr(l, 'aux', []), ValueError, 'aux has 0 tensors'),
    (lambda l: setattr(l, 'params', [p.float() for p in l.params]), TypeError,
     'holds bfloat16 params'),
    (lambda l: setattr(l, 'v', [v.bfloat16() for v in l.v]), TypeError, 'one of float32 or bfloat16'),
])
def test_errors_name_the_argument(mutate, err, match):
    lean, grads = _lean_args()
    mutate(lean)
    with pytest.raises(err, match=match):
        lean.adam(multi_tensor_adam_lean, grads, ADAM)


def test_stochastic_refuses_aux():
    lean, grads = _lean_args('stochastic')
    lean.aux = [torch.zeros(8, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="storage='stochastic' keeps no aux state"):
        lean.sgd(multi_tensor_sgd_lean, grads, SGD)


@needs_kernels
def test_kernel_checks_direct_calls():
    lean, grads = _lean_args('kahan')
    with pytest.raises(RuntimeError, match="storage='kahan' needs BFloat16"):
        torch.ops.mp_wrappers.multi_tensor_adam_lean_(
            lean.params, [torch.zeros(8, dtype=torch.int16)], grads, lean.m, lean.v, lean.step,
            *ADAM.values(), 'kahan', 0, None, None)
    with pytest.raises(RuntimeError, match="storage='nope' is not allowed"):
        torch.ops.mp_wrappers.multi_tensor_sgd_lean_(
            lean.params, lean.aux, grads, lean.m, lean.step, *SGD.values(), 'nope', 0, None, None)


@needs_opcheck
@needs_kernels
def test_opcheck():
    lean, grads = _lean_args('split')
    opcheck(torch.ops.mp_wrappers.multi_tensor_adam_lean_,
            (lean.params, lean.aux, grads, lean.m, lean.v, lean.step,
             *ADAM.values(), 'split', 0, None, None))


@needs_kernels
@pytest.mark.parametrize('shift', [0, 1])
@pytest.mark.parametrize('storage', ['split', 'kahan', 'stochastic'])
@pytest.mark.parametrize('opt,hp', [('adam', ADAM), ('sgd', SGD)], ids=['adam', 'sgd'])
def test_flat_buffers_match_separate_tensors(opt, hp, storage, shift):
    """Every list as adjacent views of one flat buffer: the same bits as separate tensors after two
    steps (a write past one tensor would change its neighbour's input or value)."""
    sep = Lean(storage, [777, 65537, 1, 31, 555], seed=8)
    got = sep.flat(shift)
    fn = _kernel_or_ref(True, f'multi_tensor_{opt}_lean_')
    for _ in range(2):
        grads = sep.grads()
        getattr(got, opt)(fn, grads, hp, torch.full((1,), 8.0))
        getattr(sep, opt)(fn, grads, hp, torch.full((1,), 8.0))
    for a, b in zip(got.tensors(), sep.tensors()):
        _assert_same_bits(a, b, f'{storage} {opt}: flat buffers differ from separate tensors')
