"""Pure-PyTorch references of the multi-tensor ops: scale, L2 norms, axpby, loss-scale update."""
from typing import List, Tuple

import torch
from torch import Tensor

__all__ = ['multi_tensor_scale_', 'multi_tensor_l2norm', 'multi_tensor_unscale_l2norm',
           'multi_tensor_axpby_', 'update_scale_hysteresis_']


def _flag_nonfinite_(found_inf: Tensor, tensors: List[Tensor]) -> None:
    """Set ``found_inf`` to 1 when any element of ``tensors`` is inf or nan; never clear it."""
    if not tensors:
        return
    bad = torch.stack([~torch.isfinite(t).all() for t in tensors]).any()
    torch.maximum(found_inf, bad.to(found_inf.dtype).reshape(found_inf.shape), out=found_inf)


def multi_tensor_scale_(inputs: List[Tensor], outputs: List[Tensor], scale: Tensor,
                        found_inf: Tensor) -> None:
    """``outputs[i] = inputs[i] * scale`` computed in fp32, rounded to each output's dtype.

    ``found_inf`` is set when any *input* element is non-finite (the output is still written).
    """
    _flag_nonfinite_(found_inf, inputs)
    s = scale.to(torch.float32)
    for src, dst in zip(inputs, outputs):
        dst.copy_(src.to(torch.float32) * s)


def multi_tensor_l2norm(tensors: List[Tensor], per_tensor: bool) -> Tuple[Tensor, Tensor]:
    """Global L2 norm (a 0-dim fp32 tensor) and, if asked, the per-tensor norms (fp32 ``[n]``).

    The per-tensor result is an empty tensor when ``per_tensor`` is False. Accumulated in float64,
    as the kernels do: fp32 squares overflow for finite elements above ~1.8e19 (an inf norm that
    clipping would turn into zeroed gradients) and underflow below ~1e-19 (a zero norm of unscaled
    gradients when the inverse loss scale is tiny, such as 2**-127).
    """
    device = tensors[0].device if tensors else torch.device('cpu')
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device), torch.empty(0, device=device)
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors])
    total = torch.linalg.vector_norm(norms).to(torch.float32)
    norms = norms.to(torch.float32)
    return total, (norms if per_tensor else torch.empty(0, device=device))


def multi_tensor_unscale_l2norm(tensors: List[Tensor], inv_scale: Tensor, found_inf: Tensor,
                                per_tensor: bool) -> Tuple[Tensor, Tensor]:
    """Norms of ``tensors * inv_scale`` without writing them, and the non-finite check."""
    _flag_nonfinite_(found_inf, tensors)
    s = inv_scale.to(torch.float32)
    return multi_tensor_l2norm([t.to(torch.float32) * s for t in tensors], per_tensor)


def multi_tensor_axpby_(x: List[Tensor], y: List[Tensor], out: List[Tensor], a: float, b: float,
                        arg_to_check: int, found_inf: Tensor) -> None:
    """``out = a * x + b * y`` in fp32; ``arg_to_check`` -1 checks x and y, 0 only x, 1 only y."""
    if arg_to_check in (-1, 0):
        _flag_nonfinite_(found_inf, x)
    if arg_to_check in (-1, 1):
        _flag_nonfinite_(found_inf, y)
    for xi, yi, oi in zip(x, y, out):
        oi.copy_(a * xi.to(torch.float32) + b * yi.to(torch.float32))


def update_scale_hysteresis_(scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                             found_inf: Tensor, growth_factor: float, backoff_factor: float,
                             growth_interval: int, hysteresis: int, min_scale: float,
                             max_scale: float) -> None:
    """One dynamic loss-scale update, entirely on the device.

    On an overflow the hysteresis budget is decremented and, once it is used up (``hysteresis``
    consecutive overflows), the scale is multiplied by ``backoff_factor`` but never below
    ``min_scale``; the growth tracker restarts. After ``growth_interval`` consecutive clean updates the
    scale is multiplied by ``growth_factor``, never above ``max_scale`` nor to inf. A clean update
    refills the hysteresis budget. With ``hysteresis=1`` this is exactly apex amp's scaler.
    """
    overflow = found_inf.reshape(()) > 0
    hyst_left = torch.where(overflow, hysteresis_tracker - 1,
                            torch.full_like(hysteresis_tracker, hysteresis))
    backoff = overflow & (hyst_left.reshape(()) <= 0)
    grown_count = growth_tracker + 1
    grow = (~overflow) & (grown_count.reshape(()) >= growth_interval)
    down = torch.clamp(scale * backoff_factor, min=min_scale)
    up = torch.clamp(scale * growth_factor, max=max_scale)
    up = torch.where(torch.isfinite(up), up, scale)
    new_scale = torch.where(backoff, down, torch.where(grow, up, scale))
    new_growth = torch.where(overflow | grow, torch.zeros_like(growth_tracker), grown_count)
    scale.copy_(new_scale)
    growth_tracker.copy_(new_growth)
    hysteresis_tracker.copy_(hyst_left)
