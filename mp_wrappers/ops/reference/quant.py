"""Pure-PyTorch reference of block-wise 8-bit optimizer states and of the 8-bit Adam update.

Note [8-bit optimizer states]
    Adam's two fp32 moments cost 8 bytes per parameter. Here each moment is kept as one uint8 code
    per element plus one float32 ``absmax`` per block of :data:`BLOCK_SIZE` consecutive elements (in
    memory order), about 2.03 bytes per parameter for both (Dettmers et al., "8-bit Optimizers via
    Block-wise Quantization", 2022). The measurements behind the choices below are in
    docs/quantized_states.md.

    The codes are small floating-point numbers relative to the block's absmax ("minifloats"), so
    that quantizing and dequantizing are a few integer and float operations per element, the same
    in every SIMD flavour and in this reference, instead of a search in a 256-entry table:

    * ``exp_avg`` (signed): a sign bit and an E4M3 magnitude (4 exponent bits, 3 mantissa bits).
    * ``exp_avg_sq`` (non-negative): an unsigned E5M3 code (5 exponent bits, 3 mantissa bits).

    A magnitude code ``c`` with exponent field ``e = c >> M`` and mantissa ``f = c & (2**M - 1)``
    means ``2**(e - B) * (1 + f / 2**M)`` for ``e >= 1`` and ``f * 2**(1 - B - M)`` for ``e == 0``
    (IEEE-style subnormals, so 0 is code 0), with ``B = 2**E - 1``: the largest code is
    ``MAX = 2 - 2**-M`` and there is no inf or NaN. A block is stored as ``x * (MAX / absmax)``
    rounded to the nearest code (ties away from zero: Note [ties away from zero]) and read back as
    ``code_value * (absmax / MAX)``. Both block factors are one float32 division each; a block of
    zeros has absmax 0 and codes 0 (0x80 for a -0.0 moment of ``exp_avg``: Note [signed zero
    codes]). :func:`code_table` lists the 256 values of each code.

    The 8-bit Adam update (:func:`multi_tensor_adam8bit_`) reads both moments' codes, applies the
    float32 Adam update, writes the param and the optional half model copy, and requantizes the new
    moments with the new absmax of every block: one pass, the block's absmax computed from the
    updated moments before its codes. It is Adam's update in float32 with fewer roundings than
    ``multi_tensor_adam_``'s (each difference far below the quantization's), so that the kernels
    spend fewer vector operations per element and wait less on the divider's chain
    (docs/quantized_states.md measures them). With ``fl`` the rounding to float32, ``fma`` a fused
    multiply-add (one rounding), ``code`` a code's value with absmax = MAX (:func:`code_table`)
    and ``bc = 1 - beta**step`` (float64):

    * ``m = fma(code_m, fl(beta1 * fl(absmax_m / MAX)), fl((1 - beta1) * g))``: the moment's decay
      and the block's decode factor are one factor per block (``beta1`` and ``1 - beta1`` rounded
      to float32 first, the latter computed in float64);
    * ``v = fma(fl((1 - beta2) * g), g, fl(code_v * fl(beta2 * fl(absmax_v / MAX))))``;
    * ``q = m / fma(sqrt(v), fl(bc1 / sqrt(bc2)), fl(eps * bc1))``: Adam's
      ``(m / bc1) / (sqrt(v / bc2) + eps)`` with the bias corrections moved into the denominator's
      two constants (one division and one square root per element);
    * ``p = fma(-lr, q, p)``, and with AdamW's decoupled decay
      ``p = fma(-lr, q, fma(-fl(lr * weight_decay), p, p))`` (the decay applied to the param, as
      torch's AdamW applies it); L2 decay (Adam) is ``g = fma(weight_decay, p, g)`` first. The lean variant
      (:func:`multi_tensor_adam8bit_lean_`) steps its bf16 storage by ``-(lr * u)`` with
      ``u = fma(weight_decay, p, q)``, as the lean masters compose a step.

    The 8-bit SGD update (:func:`multi_tensor_sgd8bit_`, ``FusedSGD(state_dtype='int8')``) keeps
    the momentum buffer ``b`` in ``EXP_AVG_CODE`` (signed) and follows ``multi_tensor_sgd_``'s
    semantics (torch.optim.SGD, apex's ``wd_after_momentum``) with its additions as fused
    multiply-adds, the decay of the buffer folded into the block's decode factor as for ``m``:

    * ``d = g``, L2 decay first ``d = fma(weight_decay, p, d)`` (unless ``wd_after_momentum``);
    * ``b = d`` on the first applied update (``step == 0``, decided on the device as in
      ``multi_tensor_sgd_``; the codes are not read), else
      ``b = fma(code_b, fl(momentum * fl(absmax_b / MAX)), fl(fl(1 - dampening) * d))``;
    * ``d = fma(momentum, b, d)`` with Nesterov, else ``d = b``; then
      ``d = fma(weight_decay, p, d)`` with ``wd_after_momentum``;
    * ``p = fma(-lr, d, p)``, and ``b`` is requantized with its block's new absmax. The lean
      variant (:func:`multi_tensor_sgd8bit_lean_`) steps its bf16 storage by ``-(lr * d)``.

    Square roots and fused multiply-adds are correctly rounded here (:func:`_sqrt_rn`,
    :func:`_fma_rn`), as the C++ and CUDA kernels' are, so every output matches the kernels bit for
    bit.

    Note [signed zero codes]
        The update encodes ``exp_avg``'s sign from the scaled value's sign bit, so a -0.0 moment
        gets code 0x80 (which reads back as -0.0) rather than 0 (an or and a blend per vector on
        AVX2 where a compare, an and and an or were three):
        ``quantize_blockwise(..., signed_zeros=True)``. A moment is -0.0 only when both the
        code's and the gradient's terms are -0.0; -0.0 and +0.0 are equal values, though the sign
        reaches the direction and can decide the sign of a zero param. A NaN's sign bit counts
        too: in a block whose absmax is subnormal (its encode factor overflows, Note [8-bit
        optimizer states] ``_block_factors``) a zero moment scales to 0 * inf = NaN, whose sign is
        the platform's default NaN's (negative on x86: code 0xFC, which reads back as -0.8 of the
        absmax, a moment below 1e-38 where there was 0).

    Note [ties away from zero]
        A value exactly halfway between two codes gets the one of larger magnitude (IEEE's
        roundTiesToAway), not the one with the even mantissa. Adding half a code step to the
        float32 bits and shifting is the whole rounding; ties to even needed the kept bits' lowest
        bit as well (a shift, an and and an add per vector), which made the AVX2 step ~10% slower
        on one core (docs/quantized_states.md, "What bounds the 8-bit step on AVX2"). Only exact
        midpoints change, and nothing depends on which way they go: every value's error is at
        most half a code step either way. Codes written under the earlier rule decode as before.
"""
from typing import List, NamedTuple, Optional, Union

