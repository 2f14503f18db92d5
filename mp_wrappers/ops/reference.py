"""Pure-PyTorch references of every ``torch.ops.mp_wrappers`` op.

Each function has exactly the signature of the op schema in ``csrc/bindings.cpp`` and is the
executable definition of its semantics: the fallback when the extension is unavailable and the oracle
the tests compare kernels with. Clarity over speed, but no host synchronisation: flags and counters
stay tensors so the references can be used in the same places as the kernels.
"""
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    'multi_tensor_scale_', 'multi_tensor_l2norm', 'multi_tensor_unscale_l2norm',
    'multi_tensor_axpby_', 'update_scale_hysteresis_',
    # fused optimizer updates (section at the end of the file)
    'multi_tensor_adam_', 'multi_tensor_sgd_', 'multi_tensor_lamb_', 'multi_tensor_adagrad_',
    'multi_tensor_novograd_',
]


def _flag_nonfinite_(found_inf: Tensor, tensors: List[Tensor]) -> None:
    """Set ``found_inf`` to 1 when any element of ``tensors`` is inf or nan; never clear it."""
    if not tensors:
        return
    bad = torch.stack([~torch.isfinite(t).all() for t in tensors]).any()
    torch.maximum(found_inf, bad.to(found_inf.dtype).reshape(found_inf.shape), out=found_inf)


def multi_tensor_scale_(inputs: List[Tensor], outputs: List[Tensor], scale: Tensor,
                        found_inf: Tensor) -> None:
    """``outputs[i] = inputs[i] * scale`` computed in fp32, rounded to each output's dtype.

    ``found_inf`` is set when any *input* element is non-finite (the output is still written).
    """
    _flag_nonfinite_(found_inf, inputs)
    s = scale.to(torch.float32)
    for src, dst in zip(inputs, outputs):
        dst.copy_(src.to(torch.float32) * s)


def multi_tensor_l2norm(tensors: List[Tensor], per_tensor: bool) -> Tuple[Tensor, Tensor]:
    """Global L2 norm (a 0-dim fp32 tensor) and, if asked, the per-tensor norms (fp32 ``[n]``).

    The per-tensor result is an empty tensor when ``per_tensor`` is False. Accumulated in float64,
    as the kernels do: fp32 squares overflow for finite elements above ~1.8e19 (an inf norm that
    clipping would turn into zeroed gradients) and underflow below ~1e-19 (a zero norm of unscaled
    gradients when the inverse loss scale is tiny, such as 2**-127).
    """
    device = tensors[0].device if tensors else torch.device('cpu')
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device), torch.empty(0, device=device)
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors])
    total = torch.linalg.vector_norm(norms).to(torch.float32)
    norms = norms.to(torch.float32)
    return total, (norms if per_tensor else torch.empty(0, device=device))


def multi_tensor_unscale_l2norm(tensors: List[Tensor], inv_scale: Tensor, found_inf: Tensor,
                                per_tensor: bool) -> Tuple[Tensor, Tensor]:
    """Norms of ``tensors * inv_scale`` without writing them, and the non-finite check."""
    _flag_nonfinite_(found_inf, tensors)
    s = inv_scale.to(torch.float32)
    return multi_tensor_l2norm([t.to(torch.float32) * s for t in tensors], per_tensor)


def multi_tensor_axpby_(x: List[Tensor], y: List[Tensor], out: List[Tensor], a: float, b: float,
                        arg_to_check: int, found_inf: Tensor) -> None:
    """``out = a * x + b * y`` in fp32; ``arg_to_check`` -1 checks x and y, 0 only x, 1 only y."""
    if arg_to_check in (-1, 0):
        _flag_nonfinite_(found_inf, x)
    if arg_to_check in (-1, 1):
        _flag_nonfinite_(found_inf, y)
    for xi, yi, oi in zip(x, y, out):
        oi.copy_(a * xi.to(torch.float32) + b * yi.to(torch.float32))


