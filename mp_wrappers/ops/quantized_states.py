"""Public op of block-wise 8-bit optimizer states: Adam/AdamW with uint8 moment codes.

See Note [8-bit optimizer states] in :mod:`mp_wrappers.ops.reference.quant` for the codes and the
per-block absmax. :func:`multi_tensor_adam8bit` validates its arguments the way
:mod:`mp_wrappers.ops.optimizers` does and calls the implementation chosen by
:func:`~mp_wrappers.ops._dispatch.implementation`: on the CPU the CPU kernel (or the reference when
the extension is not built), on CUDA the CUDA kernel (``csrc/cuda/multi_tensor_adam8bit.cu``, one
warp per quantization block). CUDA tensors are accepted only where the loaded build has that CUDA
kernel; elsewhere (a CPU-only build, any other device type) :func:`check_quantized_device` refuses
them before any work, naming the fix, rather than running the pure-PyTorch reference on the GPU.
The argument order follows the op schema in ``csrc/bindings.cpp``.
:class:`mp_wrappers.optim.FusedAdam` with ``state_dtype='int8'`` builds these lists for you.
"""
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from ._checks import _check_adam_scalars, _check_lists
from ._dispatch import _op_has_kernel, run
from .lean import _check_lean
from .optimizers import _split_lr
from .reference.quant import BLOCK_SIZE, num_blocks

__all__ = ['multi_tensor_adam8bit', 'multi_tensor_adam8bit_lean', 'BLOCK_SIZE', 'num_blocks', 'check_quantized_device',
           'has_quantized_kernel']


def has_quantized_kernel(device_type: str, lean: bool = False) -> bool:
    """Whether 8-bit optimizer states run on ``device_type``: always on the CPU (the kernel, or the
    reference without the extension); on CUDA when the loaded build has the CUDA kernel (of
    ``multi_tensor_adam8bit_lean_`` when ``lean``: bf16 params with lean storage)."""
    if device_type == 'cpu':
        return True
    op = 'multi_tensor_adam8bit_lean_' if lean else 'multi_tensor_adam8bit_'
    return device_type == 'cuda' and _op_has_kernel(op, 'cuda')


def check_quantized_device(owner: str, device: torch.device,
                           bf16_storage: Optional[str] = None) -> None:
    """Refuse a device without 8-bit state kernels (:func:`has_quantized_kernel`); with a
    ``bf16_storage`` (lean bf16 params), a device without the lean 8-bit kernel."""
    if has_quantized_kernel(device.type, lean=bf16_storage is not None):
        return
    why = ('this mp_wrappers build has no CUDA kernels (rebuild it with MP_WRAPPERS_CUDA=1 '
           'against a CUDA torch, docs/cuda.md)' if device.type == 'cuda' else
           f'there is no {device.type} kernel')
    where = (f'run on CPU tensors, and on CUDA tensors with a build that has CUDA kernels; got '
             f'tensors on {device} and {why}')
    if bf16_storage is not None:
        raise NotImplementedError(
            f"{owner}: 8-bit optimizer states (state_dtype='int8') with bf16_storage="
            f"{bf16_storage!r} (a wrapper's master_weights={bf16_storage!r}) {where}. Allowed on "
            f"{device.type}: state_dtype='int8' with fp32 masters (master_weights=True / "
            f"opt_level='O2', bf16_storage=None), or state_dtype='float32' with "
            f'bf16_storage={bf16_storage!r}')
    raise NotImplementedError(
        f"{owner}: 8-bit optimizer states (state_dtype='int8') {where}. Use "
        f"state_dtype='float32' on {device.type}")


def _checked_states(op: str, params: List[Tensor], device: torch.device, *states: Sequence[Tensor]
                    ) -> List[List[Tensor]]:
    """The four state lists (codes and absmaxes of m, then of v) as lists, checked against
    ``params``."""
    kinds = (('exp_avgs', torch.uint8, int), ('exp_avg_absmaxes', torch.float32, num_blocks),
             ('exp_avg_sqs', torch.uint8, int), ('exp_avg_sq_absmaxes', torch.float32, num_blocks))
    lists = []
    for tensors, (name, dtype, numel) in zip(states, kinds, strict=True):
        tensors = list(tensors)
        _check_state(op, name, tensors, params, dtype, numel, device)
        lists.append(tensors)
    return lists


def _check_state(op: str, name: str, tensors: List[Tensor], params: List[Tensor],
                 dtype: torch.dtype, numel, device: torch.device) -> None:
    if len(tensors) != len(params):
        raise ValueError(f'{op}: {name} has {len(tensors)} tensors but params has {len(params)}; '
                         'the lists must be parallel')
    for i, (t, p) in enumerate(zip(tensors, params)):
        want = numel(p.numel())
        if (not isinstance(t, Tensor) or t.dtype != dtype or t.device != device
                or not t.is_contiguous() or t.numel() != want):
            got = ((t.dtype, str(t.device), tuple(t.shape)) if isinstance(t, Tensor)
                   else type(t).__name__)
            raise ValueError(f'{op}: {name}[{i}] must be a contiguous {dtype} tensor on {device} '
                             f'with {want} elements, got {got}')


