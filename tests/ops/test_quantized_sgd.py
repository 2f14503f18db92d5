"""SGD with a block-wise 8-bit momentum buffer (``multi_tensor_sgd8bit_``, Note [8-bit optimizer
states]): the CPU kernel against its reference, the reference against a float64 oracle.

* Kernel vs reference bit for bit, from the first applied update (the buffer set to the direction,
  the codes not read) through later ones, for fp32 params, the O2 step (bf16/fp16 grads and a
  model copy), loss scales, bf16 params; momentum with L2 decay, Nesterov, dampening with
  ``wd_after_momentum``; every written tensor between guard canaries; blocks down each of the
  kernel's paths (whole blocks of normal codes, subnormal codes, zero and negative-zero blocks, a
  subnormal absmax whose encode factor overflows, a short tail).
* A found_inf step leaves codes, absmax, params, model copies and step bit-identical.
* AVX-512, AVX2 and baseline (the ``cpu_isa`` fixture), one thread and two, give the same bits.
* The reference against SGD computed in float64 from the same dequantized buffer.
* ``multi_tensor_sgd8bit_lean_`` (bf16 params stored 'split', 'kahan' or 'stochastic', a CPU kernel
  only) against its reference, the 8-bit direction plus the lean master update, the same way.
"""
import pytest
import torch

from _compat import needs_opcheck, opcheck
from _guards import checked, flat, guarded
from _lean_storage import LEAN_STORAGES, lean_stored
from mp_wrappers.ops import backend, multi_tensor_sgd8bit, multi_tensor_sgd8bit_lean, reference
from mp_wrappers.ops._dispatch import _op_has_kernel
from mp_wrappers.ops.reference import quant as quant_ref
from mp_wrappers.ops.reference.lean import bf16_join
from mp_wrappers.ops.reference.quant import (BLOCK_SIZE, EXP_AVG_CODE, dequantize_blockwise,
                                             num_blocks, quantize_blockwise)

HAS_KERNEL = backend()['extension'] and _op_has_kernel('multi_tensor_sgd8bit_', 'cpu')
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason='8-bit SGD kernel not built')

SIZES = [777, 65537 + 33, 4096]
MOMENTUM = dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=1e-3, nesterov=False,
                wd_after_momentum=False)
NESTEROV = dict(MOMENTUM, lr=0.02, momentum=0.95, nesterov=True)
DAMPENED = dict(lr=0.1, momentum=0.8, dampening=0.25, weight_decay=5e-2, nesterov=False,
                wd_after_momentum=True)
HYPERS = {'momentum': MOMENTUM, 'nesterov': NESTEROV, 'dampened-wd-after': DAMPENED}
# (param dtype, grad dtype, model dtype or None, grad_scale)
SETUPS = {
    'fp32': (torch.float32, torch.float32, None, None),
    'o2-bf16': (torch.float32, torch.bfloat16, torch.bfloat16, 1.0),
    'o2-fp16-scaled': (torch.float32, torch.float16, torch.float16, 1024.0),
    'fp32-odd-scale': (torch.float32, torch.float32, None, 3.0),
    'bf16-params': (torch.bfloat16, torch.bfloat16, None, None),
    'fp16-params': (torch.float16, torch.float16, None, 512.0),
}


class Case:
    """One call's tensors: params, grads, the buffer's codes and absmax, the step counter (0: the
    first applied update comes next)."""

    def __init__(self, setup, sizes=SIZES, seed=0):
        pdt, self.gdt, mdt, scale = SETUPS[setup]
        g = torch.Generator().manual_seed(seed)
        self.gen, self.sizes = g, sizes
        self.scale = None if scale is None else torch.full((1,), scale)
        self.params = [guarded(torch.randn(n, generator=g).to(pdt)) for n in sizes]
        self.model = [guarded(p.to(mdt)) for p in self.params] if mdt else []
        self.codes = [guarded(torch.zeros(n, dtype=torch.uint8)) for n in sizes]
        self.absmax = [guarded(torch.zeros(num_blocks(n))) for n in sizes]
        self.step = guarded(torch.zeros(1))

    def grads(self):
        s = 1.0 if self.scale is None else float(self.scale)
        return [(torch.randn(n, generator=self.gen) * s).to(self.gdt) for n in self.sizes]

    def tensors(self):
        return self.params + self.model + self.codes + self.absmax + [self.step]

    def clone(self, as_flat=False, shift=0):
        c = type(self).__new__(type(self))
        c.__dict__.update(self.__dict__)
        for k in ('params', 'model', 'codes', 'absmax'):
            lst = getattr(self, k)
            setattr(c, k, (flat(lst, shift) if as_flat else [guarded(t) for t in lst])
                    if lst else [])
        c.step = guarded(self.step)
        return c

    def run(self, fn, grads, hp, found_inf=None, **extra):
        fn(self.params, grads, self.codes, self.absmax, self.model, self.step, **hp,
           grad_scale=self.scale, found_inf=found_inf, **extra)


