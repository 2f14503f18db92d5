"""Pure-PyTorch references of the fused optimizer updates: Adam/AdamW, SGD, LAMB, Adagrad, NovoGrad.

Their shared conventions (unscale, skip on ``found_inf``, ``step``, ``model_params``) are in
:mod:`._common`.
"""
from typing import List, Optional

import torch
from torch import Tensor

from ._common import _bias_correction, _commit_, _lr, _skip_mask, _unscaled

__all__ = ['multi_tensor_adam_', 'multi_tensor_sgd_', 'multi_tensor_lamb_', 'multi_tensor_adagrad_',
           'multi_tensor_novograd_']


def multi_tensor_adam_(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                       exp_avg_sqs: List[Tensor], model_params: List[Tensor], step: Tensor,
                       lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                       adam_w_mode: bool, bias_correction: bool, grad_scale: Optional[Tensor],
                       found_inf: Optional[Tensor],
                       lr_tensor: Optional[Tensor] = None) -> None:
    """Adam / AdamW update (apex FusedAdam semantics).

    With ``adam_w_mode`` the decay is decoupled: ``update = m_hat / (sqrt(v_hat) + eps) + wd * p``;
    otherwise it is L2 regularisation: ``g += wd * p`` before the moments. Then ``p -= lr * update``.
    """
    lr = _lr(lr, lr_tensor)
    skip = _skip_mask(found_inf)
    count = step + 1
    bc1 = _bias_correction(beta1, count, bias_correction)
    bc2 = _bias_correction(beta2, count, bias_correction)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        p32 = p.to(torch.float32)
        g32 = _unscaled(g, grad_scale)
        if not adam_w_mode and weight_decay != 0.0:
            g32 = g32 + weight_decay * p32
        m_new = beta1 * m + (1.0 - beta1) * g32
        v_new = beta2 * v + (1.0 - beta2) * g32 * g32
        update = (m_new / bc1) / (torch.sqrt(v_new / bc2) + eps)
        if adam_w_mode and weight_decay != 0.0:
            update = update + weight_decay * p32
        p_new = p32 - lr * update
        _commit_(m, m_new, skip)
        _commit_(v, v_new, skip)
        _commit_(p, p_new, skip)
        if model_params:
            _commit_(model_params[i], p_new, skip)
    _commit_(step, count, skip)


def multi_tensor_sgd_(params: List[Tensor], grads: List[Tensor], momentum_buffers: List[Tensor],
                      model_params: List[Tensor], step: Tensor, lr: float, momentum: float,
                      dampening: float, weight_decay: float, nesterov: bool,
                      wd_after_momentum: bool, grad_scale: Optional[Tensor],
                      found_inf: Optional[Tensor],
                      lr_tensor: Optional[Tensor] = None) -> None:
    """SGD with momentum (torch.optim.SGD semantics, plus apex's ``wd_after_momentum``).

    Weight decay ``g += wd * p`` is applied before the momentum or, with ``wd_after_momentum``, to the
    direction that comes out of it. On the first applied update (``step == 0``) the buffer is set to
    the gradient (no dampening), as torch does; the choice is made on the device. Dampening scales the
    gradient in later updates: ``buf = momentum * buf + (1 - dampening) * g``. ``momentum_buffers``
    may be empty when ``momentum == 0``.
    """
    lr = _lr(lr, lr_tensor)
    skip = _skip_mask(found_inf)
    first = step.reshape(()) == 0
    for i, (p, g) in enumerate(zip(params, grads)):
        p32 = p.to(torch.float32)
        d = _unscaled(g, grad_scale)
        if weight_decay != 0.0 and not wd_after_momentum:
            d = d + weight_decay * p32
        if momentum != 0.0:
            buf = momentum_buffers[i]
            buf_new = torch.where(first, d, momentum * buf + (1.0 - dampening) * d)
            d = d + momentum * buf_new if nesterov else buf_new
            _commit_(buf, buf_new, skip)
        if weight_decay != 0.0 and wd_after_momentum:
            d = d + weight_decay * p32
        p_new = p32 - lr * d
        _commit_(p, p_new, skip)
        if model_params:
            _commit_(model_params[i], p_new, skip)
    _commit_(step, step + 1, skip)