def multi_tensor_adam8bit(params: Sequence[Tensor], grads: Sequence[Tensor],
                          exp_avgs: Sequence[Tensor], exp_avg_absmaxes: Sequence[Tensor],
                          exp_avg_sqs: Sequence[Tensor], exp_avg_sq_absmaxes: Sequence[Tensor],
                          model_params: Sequence[Tensor], step: Tensor, lr: Union[float, Tensor],
                          beta1: float, beta2: float, eps: float, weight_decay: float,
                          adam_w_mode: bool, bias_correction: bool,
                          grad_scale: Optional[Tensor] = None,
                          found_inf: Optional[Tensor] = None) -> None:
    """One Adam/AdamW update of ``params`` with block-wise 8-bit moments.

    Args:
        params: Parameters to update in place (float32 masters, or half).
        grads: Their gradients, scaled by ``grad_scale`` when it is given.
        exp_avgs, exp_avg_sqs: uint8 moment codes, one per element, updated in place.
        exp_avg_absmaxes, exp_avg_sq_absmaxes: float32, one absmax per block of
            :data:`BLOCK_SIZE` elements, updated in place.
        model_params: Empty, or half copies that receive the new values rounded to their dtype.
        step, lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, grad_scale,
            found_inf: As in :func:`~mp_wrappers.ops.multi_tensor_adam`: lr a number, or
            (capturable=True) a 1-element float32 tensor on the params' device, read when the
            step runs.

    Examples:
        >>> codes = [torch.zeros(p.numel(), dtype=torch.uint8) for p in params]
        >>> absmax = [torch.zeros(num_blocks(p.numel())) for p in params]
        >>> multi_tensor_adam8bit(params, grads, codes, absmax, list(c.clone() for c in codes),
        ...                       [a.clone() for a in absmax], [], torch.zeros(1), 1e-3, 0.9,
        ...                       0.999, 1e-8, 0.0, True, True)
    """
    op = 'multi_tensor_adam8bit'
    params, grads, model_params = list(params), list(grads), list(model_params)
    device = _check_lists(op, ('params', 'grads', 'model_params'), [params, grads, model_params],
                          allow_empty=('model_params',))
    check_quantized_device(op, device)
    lists = _checked_states(op, params, device, exp_avgs, exp_avg_absmaxes, exp_avg_sqs,
                            exp_avg_sq_absmaxes)
    lr, lr_tensor = _split_lr(op, lr, device)
    _check_adam_scalars(op, lr, beta1, beta2, eps, weight_decay, step, grad_scale, found_inf,
                        device)
    if params:
        run('multi_tensor_adam8bit_', device, params, grads, *lists, model_params, step,
             float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
             bool(adam_w_mode), bool(bias_correction), grad_scale, found_inf, lr_tensor)


def multi_tensor_adam8bit_lean(params: Sequence[Tensor], aux: Sequence[Tensor],
                               grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                               exp_avg_absmaxes: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
                               exp_avg_sq_absmaxes: Sequence[Tensor], step: Tensor, lr: float,
                               beta1: float, beta2: float, eps: float, weight_decay: float,
                               adam_w_mode: bool, bias_correction: bool, storage: str,
                               seed: int = 0, grad_scale: Optional[Tensor] = None,
                               found_inf: Optional[Tensor] = None) -> None:
    """:func:`multi_tensor_adam8bit` on bfloat16 ``params`` stored the ``storage`` way, in one pass
    (no fp32 master: ``aux``, ``storage`` and ``seed`` as in
    :func:`~mp_wrappers.ops.multi_tensor_adam_lean`). On CUDA tensors where the loaded build has
    the CUDA kernel (``csrc/cuda/multi_tensor_adam8bit.cu``), as :func:`multi_tensor_adam8bit`.

    Examples:
        >>> comps = [torch.zeros_like(p) for p in params]          # 'kahan': bf16 compensation
        >>> multi_tensor_adam8bit_lean(params, comps, grads, codes, absmax, codes_sq, absmax_sq,
        ...                            torch.zeros(1), 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True,
        ...                            'kahan')
    """
    op = 'multi_tensor_adam8bit_lean'
    params, aux, grads = list(params), list(aux), list(grads)
    device = _check_lean(op, storage, params, aux, grads, [])
    check_quantized_device(op, device, storage)
    lists = _checked_states(op, params, device, exp_avgs, exp_avg_absmaxes, exp_avg_sqs,
                            exp_avg_sq_absmaxes)
    _check_adam_scalars(op, lr, beta1, beta2, eps, weight_decay, step, grad_scale, found_inf,
                        device, seed=seed)
    if params:
        run('multi_tensor_adam8bit_lean_', device, params, aux, grads, *lists, step, float(lr),
            float(beta1), float(beta2), float(eps), float(weight_decay), bool(adam_w_mode),
            bool(bias_correction), storage, int(seed), grad_scale, found_inf)