class EdgeCase(Case):
    """One tensor, started past its first update, whose blocks take every path of the kernel: 0,
    a heavy-tailed buffer (subnormal codes); 1, normal codes only (the whole-block decode); 2, a zero
    buffer and grads (absmax 0); 3, negative-zero codes and grads; 4, a buffer and grads of
    subnormal size (the encode factor MAX / absmax overflows: the clamp, NaN for 0 * inf); 5, a
    short tail."""

    def __init__(self, setup, seed=3):
        B = BLOCK_SIZE
        n = 4 * B + 33
        super().__init__(setup, sizes=[n], seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        b = torch.randn(n, generator=g) * 0.1 * torch.exp(torch.randn(n, generator=g))
        sign = torch.where(torch.rand(B, generator=g) < 0.5, -1.0, 1.0)
        b[B:2 * B] = sign * (0.5 + torch.rand(B, generator=g))
        b[2 * B:3 * B] = 0.0
        b[3 * B:4 * B] = torch.randn(B, generator=g) * 1e-39
        codes, absmax = quantize_blockwise(b, EXP_AVG_CODE)
        codes[2 * B + 128:3 * B] = 0x80  # -0: what a negative value that rounds to 0 encodes to
        codes[3 * B:3 * B + 16] = 0  # zeros beside a subnormal absmax: 0 * inf in the encode
        self.codes, self.absmax = [guarded(codes)], [guarded(absmax)]
        self.step = guarded(torch.full((1,), 3.0))

    def grads(self):
        B = BLOCK_SIZE
        (g,) = super().grads()
        g[2 * B:3 * B] = 0.0
        g[2 * B + 128:3 * B] = -0.0
        g[3 * B:4 * B] = 0.0
        return [g]


def _kernel():
    return checked(torch.ops.mp_wrappers).multi_tensor_sgd8bit_


def _assert_equal(got, want, what=''):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), \
            f'{what} tensor {i}'


def _steps_agree(k, hp, steps, what, kernel=None, ref=reference.multi_tensor_sgd8bit_):
    """``steps`` updates of ``k`` by the kernel (default the fp32-master op's) and of its clone by
    the reference ``ref``, compared bit for bit after each."""
    kernel = kernel or _kernel()
    r = k.clone()
    for step in range(steps):
        grads = k.grads()
        k.run(kernel, grads, hp)
        r.run(ref, grads, hp)
        _assert_equal(k.tensors(), r.tensors(), f'{what} step {step}')


@needs_kernel
@pytest.mark.parametrize('hp', list(HYPERS))
@pytest.mark.parametrize('setup', list(SETUPS))
def test_kernel_matches_reference_bitwise(setup, hp, cpu_isa):
    k = Case(setup)
    _steps_agree(k, HYPERS[hp], 3, f'{cpu_isa} {setup}')
    assert k.step.item() == 3.0
    assert all(a.abs().max() > 0 for a in k.absmax)  # the buffer holds something after step 1


@needs_kernel
@pytest.mark.parametrize('hp', ['momentum', 'dampened-wd-after'])
@pytest.mark.parametrize('setup', ['fp32', 'o2-fp16-scaled', 'bf16-params'])
def test_kernel_matches_reference_on_edge_blocks(setup, hp, cpu_isa):
    _steps_agree(EdgeCase(setup), HYPERS[hp], 3, f'{cpu_isa} {setup}')


@pytest.mark.parametrize('use_kernel', [pytest.param(True, marks=needs_kernel), False],
                         ids=['kernel', 'reference'])
