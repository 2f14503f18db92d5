"""The one place that chooses an op implementation: compiled kernel or pure-PyTorch reference.

The choice is made when the extension loads, not per call (Note [dispatch decided at registration]
in :mod:`._registration`): per call this is a lookup, which ``torch.compile`` traces without a
graph break.
"""
from typing import Callable

import torch

from . import _registration, reference
from ._extension import has_kernels

__all__ = ['implementation', 'run']


def _op_has_kernel(name: str, device_type: str) -> bool:
    """Whether ``mp_wrappers::<name>`` has a compiled kernel for ``device_type`` (a reference
    registered in its place does not count): what the kernel tests and the doctor check."""
    return _registration.has_compiled_kernel(name, device_type)


def implementation(name: str, device: torch.device) -> Callable:
    """Return ``torch.ops.mp_wrappers.<name>`` when the loaded extension covers ``device``'s type,
    else the reference.

    The op itself then runs its compiled kernel, or the reference registered as its kernel where
    the build has none for that device (kernels land op by op).
    """
    if has_kernels(device):
        impls = _registration.implementations(device.type)
        if impls is not None:
            return impls[name]
    return getattr(reference, name)


def run(name: str, device: torch.device, *args) -> None:
    """Call the implementation of the mutating op ``name`` for ``device`` on ``args``."""
    # The ops write leaf tensors that require grad (parameters): that must not be recorded.
    with torch.no_grad():
        implementation(name, device)(*args)