import torch
from torch import Tensor

from ._common import _commit_, _lr, _skip_mask, _unscaled
from .lean import _check_storage, _read_param, _write_param

__all__ = ['BLOCK_SIZE', 'Minifloat', 'EXP_AVG_CODE', 'EXP_AVG_SQ_CODE', 'num_blocks',
           'quantize_blockwise', 'dequantize_blockwise', 'dequantize_invertibly', 'code_table',
           'multi_tensor_adam8bit_', 'multi_tensor_adam8bit_lean_', 'multi_tensor_sgd8bit_',
           'multi_tensor_sgd8bit_lean_']

#: Elements per absmax block (the kernels' constant too; docs/quantized_states.md says why 256).
BLOCK_SIZE = 256


class Minifloat(NamedTuple):
    """An 8-bit code: ``exp_bits`` + ``man_bits`` magnitude bits, plus a sign bit when ``signed``."""

    exp_bits: int
    man_bits: int
    signed: bool

    @property
    def bias(self) -> int:
        return 2 ** self.exp_bits - 1

    @property
    def max_value(self) -> float:
        return 2.0 - 2.0 ** -self.man_bits

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)


#: The code of ``exp_avg`` (first moment, signed).
EXP_AVG_CODE = Minifloat(4, 3, True)
#: The code of ``exp_avg_sq`` (second moment, non-negative).
EXP_AVG_SQ_CODE = Minifloat(5, 3, False)


