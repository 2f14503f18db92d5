"""FusedAdam: Adam and AdamW in one multi-tensor op per bucket (apex's signature and defaults)."""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..casting import HALF_DTYPES
from ..ops._checks import (_as_pair, _check_betas, _check_flag, _check_lr,
                           _check_nonnegative)
from ..registry import OPTIMIZERS
from . import layout
from .base import FusedOptimizer, ParamsT
from .buckets import _Bucket
from .lean import AUX_STATE_KEYS, LeanStorageMixin
from .quantized_state import ADAM_CODES, DEFAULT_MIN_8BIT_SIZE, QuantizedStateMixin

__all__ = ['FusedAdam']


@OPTIMIZERS.register_module()
class FusedAdam(QuantizedStateMixin, LeanStorageMixin, FusedOptimizer):
    """Adam / AdamW with the update of each bucket of params in one fused op (apex FusedAdam).

    With ``adam_w_mode=True`` (the default, as in apex) weight decay is decoupled:
    ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``, i.e. torch's AdamW. With False it
    is L2 regularisation added to the gradient, i.e. torch's Adam. Moments are float32 for every
    param dtype; the step count is per param cohort (normally per group) and lives on the device.
    See :class:`~mp_wrappers.optim.FusedOptimizer` for loss scaling and ``fused_master_step``.

    Args:
        params: Parameters or param-group dicts.
        lr: Learning rate.
        bias_correction: Divide the moments by ``1 - beta**t``.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Added to the denominator.
        adam_w_mode: Decoupled weight decay (AdamW) when True, L2 regularisation when False.
        weight_decay: Weight decay coefficient.
        amsgrad: Must be False; the AMSGrad variant is not implemented (apex neither).
        set_grad_none: Default of ``zero_grad(set_to_none=...)``.
        capturable: Make every group's lr a 1-element float32 tensor on the params' device at its
            first step, read by the kernel on the device, so that a CUDA graph capturing step()
            replays with the lr an LR scheduler writes into that tensor (Note [capturable] in
            mp_wrappers.optim.base). Any fused optimizer also takes a tensor lr directly.
        master_weights: Keep an fp32 master copy of every fp16/bf16 param in the optimizer state
            and update it, rounding the result into the param (apex's option). Not needed when a
            wrapper already swaps fp32 masters into ``param_groups``.
        bf16_storage: How bfloat16 params are stored without an fp32 master: None (default),
            ``'split'``, ``'kahan'`` or ``'stochastic'`` (:mod:`mp_wrappers.optim.lean`).
        state_dtype: ``'float32'`` (default), ``'bfloat16'``: dtype of both moments of the
            bf16 params stepped with ``bf16_storage`` (Adam at 8 B/param with 'kahan'), or
            ``'int8'``: block-wise 8-bit moments (~2 B/param) for params of at least
            ``min_8bit_size`` elements (:mod:`mp_wrappers.optim.quantized_state`; CPU, and CUDA
            with a build that has CUDA kernels; with a ``bf16_storage``, CPU only: 'kahan' +
            int8 keeps ~6 B/param besides the grads).
        min_8bit_size: Params with fewer elements keep float32 moments under ``'int8'``.
        seed: Key of the stochastic-rounding hash (``bf16_storage='stochastic'``).

    Examples:
        >>> optim_wrapper = dict(
        ...     type='OptimWrapper',
        ...     optimizer=dict(type='mp_wrappers.FusedAdam', lr=1e-3, weight_decay=0.05))
        >>> opt = FusedAdam(model.parameters(), lr=1e-3)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    _op = 'multi_tensor_adam_'
    _tensor_state = ('exp_avg', 'exp_avg_sq')
    _moment_keys = ('exp_avg', 'exp_avg_sq')
    _lean_op = 'multi_tensor_adam_lean_'
    _quantized_codes = ADAM_CODES
    _quantized_op = 'multi_tensor_adam8bit_'

    def __init__(self, params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, capturable: bool = False,
                 master_weights: bool = False, bf16_storage: Optional[str] = None,
                 state_dtype: str = 'float32', seed: int = 0,
                 min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE) -> None:
        _check_flag('FusedAdam', 'amsgrad', amsgrad)
        if amsgrad:
            raise ValueError('FusedAdam: amsgrad=True is not supported (there is no fused AMSGrad '
                             'update); use amsgrad=False or torch.optim.Adam(amsgrad=True)')
        _check_flag('FusedAdam', 'master_weights', master_weights)
        self.master_weights = bool(master_weights)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=_as_pair(betas), eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode)
        state_dtype = self._init_quantized(state_dtype, min_8bit_size)
        self._init_lean(bf16_storage, state_dtype, seed)
        super().__init__(params, defaults, set_grad_none, capturable)

    _flag_options = ('bias_correction', 'adam_w_mode')

    def _check_hyperparameters(self, group: Dict[str, Any]) -> None:
        _check_lr('FusedAdam', group['lr'])
        _check_betas('FusedAdam', group['betas'])
        _check_nonnegative('FusedAdam', 'eps', group['eps'])
        _check_nonnegative('FusedAdam', 'weight_decay', group['weight_decay'])
        if group.get('amsgrad', False):
            raise ValueError('FusedAdam: amsgrad=True is not supported')

    def _init_extra_state(self, param: Tensor, state: Dict[str, Any]) -> None:
        if self.master_weights and param.dtype in HALF_DTYPES:
            state['master_param'] = layout.like(param, torch.float32).copy_(param)

    def _targets_are_params(self, with_models: bool) -> bool:
        # An internal master is another target; a state may hold one from a checkpoint saved with
        # master_weights=True, which _update_target below then steps.
        return (LeanStorageMixin._targets_are_params(self, with_models) and not self.master_weights
                and not any('master_param' in state for state in self.state.values()))

    def _update_target(self, param: Tensor, state: Dict[str, Any],
                       model: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        if self.bf16_storage is not None or self.state_dtype != torch.float32:
            # The lean storages (never with master_weights=True: refused in set_bf16_storage).
            return LeanStorageMixin._update_target(self, param, state, model)
        master = state.get('master_param')
        if master is None:
            return param, model
        if model is not None:
            raise ValueError('FusedAdam(master_weights=True) keeps its own fp32 master for a half '
                             'param; fused_master_step cannot also write a model copy for it')
        # The internal master is updated and the param itself is the model copy.
        return master, param

    def _launch(self, bucket: _Bucket, grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                prepared: Any) -> None:
        g = bucket.group
        beta1, beta2 = g['betas']
        lr, lr_tensor = self._lr_args(g, bucket.device)
        bucket = self._launch_quantized(bucket, grad_scale, found_inf, lr, lr_tensor)
        if bucket is None:  # all of its slots had 8-bit moments
            return
        if self._is_lean(bucket.params[0]):
            self._launch_lean(bucket, (bucket.states['exp_avg'], bucket.states['exp_avg_sq']),
                              self._lean_lr(lr, lr_tensor), float(beta1), float(beta2),
                              float(g['eps']), float(g['weight_decay']), bool(g['adam_w_mode']),
                              bool(g['bias_correction']), grad_scale, found_inf)
            return
        self._call_op(bucket, bucket.params, bucket.grads, bucket.states['exp_avg'],
                      bucket.states['exp_avg_sq'], bucket.model_params, bucket.step,
                      lr, float(beta1), float(beta2), float(g['eps']),
                      float(g['weight_decay']), bool(g['adam_w_mode']),
                      bool(g['bias_correction']), grad_scale, found_inf, lr_tensor)

    def _call_8bit_op(self, bucket: _Bucket, pick: Callable[[List[Tensor]], List[Tensor]],
                      states: List[List[Tensor]], step: Tensor, grad_scale: Optional[Tensor],
                      found_inf: Optional[Tensor], lr: float, lr_tensor: Optional[Tensor]) -> None:
        # multi_tensor_adam8bit_, or its lean form for bf16 params with a bf16_storage (the aux
        # state in the same pass). The kernel checks its lists again; the optimizer built them.
        g = bucket.group
        beta1, beta2 = g['betas']
        params, grads = pick(bucket.params), pick(bucket.grads)
        hyper = (lr, float(beta1), float(beta2), float(g['eps']),
                 float(g['weight_decay']), bool(g['adam_w_mode']), bool(g['bias_correction']))
        if self._lean_8bit(bucket.params[0]):
            key = AUX_STATE_KEYS.get(self.bf16_storage)
            aux = pick(bucket.states[key]) if key else []
            self._call_op(bucket, params, aux, grads, *states, step, *hyper, self.bf16_storage,
                          int(self.seed), grad_scale, found_inf, op='multi_tensor_adam8bit_lean_')
            return
        models = pick(bucket.model_params) if bucket.model_params else []
        self._call_op(bucket, params, grads, *states, models, step, *hyper, grad_scale, found_inf,
                      lr_tensor, op='multi_tensor_adam8bit_')
