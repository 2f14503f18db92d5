"""Argument checks shared by every entry point of the ops: tensor lists, scalars, hyperparameters.

A leaf of :mod:`mp_wrappers.ops`: the public ops, the fake kernels (registered while the extension
loads) and :mod:`mp_wrappers.optim` all check with these, so one wording reaches the user whichever
way a call came in, and nothing here imports the dispatcher or the extension.
"""
import math
import numbers
from typing import Any, List, Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = ['check_tensor_lists', 'as_tensor_list']


# ---- tensor lists ---------------------------------------------------------------------------------

def as_tensor_list(op: str, name: str, value: Any) -> List[Tensor]:
    """``list(value)``, refusing a bare tensor: ``list(t)`` would silently split it into its rows."""
    if isinstance(value, Tensor):
        raise TypeError(f'{op}: {name} must be a list of tensors, got a Tensor of shape '
                        f'{tuple(value.shape)}; wrap it in a list: [{name}]')
    return list(value)


def check_tensor_lists(op: str, names: Sequence[str], lists: Sequence[List[Tensor]],
                       allow_empty: Sequence[str] = ()) -> torch.device:
    """Validate parallel tensor lists the way every multi-tensor op needs them; return the device.

    Lists must have the same length, every tensor must be a dense, contiguous floating-point tensor on
    one device, and tensors at the same position must have the same number of elements. A list named
    in ``allow_empty`` may also be empty (optional outputs such as ``model_params``).
    """
    ref_name, ref = names[0], lists[0]
    for name, tensors in zip(names, lists):
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f'{op}: {name} must be a list of tensors, got {type(tensors).__name__}')
        if name in allow_empty and len(tensors) == 0:
            continue
        if len(tensors) != len(ref):
            raise ValueError(f'{op}: {name} has {len(tensors)} tensors but {ref_name} has '
                             f'{len(ref)}; the lists must be parallel')
    device = None
    for name, tensors in zip(names, lists):
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise TypeError(f'{op}: {name}[{i}] is a {type(t).__name__}, not a tensor')
            if t.is_sparse:
                raise RuntimeError(f'{op}: {name}[{i}] is sparse; only dense tensors are supported')
            if not t.is_floating_point():
                raise TypeError(f'{op}: {name}[{i}] has dtype {t.dtype}; expected float32, '
                                'float16 or bfloat16')
            if not t.is_contiguous():
                raise ValueError(f'{op}: {name}[{i}] (shape {tuple(t.shape)}) is not contiguous; '
                                 'call .contiguous() first')
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f'{op}: {name}[{i}] is on {t.device} but the other tensors are on '
                                 f'{device}; all tensors of one call must share a device')
            if t.numel() != ref[i].numel():
                raise ValueError(f'{op}: {name}[{i}] has {t.numel()} elements but {ref_name}[{i}] '
                                 f'has {ref[i].numel()}')
    return device if device is not None else torch.device('cpu')


# ---- hyperparameter checks, shared with mp_wrappers.optim -------------------------------------