def test_first_update_sets_the_buffer_to_the_direction(use_kernel):
    """Whatever the codes hold at step 0, the first applied update is ``b = g`` (torch's SGD; no
    decay here), and the param moves by ``lr * b``."""
    k = Case('fp32', sizes=[2 * BLOCK_SIZE + 7])
    k.codes[0].fill_(0x3A)  # junk the first update must not read (normal codes: the fast path)
    k.absmax[0].fill_(3.0)
    p0, (g,) = k.params[0].clone(), k.grads()
    hp = dict(MOMENTUM, weight_decay=0.0)
    k.run(_kernel() if use_kernel else reference.multi_tensor_sgd8bit_, [g], hp)
    want_codes, want_absmax = quantize_blockwise(g, EXP_AVG_CODE, signed_zeros=True)
    assert torch.equal(k.codes[0], want_codes) and torch.equal(k.absmax[0], want_absmax)
    # p0 - fl(lr) * g rounded once (the FMA): within half a float32 ulp of the exact value
    exact = p0.double() - torch.tensor(0.05).double() * g.double()
    torch.testing.assert_close(k.params[0].double(), exact, rtol=2 ** -24, atol=0)


@pytest.mark.parametrize('hp', list(HYPERS))
def test_reference_matches_a_float64_oracle(hp):
    """One later update: the new buffer and param against SGD in float64 from the dequantized
    buffer (the fused multiply-adds round once where the oracle does not round at all: within a
    few float32 ulps), the codes within one code step of quantizing the oracle's buffer."""
    h = HYPERS[hp]
    k = Case('fp32', sizes=[3 * BLOCK_SIZE + 11], seed=4)
    k.run(reference.multi_tensor_sgd8bit_, k.grads(), h)  # a buffer to start from
    p, (g,) = k.params[0].double(), k.grads()
    b = dequantize_blockwise(k.codes[0], k.absmax[0], EXP_AVG_CODE).double()
    d = g.double()
    wd, mom = h['weight_decay'], h['momentum']
    if not h['wd_after_momentum']:
        d = d + wd * p
    b_new = mom * b + (1 - h['dampening']) * d
    d = d + mom * b_new if h['nesterov'] else b_new
    if h['wd_after_momentum']:
        d = d + wd * p
    p_new = p - h['lr'] * d
    k.run(reference.multi_tensor_sgd8bit_, [g], h)
    torch.testing.assert_close(k.params[0].double(), p_new, rtol=4e-7, atol=1e-7)
    got_b = dequantize_blockwise(k.codes[0], k.absmax[0], EXP_AVG_CODE).double()
    want_codes, want_absmax = quantize_blockwise(b_new.float(), EXP_AVG_CODE)
    torch.testing.assert_close(k.absmax[0], want_absmax, rtol=1e-6, atol=0)
    step = (want_absmax.double() / 8).repeat_interleave(BLOCK_SIZE)[:b_new.numel()]
    assert torch.all((got_b - b_new).abs() <= step + 1e-30)


@pytest.mark.parametrize('use_kernel', [pytest.param(True, marks=needs_kernel), False],
                         ids=['kernel', 'reference'])
def test_found_inf_leaves_everything_bit_identical(use_kernel):
    c = EdgeCase('o2-fp16-scaled')
    before = [t.clone() for t in c.tensors()]
    fn = _kernel() if use_kernel else reference.multi_tensor_sgd8bit_
    c.run(fn, c.grads(), MOMENTUM, found_inf=torch.ones(1))
    _assert_equal(c.tensors(), before)


def _on(device, case):
    """A copy of ``case`` with its tensors on ``device``."""
    twin = Case.__new__(Case)
    twin.__dict__.update(case.__dict__)
    for k in ('params', 'model', 'codes', 'absmax'):
        setattr(twin, k, [t.to(device) for t in getattr(case, k)])
    twin.step = case.step.to(device)
    twin.scale = None if case.scale is None else case.scale.to(device)
    return twin


def _step_both(device, case, twin, hp, what, lr_tensor=False):
    grads = case.grads()
    extra = dict(lr=torch.full((1,), hp['lr'], device=device)) if lr_tensor else {}
    case.run(_kernel(), grads, hp)
    twin.run(multi_tensor_sgd8bit, [g.to(device) for g in grads], dict(hp, **extra))
    _assert_equal([t.cpu() for t in twin.tensors()], case.tensors(), what)


