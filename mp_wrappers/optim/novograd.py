"""FusedNovoGrad: NovoGrad in one multi-tensor op per bucket (apex's signature and defaults)."""
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from ..ops._checks import (_as_pair, _check_betas, _check_flag, _check_lr, _check_nonnegative,
                           _check_norm_type)
from ..registry import OPTIMIZERS
from .base import FusedOptimizer, ParamsT
from .buckets import _Bucket

__all__ = ['FusedNovoGrad']


@OPTIMIZERS.register_module()
class FusedNovoGrad(FusedOptimizer):
    """NovoGrad (apex FusedNovoGrad): layer-wise second moment of the gradient norm.

    Each param keeps a running norm of its gradient (L2 with ``norm_type=2``, max-abs with 0),
    blended with ``beta2``; the first applied step sets it to the current norm unless ``init_zero``.
    The first moment accumulates ``g / (norm + eps)`` plus weight decay when ``reg_inside_moment``,
    otherwise ``g``, with the normalisation and decay applied in the update. See
    ``mp_wrappers.ops.reference.multi_tensor_novograd_`` for the exact formulas.

    Args:
        params: Parameters or param-group dicts.
        lr: Learning rate.
        bias_correction: Bias-correct the moments.
        betas: Coefficients of the first moment and of the running norm.
        eps: Added to the denominator.
        weight_decay: Weight decay coefficient.
        amsgrad: Must be False (not implemented, as in apex).
        reg_inside_moment: Put the normalised gradient and the decay inside the moment (the
            NovoGrad paper) instead of applying them in the update.
        grad_averaging: Scale the gradient by ``1 - beta1`` in the first moment.
        norm_type: 2 for the L2 norm, 0 for the infinity norm.
        init_zero: Start the running norm at 0 instead of the first gradient's norm.
        set_grad_none: Default of ``zero_grad(set_to_none=...)``.
        capturable: Make every group's lr a 1-element float32 tensor on the params' device at its
            first step, read by the kernel on the device, so that a CUDA graph capturing step()
            replays with the lr an LR scheduler writes into that tensor (Note [capturable] in
            mp_wrappers.optim.base). A tensor lr may also be passed directly.

    Examples:
        >>> optim_wrapper = dict(
        ...     type='OptimWrapper',
        ...     optimizer=dict(type='mp_wrappers.FusedNovoGrad', lr=1e-2, betas=(0.95, 0.98),
        ...                    weight_decay=1e-3))
    """

    _op = 'multi_tensor_novograd_'
    _tensor_state = ('exp_avg',)
    _scalar_state = ('exp_avg_sq',)

    def __init__(self, params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False,
                 reg_inside_moment: bool = False, grad_averaging: bool = True, norm_type: int = 2,
                 init_zero: bool = False, set_grad_none: bool = True,
                 capturable: bool = False) -> None:
        _check_flag('FusedNovoGrad', 'amsgrad', amsgrad)
        if amsgrad:
            raise ValueError('FusedNovoGrad: amsgrad=True is not supported; use amsgrad=False')
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=_as_pair(betas), eps=eps,
                        weight_decay=weight_decay, reg_inside_moment=reg_inside_moment,
                        grad_averaging=grad_averaging, norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults, set_grad_none, capturable)

    _flag_options = ('bias_correction', 'reg_inside_moment', 'grad_averaging', 'init_zero')

    def _check_hyperparameters(self, group: Dict[str, Any]) -> None:
        _check_lr('FusedNovoGrad', group['lr'])
        _check_betas('FusedNovoGrad', group['betas'])
        _check_nonnegative('FusedNovoGrad', 'eps', group['eps'])
        _check_nonnegative('FusedNovoGrad', 'weight_decay', group['weight_decay'])
        _check_norm_type('FusedNovoGrad', group['norm_type'])

    def _launch(self, bucket: _Bucket, grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                prepared: Any) -> None:
        g = bucket.group
        beta1, beta2 = g['betas']
        # The op wants the running norms of a bucket as one tensor, while the state keeps one per
        # param (bucket membership changes with which params have grads): gather, update, scatter.
        per_param = bucket.states['exp_avg_sq']
        norms = torch.cat(per_param)
        lr, lr_tensor = self._lr_args(g, bucket.device)
        self._call_op(bucket, bucket.params, bucket.grads, bucket.states['exp_avg'], norms,
                      bucket.model_params, bucket.step, lr, float(beta1), float(beta2),
                      float(g['eps']), float(g['weight_decay']), bool(g['bias_correction']),
                      bool(g['grad_averaging']), bool(g['reg_inside_moment']),
                      int(g['norm_type']), bool(g['init_zero']), grad_scale, found_inf,
                      lr_tensor)
        torch._foreach_copy_(per_param, list(norms.split(1)))
