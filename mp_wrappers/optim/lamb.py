"""FusedLAMB: LAMB with global grad-norm clipping in one multi-tensor op per bucket (apex's API)."""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..ops.multi_tensor import multi_tensor_l2norm, multi_tensor_unscale_l2norm
from ..ops._checks import (_as_pair, _check_betas, _check_flag, _check_lr,
                           _check_nonnegative)
from ..registry import OPTIMIZERS
from .base import FusedOptimizer, ParamsT
from .buckets import _Bucket

__all__ = ['FusedLAMB']


@OPTIMIZERS.register_module()
class FusedLAMB(FusedOptimizer):
    """LAMB (apex FusedLAMB): Adam-style moments with a per-tensor trust ratio.

    Each step first computes the L2 norm of the *unscaled* gradients of all groups together; when it
    exceeds ``max_grad_norm`` every gradient is divided by ``norm / max_grad_norm`` (0 disables the
    clipping). The Adam direction ``update`` (decoupled decay with ``adam_w_mode``, L2 otherwise) is
    then applied as ``p -= lr * (||p|| / ||update||) * update`` per tensor; the ratio is used for
    groups with ``weight_decay != 0`` only, unless ``use_nvlamb``, and is 1 when either norm is 0.

    Args:
        params: Parameters or param-group dicts.
        lr: Learning rate.
        bias_correction: Divide the moments by ``1 - beta**t``.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Added to the denominator.
        weight_decay: Weight decay coefficient.
        amsgrad: Must be False (not implemented, as in apex).
        adam_w_mode: Decoupled weight decay when True, L2 regularisation when False.
        grad_averaging: Scale the gradient by ``1 - beta1`` in the first moment.
        set_grad_none: Default of ``zero_grad(set_to_none=...)``.
        max_grad_norm: Global gradient-norm clipping threshold (0 disables).
        use_nvlamb: Apply the trust ratio to params without weight decay too (NVLAMB).
        capturable: Make every group's lr a 1-element float32 tensor on the params' device at its
            first step, read by the kernel on the device, so that a CUDA graph capturing step()
            replays with the lr an LR scheduler writes into that tensor (Note [capturable] in
            mp_wrappers.optim.base). A tensor lr may also be passed directly.

    Examples:
        >>> optim_wrapper = dict(
        ...     type='OptimWrapper',
        ...     optimizer=dict(type='mp_wrappers.FusedLAMB', lr=2e-3, weight_decay=0.01))
    """

    _op = 'multi_tensor_lamb_'
    _tensor_state = ('exp_avg', 'exp_avg_sq')

    def __init__(self, params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, set_grad_none: bool = True,
                 max_grad_norm: float = 1.0, use_nvlamb: bool = False,
                 capturable: bool = False) -> None:
        _check_flag('FusedLAMB', 'amsgrad', amsgrad)
        if amsgrad:
            raise ValueError('FusedLAMB: amsgrad=True is not supported; use amsgrad=False')
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=_as_pair(betas), eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm,
                        use_nvlamb=use_nvlamb)
        super().__init__(params, defaults, set_grad_none, capturable)

    _flag_options = ('bias_correction', 'adam_w_mode', 'grad_averaging', 'use_nvlamb')

    def _check_hyperparameters(self, group: Dict[str, Any]) -> None:
        _check_lr('FusedLAMB', group['lr'])
        _check_betas('FusedLAMB', group['betas'])
        _check_nonnegative('FusedLAMB', 'eps', group['eps'])
        _check_nonnegative('FusedLAMB', 'weight_decay', group['weight_decay'])
        _check_nonnegative('FusedLAMB', 'max_grad_norm', group['max_grad_norm'], finite=False)

    def _prepare(self, buckets: List[_Bucket], grad_scale: Optional[Tensor]) -> Tensor:
        """The L2 norm of all unscaled grads of the step (every group), as in apex."""
        by_device: Dict[torch.device, List[Tensor]] = {}
        for bucket in buckets:
            by_device.setdefault(bucket.device, []).extend(bucket.grads)
        totals = []
        for device, grads in by_device.items():
            if grad_scale is None:
                total, _ = multi_tensor_l2norm(grads)
            else:
                # 1 / scale in float64: exact for the power-of-two scales loss scalers use and
                # correctly rounded otherwise.
                inv = grad_scale.to(device=device, dtype=torch.float64).reciprocal().float()
                total, _, _ = multi_tensor_unscale_l2norm(grads, inv.reshape(1))
            totals.append(total.reshape(1))
        if len(totals) == 1:
            return totals[0]
        first = totals[0].device
        return torch.linalg.vector_norm(torch.cat([t.to(first) for t in totals])).reshape(1)

    def _launch(self, bucket: _Bucket, grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                prepared: Tensor) -> None:
        g = bucket.group
        beta1, beta2 = g['betas']
        lr, lr_tensor = self._lr_args(g, bucket.device)
        self._call_op(bucket, bucket.params, bucket.grads, bucket.states['exp_avg'],
                      bucket.states['exp_avg_sq'], bucket.model_params, bucket.step,
                      lr, float(beta1), float(beta2), float(g['eps']),
                      float(g['weight_decay']), bool(g['adam_w_mode']),
                      bool(g['bias_correction']), bool(g['grad_averaging']),
                      float(g['max_grad_norm']), bool(g['use_nvlamb']),
                      prepared.to(bucket.device, non_blocking=True), grad_scale, found_inf,
                      lr_tensor)
