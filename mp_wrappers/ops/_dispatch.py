"""The one place that chooses an op implementation: compiled kernel or pure-PyTorch reference."""
import functools
from typing import Callable, List, Sequence

import torch
from torch import Tensor

from . import reference
from ._extension import has_kernels

__all__ = ['implementation', 'check_tensor_lists']


# Dispatch keys of the device types we may see; anything else has no kernels of ours.
_DISPATCH_KEYS = {'cpu': 'CPU', 'cuda': 'CUDA'}


@functools.lru_cache(maxsize=None)
def _op_has_kernel(name: str, device_type: str) -> bool:
    """Whether ``mp_wrappers::<name>`` is declared and has a kernel registered for ``device_type``.

    An op can be declared in bindings.cpp before any kernel file implements it (kernels land op by
    op), and calling such an op raises NotImplementedError inside the dispatcher; asking the
    dispatcher once per (op, device type) lets every other op use its kernel meanwhile. Cached:
    the registrations only change when the extension is (re)loaded, which happens once per process.
    """
    key = _DISPATCH_KEYS.get(device_type)
    if key is None:
        return False
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f'mp_wrappers::{name}', key))
    except RuntimeError:  # the op is not declared at all (an older extension build)
        return False


def implementation(name: str, device: torch.device) -> Callable:
    """Return ``torch.ops.mp_wrappers.<name>`` when it has a kernel for ``device``, else the reference.

    Decided per op, so a partially implemented extension still serves the ops it has.
    """
    if has_kernels(device) and _op_has_kernel(name, device.type):
        return getattr(torch.ops.mp_wrappers, name)
    return getattr(reference, name)


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