@needs_kernel
@pytest.mark.parametrize('setup', ['fp32', 'o2-bf16', 'o2-fp16-scaled', 'fp32-odd-scale',
                                   'fp16-params'])
@pytest.mark.parametrize('device', ['cuda'])
def test_cuda_kernel_matches_the_cpu_kernel(device, setup):
    """The CUDA kernel (csrc/cuda/multi_tensor_sgd8bit.cu) through the public op, on a GPU with a
    build that has CUDA kernels (skipped otherwise; the conftest fails the case if the reference
    runs instead), bit for bit against the CPU kernel:

    * from the first applied update over junk codes and absmaxes (a kernel that missed step == 0
      on the device would decode them) through each hyper-parameter set, the last step with a
      tensor lr; then a found_inf step changes nothing;
    * edge blocks, a fresh EdgeCase per hyper-parameter set (the one with the decay after the
      momentum meets the zero and negative-zero blocks as they are, the others decay them into
      normal blocks); their subnormal-absmax block gets normal grads: there a zero buffer
      value times the infinite encode factor is NaN, whose code follows the platform's default
      NaN (docs/quantized_states.md), not a bit pattern both devices share.
    """
    case = Case(setup)
    for c, a in zip(case.codes, case.absmax):
        c.fill_(0x7F)
        a.fill_(1e3)
    twin = _on(device, case)
    for i, (name, hp) in enumerate(HYPERS.items()):
        _step_both(device, case, twin, hp, f'{setup} {name}', lr_tensor=i == len(HYPERS) - 1)
    twin.run(multi_tensor_sgd8bit, [g.to(device) for g in case.grads()], MOMENTUM,
             found_inf=torch.ones(1, device=device))
    _assert_equal([t.cpu() for t in twin.tensors()], case.tensors(), f'{setup} skipped')
    for name, hp in HYPERS.items():
        edge = EdgeCase(setup)
        grads = edge.grads

        def normal_subnormal_block(grads=grads):
            (g,) = grads()
            g[3 * BLOCK_SIZE:4 * BLOCK_SIZE] = 1.0
            return [g]
        edge.grads = normal_subnormal_block
        _step_both(device, edge, _on(device, edge), hp, f'edge {setup} {name}')


@needs_kernel
@pytest.mark.parametrize('shift', [0, 1])
def test_flat_buffers_match_separate_tensors(shift):
    a = Case('o2-bf16')
    b = a.clone(as_flat=True, shift=shift)
    for _ in range(2):
        grads = a.grads()
        a.run(_kernel(), grads, NESTEROV)
        b.run(_kernel(), grads, NESTEROV)
    _assert_equal(a.tensors(), b.tensors())


@needs_kernel
def test_thread_counts_agree(cpu_isa):
    before = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            c = Case('o2-bf16', sizes=[65537 * 2 + 33, 4096 + 7], seed=5)
            for _ in range(2):
                c.run(_kernel(), c.grads(), DAMPENED)
            out.append(c.tensors())
    finally:
        torch.set_num_threads(before)
    _assert_equal(out[1], out[0], cpu_isa)


@pytest.mark.parametrize('impl', [pytest.param('kernel', marks=needs_kernel), 'public op'])
def test_a_tensor_lr_is_read_when_the_step_runs(impl):
    want = Case('o2-bf16')
    got = want.clone()
    lr = torch.zeros(1)
    for value in (0.05, 0.01, 0.0, 0.2):
        grads = want.grads()
        want.run(reference.multi_tensor_sgd8bit_, grads, dict(MOMENTUM, lr=value))
        lr.fill_(value)
        if impl == 'public op':
            got.run(multi_tensor_sgd8bit, grads, dict(MOMENTUM, lr=lr))
        else:  # the float says nothing: a kernel reading it instead would not step
            got.run(_kernel(), grads, dict(MOMENTUM, lr=0.0), lr_tensor=lr)
        _assert_equal(got.tensors(), want.tensors(), f'{impl}, lr {value}')


# ---- argument checks -------------------------------------------------------------------------------

def _args(**change):
    c = Case('fp32', sizes=[300])
    kw = dict(params=c.params, grads=c.grads(), momentum_buffers=c.codes,
              momentum_buffer_absmaxes=c.absmax, model_params=[], step=c.step, **MOMENTUM)
    kw.update(change)
    return kw


