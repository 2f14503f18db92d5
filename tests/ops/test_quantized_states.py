"""Block-wise 8-bit optimizer states (Note [8-bit optimizer states]): the codes, and the CPU kernel
of ``multi_tensor_adam8bit_`` against its reference.

* The codes: 256 sorted values, quantization picks the nearest (ties away from zero), code
  values round-trip exactly, all-zero blocks stay zero.
* Kernel vs reference bit for bit (the reference computes square roots correctly rounded, as the
  kernels do), for fp32 params, the O2 step (bf16/fp16 grads and model copy), power-of-two and
  other loss scales, AdamW and L2; every written tensor between guard canaries; adjacent views of one
  flat buffer like separate tensors; blocks down each of the kernels' paths (codes without
  subnormals, zero and negative-zero blocks, a subnormal absmax whose encode factor overflows).
* A found_inf step leaves codes, absmax, params, model copies and step bit-identical.
* AVX-512, AVX2 and baseline, one thread and two, give the same bits.
* The same for ``multi_tensor_adam8bit_lean_`` (bf16 params stored 'split', 'kahan' or
  'stochastic'), whose reference is the 8-bit moments plus the lean master update.
"""
import copy
from fractions import Fraction

import numpy as np
import pytest
import torch

from _guards import checked, flat, guarded
from _lean_storage import LEAN_STORAGES, lean_stored
from _quant_ties import MAX as TIE_MAX
from _quant_ties import tie_moments
from mp_wrappers.ops import backend, multi_tensor_adam8bit, multi_tensor_adam8bit_lean, reference
from mp_wrappers.ops._dispatch import _op_has_kernel
from mp_wrappers.ops.reference import quant as quant_ref
from mp_wrappers.ops.reference.lean import bf16_join
from mp_wrappers.ops.reference.quant import (BLOCK_SIZE, EXP_AVG_CODE, EXP_AVG_SQ_CODE,
                                             code_table, dequantize_blockwise,
                                             dequantize_invertibly, num_blocks, quantize_blockwise)

HAS_KERNEL = backend()['extension'] and _op_has_kernel('multi_tensor_adam8bit_', 'cpu')
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason='8-bit kernel not built')

SIZES = [777, 65537 + 33, 4096]
ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, adam_w_mode=True,
            bias_correction=True)
ADAM_L2 = dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, adam_w_mode=False,
               bias_correction=False)
# (param dtype, grad dtype, model dtype or None, grad_scale)
SETUPS = {
    'fp32': (torch.float32, torch.float32, None, None),
    'o2-bf16': (torch.float32, torch.bfloat16, torch.bfloat16, 1.0),
    'o2-fp16-scaled': (torch.float32, torch.float16, torch.float16, 1024.0),
    'fp32-odd-scale': (torch.float32, torch.float32, None, 3.0),
    'bf16-params': (torch.bfloat16, torch.bfloat16, None, None),
}


# ---- the codes -------------------------------------------------------------------------------------

@pytest.mark.parametrize('code', [EXP_AVG_CODE, EXP_AVG_SQ_CODE], ids=['exp_avg', 'exp_avg_sq'])
def test_code_table_is_sorted_and_roundtrips(code):
    table = code_table(code)
    assert table.abs().max().item() == code.max_value
    mags = table[:128] if code.signed else table
    assert torch.all(mags[1:] > mags[:-1]) and mags[0].item() == 0.0
    if code.signed:
        assert torch.equal(table[128:], -table[:128])
    x = table[torch.randperm(256)].repeat(3)  # every block holds the max code: absmax = MAX
    codes, absmax = quantize_blockwise(x, code)
    assert torch.equal(dequantize_blockwise(codes, absmax, code), x)


@pytest.mark.parametrize('code', [EXP_AVG_CODE, EXP_AVG_SQ_CODE], ids=['exp_avg', 'exp_avg_sq'])
def test_quantization_picks_the_nearest_code(code):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10 * BLOCK_SIZE, generator=g) * torch.exp(3 * torch.randn(10 * BLOCK_SIZE,
                                                                              generator=g))
    x = x if code.signed else x.abs()
    codes, absmax = quantize_blockwise(x, code)
    assert codes.dtype == torch.uint8 and absmax.shape == (10,)
    got = dequantize_blockwise(codes, absmax, code)
    # Against an exhaustive search over the block's 256 candidate values.
    scale = (absmax / code.max_value).repeat_interleave(BLOCK_SIZE)
    cands = code_table(code)[None, :] * scale[:, None]
    best = (cands - x[:, None]).abs().min(dim=1).values
    assert torch.all((got - x).abs() <= best * (1 + 1e-6) + 1e-30)


