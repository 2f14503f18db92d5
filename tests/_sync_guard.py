"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode('error')``.

Under :func:`mp_wrappers.step_outcomes.simulate_accelerator` CPU tensors play the accelerator's
tensors; :func:`forbid_host_reads` then fails every Python-level read of a tensor's values
(``.item()``, ``bool()``, ``float()``, ``.tolist()``...), each of which would wait for the device on a
GPU. The wrappers' pinned host copies (marked with ``HOST_COPY_ATTR``) are host memory and pass.
It sees reads made from Python only, which is where ours are: the kernels take their scalars as
device pointers. It cannot see syncs inside C++ ops (``.cpu()``, ``torch.equal``, ``nonzero``,
boolean-mask indexing), and under ``simulate_accelerator`` the code's other ``device.type == 'cpu'``
branches still take their CPU side (the static scaler's host update, the unit-scale loss check),
which a CUDA step never runs. A GPU run checks the real thing: tests/kernels/test_cuda_paths.py, under
``torch.cuda.set_sync_debug_mode('error')``.
"""
import contextlib
from typing import Iterator, List

import torch

from mp_wrappers.step_outcomes import HOST_COPY_ATTR

_READS = ('item', '__bool__', '__float__', '__int__', '__index__', 'tolist', 'numpy', '__array__')


class HostRead(AssertionError):
    """A tensor's value was read on the host inside :func:`forbid_host_reads`."""


@contextlib.contextmanager
def forbid_host_reads() -> Iterator[List[str]]:
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def guarded(name):
        original = saved[name]

        def read(self, *args, **kwargs):
            if getattr(self, HOST_COPY_ATTR, False):
                return original(self, *args, **kwargs)
            raise HostRead(f'host read of a device value: Tensor.{name} on a tensor of shape '
                           f'{tuple(self.shape)}')
        return read

    for name in _READS:
        setattr(torch.Tensor, name, guarded(name))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