@pytest.mark.parametrize('change,match', [
    (dict(momentum=0.0), r'momentum=0 keeps no momentum buffer to quantize'),
    (dict(momentum=-0.5), r'Invalid momentum value: -0.5; expected momentum >= 0'),
    (dict(nesterov=True, dampening=0.1), r'nesterov=True requires momentum > 0 and dampening'),
    (dict(momentum_buffers=[torch.zeros(300)]),
     r'momentum_buffers\[0\] must be a contiguous torch.uint8 tensor'),
    (dict(momentum_buffer_absmaxes=[torch.zeros(1)]),
     r'momentum_buffer_absmaxes\[0\] must be a contiguous torch.float32 tensor .* with 2 '
     r'elements'),
    (dict(momentum_buffers=[]), r'momentum_buffers has 0 tensors but params has 1'),
    (dict(lr=-1.0), r'Invalid learning rate: -1.0; expected a number lr >= 0'),
])
def test_public_op_refuses_bad_arguments(change, match):
    with pytest.raises(ValueError, match=match):
        multi_tensor_sgd8bit(**_args(**change))


@needs_kernel
def test_kernel_refuses_bad_arguments():
    kw = _args(momentum=0.0)
    with pytest.raises(RuntimeError, match='momentum=0 keeps no momentum buffer'):
        torch.ops.mp_wrappers.multi_tensor_sgd8bit_(*kw.values(), None, None)
    kw = _args(momentum_buffer_absmaxes=[torch.zeros(3)])
    with pytest.raises(RuntimeError, match=r'momentum_buffer_absmaxes\[0\] must be a contiguous '
                                           r'float32 tensor on cpu with 2 elements'):
        torch.ops.mp_wrappers.multi_tensor_sgd8bit_(*kw.values(), None, None)


# ---- lean bf16 params: multi_tensor_sgd8bit_lean_ --------------------------------------------------
# The 8-bit buffer of multi_tensor_sgd8bit_ with the master step of the lean storages (Note [lean
# bf16 storage]): bf16 params with uint16 low halves ('split'), a bf16 compensation ('kahan') or
# stochastic rounding; the kernel against the reference (the 8-bit direction plus the lean master
# update), bit for bit, in every flavour and thread count; the CUDA kernel against the CPU one.

class LeanCase(Case):
    """A Case (or EdgeCase) whose params are bf16 stored the ``storage`` way (no model copies)."""

    def __init__(self, storage, sizes=SIZES, seed=0, grad_dtype=torch.bfloat16, scale=None,
                 edge=False):
        base = EdgeCase('fp32', seed=seed) if edge else Case('fp32', sizes=sizes, seed=seed)
        base.gdt, base.scale = grad_dtype, None if scale is None else torch.full((1,), scale)
        self.__dict__.update(base.__dict__)
        self._base, self.storage = base, storage  # grads from base (the same generator)
        self.params, self.aux = lean_stored([p.clone() for p in self.params], storage)

    def grads(self):
        return self._base.grads()

    def tensors(self):
        return self.params + self.aux + self.codes + self.absmax + [self.step]

    def clone(self, as_flat=False, shift=0):
        c = Case.clone(self, as_flat, shift)
        c.aux = (flat(self.aux, shift) if as_flat else [guarded(t) for t in self.aux]) \
            if self.aux else []
        return c

    def run(self, fn, grads, hp, found_inf=None):
        fn(self.params, self.aux, grads, self.codes, self.absmax, self.step, **hp,
           storage=self.storage, seed=11, grad_scale=self.scale, found_inf=found_inf)


def _lean_kernel():
    return checked(torch.ops.mp_wrappers).multi_tensor_sgd8bit_lean_


LEAN_SETUPS = {'bf16-grads': (torch.bfloat16, None), 'fp32-grads-scaled': (torch.float32, 1024.0),
               'bf16-grads-odd-scale': (torch.bfloat16, 3.0)}