@pytest.mark.parametrize('code', [EXP_AVG_CODE, EXP_AVG_SQ_CODE], ids=['exp_avg', 'exp_avg_sq'])
def test_quantization_rounds_ties_away_from_zero(code):
    """Note [ties away from zero]: every midpoint of two neighbouring codes (exact in float32: five
    significant bits), subnormal and normal, gets the code of larger magnitude; the float32 values
    just inside it get the nearer code. With a block absmax of MAX the encode factor is 1."""
    table = code_table(code)
    mags = table[:128] if code.signed else table
    mids = (mags[:-1] + mags[1:]) / 2
    below = torch.nextafter(mids, torch.zeros(()))
    above = torch.nextafter(mids, torch.full((), 4.0))
    # y = a * 2**(bias + 2) just below 0.5 in the subnormal range: floor(y + 0.5) would give 1.
    tricky = torch.tensor([(0.5 - 2.0 ** -25) * 2.0 ** -(code.bias + 2)])
    x = torch.cat([mids, below, above, tricky])
    want = torch.cat([mags[1:], mags[:-1], mags[1:], torch.zeros(1)])
    if code.signed:
        x, want = torch.cat([x, -x]), torch.cat([want, -want])
    pad = (-len(x)) % (BLOCK_SIZE - 1)
    x, want = torch.cat([x, torch.zeros(pad)]), torch.cat([want, torch.zeros(pad)])
    # One MAX per block (absmax = MAX: factors 1), the values between them.
    blocks = x.view(-1, BLOCK_SIZE - 1)
    maxes = torch.full((blocks.shape[0], 1), code.max_value)
    x_all = torch.cat([maxes, blocks], dim=1).reshape(-1)
    want_all = torch.cat([maxes, want.view(-1, BLOCK_SIZE - 1)], dim=1).reshape(-1)
    codes, absmax = quantize_blockwise(x_all, code)
    assert torch.all(absmax == code.max_value)
    assert torch.equal(dequantize_blockwise(codes, absmax, code), want_all)


def _fl32_of_fraction(x):
    """The float32 nearest to the rational ``x`` (ties to the even mantissa), by exact comparison
    with the neighbours of ``float32(float(x))``, which is at most an ulp away."""
    f = np.float32(float(x))
    cands = [f]
    for _ in range(2):
        cands = [np.nextafter(cands[0], np.float32(-np.inf))] + cands + [
            np.nextafter(cands[-1], np.float32(np.inf))]
    return min((float(c) for c in cands),
               key=lambda c: (abs(Fraction(c) - x), int(np.float32(c).view(np.int32)) & 1))


