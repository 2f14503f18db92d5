"""Public fused-optimizer ops: one multi-tensor update per call, with in-kernel unscale and skip.

Each function validates its arguments, then calls the implementation chosen by
:func:`~mp_wrappers.ops._dispatch.implementation` (kernel or reference, same semantics; the reference
in :mod:`mp_wrappers.ops.reference` is the definition). The arguments follow the op schemas in
``csrc/bindings.cpp`` in the same order; only ``grad_scale`` and ``found_inf`` have defaults.

Contract shared by all five ops (checked here, relied upon by the kernels):

* ``params``, ``grads``, the state lists and ``model_params`` (empty, or parallel to ``params``) are
  lists of dense contiguous tensors on one device, parallel element counts at each position, and each
  list holds one dtype (kernels dispatch once per list). State lists are float32; params, grads and
  model params may be float32, float16 or bfloat16.
* ``step``, ``grad_scale``, ``found_inf`` (and LAMB's ``global_grad_norm``) are 1-element float32
  tensors on that device. ``step`` counts the applied updates and is incremented on the device.
* ``found_inf`` nonzero turns the call into a no-op, bit for bit, without a host synchronisation.
* ``lr`` is a number, or a 1-element float32 tensor on that device that the kernels read when they
  run (``lr_tensor`` in the schemas), so a captured CUDA graph replays with its current value
  (Note [capturable] in :mod:`mp_wrappers.optim.base`).

:class:`mp_wrappers.optim.FusedAdam` and friends build these lists for you.
"""
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ._checks import (_check_betas, _check_lists, _check_lr, _check_nonnegative, _check_norm_type,
                      _check_scalar, _check_sgd_hyper, _check_step)
from ._dispatch import run

__all__ = ['multi_tensor_adam', 'multi_tensor_sgd', 'multi_tensor_lamb', 'multi_tensor_adagrad',
           'multi_tensor_novograd']


def _split_lr(op: str, lr: Union[float, Tensor], device: torch.device
              ) -> Tuple[float, Optional[Tensor]]:
    """(float lr, lr_tensor): a tensor lr (capturable=True) is read by the kernels on the device,
    at run time, so a captured CUDA graph replays with the value it holds then."""
    if isinstance(lr, Tensor):
        return 0.0, _check_scalar(op, 'lr', lr, device, optional=False)
    _check_lr(op, lr)
    return float(lr), None


# ---- the ops ---------------------------------------------------------------------------------------

def multi_tensor_adam(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                      exp_avg_sqs: Sequence[Tensor], model_params: Sequence[Tensor], step: Tensor,
                      lr: Union[float, Tensor], beta1: float, beta2: float, eps: float,
                      weight_decay: float,
                      adam_w_mode: bool, bias_correction: bool,
                      grad_scale: Optional[Tensor] = None,
                      found_inf: Optional[Tensor] = None) -> None:
    """One Adam/AdamW update of ``params`` (apex FusedAdam math, see ``reference.multi_tensor_adam_``).

    Args:
        params: Parameters to update in place (float32, or half with float32 state).
        grads: Their gradients, scaled by ``grad_scale`` when it is given.
        exp_avgs: First moments (float32), updated in place.
        exp_avg_sqs: Second moments (float32), updated in place.
        model_params: Empty, or half copies that receive the new values rounded to their dtype.
        step: 1-element float32 count of applied updates, incremented in place.
        lr, beta1, beta2, eps, weight_decay: The usual Adam hyperparameters.
        adam_w_mode: Decoupled weight decay (AdamW) when True, L2 regularisation when False.
        bias_correction: Divide the moments by ``1 - beta**t``.
        grad_scale: Optional 1-element float32 tensor the grads are divided by.
        found_inf: Optional 1-element float32 flag; nonzero skips everything.

    Examples:
        >>> step = torch.zeros(1)
        >>> multi_tensor_adam(params, grads, ms, vs, [], step, 1e-3, 0.9, 0.999, 1e-8, 0.01,
        ...                   True, True)
    """
    op = 'multi_tensor_adam'
    lists = [list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(model_params)]
    device = _check_lists(op, ('params', 'grads', 'exp_avgs', 'exp_avg_sqs', 'model_params'), lists,
                          allow_empty=('model_params',), fp32=('exp_avgs', 'exp_avg_sqs'))
    _check_betas(op, (beta1, beta2))
    _check_nonnegative(op, 'eps', eps)
    _check_nonnegative(op, 'weight_decay', weight_decay)
    _check_step(op, step, device)
    _check_scalar(op, 'grad_scale', grad_scale, device)
    _check_scalar(op, 'found_inf', found_inf, device)
    lr, lr_tensor = _split_lr(op, lr, device)
    if lists[0]:
        run('multi_tensor_adam_', device, *lists, step, float(lr), float(beta1), float(beta2),
             float(eps), float(weight_decay), bool(adam_w_mode), bool(bias_correction), grad_scale,
             found_inf, lr_tensor)


