"""FusedAdagrad: Adagrad in one multi-tensor op per bucket (apex's signature and defaults)."""
from typing import Any, Dict, Optional

from torch import Tensor

from ..ops._checks import _check_lr, _check_nonnegative
from ..registry import OPTIMIZERS
from .base import FusedOptimizer, ParamsT
from .buckets import _Bucket

__all__ = ['FusedAdagrad']


@OPTIMIZERS.register_module()
class FusedAdagrad(FusedOptimizer):
    """Adagrad (apex FusedAdagrad): ``h += g * g; p -= lr * g / (sqrt(h) + eps)``.

    Matches ``torch.optim.Adagrad`` with ``lr_decay=0`` and ``initial_accumulator_value=0``. Weight
    decay is L2 on the gradient, or with ``adagrad_w_mode`` decoupled (``+ weight_decay * p`` in the
    update). The sums of squares are float32 for every param dtype.

    Args:
        params: Parameters or param-group dicts.
        lr: Learning rate.
        eps: Added to the denominator.
        weight_decay: Weight decay coefficient.
        set_grad_none: Default of ``zero_grad(set_to_none=...)``.
        adagrad_w_mode: Decoupled weight decay when True.
        capturable: Make every group's lr a 1-element float32 tensor on the params' device at its
            first step, read by the kernel on the device, so that a CUDA graph capturing step()
            replays with the lr an LR scheduler writes into that tensor (Note [capturable] in
            mp_wrappers.optim.base). A tensor lr may also be passed directly.

    Examples:
        >>> optim_wrapper = dict(
        ...     type='OptimWrapper',
        ...     optimizer=dict(type='mp_wrappers.FusedAdagrad', lr=1e-2))
    """

    _op = 'multi_tensor_adagrad_'
    _tensor_state = ('sum',)

    def __init__(self, params: ParamsT, lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0.0, set_grad_none: bool = True,
                 adagrad_w_mode: bool = False, capturable: bool = False) -> None:
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, adagrad_w_mode=adagrad_w_mode)
        super().__init__(params, defaults, set_grad_none, capturable)

    _flag_options = ('adagrad_w_mode',)

    def _check_hyperparameters(self, group: Dict[str, Any]) -> None:
        _check_lr('FusedAdagrad', group['lr'])
        _check_nonnegative('FusedAdagrad', 'eps', group['eps'])
        _check_nonnegative('FusedAdagrad', 'weight_decay', group['weight_decay'])

    def _launch(self, bucket: _Bucket, grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                prepared: Any) -> None:
        g = bucket.group
        lr, lr_tensor = self._lr_args(g, bucket.device)
        self._call_op(bucket, bucket.params, bucket.grads, bucket.states['sum'],
                      bucket.model_params, bucket.step, lr, float(g['eps']),
                      float(g['weight_decay']), bool(g['adagrad_w_mode']), grad_scale, found_inf,
                      lr_tensor)