@needs_kernel
@pytest.mark.parametrize('edge', [False, True], ids=['random', 'edge-blocks'])
@pytest.mark.parametrize('hp', list(HYPERS))
@pytest.mark.parametrize('setup', list(LEAN_SETUPS))
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_lean_kernel_matches_reference_bitwise(storage, setup, hp, edge, cpu_isa):
    """From the first applied update (random cases start at step 0) or a later one (edge blocks),
    three steps, bit for bit, in the cpu_isa fixture's flavour."""
    gdt, scale = LEAN_SETUPS[setup]
    k = LeanCase(storage, grad_dtype=gdt, scale=scale, edge=edge)
    start = k.step.item()
    _steps_agree(k, HYPERS[hp], 3, f'{storage} {setup} {hp} {cpu_isa}', _lean_kernel(),
                 reference.multi_tensor_sgd8bit_lean_)
    assert k.step.item() == start + 3


@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_lean_reference_is_the_8bit_buffer_plus_the_lean_master_update(storage):
    """The reference composes the two references: its codes are multi_tensor_sgd8bit_'s on the
    fp32 value the storage holds, and 'split' writes that value plus the lean step
    ``-(lr * d)`` exactly, ``d`` the 8-bit SGD direction (the fp32-master op writes
    ``fma(-lr, d, p)``)."""
    c = LeanCase(storage, sizes=[4096 + 7])
    c.step.fill_(2.0)  # a later update: the codes are read
    for codes in c.codes:
        codes.copy_(torch.randint(0, 256, codes.shape, generator=c.gen, dtype=torch.uint8))
    for absmax in c.absmax:
        absmax.fill_(0.5)
    master = [bf16_join(p, a) if storage == 'split' else p.float()
              for p, a in zip(c.params, c.aux or [None] * len(c.params))]
    plain = Case.clone(c)
    plain.__class__ = Case
    plain.params, plain.model = [guarded(m) for m in master], []
    before = Case.clone(plain)
    grads = c.grads()
    c.run(reference.multi_tensor_sgd8bit_lean_, grads, NESTEROV)
    plain.run(reference.multi_tensor_sgd8bit_, grads, NESTEROV)
    _assert_equal(c.codes + c.absmax + [c.step], plain.codes + plain.absmax + [plain.step])
    if storage == 'split':
        (m,), (g,) = master, grads
        d = quant_ref._sgd8bit_direction(g, m, before.codes[0].clone(), before.absmax[0].clone(),
                                         before.step, NESTEROV['momentum'], 0.0,
                                         NESTEROV['weight_decay'], True, False, None, None)
        _assert_equal([bf16_join(p, a) for p, a in zip(c.params, c.aux)],
                      [m + (-(NESTEROV['lr'] * d))])


@pytest.mark.parametrize('use_kernel', [pytest.param(True, marks=needs_kernel), False],
                         ids=['kernel', 'reference'])
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_lean_found_inf_leaves_everything_bit_identical(storage, use_kernel):
    c = LeanCase(storage, scale=1024.0, edge=True)
    before = [t.clone() for t in c.tensors()]
    fn = _lean_kernel() if use_kernel else reference.multi_tensor_sgd8bit_lean_
    c.run(fn, c.grads(), MOMENTUM, found_inf=torch.ones(1))
    _assert_equal(c.tensors(), before)


@needs_kernel
@pytest.mark.parametrize('storage', LEAN_STORAGES)
@pytest.mark.parametrize('device', ['cuda'])
def test_lean_cuda_kernel_matches_the_cpu_kernel(device, storage):
    """The lean CUDA kernel (csrc/cuda/multi_tensor_sgd8bit.cu) through the public op, on a GPU with
    a build that has CUDA kernels (skipped otherwise), bit for bit against the CPU kernel: from the
    first applied update over junk codes and absmaxes through each hyper-parameter set, bf16
    grads with a grad_scale; then a found_inf step changes nothing."""
    case = LeanCase(storage, scale=3.0)
    for c, a in zip(case.codes, case.absmax):
        c.fill_(0x7F)
        a.fill_(1e3)
    twin = case.clone()
    for k in ('params', 'aux', 'codes', 'absmax'):
        setattr(twin, k, [t.to(device) for t in getattr(case, k)])
    twin.step, twin.scale = case.step.to(device), case.scale.to(device)
    for name, hp in list(HYPERS.items()) + [('skipped', MOMENTUM)]:
        grads = case.grads()
        found_inf = torch.ones(1) if name == 'skipped' else None
        case.run(_lean_kernel(), grads, hp, found_inf)
        twin.run(multi_tensor_sgd8bit_lean, [g.to(device) for g in grads], hp,
                 None if found_inf is None else found_inf.to(device))
        _assert_equal([t.cpu() for t in twin.tensors()], case.tensors(), f'{storage} {name}')


