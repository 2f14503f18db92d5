"""The hardware half of the doctor (``python -m mp_wrappers``): every device, its ``dtype='auto'``
and the build of our extension, as plain data.

The extension's facts come from :mod:`mp_wrappers.ops` (whether it loaded, the CPU kernel flavour it
selected and the widest the CPU can run, whether CUDA kernels were built), so this module sits above
the ops, unlike the probe.
"""
import dataclasses
import os
from typing import Dict

import torch

from .policy import auto_dtype
from .probe import FORMAT_NAMES, device_capability

__all__ = ['extension_info', 'quantized_states_info', 'report']


def extension_info() -> Dict[str, object]:
    """Build facts of ``mp_wrappers._C``: loaded or why not, CPU kernel ISA (in use and widest), CUDA."""
    from ..ops import _extension
    ext = _extension.extension()
    info: Dict[str, object] = dict(backend=_extension.backend())
    if ext is None:
        info['cpu_kernels'] = None
        info['why_missing'] = info['backend']['error']
        return info
    info['cpu_kernels'] = ext.cpu_isa()
    hardware = getattr(ext, 'cpu_isa_hardware', None)
    info['cpu_kernels_widest'] = hardware() if hardware is not None else None
    info['cpu_isa_forced'] = os.environ.get('MP_WRAPPERS_CPU_ISA') or None
    info['cuda_built'] = bool(ext.cuda_built)
    if not ext.cuda_built:
        info['cuda_why_missing'] = ('built without CUDA kernels (torch has no CUDA, no toolkit was '
                                    'found, or MP_WRAPPERS_CUDA=0 at build time)')
    elif not torch.cuda.is_available():
        info['cuda_why_missing'] = 'CUDA kernels built, but torch sees no GPU'
    return info


def quantized_states_info() -> Dict[str, object]:
    """Where ``FusedAdam(state_dtype='int8')`` runs and what its moments cost per param
    (``FusedSGD(state_dtype='int8')``: ``sgd_cpu`` / ``sgd_cuda``, the same for its own op, which
    a build may lack where it has Adam's).

    ``cpu``: the kernel flavour that runs the 8-bit update (``'cpp-avx512'``, ``'cpp-avx2'``,
    ``'cpp-baseline'``), or ``'reference'`` (the pure-PyTorch update: same bits, much slower) when the
    extension or its 8-bit kernel is missing. ``cuda``: ``'cuda'`` when the loaded build has the CUDA
    kernel, else None (the optimizer then refuses CUDA params before the first step).
    ``bytes_per_param``: the expected persistent bytes, fp32 against int8 moments
    (docs/quantized_states.md).
    """
    from ..ops import _extension
    from ..ops._dispatch import _op_has_kernel
    from ..ops.quantized_states import BLOCK_SIZE
    ext = _extension.extension()
    kernel = ext is not None and _op_has_kernel('multi_tensor_adam8bit_', 'cpu')
    cuda_kernel = ext is not None and _op_has_kernel('multi_tensor_adam8bit_', 'cuda')
    sgd_kernel = ext is not None and _op_has_kernel('multi_tensor_sgd8bit_', 'cpu')
    sgd_cuda_kernel = ext is not None and _op_has_kernel('multi_tensor_sgd8bit_', 'cuda')
    moments = 2 + 2 * 4 / BLOCK_SIZE  # a byte per element per moment, an fp32 absmax per block
    return dict(
        cpu=f'cpp-{ext.cpu_isa()}' if kernel else 'reference',
        cuda='cuda' if cuda_kernel else None,
        sgd_cpu=f'cpp-{ext.cpu_isa()}' if sgd_kernel else 'reference',
        sgd_cuda='cuda' if sgd_cuda_kernel else None,
        block_size=BLOCK_SIZE,
        bytes_per_param={
            'Adam moments': (8.0, moments),
            'SGD momentum buffer (FusedSGD)': (4.0, moments / 2),
            'fp32 params + Adam (O0)': (12.0, 4 + moments),
            'O2 bf16: model + fp32 master + Adam': (14.0, 6 + moments),
        },
    )


def report() -> Dict[str, object]:
    """Every device present with its ``dtype='auto'``, and :func:`extension_info`, as plain data
    (``python -m mp_wrappers`` prints it)."""
    devices = [device_capability('cpu')]
    if torch.cuda.is_available():
        devices += [device_capability(f'cuda:{i}') for i in range(torch.cuda.device_count())]
    return dict(
        devices=[dataclasses.asdict(d) for d in devices],
        auto={d.device: FORMAT_NAMES[auto_dtype(capability=d).dtype] for d in devices},
        extension=extension_info(),
        quantized_states=quantized_states_info(),
    )
