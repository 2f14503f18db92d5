"""Helpers the fused optimizer references share: the conventions every update op follows.

One function per optimizer op of ``csrc/bindings.cpp`` lives in :mod:`.optimizers` and
:mod:`.lean`, each with the op's signature. Shared conventions (the kernels must reproduce them;
tests compare against the references):

* Math is float32 on float32 state (moments, sums, norms); params and grads may be float32,
  float16 or bfloat16. Params are read as float32 and the new value is rounded once to their dtype.
* grads are divided by ``grad_scale`` (when given) before anything else, as torch's fused
  optimizers do, so a GradScaler's scale is passed as it is, not inverted.
* ``found_inf`` nonzero skips the whole call: params, state, ``step`` and ``model_params`` keep
  their bits. The skip is a select on the device (compute, then keep the old value), never a
  host-side branch, so no synchronisation happens.
* ``step`` (1-element float32) is the number of updates already applied; the update being applied
  is number ``step + 1``, which bias corrections use, and ``step`` is incremented when it applies.
  Bias corrections are computed in float64 from that count and rounded to float32 (as apex does
  with ``std::pow`` on the host).
* ``model_params`` is empty or parallel to ``params``: each receives the new float32 param value
  rounded to its own dtype (the fp16/bf16 model copy of an fp32 master).
"""
from typing import Optional, Union

import torch
from torch import Tensor


def _skip_mask(found_inf: Optional[Tensor]) -> Optional[Tensor]:
    """A 0-dim bool tensor, True when the update must be skipped; None when there is no flag."""
    if found_inf is None:
        return None
    return found_inf.reshape(()) != 0


def _unscaled(grad: Tensor, grad_scale: Optional[Tensor]) -> Tensor:
    """The gradient as float32, divided by ``grad_scale`` when given (a new tensor or ``grad``)."""
    g = grad.to(torch.float32)
    if grad_scale is not None:
        g = g / grad_scale.reshape(()).to(torch.float32)
    return g


def _commit_(dst: Tensor, new: Tensor, skip: Optional[Tensor]) -> None:
    """Write ``new`` (rounded to ``dst.dtype``) into ``dst``, or leave ``dst`` bit-identical on skip."""
    new = new.to(dst.dtype)
    if skip is not None:
        new = torch.where(skip, dst, new)
    dst.copy_(new.reshape(dst.shape))


def _lr(lr: float, lr_tensor: Optional[Tensor]) -> Union[float, Tensor]:
    """The learning rate: ``lr``, or the 0-dim float32 value of ``lr_tensor`` (capturable=True; read
    where it lives, no host sync). float32 either way: a float lr multiplies fp32 tensors as fp32."""
    return lr if lr_tensor is None else lr_tensor.reshape(()).to(torch.float32)


def _bias_correction(beta: float, count: Tensor, enabled: bool) -> Tensor:
    """``1 - beta ** count`` computed in float64, as a float32 tensor (ones when disabled)."""
    if not enabled:
        return torch.ones_like(count, dtype=torch.float32)
    return (1.0 - torch.pow(beta, count.to(torch.float64))).to(torch.float32)