@needs_kernel
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_lean_flat_buffers_and_thread_counts_agree(storage):
    """Flat buffers (the tensors adjacent views of one allocation) and one or two threads give the
    separate tensors' bits."""
    before = torch.get_num_threads()
    out = []
    try:
        for threads, as_flat in ((1, False), (2, False), (2, True)):
            torch.set_num_threads(threads)
            c = LeanCase(storage, sizes=[65537 * 2 + 33, 4096 + 7], seed=5, scale=3.0)
            c = c.clone(as_flat=as_flat, shift=1) if as_flat else c
            for _ in range(2):
                c.run(_lean_kernel(), c.grads(), DAMPENED)
            out.append([t.clone() for t in c.tensors()])
    finally:
        torch.set_num_threads(before)
    _assert_equal(out[1], out[0], f'{storage} two threads')
    _assert_equal(out[2], out[0], f'{storage} flat buffers')


def _lean_args(storage='kahan', **change):
    c = LeanCase(storage, sizes=[300])
    kw = dict(params=c.params, aux=c.aux, grads=c.grads(), momentum_buffers=c.codes,
              momentum_buffer_absmaxes=c.absmax, step=c.step, **MOMENTUM, storage=storage)
    kw.update(change)
    return kw


@pytest.mark.parametrize('change,err,match', [
    (dict(storage='fp8'), ValueError, r"storage='fp8' is not allowed; expected one of"),
    (dict(aux=[]), ValueError, r"aux has 0 tensors but params has 1; storage='kahan' needs"),
    (dict(momentum=0.0), ValueError, r'momentum=0 keeps no momentum buffer to quantize; use '
                                     'multi_tensor_sgd_lean'),
    (dict(momentum_buffers=[torch.zeros(300)]), ValueError,
     r'momentum_buffers\[0\] must be a contiguous torch.uint8 tensor'),
    (dict(momentum_buffer_absmaxes=[torch.zeros(1)]), ValueError,
     r'momentum_buffer_absmaxes\[0\].*2 elements'),
    (dict(lr=-1.0), ValueError, r'Invalid learning rate: -1.0'),
    (dict(seed=1.5), TypeError, 'seed must be an int'),
])
def test_lean_errors_name_the_argument(change, err, match):
    with pytest.raises(err, match=match):
        multi_tensor_sgd8bit_lean(**_lean_args(**change))


def test_lean_params_must_be_bf16_and_on_a_device_with_the_kernel():
    kw = _lean_args()
    kw['params'] = [p.float() for p in kw['params']]
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.float32; storage='kahan' "
                                        'holds bfloat16 params'):
        multi_tensor_sgd8bit_lean(**kw)
    meta = {k: ([t.to('meta') for t in v] if isinstance(v, list) else
                v.to('meta') if isinstance(v, torch.Tensor) else v)
            for k, v in _lean_args().items()}
    with pytest.raises(NotImplementedError, match=r"bf16_storage='kahan'.*run on CPU tensors, "
                                                  r"and on CUDA .*; got tensors on meta and there "
                                                  r"is no meta kernel"):
        multi_tensor_sgd8bit_lean(**meta)


@pytest.mark.parametrize('cuda_build', [True, False], ids=['cuda-build', 'cpu-only-build'])
def test_lean_cuda_params_run_where_the_build_has_cuda_kernels(monkeypatch, cuda_build):
    """A build with CUDA kernels steps the lean op's CUDA params (csrc/cuda/
    multi_tensor_sgd8bit.cu); a CPU-only build refuses them saying how to get the kernel, and
    offers no fp32 masters (the fp32-master op does not run on CUDA there either)."""
    from mp_wrappers.ops import quantized_states
    monkeypatch.setattr(quantized_states, '_op_has_kernel',
                        lambda name, device_type: device_type == 'cpu' or cuda_build)
    assert quantized_states.has_quantized_kernel('cuda', lean=True,
                                                 op='multi_tensor_sgd8bit_') == cuda_build
    assert quantized_states.has_quantized_kernel('cpu', lean=True, op='multi_tensor_sgd8bit_')

    def check():
        quantized_states.check_quantized_device('FusedSGD', torch.device('cuda:0'), 'kahan',
                                                op='multi_tensor_sgd8bit_')
    if cuda_build:
        check()
        return
    with pytest.raises(NotImplementedError,
                       match=r"FusedSGD: 8-bit optimizer states \(state_dtype='int8'\) with "
                             r"bf16_storage='kahan' .* run on CPU tensors, and on CUDA tensors "
                             r"with a build that has CUDA kernels; got tensors on cuda:0 and this "
                             r"mp_wrappers build has no CUDA kernels \(rebuild it with "
                             r"MP_WRAPPERS_CUDA=1 .*\)\. Allowed on cuda: state_dtype='float32' "
                             r"or 'bfloat16' with bf16_storage='kahan'$"):
        check()


