"""What ``dtype='auto'`` means on a device, and the warning for a dtype it does not run natively.

:func:`auto_dtype` is what ``dtype='auto'`` means everywhere (the wrappers, ``DigitsCNN``,
``tools/train.py --amp``): bf16 where it is native, else fp16 where that is native, else fp32.
:func:`slowdown_reason` is the warning for an explicit dtype the device does not run natively.
Both decide from a :class:`~mp_wrappers.hardware.probe.DeviceCapability`, given (tests) or probed.
"""
import dataclasses
from typing import Optional, Union

import torch

from .probe import FORMAT_NAMES, DeviceCapability, device_capability

__all__ = ['AutoDtype', 'auto_dtype', 'resolve_dtype', 'slowdown_reason']


@dataclasses.dataclass(frozen=True)
class AutoDtype:
    """What ``dtype='auto'`` resolved to on one device, and why (one log line)."""

    dtype: torch.dtype
    device: str
    reason: str


def auto_dtype(device: Union[str, torch.device, None] = None,
               capability: Optional[DeviceCapability] = None) -> AutoDtype:
    """What ``dtype='auto'`` means on ``device``: bf16 if native, else fp16 if native, else fp32.

    bf16 comes first because it has fp32's exponent range (no loss scaling needed). On CUDA this is
    bf16 from sm_80 and fp16 before; on a CPU without native half formats it is fp32: mixed precision
    would only add conversions there.

    Args:
        device: The training device (default: CUDA when available, else CPU).
        capability: A :class:`DeviceCapability` to decide for (tests); default: probe ``device``.
    """
    cap = capability if capability is not None else device_capability(device)
    for name, dtype in (('bfloat16', torch.bfloat16), ('float16', torch.float16)):
        if name in cap.native:
            why = 'native' if name == 'bfloat16' else 'native, bfloat16 is not'
            return AutoDtype(dtype, cap.device,
                             f"dtype='auto' resolved to {name} on {cap.device} ({cap.name}, "
                             f'{cap.isa}): {name} is {why} there')
    if cap.instructions:
        why = ('its half-precision instructions run no faster than fp32 ('
               + '; '.join(f'{fmt}: {slow}' for fmt, slow in cap.instructions) + ')')
    else:
        why = 'it has no native bfloat16 or float16 instructions'
    return AutoDtype(torch.float32, cap.device,
                     f"dtype='auto' resolved to float32 on {cap.device} ({cap.name}, {cap.isa}): "
                     f'{why}, so half precision would run slower than fp32 here; the wrapper '
                     'keeps its scaling, skipping and checkpoint behaviour, and computes in fp32')


def resolve_dtype(dtype: Union[str, torch.dtype], device: Union[str, torch.device, None] = None,
                  capability: Optional[DeviceCapability] = None) -> torch.dtype:
    """``torch.float32/float16/bfloat16`` for ``dtype``, resolving ``'auto'`` with :func:`auto_dtype`."""
    if isinstance(dtype, str) and dtype == 'auto':
        return auto_dtype(device, capability).dtype
    from ..casting import parse_dtype
    return parse_dtype(dtype, 'dtype', allowed=('float16', 'bfloat16', 'float32'))


def slowdown_reason(dtype: torch.dtype, device: Union[str, torch.device, None] = None,
                    capability: Optional[DeviceCapability] = None) -> Optional[str]:
    """A warning for computing in ``dtype`` on ``device`` when it has no native instructions.

    Returns None when ``dtype`` is native there (or fp32). The text states the class of machine and
    what was measured on that class, and names the dtype ``'auto'`` would pick.
    """
    cap = capability if capability is not None else device_capability(device)
    if cap.is_native(dtype):
        return None
    name = FORMAT_NAMES.get(dtype, str(dtype))
    short = {'bfloat16': 'bf16', 'float16': 'fp16'}.get(name, name)
    auto = auto_dtype(capability=cap).dtype
    slow = dict(cap.instructions).get(name)
    if slow is not None:
        return (f'{short} on this CPU ({cap.name}, {cap.isa}) has {slow}: expect slower than '
                f'fp32. Use dtype=\'auto\' (here: dtype=\'{FORMAT_NAMES[auto]}\').')
    if cap.device == 'cpu':
        measured = {
            'bfloat16': 'measured on an AVX2-only CPU: the digits CNN 8x slower than fp32',
            'float16': 'measured on an AVX-512 CPU without AVX512-FP16: fp16 matmuls ~100x '
                       'slower than fp32',
        }.get(name, '')
        what = f'{short} on this CPU ({cap.name}, {cap.isa}) has no native instructions'
    else:
        measured = 'bf16 is emulated before sm_80'
        what = f'{short} on {cap.device} ({cap.name}, {cap.isa}) has no native instructions'
    return (f'{what}: expect slower than fp32 ({measured}). Use dtype=\'auto\' (here: '
            f'dtype=\'{FORMAT_NAMES[auto]}\').')
