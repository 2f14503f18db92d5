"""Public ops of block-wise 8-bit optimizer states: Adam/AdamW with uint8 moment codes, SGD with a
uint8 momentum buffer.

See Note [8-bit optimizer states] in :mod:`mp_wrappers.ops.reference.quant` for the codes and the
per-block absmax. :func:`multi_tensor_adam8bit` validates its arguments the way
:mod:`mp_wrappers.ops.optimizers` does and calls the implementation chosen by
:func:`~mp_wrappers.ops._dispatch.implementation`: on the CPU the CPU kernel (or the reference when
the extension is not built), on CUDA the CUDA kernel (``csrc/cuda/multi_tensor_adam8bit.cu`` and
``multi_tensor_sgd8bit.cu``, one warp per quantization block). CUDA tensors are accepted only where
the loaded build has that CUDA kernel; elsewhere (a CPU-only build, any other device type)
:func:`check_quantized_device` refuses them before any work, naming the fix, rather than running
the pure-PyTorch reference on the GPU.
The argument order follows the op schema in ``csrc/bindings.cpp``.
:class:`mp_wrappers.optim.FusedAdam` and :class:`mp_wrappers.optim.FusedSGD` with
``state_dtype='int8'`` build these lists for you.
"""
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from ._checks import (_check_adam_scalars, _check_lists, _check_lr, _check_sgd_hyper,
                      _check_step_scalars)
from ._dispatch import _op_has_kernel, run
from .lean import _check_lean, _check_seed
from .optimizers import _split_lr
from .reference.quant import BLOCK_SIZE, num_blocks

__all__ = ['multi_tensor_adam8bit', 'multi_tensor_adam8bit_lean', 'multi_tensor_sgd8bit',
           'multi_tensor_sgd8bit_lean',
           'BLOCK_SIZE', 'num_blocks', 'check_quantized_device', 'has_quantized_kernel']

# The 8-bit op of each optimizer, and its lean bf16 variant.
_LEAN_OPS = {'multi_tensor_adam8bit_': 'multi_tensor_adam8bit_lean_',
             'multi_tensor_sgd8bit_': 'multi_tensor_sgd8bit_lean_'}
# The ops with a CUDA kernel (csrc/cuda/), in a build with CUDA kernels; the others run on the CPU.
_CUDA_OPS = frozenset({'multi_tensor_adam8bit_', 'multi_tensor_adam8bit_lean_',
                       'multi_tensor_sgd8bit_', 'multi_tensor_sgd8bit_lean_'})


def has_quantized_kernel(device_type: str, lean: bool = False,
                         op: str = 'multi_tensor_adam8bit_') -> bool:
    """Whether the 8-bit update ``op`` runs on ``device_type``: on the CPU always (the kernel,
    or the reference without the extension); on CUDA when the loaded build has its CUDA kernel.
    ``lean``: its variant for bf16 params with lean storage (``multi_tensor_adam8bit_lean_``,
    ``multi_tensor_sgd8bit_lean_``)."""
    if op not in _LEAN_OPS:
        raise ValueError(f'has_quantized_kernel: op={op!r} is not an 8-bit update; expected one '
                         f'of {sorted(_LEAN_OPS)}')
    if lean:
        op = _LEAN_OPS[op]
    if device_type == 'cpu':
        return True
    return device_type == 'cuda' and _op_has_kernel(op, 'cuda')


def check_quantized_device(owner: str, device: torch.device, bf16_storage: Optional[str] = None,
                           op: str = 'multi_tensor_adam8bit_') -> None:
    """Refuse a device without the 8-bit update ``op`` (:func:`has_quantized_kernel`); with a
    ``bf16_storage`` (lean bf16 params), a device without its lean variant."""
    lean = bf16_storage is not None
    if has_quantized_kernel(device.type, lean=lean, op=op):
        return
    kernel = _LEAN_OPS[op] if lean else op
    if device.type != 'cuda':
        why = f'there is no {device.type} kernel'
    elif kernel not in _CUDA_OPS:
        why = f'{kernel} has no CUDA kernel yet'
    else:
        why = ('this mp_wrappers build has no CUDA kernels (rebuild it with MP_WRAPPERS_CUDA=1 '
               'against a CUDA torch, docs/cuda.md)')
    runs = ('run on CPU tensors, and on CUDA tensors with a build that has CUDA kernels'
            if kernel in _CUDA_OPS else 'run on CPU tensors only')
    where = f'{runs}; got tensors on {device} and {why}'
    if lean:
        # fp32 masters are a way out only where the op itself runs
        masters = (f"state_dtype='int8' with fp32 masters (master_weights=True / "
                   f"opt_level='O2', bf16_storage=None), or "
                   if has_quantized_kernel(device.type, op=op) else '')
        raise NotImplementedError(
            f"{owner}: 8-bit optimizer states (state_dtype='int8') with bf16_storage="
            f"{bf16_storage!r} (a wrapper's master_weights={bf16_storage!r}) {where}. Allowed on "
            f"{device.type}: {masters}state_dtype='float32' or 'bfloat16' with "
            f'bf16_storage={bf16_storage!r}')
    raise NotImplementedError(
        f"{owner}: 8-bit optimizer states (state_dtype='int8') {where}. Use "
        f"state_dtype='float32' on {device.type}")


_ADAM_STATES = ('exp_avgs', 'exp_avg_sqs')


