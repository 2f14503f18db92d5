"""Public multi-tensor ops: scale/unscale with a non-finite check, L2 norms, axpby, scale update.

Each function validates its arguments, then calls the implementation chosen by
:func:`~mp_wrappers.ops._dispatch.implementation` (kernel or reference, same semantics).
"""
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ._checks import as_tensor_list, check_tensor_lists
from ._dispatch import implementation

__all__ = ['multi_tensor_scale', 'multi_tensor_l2norm', 'multi_tensor_unscale_l2norm',
           'multi_tensor_axpby', 'update_scale_hysteresis_', 'new_found_inf']


def new_found_inf(device: Union[str, torch.device] = 'cpu') -> Tensor:
    """A cleared overflow flag: 1-element float32, as every op's ``found_inf`` argument expects."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def _as_scalar_tensor(op: str, name: str, value: Union[float, Tensor],
                      device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f'{op}: {name} must be a number or a 1-element tensor, got a tensor '
                             f'of shape {tuple(value.shape)}')
        return value.to(device=device, dtype=torch.float32).reshape(1)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f'{op}: {name} must be a float or a 1-element tensor, got {value!r}')
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def _checked_flag(op: str, found_inf: Optional[Tensor], device: torch.device) -> Tensor:
    if found_inf is None:
        return new_found_inf(device)
    if (not isinstance(found_inf, Tensor) or found_inf.numel() != 1
            or found_inf.dtype != torch.float32 or found_inf.device != device):
        raise ValueError(f'{op}: found_inf must be a 1-element float32 tensor on {device} '
                         '(see mp_wrappers.ops.new_found_inf), got '
                         f'{found_inf if not isinstance(found_inf, Tensor) else (found_inf.dtype, found_inf.device, tuple(found_inf.shape))}')
    return found_inf


def multi_tensor_scale(inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                       scale: Union[float, Tensor], found_inf: Optional[Tensor] = None) -> Tensor:
    """Write ``inputs[i] * scale`` into ``outputs[i]`` and check the inputs for inf/nan.

    The product is computed in fp32 and rounded to each output's dtype; inputs and outputs may be
    any mix of float32, float16 and bfloat16, and may be the same tensors (in-place unscale).

    Args:
        inputs: Source tensors.
        outputs: Destination tensors, parallel to ``inputs`` (same numel).
        scale: A float or a 1-element tensor (use a tensor to avoid a host sync on GPU).
        found_inf: Optional flag to accumulate into; it is set, never cleared. A fresh flag is
            created when omitted.

    Returns:
        Tensor: the 1-element float32 flag, nonzero when any input element was inf or nan.

    Examples:
        >>> grads = [p.grad for p in model.parameters()]
        >>> found_inf = multi_tensor_scale(grads, grads, 1.0 / 65536)
    """
    inputs = as_tensor_list('multi_tensor_scale', 'inputs', inputs)
    outputs = as_tensor_list('multi_tensor_scale', 'outputs', outputs)
    device = check_tensor_lists('multi_tensor_scale', ('inputs', 'outputs'), (inputs, outputs))
    flag = _checked_flag('multi_tensor_scale', found_inf, device)
    s = _as_scalar_tensor('multi_tensor_scale', 'scale', scale, device)
    if inputs:
        implementation('multi_tensor_scale_', device)(inputs, outputs, s, flag)
    return flag


def multi_tensor_l2norm(tensors: Sequence[Tensor], per_tensor: bool = False
                        ) -> Tuple[Tensor, Optional[Tensor]]:
    """L2 norm over all ``tensors`` together (a 0-dim float32 tensor) and, optionally, of each.

    Returns:
        tuple: ``(total_norm, per_tensor_norms)`` where ``per_tensor_norms`` is a float32 tensor of
        shape ``[len(tensors)]`` when ``per_tensor`` is True, else None.
    """
    tensors = as_tensor_list('multi_tensor_l2norm', 'tensors', tensors)
    device = check_tensor_lists('multi_tensor_l2norm', ('tensors',), (tensors,))
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device), (
            torch.zeros(0, dtype=torch.float32, device=device) if per_tensor else None)
    total, norms = implementation('multi_tensor_l2norm', device)(tensors, bool(per_tensor))
    return total, (norms if per_tensor else None)


def multi_tensor_unscale_l2norm(tensors: Sequence[Tensor], inv_scale: Union[float, Tensor],
                                found_inf: Optional[Tensor] = None, per_tensor: bool = False
                                ) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """Norms of ``tensors * inv_scale`` and a non-finite check, in one read-only pass.

    Returns:
        tuple: ``(total_norm, per_tensor_norms or None, found_inf)``.
    """
    op = 'multi_tensor_unscale_l2norm'
    tensors = as_tensor_list(op, 'tensors', tensors)
    device = check_tensor_lists(op, ('tensors',), (tensors,))
    flag = _checked_flag(op, found_inf, device)
    s = _as_scalar_tensor(op, 'inv_scale', inv_scale, device)
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device), (
            torch.zeros(0, dtype=torch.float32, device=device) if per_tensor else None), flag
    total, norms = implementation(op, device)(tensors, s, flag, bool(per_tensor))
    return total, (norms if per_tensor else None), flag


def multi_tensor_axpby(x: Sequence[Tensor], y: Sequence[Tensor], out: Sequence[Tensor], a: float,
                       b: float, arg_to_check: int = -1, found_inf: Optional[Tensor] = None
                       ) -> Tensor:
    """``out = a * x + b * y`` (fp32 math), checking x (0), y (1) or both (-1) for inf/nan."""
    x, y, out = (as_tensor_list('multi_tensor_axpby', n, v) for n, v in (('x', x), ('y', y),
                                                                          ('out', out)))
    op = 'multi_tensor_axpby'
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f'{op}: arg_to_check={arg_to_check!r}; allowed: -1 (x and y), 0 (x), 1 (y)')
    device = check_tensor_lists(op, ('x', 'y', 'out'), (x, y, out))
    flag = _checked_flag(op, found_inf, device)
    if x:
        implementation('multi_tensor_axpby_', device)(x, y, out, float(a), float(b),
                                                       int(arg_to_check), flag)
    return flag


def update_scale_hysteresis_(scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                             found_inf: Tensor, growth_factor: float, backoff_factor: float,
                             growth_interval: int, hysteresis: int = 1, min_scale: float = 0.0,
                             max_scale: float = float('inf')) -> None:
    """Update a dynamic loss scale on its device (see ``reference.update_scale_hysteresis_``).

    ``scale`` is a 1-element float32 tensor, the trackers 1-element int32 tensors on the same device.
    """
    implementation('update_scale_hysteresis_', scale.device)(
        scale, growth_tracker, hysteresis_tracker, found_inf, float(growth_factor),
        float(backoff_factor), int(growth_interval), int(hysteresis), float(min_scale),
        float(max_scale))