def num_blocks(numel: int) -> int:
    """The number of absmax blocks of a tensor with ``numel`` elements."""
    return (numel + BLOCK_SIZE - 1) // BLOCK_SIZE


def _blocks(x: Tensor) -> Tensor:
    """``x`` flat, zero-padded to whole blocks, as (blocks, BLOCK_SIZE)."""
    flat = x.reshape(-1)
    pad = num_blocks(flat.numel()) * BLOCK_SIZE - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK_SIZE)


def _encode_magnitude(a: Tensor, code: Minifloat) -> Tensor:
    """Nearest magnitude codes (int32) of float32 ``a`` in [0, MAX] (ties away from zero: Note
    [ties away from zero])."""
    m = code.man_bits
    shift = 23 - m
    bits = a.view(torch.int32)
    # Round the float32 mantissa to m bits by adding half a code step to the bits (a carry moves
    # into the exponent), then re-base the exponent so that min_normal has exponent field 1.
    normal = (bits + (1 << (shift - 1))) >> shift
    normal = normal - ((127 - code.bias) << m)
    # Below min_normal the codes are evenly spaced: scale by an exact power of two (to [0, 2**m))
    # and round half up. floor(y + 0.5) would not do: y + 0.5 rounds to 1 for y just below 0.5.
    y = a * 2.0 ** (code.bias - 1 + m)
    whole = torch.floor(y)
    sub = (whole + (y - whole >= 0.5).to(whole.dtype)).to(torch.int32)  # y - whole is exact
    return torch.where(a < code.min_normal, sub, normal)


def _decode_magnitude(c: Tensor, code: Minifloat) -> Tensor:
    """Float32 values of int32 magnitude codes ``c``."""
    m = code.man_bits
    normal = ((c + ((127 - code.bias) << m)) << (23 - m)).view(torch.float32)
    sub = (c & ((1 << m) - 1)).to(torch.float32) * 2.0 ** (1 - code.bias - m)
    return torch.where(c < (1 << m), sub, normal)


def _block_factors(absmax: Tensor, code: Minifloat):
    """(encode factor MAX/absmax, 0 for an all-zero block; decode factor absmax/MAX), float32."""
    maxv = torch.tensor(code.max_value, dtype=torch.float32)
    enc = torch.where(absmax > 0, maxv / absmax, torch.zeros_like(absmax))
    return enc, absmax / maxv


def quantize_blockwise(x: Tensor, code: Minifloat, signed_zeros: bool = False) -> tuple:
    """(uint8 codes shaped like ``x``, float32 absmax per block) of float32 ``x`` (memory order of
    a contiguous ``x``).

    ``signed_zeros``: a -0.0 gets the negative zero code 0x80 (a signed code), as
    :func:`dequantize_invertibly` and the update (Note [signed zero codes]) need; without it
    -0.0 gets code 0, which reads back as +0.0.
    """
    blocks = _blocks(x.to(torch.float32))
    absmax = blocks.abs().amax(dim=1)
    enc, _ = _block_factors(absmax, code)
    scaled = blocks * enc[:, None]
    a = torch.clamp(scaled.abs(), max=code.max_value)
    c = _encode_magnitude(a, code)
    if code.signed:
        negative = torch.signbit(scaled) if signed_zeros else scaled < 0
        c = c | torch.where(negative, 0x80, 0).to(torch.int32)
    codes = c.reshape(-1)[:x.numel()].to(torch.uint8).view(x.shape)
    return codes, absmax


def dequantize_blockwise(codes: Tensor, absmax: Tensor, code: Minifloat) -> Tensor:
    """Float32 values (shaped like ``codes``) of block-wise codes with their per-block absmax."""
    c = _blocks(codes.to(torch.int32))
    mag = c & 0x7F if code.signed else c
    _, dec = _block_factors(absmax.to(torch.float32), code)
    x = _decode_magnitude(mag, code) * dec[:, None]
    if code.signed:
        x = torch.where(c >= 0x80, -x, x)
    return x.reshape(-1)[:codes.numel()].view(codes.shape)


