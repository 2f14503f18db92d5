"""Fake (meta) kernels of the fused-optimizer ops ``torch.ops.mp_wrappers.multi_tensor_*_``.

These ops only mutate their arguments and return ``()``, so a fake kernel has no output metadata to
compute. ``torch.library.opcheck`` passes on torch 2.13 without one (checked for all five ops: its
fake-tensor test treats an op that returns nothing as having nothing to fake), but under
``torch.compile`` or with meta tensors an op without a fake kernel fails with an unhelpful "no
kernel registered" error. Registering one lets traces run and validates the tensor lists the way the
public API does, failing with the same message as in eager mode (see also :mod:`._fake`).

Imported by :mod:`mp_wrappers.ops._extension` right after ``mp_wrappers._C`` has registered the op
schemas; it must not be imported when the extension is missing. An op an older build does not
declare gets no fake kernel (its reference serves it).
"""
from typing import List, Optional

import torch
from torch import Tensor

from ._checks import check_tensor_lists
from ._registration import register_fake_if_declared

__all__: List[str] = []


@register_fake_if_declared('multi_tensor_adam_')
def _multi_tensor_adam_fake(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                            exp_avg_sqs: List[Tensor], model_params: List[Tensor], step: Tensor,
                            lr: float, beta1: float, beta2: float, eps: float,
                            weight_decay: float, adam_w_mode: bool, bias_correction: bool,
                            grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                            lr_tensor: Optional[Tensor] = None) -> None:
    check_tensor_lists('multi_tensor_adam_',
                       ('params', 'grads', 'exp_avgs', 'exp_avg_sqs', 'model_params'),
                       (params, grads, exp_avgs, exp_avg_sqs, model_params),
                       allow_empty=('model_params',))


@register_fake_if_declared('multi_tensor_sgd_')
def _multi_tensor_sgd_fake(params: List[Tensor], grads: List[Tensor],
                           momentum_buffers: List[Tensor], model_params: List[Tensor],
                           step: Tensor, lr: float, momentum: float, dampening: float,
                           weight_decay: float, nesterov: bool, wd_after_momentum: bool,
                           grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                           lr_tensor: Optional[Tensor] = None) -> None:
    allow_empty = ('model_params', 'momentum_buffers') if momentum == 0 else ('model_params',)
    check_tensor_lists('multi_tensor_sgd_', ('params', 'grads', 'momentum_buffers', 'model_params'),
                       (params, grads, momentum_buffers, model_params), allow_empty=allow_empty)


@register_fake_if_declared('multi_tensor_lamb_')
def _multi_tensor_lamb_fake(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                            exp_avg_sqs: List[Tensor], model_params: List[Tensor], step: Tensor,
                            lr: float, beta1: float, beta2: float, eps: float,
                            weight_decay: float, adam_w_mode: bool, bias_correction: bool,
                            grad_averaging: bool, max_grad_norm: float, use_nvlamb: bool,
                            global_grad_norm: Tensor, grad_scale: Optional[Tensor],
                            found_inf: Optional[Tensor],
                            lr_tensor: Optional[Tensor] = None) -> None:
    check_tensor_lists('multi_tensor_lamb_',
                       ('params', 'grads', 'exp_avgs', 'exp_avg_sqs', 'model_params'),
                       (params, grads, exp_avgs, exp_avg_sqs, model_params),
                       allow_empty=('model_params',))


@register_fake_if_declared('multi_tensor_adagrad_')
def _multi_tensor_adagrad_fake(params: List[Tensor], grads: List[Tensor],
                               state_sums: List[Tensor], model_params: List[Tensor],
                               step: Tensor, lr: float, eps: float, weight_decay: float,
                               adagrad_w_mode: bool, grad_scale: Optional[Tensor],
                               found_inf: Optional[Tensor],
                               lr_tensor: Optional[Tensor] = None) -> None:
    check_tensor_lists('multi_tensor_adagrad_', ('params', 'grads', 'state_sums', 'model_params'),
                       (params, grads, state_sums, model_params), allow_empty=('model_params',))


@register_fake_if_declared('multi_tensor_novograd_')
def _multi_tensor_novograd_fake(params: List[Tensor], grads: List[Tensor],
                                exp_avgs: List[Tensor], exp_avg_sq_norms: Tensor,
                                model_params: List[Tensor], step: Tensor, lr: float,
                                beta1: float, beta2: float, eps: float, weight_decay: float,
                                bias_correction: bool, grad_averaging: bool,
                                reg_inside_moment: bool, norm_type: int, init_zero: bool,
                                grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                                lr_tensor: Optional[Tensor] = None) -> None:
    check_tensor_lists('multi_tensor_novograd_', ('params', 'grads', 'exp_avgs', 'model_params'),
                       (params, grads, exp_avgs, model_params), allow_empty=('model_params',))