def test_reference_fma_is_correctly_rounded():
    """``_fma_rn`` (the kernels' fused multiply-add in the 8-bit update) against exact rational
    arithmetic, on random triples and on sums just off a float32 midpoint, where rounding the
    float64 sum and then to float32 (double rounding) picks the wrong neighbour."""
    g = torch.Generator().manual_seed(0)
    n = 400
    a = torch.randn(n, generator=g) * torch.exp(8 * torch.randn(n, generator=g))
    b = torch.randn(n, generator=g) * torch.exp(8 * torch.randn(n, generator=g))
    c = -(a * b) * (1 + 1e-3 * torch.randn(n, generator=g))  # cancellation
    c[::3] = torch.randn(n, generator=g)[::3]
    # 1 + 2**-23 + (2**-24 - 2**-70): below the midpoint of 1 + 2**-23 and 1 + 2**-22, but its
    # float64 rounding is the midpoint, which ties to the even 1 + 2**-22.
    hard = (torch.tensor([2.0 ** -24 * (1 - 2.0 ** -23), -2.0 ** -24 * (1 - 2.0 ** -23)]),
            torch.tensor([1 + 2.0 ** -23, 1 + 2.0 ** -23]),
            torch.tensor([1 + 2.0 ** -23, -(1 + 2.0 ** -23)]))
    a, b, c = (torch.cat([x, h]) for x, h in zip((a, b, c), hard))
    got = quant_ref._fma_rn(a, b, c)
    want = [_fl32_of_fraction(Fraction(x) * Fraction(y) + Fraction(z))
            for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    assert got.tolist() == want
    assert got[-2].item() == 1 + 2.0 ** -23 and got[-1].item() == -(1 + 2.0 ** -23)
    twice = (a.double() * b.double() + c.double()).float()
    assert twice[-2].item() != got[-2].item()  # the hard cases do catch a double rounding


def _libm_fmaf():
    """The C library's fmaf (correctly rounded, IEEE edge cases), or None."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library('m')
    if name is None:
        return None
    fmaf = ctypes.CDLL(name).fmaf
    fmaf.restype, fmaf.argtypes = ctypes.c_float, [ctypes.c_float] * 3
    return fmaf


def test_reference_fma_edge_cases_match_the_c_library():
    """``_fma_rn`` bit for bit against the C library's ``fmaf`` where exact rationals cannot go:
    signed zeros (compared as bits), results that overflow to inf or underflow to float32
    subnormals, infinite and NaN operands (NaN compared as NaN: its payload is unspecified)."""
    fmaf = _libm_fmaf()
    if fmaf is None:
        pytest.skip('no C math library found')
    tiny, big, inf, nan = 2.0 ** -149, 3.0e38, float('inf'), float('nan')
    vals = [0.0, -0.0, 1.0, -1.0, 1.5, tiny, -tiny, 2.0 ** -126, 1e-20, -3e-25, big, -big,
            2.0 ** 64, 1 + 2.0 ** -23, inf, -inf, nan]
    a, b, c = (torch.tensor(t, dtype=torch.float32) for t in zip(
        *[(x, y, z) for x in vals for y in vals for z in vals]))
    got = quant_ref._fma_rn(a, b, c)
    want = torch.tensor([fmaf(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())],
                        dtype=torch.float32)
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want)
    assert torch.equal(got[~nan_got].view(torch.int32), want[~nan_want].view(torch.int32))


def test_zero_blocks_and_partial_blocks():
    x = torch.zeros(BLOCK_SIZE * 2 + 5)
    x[-3:] = torch.tensor([1.0, -2.0, 0.5])
    codes, absmax = quantize_blockwise(x, EXP_AVG_CODE)
    assert absmax.tolist() == [0.0, 0.0, 2.0] and absmax.numel() == num_blocks(x.numel())
    assert torch.equal(dequantize_blockwise(codes, absmax, EXP_AVG_CODE), x)


@pytest.mark.parametrize('code', [EXP_AVG_CODE, EXP_AVG_SQ_CODE], ids=['exp_avg', 'exp_avg_sq'])
def test_invertible_dequantization_quantizes_back_to_the_same_codes_and_absmax(code):
    """Codes and absmax as a quantization writes them (every nonzero block holds its MAX code;
    absmax from the documented lower bound, 2**-116 / 2**-92, up to near FLT_MAX), a block of
    zeros, signed zeros (0x80) and a partial block: through float32 and back, bit for bit. Plain
    dequantization moves an absmax by an ulp in some blocks."""
    g = torch.Generator().manual_seed(1)
    blocks = 400
    n = blocks * BLOCK_SIZE - 179
    x = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    x = x if code.signed else x.abs()
    # each block scaled to an absmax in [2**e, 2**(e + 1)), e from the bound to 2**127
    lowest = -116 if code.signed else -92
    e = torch.randint(lowest, 127, (blocks,), generator=g).double()
    e[:2] = torch.tensor([lowest, 126.0])
    rows = torch.cat([x, x.new_zeros(blocks * BLOCK_SIZE - n)]).view(blocks, -1).double()
    rows = rows / rows.abs().amax(1, keepdim=True) * torch.exp2(e)[:, None] * (1 + 0.999 * torch.rand(
        blocks, 1, generator=g, dtype=torch.float64))
    x = rows.reshape(-1)[:n].float()
    assert torch.isfinite(x).all()
    x[BLOCK_SIZE:2 * BLOCK_SIZE] = 0.0
    if code.signed:  # magnitudes that round to 0 keep their sign: code 0x80
        x[5 * BLOCK_SIZE:5 * BLOCK_SIZE + 9] = -1e-30
    codes, absmax = quantize_blockwise(x, code)
    if code.signed:
        assert (codes == 0x80).sum() >= 9
    values = dequantize_invertibly(codes, absmax, code)
    assert values.dtype == torch.float32 and values.shape == codes.shape
    back_codes, back_absmax = quantize_blockwise(values, code, signed_zeros=True)
    assert torch.equal(back_codes, codes) and torch.equal(back_absmax, absmax)
    # the values differ from dequantize_blockwise's at MAX codes only, by at most an ulp
    plain = dequantize_blockwise(codes, absmax, code)
    differ = values != plain
    assert torch.all((codes[differ].int() & 0x7F) == (codes.int() & 0x7F).max())
    torch.testing.assert_close(values, plain, rtol=2 ** -23, atol=0)
    assert not torch.equal(quantize_blockwise(plain, code)[1], absmax)
    if code.signed:  # without signed_zeros, -0.0 gets code 0
        assert (quantize_blockwise(values, code)[0] == 0x80).sum() == 0


# ---- the update ------------------------------------------------------------------------------------

class Case:
    """One call's tensors: params, grads, codes/absmax of moments from a few fp32 Adam steps."""

    def __init__(self, setup, sizes=SIZES, seed=0):
        pdt, self.gdt, mdt, scale = SETUPS[setup]
        g = torch.Generator().manual_seed(seed)
        self.gen, self.sizes = g, sizes
        self.scale = None if scale is None else torch.full((1,), scale)
        self.params = [guarded(torch.randn(n, generator=g).to(pdt)) for n in sizes]
        self.model = [guarded(p.to(mdt)) for p in self.params] if mdt else []
        self.mc, self.ma, self.vc, self.va = [], [], [], []
        for n in sizes:
            m = torch.randn(n, generator=g) * 0.1 * torch.exp(torch.randn(n, generator=g))
            v = torch.rand(n, generator=g) * 0.01 * torch.exp(2 * torch.randn(n, generator=g))
            for codes, absmax, x, code in ((self.mc, self.ma, m, EXP_AVG_CODE),
                                           (self.vc, self.va, v, EXP_AVG_SQ_CODE)):
                c, a = quantize_blockwise(x, code)
                codes.append(guarded(c))
                absmax.append(guarded(a))
        self.step = guarded(torch.full((1,), 2.0))

    def grads(self):
        s = 1.0 if self.scale is None else float(self.scale)
        return [(torch.randn(n, generator=self.gen) * s).to(self.gdt) for n in self.sizes]

    def tensors(self):
        return self.params + self.model + self.mc + self.ma + self.vc + self.va + [self.step]

    def clone(self, as_flat=False, shift=0):
        c = Case.__new__(Case)
        c.__dict__.update(self.__dict__)
        for k in ('params', 'model', 'mc', 'ma', 'vc', 'va'):
            lst = getattr(self, k)
            setattr(c, k, (flat(lst, shift) if as_flat else [guarded(t) for t in lst])
                    if lst else [])
        c.step = guarded(self.step)
        return c

    def run(self, fn, grads, hp, found_inf=None, **extra):
        fn(self.params, grads, self.mc, self.ma, self.vc, self.va, self.model, self.step,
           **hp, grad_scale=self.scale, found_inf=found_inf, **extra)


class EdgeCase(Case):
    """One tensor whose blocks take every path of the kernels: 0, heavy-tailed moments (subnormal
    codes); 1, moments with normal codes only (the whole-block decode); 2, zero moments and grads
    (absmax 0); 3, negative-zero codes and grads; 4, moments and grads of subnormal size (the
    encode factor MAX / absmax overflows: the clamp, and NaN for 0 * inf); 5, a short tail."""

    def __init__(self, setup, seed=3):
        B = BLOCK_SIZE
        super().__init__(setup, sizes=[4 * B + 33], seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        m = torch.randn(4 * B + 33, generator=g) * 0.1 * torch.exp(torch.randn(4 * B + 33,
                                                                               generator=g))
        v = torch.rand(4 * B + 33, generator=g) * 0.01 * torch.exp(2 * torch.randn(4 * B + 33,
                                                                                 generator=g))
        sign = torch.where(torch.rand(B, generator=g) < 0.5, -1.0, 1.0)
        m[B:2 * B] = sign * (0.5 + torch.rand(B, generator=g))
        v[B:2 * B] = 0.01 * (1 + torch.rand(B, generator=g))
        m[2 * B:3 * B] = 0.0
        v[2 * B:3 * B] = 0.0
        m[3 * B:4 * B] = torch.randn(B, generator=g) * 1e-39
        v[3 * B:4 * B] = torch.rand(B, generator=g) * 1e-39
        mc, ma = quantize_blockwise(m, EXP_AVG_CODE)
        vc, va = quantize_blockwise(v, EXP_AVG_SQ_CODE)
        mc[2 * B + 128:3 * B] = 0x80  # -0: encoded only where a negative value rounds to 0
        mc[3 * B:3 * B + 16] = 0  # zeros beside a subnormal absmax: 0 * inf in the encode
        vc[3 * B:3 * B + 8] = 0
        self.mc, self.ma, self.vc, self.va = ([guarded(t)] for t in (mc, ma, vc, va))

    def grads(self):
        B = BLOCK_SIZE
        (g,) = super().grads()
        g[2 * B:3 * B] = 0.0
        g[2 * B + 128:3 * B] = -0.0
        g[3 * B:4 * B] = 0.0
        return [g]


@needs_kernel
@pytest.mark.parametrize('hp', [ADAM, ADAM_L2], ids=['adamw', 'l2'])
@pytest.mark.parametrize('setup', list(SETUPS))
def test_kernel_matches_reference_on_edge_blocks(setup, hp):
    _steps_agree(EdgeCase(setup), _kernel(), reference.multi_tensor_adam8bit_, hp, 3, setup)


class LargeAbsmaxCase(Case):
    """Whole blocks of normal codes whose absmax is near or past where the kernels' re-based decode
    factor overflows (Note [normal decode without the re-base] in
    csrc/cpu/multi_tensor_adam8bit.cpp: exp_avg ~1.2e5 / beta1, exp_avg_sq ~8e9 / beta2), one
    moment at a time: just below both bounds, exp_avg past it, exp_avg_sq past it, both far past
    (1e30 / 1e37)."""

    SCALES = [(7e4, 5e9), (2e5, 1.0), (1.0, 1e10), (1e30, 1e37)]

    def __init__(self, setup, seed=5):
        B = BLOCK_SIZE
        super().__init__(setup, sizes=[len(self.SCALES) * B], seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        m, v = [], []
        for sm, sv in self.SCALES:  # codes all normal: within [0.5, 1.5) of the scale
            sign = torch.where(torch.rand(B, generator=g) < 0.5, -1.0, 1.0)
            m.append(sign * (0.5 + torch.rand(B, generator=g)) * sm)
            v.append((0.5 + torch.rand(B, generator=g)) * sv)
        mc, ma = quantize_blockwise(torch.cat(m), EXP_AVG_CODE)
        vc, va = quantize_blockwise(torch.cat(v), EXP_AVG_SQ_CODE)
        self.mc, self.ma, self.vc, self.va = ([guarded(t)] for t in (mc, ma, vc, va))


@needs_kernel
@pytest.mark.parametrize('setup', ['fp32', 'o2-fp16-scaled', 'bf16-params'])
def test_kernel_matches_reference_where_the_rebased_decode_factor_overflows(setup):
    k = LargeAbsmaxCase(setup)
    (ma,), (va,) = k.ma, k.va
    assert float(ma[0]) < 1.2e5 < float(ma[1]) and float(va[0]) < 8e9 < float(va[2])
    _steps_agree(k, _kernel(), reference.multi_tensor_adam8bit_, ADAM, 2, setup)


def _steps_agree(k, kernel, ref, hp, steps, what):
    """``steps`` steps of ``kernel`` on case ``k`` and of ``ref`` on a clone: bit for bit after
    each (a code that differs once may be absorbed later)."""
    r = k.clone()
    for step in range(steps):
        grads = k.grads()
        k.run(kernel, grads, hp)
        r.run(ref, grads, hp)
        _assert_equal(k.tensors(), r.tensors(), f'{what} step {step}')


def _kernel():
    return checked(torch.ops.mp_wrappers).multi_tensor_adam8bit_


def _assert_equal(got, want, what=''):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), \
            f'{what} tensor {i}'


@needs_kernel
@pytest.mark.parametrize('hp', [ADAM, ADAM_L2], ids=['adamw', 'l2'])
@pytest.mark.parametrize('setup', list(SETUPS))
def test_kernel_matches_reference_bitwise(setup, hp):
    k = Case(setup)
    r = k.clone()
    for _ in range(3):
        grads = k.grads()
        k.run(_kernel(), grads, hp)
        r.run(reference.multi_tensor_adam8bit_, grads, hp)
    _assert_equal(k.tensors(), r.tensors(), setup)
    assert k.step.item() == 5.0


@needs_kernel
def test_kernel_rounds_ties_away_from_zero(cpu_isa):
    """New moments exactly halfway between two codes in each CPU flavour (tests/_quant_ties.py:
    normal and subnormal codes, both signs, a value just below half a step), against the reference
    and the codes themselves; a whole block (the vector path) and a short one (the tail)."""
    n = BLOCK_SIZE + 40
    k = Case('fp32', sizes=[n])
    codes, g, want = tie_moments(n, [0, BLOCK_SIZE])
    k.mc[0].copy_(codes)
    k.ma[0].fill_(TIE_MAX)
    hp = dict(ADAM, beta1=0.5)
    r = k.clone()
    k.run(_kernel(), [g.clone()], hp)
    r.run(reference.multi_tensor_adam8bit_, [g.clone()], hp)
    _assert_equal(k.tensors(), r.tensors(), f'{cpu_isa} ties')
    assert torch.equal(k.mc[0], want) and k.ma[0].tolist() == [TIE_MAX, TIE_MAX]


@pytest.mark.parametrize('impl', [pytest.param('kernel', marks=needs_kernel), 'reference',
                                  'public op'])
def test_a_tensor_lr_is_read_when_the_step_runs(impl):
    """lr as a 1-element float32 tensor (capturable=True): the same bits as the float lr, with a
    value changed between steps (an LR schedule writing in place) read by the next step."""
    want = Case('o2-bf16')
    got = want.clone()
    lr = torch.zeros(1)
    for value in (1e-2, 4e-3, 0.0, 2.5e-2):
        grads = want.grads()
        want.run(_kernel() if HAS_KERNEL else reference.multi_tensor_adam8bit_, grads,
                 dict(ADAM, lr=value))
        lr.fill_(value)
        if impl == 'public op':
            got.run(multi_tensor_adam8bit, grads, dict(ADAM, lr=lr))
        else:  # the float says nothing: a kernel reading it instead would not step
            op = _kernel() if impl == 'kernel' else reference.multi_tensor_adam8bit_
            got.run(op, grads, dict(ADAM, lr=0.0), lr_tensor=lr)
        _assert_equal(got.tensors(), want.tensors(), f'{impl}, lr {value}')


# AdamW (the decoupled decay's FMA, the -0.0 codes of zero blocks) without bias correction.
ADAMW_NO_BC = dict(ADAM, bias_correction=False)


def _cuda_matches_cpu(device, case, cuda_op, cpu_op, what):
    """Two steps of ``cuda_op`` (the public op) on CUDA copies of ``case``'s tensors against the CPU
    kernel ``cpu_op`` on ``case``, bit for bit without bias correction (no float64 pow on the
    device), Adam with L2 decay then AdamW; then a found_inf step changes nothing."""
    twin = copy.copy(case)
    for k, v in vars(case).items():
        if isinstance(v, list) and all(isinstance(t, torch.Tensor) for t in v):
            setattr(twin, k, [t.to(device) for t in v])
    twin.step = case.step.to(device)
    twin.scale = None if case.scale is None else case.scale.to(device)
    for hp in (ADAM_L2, ADAMW_NO_BC):
        grads = case.grads()
        case.run(cpu_op, grads, hp)
        twin.run(cuda_op, [g.to(device) for g in grads], hp)
        _assert_equal([t.cpu() for t in twin.tensors()], case.tensors(), what)
    twin.run(cuda_op, [g.to(device) for g in case.grads()], ADAM_L2,
             found_inf=torch.ones(1, device=device))
    _assert_equal([t.cpu() for t in twin.tensors()], case.tensors(), what)


@needs_kernel
@pytest.mark.parametrize('setup', ['fp32', 'o2-bf16', 'o2-fp16-scaled', 'bf16-params'])
@pytest.mark.parametrize('device', ['cuda'])
def test_cuda_kernel_matches_the_cpu_kernel(device, setup):
    """The CUDA kernel through the public op (a build with CUDA kernels, on a GPU; skipped
    otherwise): _cuda_matches_cpu, edge blocks included."""
    for case in (Case(setup), EdgeCase(setup)):
        _cuda_matches_cpu(device, case, multi_tensor_adam8bit, _kernel(), setup)


@pytest.mark.parametrize('use_kernel', [pytest.param(True, marks=needs_kernel), False],
                         ids=['kernel', 'reference'])
def test_found_inf_leaves_everything_bit_identical(use_kernel):
    c = Case('o2-fp16-scaled')
    before = [t.clone() for t in c.tensors()]
    fn = _kernel() if use_kernel else reference.multi_tensor_adam8bit_
    c.run(fn, c.grads(), ADAM, found_inf=torch.ones(1))
    _assert_equal(c.tensors(), before)


@needs_kernel
@pytest.mark.parametrize('shift', [0, 1])
def test_flat_buffers_match_separate_tensors(shift):
    a = Case('o2-bf16')
    b = a.clone(as_flat=True, shift=shift)
    grads = a.grads()
    a.run(_kernel(), grads, ADAM)
    b.run(_kernel(), grads, ADAM)
    _assert_equal(a.tensors(), b.tensors())


def _isa_run(isa, threads):
    from mp_wrappers.ops._extension import extension
    ext = extension()
    previous, before = ext._set_cpu_isa(isa), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {}
        for setup in ('o2-bf16', 'fp32-odd-scale', 'bf16-params'):
            c = Case(setup, sizes=[65537 * 2 + 33, 4096 + 7], seed=5)
            for _ in range(2):
                c.run(torch.ops.mp_wrappers.multi_tensor_adam8bit_, c.grads(), ADAM_L2)
            out[setup] = [t.clone() for t in c.tensors()]
            e = EdgeCase(setup)
            for _ in range(2):
                e.run(torch.ops.mp_wrappers.multi_tensor_adam8bit_, e.grads(), ADAM)
            out[setup + '-edge'] = [t.clone() for t in e.tensors()]
        return out
    finally:
        ext._set_cpu_isa(previous)
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.skipif(backend()['cpu'] not in ('cpp-avx512', 'cpp-avx2'),
                    reason='needs a CPU with at least AVX2 (two flavours to compare)')
@pytest.mark.parametrize('op', ['adam8bit', 'adam8bit_lean'])
def test_isa_flavours_and_thread_counts_agree(op):
    from mp_wrappers.ops._extension import extension
    run = _isa_run if op == 'adam8bit' else _lean_isa_run
    isas = ('avx512', 'avx2', 'baseline')
    isas = isas[isas.index(extension().cpu_isa_hardware()):]
    want = run(isas[0], 2)
    for isa in isas:
        got = run(isa, 1)
        for setup in want:
            _assert_equal(got[setup], want[setup], f'{isa} {setup}')


# ---- argument checks -------------------------------------------------------------------------------

def _args(**change):
    c = Case('fp32', sizes=[300])
    kw = dict(params=c.params, grads=c.grads(), exp_avgs=c.mc, exp_avg_absmaxes=c.ma,
              exp_avg_sqs=c.vc, exp_avg_sq_absmaxes=c.va, model_params=[], step=c.step, **ADAM)
    kw.update(change)
    return kw


@pytest.mark.parametrize('change,err,match', [
    (dict(exp_avgs=[torch.zeros(300)]), ValueError, r'exp_avgs\[0\] must be a contiguous '
                                                    r'torch.uint8 tensor'),
    (dict(exp_avg_sq_absmaxes=[torch.zeros(1)]), ValueError, r'exp_avg_sq_absmaxes\[0\].*2 '
                                                             'elements'),
    (dict(exp_avg_absmaxes=[]), ValueError, 'exp_avg_absmaxes has 0 tensors'),
    (dict(lr=-1.0), ValueError, 'Invalid learning rate'),
    (dict(lr=torch.tensor([1e-3], dtype=torch.float64)), ValueError,
     'lr must be a 1-element float32 tensor on cpu'),
])
def test_errors_name_the_argument(change, err, match):
    with pytest.raises(err, match=match):
        multi_tensor_adam8bit(**_args(**change))


def test_cuda_tensors_need_a_build_with_the_cuda_kernel(monkeypatch):
    """CUDA tensors run where the loaded build has the CUDA kernel; a CPU-only build refuses them
    before any work, saying how to get the kernel (not the reference on the GPU)."""
    from mp_wrappers.ops import quantized_states
    monkeypatch.setattr(quantized_states, '_op_has_kernel',  # a CPU-only build, also on a GPU
                        lambda name, device_type: device_type == 'cpu')
    with pytest.raises(NotImplementedError, match=r"FusedAdam: 8-bit optimizer states "
                       r"\(state_dtype='int8'\) run on CPU tensors, and on CUDA tensors with a build "
                       r"that has CUDA kernels; got tensors on cuda:0 and this mp_wrappers build has "
                       r"no CUDA kernels \(rebuild it with MP_WRAPPERS_CUDA=1"):
        quantized_states.check_quantized_device('FusedAdam', torch.device('cuda:0'))
    monkeypatch.setattr(quantized_states, '_op_has_kernel',
                        lambda name, device_type: (name, device_type) == ('multi_tensor_adam8bit_',
                                                                          'cuda'))
    assert quantized_states.has_quantized_kernel('cuda')
    quantized_states.check_quantized_device('FusedAdam', torch.device('cuda:0'))
    assert quantized_states.has_quantized_kernel('cpu')
    # Lean bf16 params need the lean op's CUDA kernel (csrc/cuda/multi_tensor_adam8bit.cu).
    with pytest.raises(NotImplementedError, match=r"with bf16_storage='split' \(a wrapper's "
                       r"master_weights='split'\) run on CPU tensors, and on CUDA tensors with a "
                       r"build that has CUDA kernels; got tensors on cuda:0.*Allowed on cuda"):
        quantized_states.check_quantized_device('FusedAdam', torch.device('cuda:0'), 'split')
    monkeypatch.setattr(quantized_states, '_op_has_kernel',
                        lambda name, device_type: device_type == 'cuda')
    assert quantized_states.has_quantized_kernel('cuda', lean=True)
    quantized_states.check_quantized_device('FusedAdam', torch.device('cuda:0'), 'split')


def test_other_devices_are_refused():
    p = torch.zeros(300, device='meta')
    with pytest.raises(NotImplementedError, match="state_dtype='int8'.*run on CPU tensors.*got "
                                                  "tensors on meta and there is no meta kernel"):
        multi_tensor_adam8bit([p], [p], [torch.zeros(300, dtype=torch.uint8, device='meta')],
                              [torch.zeros(2, device='meta')],
                              [torch.zeros(300, dtype=torch.uint8, device='meta')],
                              [torch.zeros(2, device='meta')], [],
                              torch.zeros(1, device='meta'), **ADAM)


@needs_kernel
def test_kernel_checks_direct_calls():
    kw = _args(exp_avg_absmaxes=[torch.zeros(5)])
    with pytest.raises(RuntimeError, match=r'exp_avg_absmaxes\[0\] must be a contiguous float32'):
        torch.ops.mp_wrappers.multi_tensor_adam8bit_(*kw.values(), None, None)


# ---- lean bf16 params: multi_tensor_adam8bit_lean_ -------------------------------------------------
# The 8-bit moments of multi_tensor_adam8bit_ with the master step of the lean storages (Note [lean
# bf16 storage]): bf16 params with uint16 low halves ('split'), a bf16 compensation ('kahan') or
# stochastic rounding; the kernel against the reference (8-bit reference moments + lean reference
# master update), bit for bit, in every flavour and thread count.

class LeanCase(Case):
    """A Case whose params are bf16 stored the ``storage`` way (no model copies)."""

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
        return self.params + self.aux + self.mc + self.ma + self.vc + self.va + [self.step]

    def clone(self, as_flat=False, shift=0):
        c = Case.clone(self, as_flat, shift)
        c.__class__ = LeanCase
        c.aux = (flat(self.aux, shift) if as_flat else [guarded(t) for t in self.aux]) \
            if self.aux else []
        return c

    def run(self, fn, grads, hp, found_inf=None):
        fn(self.params, self.aux, grads, self.mc, self.ma, self.vc, self.va, self.step, **hp,
           storage=self.storage, seed=11, grad_scale=self.scale, found_inf=found_inf)


def _lean_kernel():
    return checked(torch.ops.mp_wrappers).multi_tensor_adam8bit_lean_


LEAN_SETUPS = {'bf16-grads': (torch.bfloat16, None), 'fp32-grads-scaled': (torch.float32, 1024.0),
               'bf16-grads-odd-scale': (torch.bfloat16, 3.0)}


@needs_kernel
@pytest.mark.parametrize('edge', [False, True], ids=['random', 'edge-blocks'])
@pytest.mark.parametrize('hp', [ADAM, ADAM_L2], ids=['adamw', 'l2'])
@pytest.mark.parametrize('setup', list(LEAN_SETUPS))
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_lean_kernel_matches_reference_bitwise(storage, setup, hp, edge):
    gdt, scale = LEAN_SETUPS[setup]
    k = LeanCase(storage, grad_dtype=gdt, scale=scale, edge=edge)
    _steps_agree(k, _lean_kernel(), reference.multi_tensor_adam8bit_lean_, hp, 3,
                 f'{storage} {setup}')
    assert k.step.item() == 5.0


@needs_kernel
@pytest.mark.parametrize('storage', LEAN_STORAGES)
@pytest.mark.parametrize('device', ['cuda'])
def test_cuda_lean_kernel_matches_the_cpu_kernel(device, storage):
    """The lean CUDA kernel through the public op (a build with CUDA kernels, on a GPU; skipped
    otherwise): _cuda_matches_cpu for each storage, scaled fp32 grads and edge blocks."""
    for case in (LeanCase(storage, grad_dtype=torch.float32, scale=1024.0),
                 LeanCase(storage, edge=True)):
        _cuda_matches_cpu(device, case, multi_tensor_adam8bit_lean, _lean_kernel(), storage)


@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_lean_reference_is_8bit_moments_plus_lean_master_update(storage):
    """The reference composes the two references: its codes are multi_tensor_adam8bit_'s on the
    fp32 value the storage holds, and 'split' writes that value plus the lean step
    ``-(lr * fma(weight_decay, p, q))`` exactly, ``q`` the 8-bit direction (the fp32-master op
    instead applies AdamW's decay as a factor of the param: Note [8-bit optimizer states])."""
    c = LeanCase(storage, sizes=[4096 + 7])
    master = [bf16_join(p, a) if storage == 'split' else p.float()
              for p, a in zip(c.params, c.aux or [None] * len(c.params))]
    plain = Case.clone(c)
    plain.__class__ = Case
    plain.params, plain.model = [guarded(m) for m in master], []
    before = Case.clone(plain)
    grads = c.grads()
    c.run(reference.multi_tensor_adam8bit_lean_, grads, ADAM)
    plain.run(reference.multi_tensor_adam8bit_, grads, ADAM)
    _assert_equal(c.mc + c.ma + c.vc + c.va + [c.step],
                  plain.mc + plain.ma + plain.vc + plain.va + [plain.step])
    if storage == 'split':
        scale, eps = quant_ref._step_constants(ADAM['beta1'], ADAM['beta2'], ADAM['eps'],
                                               before.step + 1, True)
        (m,), (g,) = master, grads
        q = quant_ref._adam8bit_update(g, m, before.mc[0], before.ma[0], before.vc[0],
                                       before.va[0], ADAM['beta1'], ADAM['beta2'],
                                       ADAM['weight_decay'], True, scale, eps, None, None)
        wd = torch.full_like(m, ADAM['weight_decay'])
        want = m + (-(ADAM['lr'] * quant_ref._fma_rn(wd, m, q)))
        _assert_equal([bf16_join(p, a) for p, a in zip(c.params, c.aux)], [want])


@pytest.mark.parametrize('use_kernel', [pytest.param(True, marks=needs_kernel), False],
                         ids=['kernel', 'reference'])
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_lean_found_inf_leaves_everything_bit_identical(storage, use_kernel):
    c = LeanCase(storage, scale=1024.0)
    before = [t.clone() for t in c.tensors()]
    fn = _lean_kernel() if use_kernel else reference.multi_tensor_adam8bit_lean_
    c.run(fn, c.grads(), ADAM, found_inf=torch.ones(1))
    _assert_equal(c.tensors(), before)


@needs_kernel
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_lean_flat_buffers_match_separate_tensors(storage):
    a = LeanCase(storage)
    b = a.clone(as_flat=True, shift=1)
    grads = a.grads()
    a.run(_lean_kernel(), grads, ADAM)
    b.run(_lean_kernel(), grads, ADAM)
    _assert_equal(a.tensors(), b.tensors())


def _lean_isa_run(isa, threads):
    from mp_wrappers.ops._extension import extension
    ext = extension()
    previous, before = ext._set_cpu_isa(isa), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {}
        for storage in LEAN_STORAGES:
            for edge in (False, True):
                c = LeanCase(storage, sizes=[65537 * 2 + 33, 4096 + 7], seed=5, scale=3.0,
                             edge=edge)
                for _ in range(2):
                    c.run(torch.ops.mp_wrappers.multi_tensor_adam8bit_lean_, c.grads(), ADAM)
                out[f'{storage}-{edge}'] = [t.clone() for t in c.tensors()]
        return out
    finally:
        ext._set_cpu_isa(previous)
        torch.set_num_threads(before)


def _lean_args(storage='kahan', **change):
    c = LeanCase(storage, sizes=[300])
    kw = dict(params=c.params, aux=c.aux, grads=c.grads(), exp_avgs=c.mc, exp_avg_absmaxes=c.ma,
              exp_avg_sqs=c.vc, exp_avg_sq_absmaxes=c.va, step=c.step, **ADAM, storage=storage)
    kw.update(change)
    return kw


@pytest.mark.parametrize('change,err,match', [
    (dict(storage='fp8'), ValueError, r"storage='fp8' is not allowed; expected one of"),
    (dict(aux=[]), ValueError, r"aux has 0 tensors but params has 1; storage='kahan' needs"),
    (dict(exp_avgs=[torch.zeros(300)]), ValueError, r'exp_avgs\[0\] must be a contiguous '
                                                    r'torch.uint8 tensor'),
    (dict(exp_avg_sq_absmaxes=[torch.zeros(1)]), ValueError, r'exp_avg_sq_absmaxes\[0\].*2 '
                                                             'elements'),
    (dict(seed=1.5), TypeError, 'seed must be an int'),
])
def test_lean_errors_name_the_argument(change, err, match):
    with pytest.raises(err, match=match):
        multi_tensor_adam8bit_lean(**_lean_args(**change))


def test_lean_params_must_be_bf16_and_on_a_device_with_the_kernel():
    kw = _lean_args()
    kw['params'] = [p.float() for p in kw['params']]
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.float32; storage='kahan' "
                                        'holds bfloat16 params'):
        multi_tensor_adam8bit_lean(**kw)
    meta = {k: ([t.to('meta') for t in v] if isinstance(v, list) else
                v.to('meta') if isinstance(v, torch.Tensor) else v)
            for k, v in _lean_args().items()}
    with pytest.raises(NotImplementedError, match=r"bf16_storage='kahan'.*run on CPU tensors, and "
                                                  r"on CUDA tensors with a build that has CUDA "
                                                  r"kernels; got tensors on meta"):
        multi_tensor_adam8bit_lean(**meta)


@needs_kernel
def test_lean_kernel_checks_direct_calls():
    kw = _lean_args(seed=0, grad_scale=None, found_inf=None)
    kw['exp_avg_absmaxes'] = [torch.zeros(5)]
    with pytest.raises(RuntimeError, match=r'multi_tensor_adam8bit_lean_: exp_avg_absmaxes\[0\] '
                                           'must be a contiguous float32 tensor'):
        torch.ops.mp_wrappers.multi_tensor_adam8bit_lean_(**kw)
    kw = _lean_args(seed=0, grad_scale=None, found_inf=None)
    kw['storage'] = 'fp8'
    with pytest.raises(RuntimeError, match="storage='fp8' is not allowed"):
        torch.ops.mp_wrappers.multi_tensor_adam8bit_lean_(**kw)
