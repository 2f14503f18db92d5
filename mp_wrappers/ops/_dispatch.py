"""The one place that chooses an op implementation: compiled kernel or pure-PyTorch reference."""
import functools
from typing import Callable

import torch

from . import reference
from ._extension import has_kernels

__all__ = ['implementation', 'run']


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


def run(name: str, device: torch.device, *args) -> None:
    """Call the implementation of the mutating op ``name`` for ``device`` on ``args``."""
    # The ops write leaf tensors that require grad (parameters): that must not be recorded.
    with torch.no_grad():
        implementation(name, device)(*args)