# ---- lean bf16 storage (Note [lean bf16 storage] in reference/lean.py) ----------------------------
# aux holds uint16 or bf16 tensors (or nothing), which check_tensor_lists would refuse as
# non-float; it is validated by the public entry points in mp_wrappers/ops/lean.py.

@register_fake_if_declared('multi_tensor_adam_lean_')
def _multi_tensor_adam_lean_fake(params: List[Tensor], aux: List[Tensor], grads: List[Tensor],
                                 exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], step: Tensor,
                                 lr: float, beta1: float, beta2: float, eps: float,
                                 weight_decay: float, adam_w_mode: bool, bias_correction: bool,
                                 storage: str, seed: int, grad_scale: Optional[Tensor],
                                 found_inf: Optional[Tensor]) -> None:
    check_tensor_lists('multi_tensor_adam_lean_', ('params', 'grads', 'exp_avgs', 'exp_avg_sqs'),
                       (params, grads, exp_avgs, exp_avg_sqs))


@register_fake_if_declared('multi_tensor_sgd_lean_')
def _multi_tensor_sgd_lean_fake(params: List[Tensor], aux: List[Tensor], grads: List[Tensor],
                                momentum_buffers: List[Tensor], step: Tensor, lr: float,
                                momentum: float, dampening: float, weight_decay: float,
                                nesterov: bool, wd_after_momentum: bool, storage: str, seed: int,
                                grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    allow_empty = ('momentum_buffers',) if momentum == 0 else ()
    check_tensor_lists('multi_tensor_sgd_lean_', ('params', 'grads', 'momentum_buffers'),
                       (params, grads, momentum_buffers), allow_empty=allow_empty)


# ---- block-wise 8-bit states (Note [8-bit optimizer states] in reference/quant.py) ----------------
# The uint8 codes and their float32 absmax lists have their own element counts (one code per element,
# one absmax per block): validated by the public entry point in mp_wrappers/ops/quantized_states.py.

@register_fake_if_declared('multi_tensor_adam8bit_')
def _multi_tensor_adam8bit_fake(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                                exp_avg_absmaxes: List[Tensor], exp_avg_sqs: List[Tensor],
                                exp_avg_sq_absmaxes: List[Tensor], model_params: List[Tensor],
                                step: Tensor, lr: float, beta1: float, beta2: float, eps: float,
                                weight_decay: float, adam_w_mode: bool, bias_correction: bool,
                                grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                                lr_tensor: Optional[Tensor] = None) -> None:
    check_tensor_lists('multi_tensor_adam8bit_', ('params', 'grads', 'model_params'),
                       (params, grads, model_params), allow_empty=('model_params',))


@register_fake_if_declared('multi_tensor_adam8bit_lean_')
def _multi_tensor_adam8bit_lean_fake(params: List[Tensor], aux: List[Tensor], grads: List[Tensor],
                                     exp_avgs: List[Tensor], exp_avg_absmaxes: List[Tensor],
                                     exp_avg_sqs: List[Tensor], exp_avg_sq_absmaxes: List[Tensor],
                                     step: Tensor, lr: float, beta1: float, beta2: float,
                                     eps: float, weight_decay: float, adam_w_mode: bool,
                                     bias_correction: bool, storage: str, seed: int,
                                     grad_scale: Optional[Tensor],
                                     found_inf: Optional[Tensor]) -> None:
    check_tensor_lists('multi_tensor_adam8bit_lean_', ('params', 'grads'), (params, grads))


@register_fake_if_declared('multi_tensor_sgd8bit_')
def _multi_tensor_sgd8bit_fake(params: List[Tensor], grads: List[Tensor],
                               momentum_buffers: List[Tensor],
                               momentum_buffer_absmaxes: List[Tensor], model_params: List[Tensor],
                               step: Tensor, lr: float, momentum: float, dampening: float,
                               weight_decay: float, nesterov: bool, wd_after_momentum: bool,
                               grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                               lr_tensor: Optional[Tensor] = None) -> None:
    check_tensor_lists('multi_tensor_sgd8bit_', ('params', 'grads', 'model_params'),
                       (params, grads, model_params), allow_empty=('model_params',))


@register_fake_if_declared('multi_tensor_sgd8bit_lean_')
def _multi_tensor_sgd8bit_lean_fake(params: List[Tensor], aux: List[Tensor], grads: List[Tensor],
                                    momentum_buffers: List[Tensor],
                                    momentum_buffer_absmaxes: List[Tensor], step: Tensor,
                                    lr: float, momentum: float, dampening: float,
                                    weight_decay: float, nesterov: bool, wd_after_momentum: bool,
                                    storage: str, seed: int, grad_scale: Optional[Tensor],
                                    found_inf: Optional[Tensor]) -> None:
    check_tensor_lists('multi_tensor_sgd8bit_lean_', ('params', 'grads'), (params, grads))
