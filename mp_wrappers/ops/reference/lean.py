"""Pure-PyTorch references of the lean bf16 optimizer ops (no separate fp32 master copy).

Note [lean bf16 storage]
    A bf16 parameter can carry what an fp32 master carries, or most of it, in three ways; each op
    here takes the name of one as ``storage`` and a parallel list ``aux`` of the extra per-element
    state it needs:

    ``'split'``
        An fp32 number is exactly its top 16 bits (a bf16, the value rounded toward zero) followed
        by 16 low bits. The param holds the top half and ``aux`` (``torch.uint16``) the low half, so
        together they ARE the fp32 master (4 B/param instead of bf16 model 2 B + fp32 master 4 B).
        The update reconstructs the exact fp32 value, applies the same fp32 arithmetic as the
        fused O2 step (``multi_tensor_adam_`` / ``multi_tensor_sgd_`` with fp32 masters) and
        writes both halves back: the master evolves bit for bit as O2's for the same gradients. The
        one difference is the forward weight: the top half is the master rounded toward zero,
        where O2 rounds its bf16 model copy to nearest.
    ``'kahan'``
        No master: ``aux`` (bf16) is a Kahan compensation holding what the last bf16 roundings
        of the param dropped. The update adds it to the increment before rounding and keeps the new
        rounding error: ``c = comp - lr*u; y = p + c; p' = bf16(y); comp' = bf16(c - (p' - p))``
        (optimi, AnyPrecisionAdamW). ``p + comp`` is the best fp32 estimate of the weight.
    ``'stochastic'``
        No master and no ``aux`` (an empty list): the fp32 result is rounded to bf16 up or down
        with probabilities proportional to its distance to each neighbour, so small updates are not
        lost on average (torchao). The random bits are a hash of ``(seed, update number, position of
        the tensor in the list, element index)`` (:func:`stochastic_bits`): the same on every
        backend, ISA and thread count, and reproducible after a resume.

    Moments / momentum buffers may be float32 or bfloat16 (the optimizers' ``state_dtype``): they
    are read as fp32, updated in fp32 and rounded to nearest when stored. All other conventions
    (grad_scale, found_inf, step) are those of the fused optimizer updates in
    :mod:`mp_wrappers.ops.reference._common`.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ... import compat
from ._common import _bias_correction, _commit_, _skip_mask, _unscaled

__all__ = ['LEAN_STORAGES', 'bf16_join', 'bf16_split', 'stochastic_bits', 'round_stochastic',
           'multi_tensor_adam_lean_', 'multi_tensor_sgd_lean_']

#: The storage modes of Note [lean bf16 storage], with the dtype of their ``aux`` tensors.
#: torch.uint16 exists from torch 2.3: before it 'split' maps to None and every entry point refuses
#: it with :func:`mp_wrappers.compat.require` ('uint16') before looking its dtype up.
LEAN_STORAGES = {'split': getattr(torch, 'uint16', None), 'kahan': torch.bfloat16,
                 'stochastic': None}

_M32 = 0xFFFFFFFF
# Multipliers of the 32-bit mixer below. Both are odd and below 2**31, so a product with a 32-bit
# value fits an int64 tensor exactly (the reference does the hash in int64 arithmetic).
_MIX1 = 0x7FEB352D
_MIX2 = 0x5BD1E995
_GOLDEN = 0x9E3779B1


def bf16_join(hi: Tensor, lo: Tensor) -> Tensor:
    """The fp32 tensor whose top 16 bits are ``hi`` (bfloat16) and low 16 bits ``lo`` (uint16).

    Exact (bit concatenation, no arithmetic). Little-endian layout, like every machine torch runs on.
    """
    pair = torch.stack([lo.reshape(-1).view(torch.int16), hi.reshape(-1).view(torch.int16)], dim=-1)
    return pair.contiguous().view(torch.float32).reshape(hi.shape)


def bf16_split(x: Tensor) -> Tuple[Tensor, Tensor]:
    """``(hi, lo)``: the top half of each fp32 of ``x`` as bfloat16 (rounded toward zero) and the
    low half as uint16, so that ``bf16_join(hi, lo)`` is ``x`` bit for bit."""
    compat.require('uint16')
    halves = x.to(torch.float32).contiguous().reshape(-1).view(torch.int16).reshape(-1, 2)
    lo = halves[:, 0].contiguous().view(torch.uint16).reshape(x.shape)
    hi = halves[:, 1].contiguous().view(torch.bfloat16).reshape(x.shape)
    return hi, lo


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift / multiply) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _M32
    return x ^ (x >> 16)


def stochastic_bits(seed: int, count: Tensor, index: int, numel: int) -> Tensor:
    """The 32 random bits (int64 values < 2**32) of each element of tensor ``index`` of a call.

    ``count`` is the update number (``step + 1``, a float32 tensor on the device: no host read).
    Per tensor: ``key = mix(mix(seed ^ mix(count)) ^ (index * 0x9E3779B1))``; per element ``i``:
    ``mix(i ^ key)``, all modulo 2**32. The kernels compute the same function.
    """
    device = count.device
    c = count.reshape(()).to(torch.int64) & _M32
    key = _mix32(_mix32((seed & _M32) ^ _mix32(c)) ^ ((index * _GOLDEN) & _M32))
    i = torch.arange(numel, dtype=torch.int64, device=device) & _M32
    return _mix32(i ^ key)


def round_stochastic(x: Tensor, bits: Tensor) -> Tensor:
    """Round fp32 ``x`` to bfloat16 up or down at random: add the low 16 random bits to the fp32
    bit pattern and keep its top half (a carry rounds the magnitude up). NaN becomes 0x7FC0."""
    flat = x.to(torch.float32).contiguous().reshape(-1)
    pattern = flat.view(torch.int32).to(torch.int64) & _M32
    top = (pattern + (bits & 0xFFFF)) >> 16
    top = torch.where(torch.isnan(flat), torch.full_like(top, 0x7FC0), top)
    top = torch.where(top >= 0x8000, top - 0x10000, top).to(torch.int16)
    return top.view(torch.bfloat16).reshape(x.shape)


def _check_storage(storage: str) -> None:
    if storage not in LEAN_STORAGES:
        raise ValueError(f'storage={storage!r} is not allowed; expected one of '
                         f'{sorted(LEAN_STORAGES)}')
    if storage == 'split':
        compat.require('uint16')


def _read_param(p: Tensor, aux: Optional[Tensor], storage: str) -> Tensor:
    return bf16_join(p, aux) if storage == 'split' else p.to(torch.float32)


def _write_param(p: Tensor, aux: Optional[Tensor], p32: Tensor, delta: Tensor, storage: str,
                 skip: Optional[Tensor], seed: int, count: Tensor, index: int) -> None:
    """Store ``p32 + delta`` (``delta = -lr * direction``) into the bf16 param the storage way."""
    if storage == 'kahan':
        c = aux.to(torch.float32) + delta
        new = (p32 + c).to(torch.bfloat16)
        _commit_(aux, c - (new.to(torch.float32) - p32), skip)
        _commit_(p, new, skip)
        return
    new32 = p32 + delta
    if storage == 'split':
        hi, lo = bf16_split(new32)
        _commit_(p, hi, skip)
        # Through int16 views (same bits): torch 2.3-2.6 have torch.uint16 but no CPU torch.where
        # for it ("where_cpu" not implemented for 'UInt16'), which _commit_ may use.
        _commit_(aux.view(torch.int16), lo.view(torch.int16), skip)
    else:
        _commit_(p, round_stochastic(new32, stochastic_bits(seed, count, index, p.numel())), skip)


def multi_tensor_adam_lean_(params: List[Tensor], aux: List[Tensor], grads: List[Tensor],
                            exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], step: Tensor,
                            lr: float, beta1: float, beta2: float, eps: float,
                            weight_decay: float, adam_w_mode: bool, bias_correction: bool,
                            storage: str, seed: int, grad_scale: Optional[Tensor],
                            found_inf: Optional[Tensor]) -> None:
    """Adam / AdamW on bfloat16 params stored the ``storage`` way (Note [lean bf16 storage]).

    The fp32 arithmetic is that of ``reference.multi_tensor_adam_`` in the same order; only how the
    param is read and written differs (``p32 - lr * update`` is ``p32 + (-(lr * update))`` exactly).
    """
    _check_storage(storage)
    skip = _skip_mask(found_inf)
    count = step + 1
    bc1 = _bias_correction(beta1, count, bias_correction)
    bc2 = _bias_correction(beta2, count, bias_correction)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        a = aux[i] if aux else None
        p32 = _read_param(p, a, storage)
        g32 = _unscaled(g, grad_scale)
        if not adam_w_mode and weight_decay != 0.0:
            g32 = g32 + weight_decay * p32
        m_new = beta1 * m.to(torch.float32) + (1.0 - beta1) * g32
        v_new = beta2 * v.to(torch.float32) + (1.0 - beta2) * g32 * g32
        update = (m_new / bc1) / (torch.sqrt(v_new / bc2) + eps)
        if adam_w_mode and weight_decay != 0.0:
            update = update + weight_decay * p32
        _commit_(m, m_new, skip)
        _commit_(v, v_new, skip)
        _write_param(p, a, p32, -(lr * update), storage, skip, seed, count, i)
    _commit_(step, count, skip)


def multi_tensor_sgd_lean_(params: List[Tensor], aux: List[Tensor], grads: List[Tensor],
                           momentum_buffers: List[Tensor], step: Tensor, lr: float,
                           momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                           wd_after_momentum: bool, storage: str, seed: int,
                           grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    """SGD with momentum on bfloat16 params stored the ``storage`` way (Note [lean bf16 storage]).

    The fp32 arithmetic is that of ``reference.multi_tensor_sgd_``; ``momentum_buffers`` may be
    empty when ``momentum == 0``.
    """
    _check_storage(storage)
    skip = _skip_mask(found_inf)
    count = step + 1
    first = step.reshape(()) == 0
    for i, (p, g) in enumerate(zip(params, grads)):
        a = aux[i] if aux else None
        p32 = _read_param(p, a, storage)
        d = _unscaled(g, grad_scale)
        if weight_decay != 0.0 and not wd_after_momentum:
            d = d + weight_decay * p32
        if momentum != 0.0:
            buf = momentum_buffers[i]
            buf_new = torch.where(first, d, momentum * buf.to(torch.float32) + (1.0 - dampening) * d)
            d = d + momentum * buf_new if nesterov else buf_new
            _commit_(buf, buf_new, skip)
        if weight_decay != 0.0 and wd_after_momentum:
            d = d + weight_decay * p32
        _write_param(p, a, p32, -(lr * d), storage, skip, seed, count, i)
    _commit_(step, count, skip)
