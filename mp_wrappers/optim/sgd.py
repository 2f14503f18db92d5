"""FusedSGD: SGD with momentum in one multi-tensor op per bucket (apex's signature and defaults)."""
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import Tensor

from ..ops._checks import _check_flag, _check_lr, _check_nonnegative
from ..registry import OPTIMIZERS
from .base import FusedOptimizer, ParamsT
from .buckets import _Bucket
from .lean import AUX_STATE_KEYS, LeanStorageMixin
from .quantized_state import DEFAULT_MIN_8BIT_SIZE, SGD_CODES, QuantizedStateMixin

__all__ = ['FusedSGD']


@OPTIMIZERS.register_module()
class FusedSGD(QuantizedStateMixin, LeanStorageMixin, FusedOptimizer):
    """SGD with momentum, dampening, Nesterov and weight decay (torch.optim.SGD math, apex FusedSGD).

    The first applied update sets the momentum buffer to the gradient, as torch does; the decision
    is made on the device from the step count, so an overflow-skipped first step leaves the buffer
    untouched and the next applied step is still "first" (some fused SGDs advance momentum on skipped
    steps; this one does not). ``wd_after_momentum`` adds ``weight_decay * p`` to the direction after
    the momentum instead of to the gradient before it (apex).

    Args:
        params: Parameters or param-group dicts.
        lr: Learning rate (required, as in apex).
        momentum: Momentum factor (0 disables the buffers).
        dampening: Dampening of the gradient in the momentum update.
        weight_decay: Weight decay (L2) coefficient.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).
        wd_after_momentum: Apply weight decay after the momentum.
        materialize_master_grads: Accepted for apex compatibility (there it decided whether amp
            made fp32 master grads). Never needed here: ``fused_master_step`` reads the half grads
            directly. Kept as the attribute of the same name.
        set_grad_none: Default of ``zero_grad(set_to_none=...)`` (False, as in apex).
        bf16_storage: How bfloat16 params are stored without an fp32 master: None (default),
            ``'split'``, ``'kahan'`` or ``'stochastic'`` (:mod:`mp_wrappers.optim.lean`).
        state_dtype: ``'float32'`` (default) or ``'bfloat16'``: dtype of the momentum buffers of
            the bf16 params stepped with ``bf16_storage``; or ``'int8'``: a block-wise 8-bit
            momentum buffer (~1 B/param instead of 4) for params of at least ``min_8bit_size``
            elements (:mod:`mp_wrappers.optim.quantized_state`; fp32 or half params on the CPU,
            and on CUDA with a build that has CUDA kernels, e.g. behind a wrapper's fp32 masters,
            and bf16 params with a ``bf16_storage``, where the same holds).
        min_8bit_size: Params with fewer elements keep a float32 buffer under ``'int8'``.
        seed: Key of the stochastic-rounding hash (``bf16_storage='stochastic'``).
        capturable: Make every group's lr a 1-element float32 tensor on the params' device at its
            first step, read by the kernel on the device, so that a CUDA graph capturing step()
            replays with the lr an LR scheduler writes into that tensor (Note [capturable] in
            mp_wrappers.optim.base). A tensor lr may also be passed directly.

    Examples:
        >>> optim_wrapper = dict(
        ...     type='OptimWrapper',
        ...     optimizer=dict(type='mp_wrappers.FusedSGD', lr=0.1, momentum=0.9,
        ...                    weight_decay=1e-4, nesterov=True))
    """

    _op = 'multi_tensor_sgd_'
    _moment_keys = ('momentum_buffer',)
    _lean_op = 'multi_tensor_sgd_lean_'
    _quantized_codes = SGD_CODES
    _quantized_op = 'multi_tensor_sgd8bit_'

    def __init__(self, params: ParamsT, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False,
                 wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: bool = False, bf16_storage: Optional[str] = None,
                 state_dtype: str = 'float32', seed: int = 0, capturable: bool = False,
                 min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE) -> None:
        _check_flag('FusedSGD', 'materialize_master_grads', materialize_master_grads)
        self.materialize_master_grads = bool(materialize_master_grads)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, wd_after_momentum=wd_after_momentum)
        state_dtype = self._init_quantized(state_dtype, min_8bit_size)
        self._init_lean(bf16_storage, state_dtype, seed)
        super().__init__(params, defaults, set_grad_none, capturable)

    _flag_options = ('nesterov', 'wd_after_momentum')

    def _check_hyperparameters(self, group: Dict[str, Any]) -> None:
        _check_lr('FusedSGD', group['lr'])
        _check_nonnegative('FusedSGD', 'momentum', group['momentum'])
        _check_nonnegative('FusedSGD', 'dampening', group['dampening'])
        _check_nonnegative('FusedSGD', 'weight_decay', group['weight_decay'])
        if group['nesterov'] and (group['momentum'] <= 0 or group['dampening'] != 0):
            raise ValueError('FusedSGD: nesterov=True requires momentum > 0 and dampening == 0, '
                             f'got momentum={group["momentum"]!r}, '
                             f'dampening={group["dampening"]!r}')

    def _tensor_state_keys(self, group: Dict[str, Any]) -> Tuple[str, ...]:
        return ('momentum_buffer',) if group['momentum'] != 0 else ()

    def _wants_8bit(self, param: Tensor, group: Dict[str, Any]) -> bool:
        # without momentum there is no buffer to quantize
        return group['momentum'] != 0 and super()._wants_8bit(param, group)

    def _launch(self, bucket: _Bucket, grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                prepared: Any) -> None:
        g = bucket.group
        lr, lr_tensor = self._lr_args(g, bucket.device)
        bucket = self._launch_quantized(bucket, grad_scale, found_inf, lr, lr_tensor)
        if bucket is None:  # all of its slots had an 8-bit buffer
            return
        if self._is_lean(bucket.params[0]):
            self._launch_lean(bucket, (bucket.states.get('momentum_buffer', []),),
                              self._lean_lr(lr, lr_tensor), float(g['momentum']),
                              float(g['dampening']),
                              float(g['weight_decay']), bool(g['nesterov']),
                              bool(g['wd_after_momentum']), grad_scale, found_inf)
            return
        self._call_op(bucket, bucket.params, bucket.grads, bucket.states.get('momentum_buffer', []),
                      bucket.model_params, bucket.step, lr, float(g['momentum']),
                      float(g['dampening']), float(g['weight_decay']), bool(g['nesterov']),
                      bool(g['wd_after_momentum']), grad_scale, found_inf, lr_tensor)

    def _call_8bit_op(self, bucket: _Bucket, pick: Callable[[List[Tensor]], List[Tensor]],
                      states: List[List[Tensor]], step: Tensor, grad_scale: Optional[Tensor],
                      found_inf: Optional[Tensor], lr: float, lr_tensor: Optional[Tensor]) -> None:
        # multi_tensor_sgd8bit_, or its lean form for bf16 params with a bf16_storage (the aux
        # state in the same pass; a float lr: a tensor lr is refused before any launch, and
        # _lean_lr refuses it here again rather than step by the 0.0 that stands in for it).
        g = bucket.group
        params, grads = pick(bucket.params), pick(bucket.grads)
        hyper = (float(g['momentum']), float(g['dampening']), float(g['weight_decay']),
                 bool(g['nesterov']), bool(g['wd_after_momentum']))
        if self._lean_8bit(bucket.params[0]):
            key = AUX_STATE_KEYS.get(self.bf16_storage)
            aux = pick(bucket.states[key]) if key else []
            self._call_op(bucket, params, aux, grads, *states, step, self._lean_lr(lr, lr_tensor),
                          *hyper, self.bf16_storage, int(self.seed), grad_scale, found_inf,
                          op='multi_tensor_sgd8bit_lean_')
            return
        models = pick(bucket.model_params) if bucket.model_params else []
        self._call_op(bucket, params, grads, *states, models, step, lr, *hyper, grad_scale,
                      found_inf, lr_tensor, op='multi_tensor_sgd8bit_')