def update_scale_hysteresis_(scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                             found_inf: Tensor, growth_factor: float, backoff_factor: float,
                             growth_interval: int, hysteresis: int, min_scale: float,
                             max_scale: float) -> None:
    """One dynamic loss-scale update, entirely on the device.

    On an overflow the hysteresis budget is decremented and, once it is used up (``hysteresis``
    consecutive overflows), the scale is multiplied by ``backoff_factor`` but never below
    ``min_scale``; the growth tracker restarts. After ``growth_interval`` consecutive clean updates the
    scale is multiplied by ``growth_factor``, never above ``max_scale`` nor to inf. A clean update
    refills the hysteresis budget. With ``hysteresis=1`` this is exactly apex amp's scaler.
    """
    overflow = found_inf.reshape(()) > 0
    hyst_left = torch.where(overflow, hysteresis_tracker - 1,
                            torch.full_like(hysteresis_tracker, hysteresis))
    backoff = overflow & (hyst_left.reshape(()) <= 0)
    grown_count = growth_tracker + 1
    grow = (~overflow) & (grown_count.reshape(()) >= growth_interval)
    down = torch.clamp(scale * backoff_factor, min=min_scale)
    up = torch.clamp(scale * growth_factor, max=max_scale)
    up = torch.where(torch.isfinite(up), up, scale)
    new_scale = torch.where(backoff, down, torch.where(grow, up, scale))
    new_growth = torch.where(overflow | grow, torch.zeros_like(growth_tracker), grown_count)
    scale.copy_(new_scale)
    growth_tracker.copy_(new_growth)
    hysteresis_tracker.copy_(hyst_left)


# =====================================================================================================
# Fused optimizer updates
#
# One function per optimizer op of bindings.cpp, same signature. Shared conventions (the kernels must
# reproduce them; tests compare against these functions):
#   * Math is float32 on float32 state (moments, sums, norms); params and grads may be float32,
#     float16 or bfloat16. Params are read as float32 and the new value is rounded once to their dtype.
#   * grads are divided by ``grad_scale`` (when given) before anything else, as torch's fused
#     optimizers do, so a GradScaler's scale is passed as it is, not inverted.
#   * ``found_inf`` nonzero skips the whole call: params, state, ``step`` and ``model_params`` keep
#     their bits. The skip is a select on the device (compute, then keep the old value), never a
#     host-side branch, so no synchronisation happens.
#   * ``step`` (1-element float32) is the number of updates already applied; the update being applied
#     is number ``step + 1``, which bias corrections use, and ``step`` is incremented when it applies.
#     Bias corrections are computed in float64 from that count and rounded to float32 (as apex does
#     with ``std::pow`` on the host).
#   * ``model_params`` is empty or parallel to ``params``: each receives the new float32 param value
#     rounded to its own dtype (the fp16/bf16 model copy of an fp32 master).
# =====================================================================================================

def _skip_mask(found_inf: Optional[Tensor]) -> Optional[Tensor]:
    """A 0-dim bool tensor, True when the update must be skipped; None when there is no flag."""
    if found_inf is None:
        return None
    return found_inf.reshape(()) != 0


def _unscaled(grad: Tensor, grad_scale: Optional[Tensor]) -> Tensor:
    """The gradient as float32, divided by ``grad_scale`` when given (a new tensor or ``grad``)."""
    g = grad.to(torch.float32)
    if grad_scale is not None:
        g = g / grad_scale.reshape(()).to(torch.float32)
    return g


def _commit_(dst: Tensor, new: Tensor, skip: Optional[Tensor]) -> None:
    """Write ``new`` (rounded to ``dst.dtype``) into ``dst``, or leave ``dst`` bit-identical on skip."""
    new = new.to(dst.dtype)
    if skip is not None:
        new = torch.where(skip, dst, new)
    dst.copy_(new.reshape(dst.shape))


def _lr(lr: float, lr_tensor: Optional[Tensor]) -> Union[float, Tensor]:
    """The learning rate: ``lr``, or the 0-dim float32 value of ``lr_tensor`` (capturable=True; read
    where it lives, no host sync). float32 either way: a float lr multiplies fp32 tensors as fp32."""
    return lr if lr_tensor is None else lr_tensor.reshape(()).to(torch.float32)


def _bias_correction(beta: float, count: Tensor, enabled: bool) -> Tensor:
    """``1 - beta ** count`` computed in float64, as a float32 tensor (ones when disabled)."""
    if not enabled:
        return torch.ones_like(count, dtype=torch.float32)
    return (1.0 - torch.pow(beta, count.to(torch.float64))).to(torch.float32)


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


# The lean bf16 storage updates (Note [lean bf16 storage]) live in their own module; exported here so
# the one dispatch point (_dispatch.implementation) finds every reference in this namespace.
from .reference_lean import multi_tensor_adam_lean_, multi_tensor_sgd_lean_  # noqa: E402

__all__ += ['multi_tensor_adam_lean_', 'multi_tensor_sgd_lean_']