def test_an_op_without_a_cuda_kernel_is_named_in_the_refusal(monkeypatch):
    """An 8-bit op that a build with CUDA kernels lacks (one added with its CPU kernel first: not in
    ``_CUDA_OPS``) is refused on CUDA naming that op, not the build, and fp32 masters are offered:
    the fp32-master op runs there."""
    from mp_wrappers.ops import quantized_states
    monkeypatch.setattr(quantized_states, '_CUDA_OPS',
                        quantized_states._CUDA_OPS - {'multi_tensor_sgd8bit_lean_'})
    monkeypatch.setattr(quantized_states, '_op_has_kernel', lambda name, device_type: (
        device_type == 'cpu' or name in quantized_states._CUDA_OPS))
    with pytest.raises(NotImplementedError,
                       match=r"with bf16_storage='kahan' .* run on CPU tensors only; got tensors "
                             r"on cuda:0 and multi_tensor_sgd8bit_lean_ has no CUDA kernel yet\. "
                             r"Allowed on cuda: state_dtype='int8' with fp32 masters .*, or "
                             r"state_dtype='float32' or 'bfloat16' with bf16_storage='kahan'$"):
        quantized_states.check_quantized_device('FusedSGD', torch.device('cuda:0'), 'kahan',
                                                op='multi_tensor_sgd8bit_')


@needs_kernel
def test_lean_kernel_checks_direct_calls():
    kw = _lean_args(seed=0, grad_scale=None, found_inf=None)
    kw['momentum_buffer_absmaxes'] = [torch.zeros(5)]
    with pytest.raises(RuntimeError, match=r'multi_tensor_sgd8bit_lean_: '
                                           r'momentum_buffer_absmaxes\[0\] must be a contiguous '
                                           'float32 tensor'):
        torch.ops.mp_wrappers.multi_tensor_sgd8bit_lean_(**kw)
    kw = _lean_args(seed=0, grad_scale=None, found_inf=None, momentum=0.0)
    with pytest.raises(RuntimeError, match='momentum=0 keeps no momentum buffer'):
        torch.ops.mp_wrappers.multi_tensor_sgd8bit_lean_(**kw)


@needs_opcheck
@needs_kernel
def test_lean_opcheck():
    """The schema's mutation marks, the fake kernel and the dispatcher registration."""
    kw = _lean_args(seed=0, grad_scale=None, found_inf=None)
    opcheck(torch.ops.mp_wrappers.multi_tensor_sgd8bit_lean_, tuple(kw.values()))


def test_the_ops_named_to_have_cuda_kernels_are_those_csrc_cuda_registers():
    """``_CUDA_OPS`` (which 8-bit ops a refusal says run on CUDA) is the set of 8-bit ops that the
    CUDA sources register kernels for: a new CUDA kernel, or a removed one, must update it."""
    import pathlib
    import re

    from mp_wrappers.ops import quantized_states
    cuda = pathlib.Path(quantized_states.__file__).resolve().parents[1] / 'csrc' / 'cuda'
    registered = {name for source in cuda.glob('*.cu')
                  for name in re.findall(r'm\.impl\(\s*"(\w+)"', source.read_text())}
    assert 'multi_tensor_adam_' in registered  # the pattern finds the registrations
    eight_bit = set(quantized_states._LEAN_OPS) | set(quantized_states._LEAN_OPS.values())
    assert quantized_states._CUDA_OPS == registered & eight_bit