def multi_tensor_lamb_(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                       exp_avg_sqs: List[Tensor], model_params: List[Tensor], step: Tensor,
                       lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                       adam_w_mode: bool, bias_correction: bool, grad_averaging: bool,
                       max_grad_norm: float, use_nvlamb: bool, global_grad_norm: Tensor,
                       grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                       lr_tensor: Optional[Tensor] = None) -> None:
    """LAMB update (apex FusedLAMB semantics).

    ``global_grad_norm`` is the L2 norm of the *unscaled* grads over every group of the optimizer.
    When it exceeds ``max_grad_norm > 0`` the grads are divided by ``global_grad_norm /
    max_grad_norm`` (``max_grad_norm == 0`` disables clipping). Adam-style moments follow, with
    ``beta3 = 1 - beta1`` for ``grad_averaging`` else 1, giving ``update`` (decay as in Adam: L2 on
    the grad, or decoupled ``+ wd * p`` with ``adam_w_mode``). Each tensor then moves by
    ``-lr * (||p|| / ||update||) * update``; the trust ratio is used only for ``weight_decay != 0``
    unless ``use_nvlamb``, and is replaced by 1 when either norm is zero. ``||p||`` is the norm before
    the update.
    """
    lr = _lr(lr, lr_tensor)
    skip = _skip_mask(found_inf)
    count = step + 1
    bc1 = _bias_correction(beta1, count, bias_correction)
    bc2 = _bias_correction(beta2, count, bias_correction)
    beta3 = (1.0 - beta1) if grad_averaging else 1.0
    gnorm = global_grad_norm.reshape(()).to(torch.float32)
    if max_grad_norm > 0.0:
        clip = torch.where(gnorm > max_grad_norm, gnorm / max_grad_norm, torch.ones_like(gnorm))
    else:
        clip = torch.ones_like(gnorm)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        p32 = p.to(torch.float32)
        g32 = _unscaled(g, grad_scale) / clip
        if not adam_w_mode and weight_decay != 0.0:
            g32 = g32 + weight_decay * p32
        m_new = beta1 * m + beta3 * g32
        v_new = beta2 * v + (1.0 - beta2) * g32 * g32
        update = (m_new / bc1) / (torch.sqrt(v_new / bc2) + eps)
        if adam_w_mode and weight_decay != 0.0:
            update = update + weight_decay * p32
        if use_nvlamb or weight_decay != 0.0:
            p_norm = torch.linalg.vector_norm(p32)
            u_norm = torch.linalg.vector_norm(update)
            ratio = torch.where((p_norm != 0) & (u_norm != 0), lr * (p_norm / u_norm),
                                torch.zeros_like(p_norm) + lr)
        else:
            ratio = lr
        p_new = p32 - ratio * update
        _commit_(m, m_new, skip)
        _commit_(v, v_new, skip)
        _commit_(p, p_new, skip)
        if model_params:
            _commit_(model_params[i], p_new, skip)
    _commit_(step, count, skip)


def multi_tensor_adagrad_(params: List[Tensor], grads: List[Tensor], state_sums: List[Tensor],
                          model_params: List[Tensor], step: Tensor, lr: float, eps: float,
                          weight_decay: float, adagrad_w_mode: bool, grad_scale: Optional[Tensor],
                          found_inf: Optional[Tensor],
                          lr_tensor: Optional[Tensor] = None) -> None:
    """Adagrad update (apex FusedAdagrad semantics).

    ``h += g * g; p -= lr * (g / (sqrt(h) + eps))`` with L2 decay ``g += wd * p`` first, or with
    ``adagrad_w_mode`` the decoupled ``p -= lr * (g / (sqrt(h) + eps) + wd * p)``. ``step`` only
    counts applied updates (the math does not use it).
    """
    lr = _lr(lr, lr_tensor)
    skip = _skip_mask(found_inf)
    for i, (p, g, h) in enumerate(zip(params, grads, state_sums)):
        p32 = p.to(torch.float32)
        g32 = _unscaled(g, grad_scale)
        if not adagrad_w_mode and weight_decay != 0.0:
            g32 = g32 + weight_decay * p32
        h_new = h + g32 * g32
        update = g32 / (torch.sqrt(h_new) + eps)
        if adagrad_w_mode and weight_decay != 0.0:
            update = update + weight_decay * p32
        p_new = p32 - lr * update
        _commit_(h, h_new, skip)
        _commit_(p, p_new, skip)
        if model_params:
            _commit_(model_params[i], p_new, skip)
    _commit_(step, step + 1, skip)