def multi_tensor_sgd(params: Sequence[Tensor], grads: Sequence[Tensor],
                     momentum_buffers: Sequence[Tensor], model_params: Sequence[Tensor],
                     step: Tensor, lr: Union[float, Tensor], momentum: float, dampening: float,
                     weight_decay: float, nesterov: bool, wd_after_momentum: bool,
                     grad_scale: Optional[Tensor] = None,
                     found_inf: Optional[Tensor] = None) -> None:
    """One SGD update with momentum (torch.optim.SGD math, see ``reference.multi_tensor_sgd_``).

    ``momentum_buffers`` (float32) may be empty when ``momentum == 0``. While ``step`` is 0 the
    buffers are initialised to the gradient, so zeros are a fine initial value.

    Examples:
        >>> multi_tensor_sgd(params, grads, bufs, [], torch.zeros(1), 0.1, 0.9, 0.0, 1e-4, True,
        ...                  False)
    """
    op = 'multi_tensor_sgd'
    lists = [list(params), list(grads), list(momentum_buffers), list(model_params)]
    _check_sgd_hyper(op, momentum, dampening, weight_decay, nesterov)
    allow_empty = ('model_params', 'momentum_buffers') if momentum == 0 else ('model_params',)
    device = _check_lists(op, ('params', 'grads', 'momentum_buffers', 'model_params'), lists,
                          allow_empty=allow_empty, fp32=('momentum_buffers',))
    _check_step(op, step, device)
    _check_scalar(op, 'grad_scale', grad_scale, device)
    _check_scalar(op, 'found_inf', found_inf, device)
    lr, lr_tensor = _split_lr(op, lr, device)
    if lists[0]:
        run('multi_tensor_sgd_', device, *lists, step, float(lr), float(momentum),
             float(dampening), float(weight_decay), bool(nesterov), bool(wd_after_momentum),
             grad_scale, found_inf, lr_tensor)


def multi_tensor_lamb(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                      exp_avg_sqs: Sequence[Tensor], model_params: Sequence[Tensor], step: Tensor,
                      lr: Union[float, Tensor], beta1: float, beta2: float, eps: float,
                      weight_decay: float,
                      adam_w_mode: bool, bias_correction: bool, grad_averaging: bool,
                      max_grad_norm: float, use_nvlamb: bool, global_grad_norm: Tensor,
                      grad_scale: Optional[Tensor] = None,
                      found_inf: Optional[Tensor] = None) -> None:
    """One LAMB update (apex FusedLAMB math, see ``reference.multi_tensor_lamb_``).

    ``global_grad_norm`` is the L2 norm of the unscaled grads of *all* groups (compute it with
    :func:`~mp_wrappers.ops.multi_tensor_unscale_l2norm`), used for clipping to ``max_grad_norm``
    (0 disables clipping).

    Examples:
        >>> gnorm, _, _ = multi_tensor_unscale_l2norm(all_grads, 1.0 / scale)
        >>> multi_tensor_lamb(params, grads, ms, vs, [], step, 1e-3, 0.9, 0.999, 1e-6, 0.01, True,
        ...                   True, True, 1.0, False, gnorm)
    """
    op = 'multi_tensor_lamb'
    lists = [list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(model_params)]
    device = _check_lists(op, ('params', 'grads', 'exp_avgs', 'exp_avg_sqs', 'model_params'), lists,
                          allow_empty=('model_params',), fp32=('exp_avgs', 'exp_avg_sqs'))
    _check_betas(op, (beta1, beta2))
    _check_nonnegative(op, 'eps', eps)
    _check_nonnegative(op, 'weight_decay', weight_decay)
    _check_nonnegative(op, 'max_grad_norm', max_grad_norm, finite=False)
    _check_step(op, step, device)
    _check_scalar(op, 'global_grad_norm', global_grad_norm, device, optional=False)
    _check_scalar(op, 'grad_scale', grad_scale, device)
    _check_scalar(op, 'found_inf', found_inf, device)
    lr, lr_tensor = _split_lr(op, lr, device)
    if lists[0]:
        run('multi_tensor_lamb_', device, *lists, step, float(lr), float(beta1), float(beta2),
             float(eps), float(weight_decay), bool(adam_w_mode), bool(bias_correction),
             bool(grad_averaging), float(max_grad_norm), bool(use_nvlamb), global_grad_norm,
             grad_scale, found_inf, lr_tensor)