def _checked_states(op: str, params: List[Tensor], device: torch.device, *states: Sequence[Tensor],
                    names: Sequence[str] = _ADAM_STATES) -> List[List[Tensor]]:
    """The state lists (codes and absmaxes of each moment ``names``, in that order) as lists,
    checked against ``params``."""
    kinds = [kind for name in names
             for kind in ((name, torch.uint8, int),
                          (name[:-1] + '_absmaxes', torch.float32, num_blocks))]
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


def multi_tensor_sgd8bit(params: Sequence[Tensor], grads: Sequence[Tensor],
                         momentum_buffers: Sequence[Tensor],
                         momentum_buffer_absmaxes: Sequence[Tensor],
                         model_params: Sequence[Tensor], step: Tensor, lr: Union[float, Tensor],
                         momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                         wd_after_momentum: bool, grad_scale: Optional[Tensor] = None,
                         found_inf: Optional[Tensor] = None) -> None:
    """One SGD update with a block-wise 8-bit momentum buffer (``reference.multi_tensor_sgd8bit_``;
    :func:`~mp_wrappers.ops.multi_tensor_sgd`'s arguments otherwise).

    ``momentum_buffers`` are uint8 codes, one per element, ``momentum_buffer_absmaxes`` float32,
    one per block of :data:`BLOCK_SIZE` elements, both updated in place; ``momentum`` must be
    > 0. While ``step`` is 0 the buffers are set to the gradient: zero codes are a fine start.

    Examples:
        >>> codes = [torch.zeros(p.numel(), dtype=torch.uint8) for p in params]
        >>> absmax = [torch.zeros(num_blocks(p.numel())) for p in params]
        >>> multi_tensor_sgd8bit(params, grads, codes, absmax, [], torch.zeros(1), 0.1, 0.9, 0.0,
        ...                      1e-4, True, False)
    """
    op = 'multi_tensor_sgd8bit'
    params, grads, model_params = list(params), list(grads), list(model_params)
    _check_sgd8bit_hyper(op, momentum, dampening, weight_decay, nesterov, 'multi_tensor_sgd')
    device = _check_lists(op, ('params', 'grads', 'model_params'), [params, grads, model_params],
                          allow_empty=('model_params',))
    check_quantized_device(op, device, op='multi_tensor_sgd8bit_')
    lists = _checked_states(op, params, device, momentum_buffers, momentum_buffer_absmaxes,
                            names=('momentum_buffers',))
    lr, lr_tensor = _split_lr(op, lr, device)
    _check_step_scalars(op, step, grad_scale, found_inf, device)
    if params:
        run('multi_tensor_sgd8bit_', device, params, grads, *lists, model_params, step, float(lr),
            float(momentum), float(dampening), float(weight_decay), bool(nesterov),
            bool(wd_after_momentum), grad_scale, found_inf, lr_tensor)


def multi_tensor_sgd8bit_lean(params: Sequence[Tensor], aux: Sequence[Tensor],
                              grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
                              momentum_buffer_absmaxes: Sequence[Tensor], step: Tensor,
                              lr: float, momentum: float, dampening: float, weight_decay: float,
                              nesterov: bool, wd_after_momentum: bool, storage: str,
                              seed: int = 0, grad_scale: Optional[Tensor] = None,
                              found_inf: Optional[Tensor] = None) -> None:
    """:func:`multi_tensor_sgd8bit` on bfloat16 ``params`` stored the ``storage`` way, in one pass
    (no fp32 master: ``aux``, ``storage`` and ``seed`` as in
    :func:`~mp_wrappers.ops.multi_tensor_sgd_lean`). On CUDA tensors where the loaded build has
    the CUDA kernel (``csrc/cuda/multi_tensor_sgd8bit.cu``), as :func:`multi_tensor_sgd8bit`.

    Examples:
        >>> comps = [torch.zeros_like(p) for p in params]          # 'kahan': bf16 compensation
        >>> multi_tensor_sgd8bit_lean(params, comps, grads, codes, absmax, torch.zeros(1), 0.1,
        ...                           0.9, 0.0, 1e-4, True, False, 'kahan')
    """
    op = 'multi_tensor_sgd8bit_lean'
    params, aux, grads = list(params), list(aux), list(grads)
    _check_sgd8bit_hyper(op, momentum, dampening, weight_decay, nesterov,
                         'multi_tensor_sgd_lean')
    device = _check_lean(op, storage, params, aux, grads, [])
    check_quantized_device(op, device, storage, op='multi_tensor_sgd8bit_')
    lists = _checked_states(op, params, device, momentum_buffers, momentum_buffer_absmaxes,
                            names=('momentum_buffers',))
    _check_lr(op, lr)
    _check_seed(op, seed)
    _check_step_scalars(op, step, grad_scale, found_inf, device)
    if params:
        run('multi_tensor_sgd8bit_lean_', device, params, aux, grads, *lists, step, float(lr),
            float(momentum), float(dampening), float(weight_decay), bool(nesterov),
            bool(wd_after_momentum), storage, int(seed), grad_scale, found_inf)


def _check_sgd8bit_hyper(op: str, momentum: float, dampening: float, weight_decay: float,
                         nesterov: bool, without_buffer: str) -> None:
    """SGD's hyperparameters, and a momentum: without one there is no buffer to quantize (the op
    ``without_buffer`` steps such groups)."""
    _check_sgd_hyper(op, momentum, dampening, weight_decay, nesterov)
    if momentum == 0:
        raise ValueError(f'{op}: momentum=0 keeps no momentum buffer to quantize; use '
                         f'{without_buffer} (FusedSGD with momentum=0 keeps no state)')