def _check_lr(owner: str, lr: Union[float, Tensor]) -> None:
    """A number >= 0, or (an optimizer group's, capturable) a 1-element float32 tensor holding one:
    its value is read here, at construction or loading, never in a step."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or lr.dtype != torch.float32:
            raise ValueError(f'{owner}: Invalid learning rate: a tensor lr must be a 1-element '
                             f'float32 tensor, got dtype {lr.dtype} and shape {tuple(lr.shape)}')
        value = float(lr.detach().reshape(()))
        if not 0.0 <= value < math.inf:
            raise ValueError(f'{owner}: Invalid learning rate: the tensor lr holds {value!r}; '
                             'expected lr >= 0 and finite')
        return
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not 0.0 <= lr < math.inf:
        raise ValueError(f'{owner}: Invalid learning rate: {lr!r}; expected a number lr >= 0 and '
                         'finite')


def is_flag(value: Any) -> bool:
    """True/False, a numpy bool, 1/0, or None (taken as False, as it always was): anything but a
    string such as 'False', which ``bool()`` would take as True, or another number."""
    if value is None or isinstance(value, (bool, numbers.Integral)):
        return value is None or value in (0, 1)
    kind = type(value)  # numpy.bool (numpy.bool_ before numpy 2), without importing numpy
    return kind.__module__ == 'numpy' and kind.__name__ in ('bool', 'bool_')


def _check_flag(owner: str, option: str, value: Any) -> None:
    if not is_flag(value):
        raise ValueError(f'{owner}: {option}={value!r} must be True or False')


def _as_pair(betas: Any) -> Any:
    """Betas given as a list (a config's) or an array as the tuple torch's optimizers keep; what is
    not iterable as it is, for _check_betas to refuse by name (``tuple(None)`` would fail with a
    bare TypeError)."""
    if isinstance(betas, (str, bytes, dict)) or not (hasattr(betas, '__len__')
                                                     and hasattr(betas, '__getitem__')):
        return betas  # not an ordered sequence (a set's order would be its hashes')
    return tuple(betas)  # a numpy array's too


def _check_betas(owner: str, betas: Sequence[float]) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f'{owner}: Invalid betas: {betas!r}; expected a pair (beta1, beta2)')
    for i, beta in enumerate(betas):
        if not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f'{owner}: Invalid beta parameter at index {i}: {beta!r}; '
                             'expected 0 <= beta < 1')


def _check_nonnegative(owner: str, option: str, value: float, finite: bool = True) -> None:
    """A number >= 0; finite unless ``finite=False`` (LAMB's max_grad_norm: inf clips nothing).
    An infinite lr, eps, weight decay, momentum or dampening would leave inf/nan params after
    one step."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0.0
            or (finite and value == math.inf)):
        raise ValueError(f'{owner}: Invalid {option} value: {value!r}; expected {option} >= 0'
                         + (' and finite' if finite else ''))


def _check_norm_type(owner: str, norm_type: int) -> None:
    if norm_type not in (0, 2) or isinstance(norm_type, bool):
        raise ValueError(f'{owner}: Invalid norm_type: {norm_type!r}; expected 2 (L2 norm) or '
                         '0 (infinity norm)')


# ---- tensor-argument checks ------------------------------------------------------------------------

def _check_lists(op: str, names: Sequence[str], lists: Sequence[List[Tensor]],
                 allow_empty: Sequence[str] = (), fp32: Sequence[str] = ()) -> torch.device:
    device = check_tensor_lists(op, names, lists, allow_empty=allow_empty)
    for name, tensors in zip(names, lists):
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise TypeError(f'{op}: {name} mixes dtypes {sorted(map(str, dtypes))}; each list must '
                            'hold one dtype (call once per dtype)')
        if name in fp32 and dtypes and dtypes != {torch.float32}:
            raise TypeError(f'{op}: {name} has dtype {dtypes.pop()}; optimizer state must be '
                            'float32')
    return device


def _check_scalar(op: str, name: str, t: Optional[Tensor], device: torch.device,
                  optional: bool = True) -> Optional[Tensor]:
    if t is None:
        if optional:
            return None
        raise TypeError(f'{op}: {name} is required')
    if (not isinstance(t, Tensor) or t.numel() != 1 or t.dtype != torch.float32
            or t.device != device):
        got = ((t.dtype, str(t.device), tuple(t.shape)) if isinstance(t, Tensor)
               else type(t).__name__)
        raise ValueError(f'{op}: {name} must be a 1-element float32 tensor on {device}, got {got}')
    return t


def _check_step(op: str, step: Tensor, device: torch.device) -> None:
    _check_scalar(op, 'step', step, device, optional=False)
    if not step.is_contiguous():
        raise ValueError(f'{op}: step must be contiguous')


def _check_seed(op: str, seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f'{op}: seed must be an int, got {seed!r}')


def _check_adam_scalars(op: str, lr: float, beta1: float, beta2: float, eps: float,
                        weight_decay: float, step: Tensor, grad_scale: Optional[Tensor],
                        found_inf: Optional[Tensor], device: torch.device,
                        seed: Optional[int] = None) -> None:
    """The hyperparameters and scalar tensors of an Adam op, in the order errors are reported
    (``seed``: the lean ops' stochastic-rounding seed, checked when given)."""
    _check_lr(op, lr)
    _check_betas(op, (beta1, beta2))
    _check_nonnegative(op, 'eps', eps)
    _check_nonnegative(op, 'weight_decay', weight_decay)
    if seed is not None:
        _check_seed(op, seed)
    _check_step_scalars(op, step, grad_scale, found_inf, device)


def _check_step_scalars(op: str, step: Tensor, grad_scale: Optional[Tensor],
                        found_inf: Optional[Tensor], device: torch.device) -> None:
    """The step counter and the optional scale and overflow flag of an update op."""
    _check_step(op, step, device)
    _check_scalar(op, 'grad_scale', grad_scale, device)
    _check_scalar(op, 'found_inf', found_inf, device)


def _check_sgd_hyper(op: str, momentum: float, dampening: float, weight_decay: float,
                     nesterov: bool) -> None:
    """The hyperparameters of an SGD op (torch.optim.SGD's rules for Nesterov)."""
    _check_nonnegative(op, 'momentum', momentum)
    _check_nonnegative(op, 'dampening', dampening)
    _check_nonnegative(op, 'weight_decay', weight_decay)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f'{op}: nesterov=True requires momentum > 0 and dampening == 0, got '
                         f'momentum={momentum!r}, dampening={dampening!r}')