def multi_tensor_adagrad(params: Sequence[Tensor], grads: Sequence[Tensor],
                         state_sums: Sequence[Tensor], model_params: Sequence[Tensor],
                         step: Tensor, lr: Union[float, Tensor], eps: float, weight_decay: float,
                         adagrad_w_mode: bool, grad_scale: Optional[Tensor] = None,
                         found_inf: Optional[Tensor] = None) -> None:
    """One Adagrad update (apex FusedAdagrad math, see ``reference.multi_tensor_adagrad_``).

    Examples:
        >>> multi_tensor_adagrad(params, grads, sums, [], torch.zeros(1), 1e-2, 1e-10, 0.0, False)
    """
    op = 'multi_tensor_adagrad'
    lists = [list(params), list(grads), list(state_sums), list(model_params)]
    device = _check_lists(op, ('params', 'grads', 'state_sums', 'model_params'), lists,
                          allow_empty=('model_params',), fp32=('state_sums',))
    _check_nonnegative(op, 'eps', eps)
    _check_nonnegative(op, 'weight_decay', weight_decay)
    _check_step(op, step, device)
    _check_scalar(op, 'grad_scale', grad_scale, device)
    _check_scalar(op, 'found_inf', found_inf, device)
    lr, lr_tensor = _split_lr(op, lr, device)
    if lists[0]:
        run('multi_tensor_adagrad_', device, *lists, step, float(lr), float(eps),
             float(weight_decay), bool(adagrad_w_mode), grad_scale, found_inf, lr_tensor)


def multi_tensor_novograd(params: Sequence[Tensor], grads: Sequence[Tensor],
                          exp_avgs: Sequence[Tensor], exp_avg_sq_norms: Tensor,
                          model_params: Sequence[Tensor], step: Tensor,
                          lr: Union[float, Tensor], beta1: float, beta2: float, eps: float,
                          weight_decay: float, bias_correction: bool,
                          grad_averaging: bool, reg_inside_moment: bool, norm_type: int,
                          init_zero: bool, grad_scale: Optional[Tensor] = None,
                          found_inf: Optional[Tensor] = None) -> None:
    """One NovoGrad update (apex FusedNovoGrad math, see ``reference.multi_tensor_novograd_``).

    ``exp_avg_sq_norms`` is one contiguous float32 tensor with an element per tensor of ``params``:
    the running per-tensor gradient norm.

    Examples:
        >>> norms = torch.zeros(len(params))
        >>> multi_tensor_novograd(params, grads, ms, norms, [], torch.zeros(1), 1e-3, 0.95, 0.98,
        ...                       1e-8, 0.0, True, True, False, 2, False)
    """
    op = 'multi_tensor_novograd'
    lists = [list(params), list(grads), list(exp_avgs)]
    model_params = list(model_params)
    device = _check_lists(op, ('params', 'grads', 'exp_avgs', 'model_params'),
                          lists + [model_params], allow_empty=('model_params',),
                          fp32=('exp_avgs',))
    _check_betas(op, (beta1, beta2))
    _check_nonnegative(op, 'eps', eps)
    _check_nonnegative(op, 'weight_decay', weight_decay)
    _check_norm_type(op, norm_type)
    if (not isinstance(exp_avg_sq_norms, Tensor) or exp_avg_sq_norms.dtype != torch.float32
            or exp_avg_sq_norms.device != device or not exp_avg_sq_norms.is_contiguous()
            or exp_avg_sq_norms.numel() != len(lists[0])):
        got = ((exp_avg_sq_norms.dtype, str(exp_avg_sq_norms.device),
                tuple(exp_avg_sq_norms.shape)) if isinstance(exp_avg_sq_norms, Tensor)
               else type(exp_avg_sq_norms).__name__)
        raise ValueError(f'{op}: exp_avg_sq_norms must be a contiguous float32 tensor on {device} '
                         f'with one element per param ({len(lists[0])}), got {got}')
    _check_step(op, step, device)
    _check_scalar(op, 'grad_scale', grad_scale, device)
    _check_scalar(op, 'found_inf', found_inf, device)
    lr, lr_tensor = _split_lr(op, lr, device)
    if lists[0]:
        run('multi_tensor_novograd_', device, *lists, exp_avg_sq_norms, model_params, step,
             float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
             bool(bias_correction), bool(grad_averaging), bool(reg_inside_moment), int(norm_type),
             bool(init_zero), grad_scale, found_inf, lr_tensor)