def dequantize_invertibly(codes: Tensor, absmax: Tensor, code: Minifloat) -> Tensor:
    """:func:`dequantize_blockwise`, except that the largest magnitude code reads as the block's
    absmax itself (with the code's sign): float32 values that
    ``quantize_blockwise(values, code, signed_zeros=True)`` maps back to exactly ``codes`` and
    ``absmax``, for codes and absmax as a quantization wrote them (every nonzero block holds its
    largest magnitude as the MAX code) whose block's smallest nonzero code decodes to a normal
    float32: absmax >= 2**-116 for ``EXP_AVG_CODE``, >= 2**-92 for ``EXP_AVG_SQ_CODE``, up to
    FLT_MAX. Below that a subnormal value has fewer bits than its code and may come back a code
    lower (moments too small for any update to tell from 0); NaN and inf have no such promise.

    Used where 8-bit moments pass through float32 (checkpoints under FSDP1, a param group switched
    to float32 states and back), so that a round trip resumes bit for bit. ``MAX * (absmax / MAX)``
    rounds to absmax or to a neighbour (one ulp); a neighbour would become the block's new absmax
    and could move codes. The other codes decode to at most ``(MAX - 2**-M) / MAX`` of absmax, and
    each normal value times ``MAX / absmax`` is within a few ulp of its code's value, which rounds
    to it. ``tests/ops/test_quantized_states.py`` checks blocks down to those bounds.
    """
    values = dequantize_blockwise(codes, absmax, code)
    c = codes.to(torch.int32)
    mag = c & 0x7F if code.signed else c
    top = (1 << (code.exp_bits + code.man_bits)) - 1  # MAX: every exponent and mantissa bit set
    block_absmax = absmax.to(torch.float32).reshape(-1).repeat_interleave(BLOCK_SIZE)[
        :codes.numel()].view(codes.shape)
    exact = torch.where(values < 0, -block_absmax, block_absmax) if code.signed else block_absmax
    return torch.where(mag == top, exact, values)


def code_table(code: Minifloat) -> Tensor:
    """The 256 float32 values of ``code`` (absmax = MAX), indexed by the code byte."""
    c = torch.arange(256, dtype=torch.int32)
    mag = c & 0x7F if code.signed else c
    v = _decode_magnitude(mag, code)
    return torch.where(c >= 0x80, -v, v) if code.signed else v