def multi_tensor_novograd_(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                           exp_avg_sq_norms: Tensor, model_params: List[Tensor], step: Tensor,
                           lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                           bias_correction: bool, grad_averaging: bool, reg_inside_moment: bool,
                           norm_type: int, init_zero: bool, grad_scale: Optional[Tensor],
                           found_inf: Optional[Tensor],
                           lr_tensor: Optional[Tensor] = None) -> None:
    """NovoGrad update (apex FusedNovoGrad semantics).

    ``exp_avg_sq_norms`` (float32, one element per tensor) holds each tensor's running gradient norm
    (the norm itself, not its square): with ``n`` the norm of the unscaled grad (``norm_type`` 2: L2,
    0: max-abs) it becomes ``sqrt(beta2 * old**2 + (1 - beta2) * n**2)`` (L2) or ``beta2 * old +
    (1 - beta2) * n`` (inf). On the first applied update (``step == 0``) it is set to ``n`` unless
    ``init_zero`` (then ``old`` is 0). With ``denom = norm / bc2 + eps``, ``bc2 = sqrt(1 - beta2**t)``,
    ``bc1 = 1 - beta1**t``, ``beta3 = 1 - beta1`` for ``grad_averaging`` else 1:
    ``reg_inside_moment``: ``m = beta1 * m + beta3 * (g / denom + wd * p); p -= lr * m / bc1``;
    otherwise: ``m = beta1 * m + beta3 * g; p -= lr * (m / bc1 / denom + wd * p)``.
    """
    lr = _lr(lr, lr_tensor)
    skip = _skip_mask(found_inf)
    count = step + 1
    bc1 = _bias_correction(beta1, count, bias_correction)
    bc2 = torch.sqrt(_bias_correction(beta2, count, bias_correction))
    beta3 = (1.0 - beta1) if grad_averaging else 1.0
    if not params:
        _commit_(step, count, skip)
        return
    g32s = [_unscaled(g, grad_scale) for g in grads]
    ord_ = 2.0 if norm_type == 2 else float('inf')
    norms = torch.stack([torch.linalg.vector_norm(g, ord=ord_) for g in g32s])
    old = exp_avg_sq_norms.reshape(-1)
    if norm_type == 2:
        blended = torch.sqrt(beta2 * old * old + (1.0 - beta2) * norms * norms)
    else:
        blended = beta2 * old + (1.0 - beta2) * norms
    # apex initialises the running norm with the first step's norm unless init_zero, so the first
    # blend has no effect; deciding it from the step count keeps it on the device (and a skipped
    # first step initialises on the next applied one).
    first = (step.reshape(()) == 0) & (not init_zero)
    new_norms = torch.where(first, norms, blended)
    for i, (p, g32, m) in enumerate(zip(params, g32s, exp_avgs)):
        p32 = p.to(torch.float32)
        denom = new_norms[i] / bc2 + eps
        if reg_inside_moment:
            m_new = beta1 * m + beta3 * (g32 / denom + weight_decay * p32)
            p_new = p32 - lr * (m_new / bc1)
        else:
            m_new = beta1 * m + beta3 * g32
            p_new = p32 - lr * ((m_new / bc1) / denom + weight_decay * p32)
        _commit_(m, m_new, skip)
        _commit_(p, p_new, skip)
        if model_params:
            _commit_(model_params[i], p_new, skip)
    _commit_(exp_avg_sq_norms, new_norms, skip)
    _commit_(step, count, skip)