def _sqrt_rn(x: Tensor) -> Tensor:
    """Correctly rounded float32 square root (torch's CPU float32 sqrt is not always)."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def _fma_rn(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """Correctly rounded float32 ``a * b + c`` (one rounding, as a hardware fused multiply-add).

    The product of two float32 values is exact in float64 (24 + 24 bits < 53, and float64's
    exponent range holds it), but rounding ``a * b + c`` to float64 and then to float32 rounds
    twice, which can miss (a sum just below a float32 midpoint can round to the midpoint in
    float64, then away from the nearest float32). Rounding the float64 sum *to odd* instead (an
    inexact sum keeps the neighbour whose last bit is 1, the one TwoSum's error points to) leaves
    a value that rounds to float32 as the exact sum would: float64 has more than float32's 24 + 2
    bits.
    """
    p = a.to(torch.float64) * b.to(torch.float64)  # exact
    c64 = c.to(torch.float64)
    s = p + c64
    # TwoSum: s + err == p + c exactly (finite s).
    bv = s - p
    err = (p - (s - bv)) + (c64 - bv)
    even = (s.view(torch.int64) & 1) == 0
    inf = torch.full_like(s, float('inf'))
    toward = torch.where(err > 0, inf, -inf)
    inexact_even = (err != 0) & even & torch.isfinite(s)
    s = torch.where(inexact_even, torch.nextafter(s, toward), s)
    return s.to(torch.float32)


def _f32(x: Union[float, Tensor], like: Tensor) -> Tensor:
    """``x`` (a Python float, or a 0-dim tensor such as ``lr_tensor``) rounded to float32 and
    broadcast like ``like``, as the kernels round it."""
    if isinstance(x, Tensor):
        return x.to(device=like.device, dtype=torch.float32).expand_as(like)
    return torch.full_like(like, x, dtype=torch.float32)


def _code_values(codes: Tensor, code: Minifloat) -> Tensor:
    """Flat float32 values of the codes with absmax = MAX (:func:`code_table`'s, exact)."""
    return code_table(code).to(codes.device)[codes.reshape(-1).to(torch.int64)]


def _decayed_decode_factor(absmax: Tensor, beta: float, code: Minifloat, n: int) -> Tensor:
    """``fl(beta * (absmax / MAX))`` of every block, repeated for the ``n`` elements (flat)."""
    _, dec = _block_factors(absmax.to(torch.float32), code)
    folded = dec * torch.tensor(beta, dtype=torch.float32, device=dec.device)
    return folded.reshape(-1).repeat_interleave(BLOCK_SIZE)[:n]


def _step_constants(beta1: float, beta2: float, eps: float, count: Tensor, enabled: bool):
    """float32 ``(sqrt_scale, eps_scaled)`` of the denominator ``fma(sqrt(v), sqrt_scale,
    eps_scaled)``: ``bc1 / sqrt(bc2)`` and ``eps * bc1`` with ``bc = 1 - beta**count``, computed in
    float64 from float32 ``eps`` and rounded once (1 and ``eps`` when disabled)."""
    eps32 = torch.tensor(eps, dtype=torch.float32, device=count.device)
    if not enabled:
        return torch.ones_like(count, dtype=torch.float32), eps32.expand_as(count)
    c = count.to(torch.float64)
    bc1 = 1.0 - torch.pow(beta1, c)
    sqrt_scale = bc1 / torch.sqrt(1.0 - torch.pow(beta2, c))
    return sqrt_scale.to(torch.float32), (eps32.to(torch.float64) * bc1).to(torch.float32)


def _adam8bit_update(g: Tensor, p32: Tensor, codes_m: Tensor, absmax_m: Tensor,
                     codes_v: Tensor, absmax_v: Tensor, beta1: float, beta2: float,
                     weight_decay: float, adam_w_mode: bool, sqrt_scale: Tensor,
                     eps_scaled: Tensor, grad_scale: Optional[Tensor],
                     skip: Optional[Tensor]) -> Tensor:
    """The Adam direction ``q = m / den`` of flat fp32 ``p32`` (AdamW's decoupled decay not
    included: the callers apply it); commits the requantized moments (unless ``skip``)."""
    g32 = _unscaled(g, grad_scale).reshape(-1)
    if not adam_w_mode and weight_decay != 0.0:
        g32 = _fma_rn(_f32(weight_decay, p32), p32, g32)
    n = g32.numel()
    m_fac = _decayed_decode_factor(absmax_m, beta1, EXP_AVG_CODE, n)
    v_fac = _decayed_decode_factor(absmax_v, beta2, EXP_AVG_SQ_CODE, n)
    m_new = _fma_rn(_code_values(codes_m, EXP_AVG_CODE), m_fac, (1.0 - beta1) * g32)
    v_new = _fma_rn((1.0 - beta2) * g32, g32, _code_values(codes_v, EXP_AVG_SQ_CODE) * v_fac)
    q = m_new / _fma_rn(_sqrt_rn(v_new), sqrt_scale.expand_as(v_new),
                        eps_scaled.expand_as(v_new))
    for codes, absmax, value, code in ((codes_m, absmax_m, m_new, EXP_AVG_CODE),
                                       (codes_v, absmax_v, v_new, EXP_AVG_SQ_CODE)):
        # Note [signed zero codes]: a -0.0 moment keeps its sign, as the kernels' sign bit test.
        new_codes, new_absmax = quantize_blockwise(value, code, signed_zeros=True)
        _commit_(codes, new_codes.view(codes.shape), skip)
        _commit_(absmax, new_absmax, skip)
    return q


def multi_tensor_adam8bit_(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                           exp_avg_absmaxes: List[Tensor], exp_avg_sqs: List[Tensor],
                           exp_avg_sq_absmaxes: List[Tensor], model_params: List[Tensor],
                           step: Tensor, lr: float, beta1: float, beta2: float, eps: float,
                           weight_decay: float, adam_w_mode: bool, bias_correction: bool,
                           grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                           lr_tensor: Optional[Tensor] = None) -> None:
    """Adam / AdamW with block-wise 8-bit moments (Note [8-bit optimizer states]).

    ``exp_avgs`` / ``exp_avg_sqs`` are uint8 codes with ``params``' element counts, their absmax
    lists float32 with :func:`num_blocks` elements. Otherwise ``multi_tensor_adam_``'s conventions:
    a nonzero ``found_inf`` leaves every tensor, codes and absmax included, bit-identical, and
    ``lr_tensor`` (capturable=True), when given, is the lr, read where the step runs.
    """
    lr = _lr(lr, lr_tensor)
    skip = _skip_mask(found_inf)
    count = step + 1
    sqrt_scale, eps_scaled = _step_constants(beta1, beta2, eps, count, bias_correction)
    decoupled = adam_w_mode and weight_decay != 0.0
    lr32 = torch.as_tensor(lr, dtype=torch.float32, device=step.device)
    lr_wd = lr32 * torch.tensor(weight_decay, dtype=torch.float32, device=step.device)  # fl(lr * wd)
    for i, (p, g) in enumerate(zip(params, grads)):
        p32 = p.to(torch.float32).reshape(-1)
        q = _adam8bit_update(g, p32, exp_avgs[i], exp_avg_absmaxes[i], exp_avg_sqs[i],
                             exp_avg_sq_absmaxes[i], beta1, beta2, weight_decay, adam_w_mode,
                             sqrt_scale, eps_scaled, grad_scale, skip)
        decayed = _fma_rn(-_f32(lr_wd, p32), p32, p32) if decoupled else p32
        p_new = _fma_rn(-_f32(lr32, p32), q, decayed)
        _commit_(p, p_new.view(p.shape), skip)
        if model_params:
            _commit_(model_params[i], p_new.view(model_params[i].shape), skip)
    _commit_(step, count, skip)


def multi_tensor_adam8bit_lean_(params: List[Tensor], aux: List[Tensor], grads: List[Tensor],
                                exp_avgs: List[Tensor], exp_avg_absmaxes: List[Tensor],
                                exp_avg_sqs: List[Tensor], exp_avg_sq_absmaxes: List[Tensor],
                                step: Tensor, lr: float, beta1: float, beta2: float, eps: float,
                                weight_decay: float, adam_w_mode: bool, bias_correction: bool,
                                storage: str, seed: int, grad_scale: Optional[Tensor],
                                found_inf: Optional[Tensor]) -> None:
    """:func:`multi_tensor_adam8bit_` on bfloat16 params stored the ``storage`` way (Note [lean
    bf16 storage] in :mod:`.lean`): the 8-bit moments and direction of the fp32 value the storage
    holds, then the lean master update ``p32 + (-(lr * direction))`` (``p32 - lr * direction``
    exactly). ``aux`` and ``seed`` as in ``multi_tensor_adam_lean_``; no model copies.
    """
    _check_storage(storage)
    skip = _skip_mask(found_inf)
    count = step + 1
    sqrt_scale, eps_scaled = _step_constants(beta1, beta2, eps, count, bias_correction)
    for i, (p, g) in enumerate(zip(params, grads)):
        a = aux[i] if aux else None
        p32 = _read_param(p, a, storage)
        flat = p32.reshape(-1)
        update = _adam8bit_update(g, flat, exp_avgs[i], exp_avg_absmaxes[i], exp_avg_sqs[i],
                                  exp_avg_sq_absmaxes[i], beta1, beta2, weight_decay,
                                  adam_w_mode, sqrt_scale, eps_scaled, grad_scale, skip)
        if adam_w_mode and weight_decay != 0.0:
            update = _fma_rn(_f32(weight_decay, flat), flat, update)
        _write_param(p, a, p32, -(lr * update).view(p.shape), storage, skip, seed, count, i)
    _commit_(step, count, skip)


def multi_tensor_sgd8bit_(params: List[Tensor], grads: List[Tensor],
                          momentum_buffers: List[Tensor], momentum_buffer_absmaxes: List[Tensor],
                          model_params: List[Tensor], step: Tensor, lr: float, momentum: float,
                          dampening: float, weight_decay: float, nesterov: bool,
                          wd_after_momentum: bool, grad_scale: Optional[Tensor],
                          found_inf: Optional[Tensor], lr_tensor: Optional[Tensor] = None) -> None:
    """SGD with a block-wise 8-bit momentum buffer (Note [8-bit optimizer states]).

    ``momentum_buffers`` are uint8 codes (``EXP_AVG_CODE``) with ``params``' element counts, their
    absmax lists float32 with :func:`num_blocks` elements; ``momentum`` must be nonzero (without
    momentum there is no buffer: ``multi_tensor_sgd_``). Otherwise ``multi_tensor_sgd_``'s
    conventions: the first applied update (``step == 0``) sets the buffer to the direction, a
    nonzero ``found_inf`` leaves every tensor bit-identical, ``lr_tensor`` is the lr when given.
    """
    lr = _lr(lr, lr_tensor)
    skip = _skip_mask(found_inf)
    lr32 = torch.as_tensor(lr, dtype=torch.float32, device=step.device)
    for i, (p, g) in enumerate(zip(params, grads)):
        p32 = p.to(torch.float32).reshape(-1)
        d = _sgd8bit_direction(g, p32, momentum_buffers[i], momentum_buffer_absmaxes[i], step,
                               momentum, dampening, weight_decay, nesterov, wd_after_momentum,
                               grad_scale, skip)
        p_new = _fma_rn(-_f32(lr32, p32), d, p32)
        _commit_(p, p_new.view(p.shape), skip)
        if model_params:
            _commit_(model_params[i], p_new.view(model_params[i].shape), skip)
    _commit_(step, step + 1, skip)


def multi_tensor_sgd8bit_lean_(params: List[Tensor], aux: List[Tensor], grads: List[Tensor],
                               momentum_buffers: List[Tensor],
                               momentum_buffer_absmaxes: List[Tensor], step: Tensor, lr: float,
                               momentum: float, dampening: float, weight_decay: float,
                               nesterov: bool, wd_after_momentum: bool, storage: str, seed: int,
                               grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    """:func:`multi_tensor_sgd8bit_` on bfloat16 params stored the ``storage`` way (Note [lean
    bf16 storage] in :mod:`.lean`): the 8-bit buffer and direction of the fp32 value the storage
    holds, then the lean master update ``p32 + (-(lr * direction))``, as
    :func:`multi_tensor_adam8bit_lean_` composes it. ``aux`` and ``seed`` as in
    ``multi_tensor_sgd_lean_``; no model copies.
    """
    _check_storage(storage)
    skip = _skip_mask(found_inf)
    count = step + 1
    for i, (p, g) in enumerate(zip(params, grads)):
        a = aux[i] if aux else None
        p32 = _read_param(p, a, storage)
        d = _sgd8bit_direction(g, p32.reshape(-1), momentum_buffers[i],
                               momentum_buffer_absmaxes[i], step, momentum, dampening,
                               weight_decay, nesterov, wd_after_momentum, grad_scale, skip)
        _write_param(p, a, p32, -(lr * d).view(p.shape), storage, skip, seed, count, i)
    _commit_(step, count, skip)


def _sgd8bit_direction(g: Tensor, p32: Tensor, codes: Tensor, absmax: Tensor, step: Tensor,
                       momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                       wd_after_momentum: bool, grad_scale: Optional[Tensor],
                       skip: Optional[Tensor]) -> Tensor:
    """The SGD direction of the flat fp32 ``p32``; the new buffer's codes and absmax committed
    (unless ``skip``). The first applied update (``step == 0``) sets the buffer to the direction
    without reading the codes."""
    first = step.reshape(()) == 0
    omd = torch.tensor(1.0 - dampening, dtype=torch.float32, device=step.device)  # fl(1 - damp.)
    d = _unscaled(g, grad_scale).reshape(-1)
    if weight_decay != 0.0 and not wd_after_momentum:
        d = _fma_rn(_f32(weight_decay, p32), p32, d)
    fac = _decayed_decode_factor(absmax, momentum, EXP_AVG_CODE, d.numel())
    later = _fma_rn(_code_values(codes, EXP_AVG_CODE), fac, omd * d)
    b = torch.where(first, d, later)
    d = _fma_rn(_f32(momentum, b), b, d) if nesterov else b
    if weight_decay != 0.0 and wd_after_momentum:
        d = _fma_rn(_f32(weight_decay, p32), p32, d)
    new_codes, new_absmax = quantize_blockwise(b, EXP_AVG_CODE, signed_zeros=True)
    _commit_(codes, new_codes.view(codes.shape), skip)
    _commit_(absmax, new_absmax, skip)
    return d
