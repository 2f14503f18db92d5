"""``FP16OptimWrapper``: apex ``fp16_utils.FP16_Optimizer`` semantics as an mmengine optimizer wrapper."""
import logging
import warnings
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from mmengine.logging import print_log
from torch import Tensor
from torch.optim import Optimizer

from .. import compat, hardware
from ..casting import HALF_DTYPES
from ..policy import DEFAULT
from ..registry import OPTIM_WRAPPERS
from ..scaler import DynamicLossScaler, build_loss_scaler
from .model_casting import CastPlan, ModelCastingOptimWrapper

__all__ = ['FP16OptimWrapper', 'FP32ModelWarning']

_FP32_MODEL_MESSAGE = (
    'FP16OptimWrapper got an optimizer over fp32 parameters only and no dtype: it trains entirely '
    'in fp32 (no half-precision compute, no masters, loss scaling only). Add dtype=\'bfloat16\' '
    "(or 'float16', or 'auto') to the optim_wrapper config and the wrapper casts the model itself "
    '(norm layers kept fp32) with fp32 masters; or build the model in half precision; or give '
    "dtype='float32' to train in fp32 on purpose.")


class FP32ModelWarning(UserWarning):
    """FP16OptimWrapper was given an fp32 model (it then trains in fp32)."""


def _warn_fp32_model() -> None:
    warnings.warn(_FP32_MODEL_MESSAGE, FP32ModelWarning, stacklevel=4)
    print_log(f'mp_wrappers: {_FP32_MODEL_MESSAGE}', logger='current', level=logging.WARNING)


def _check_model_dtype(optimizer: Optimizer,
                       dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """Resolve ``dtype`` for the parameters' device, check the parameters, warn when slow.

    Returns the resolved dtype (None when ``dtype`` is None).

    Raises:
        ValueError: ``dtype`` is not allowed, or a parameter is in another half dtype than ``dtype``.
    """
    params = [p for g in getattr(optimizer, 'param_groups', []) for p in g['params']]
    device = params[0].device if params else torch.device('cpu')
    resolved = None
    if dtype is not None:
        try:
            resolved = hardware.resolve_dtype(dtype, device)
        except ValueError:
            raise ValueError(f"FP16OptimWrapper: dtype={dtype!r} is not supported; allowed: "
                             "'float16', 'bfloat16', 'float32', 'auto' or None") from None
        if isinstance(dtype, str) and dtype == 'auto':
            print_log('mp_wrappers FP16OptimWrapper: ' + hardware.auto_dtype(device).reason,
                      logger='current', level=logging.INFO)
        for i, p in enumerate(params):
            if p.is_floating_point() and p.dtype not in (resolved, torch.float32):
                raise ValueError(
                    f'FP16OptimWrapper(dtype={dtype!r}) expects the model in {resolved} (normalisation '
                    f'layers may stay float32), but parameter {i} of the optimizer is {p.dtype}; '
                    f'build the model with the same dtype (e.g. DigitsCNN(dtype={dtype!r}))')
    for half in sorted({p.dtype for p in params if p.dtype in HALF_DTYPES}, key=str):
        compat.require_dtype_on(half, device)
        reason = hardware.slowdown_reason(half, device)
        if reason is not None:
            warnings.warn(f'FP16OptimWrapper: the model has {half} parameters on a device without '
                          f'native {str(half).replace("torch.", "")}: {reason}', UserWarning,
                          stacklevel=4)
    return resolved


@OPTIM_WRAPPERS.register_module()
class FP16OptimWrapper(ModelCastingOptimWrapper):
    """fp32 master weights and static or dynamic loss scaling for fp16/bf16 models.

    Build the model in half precision (keeping normalisation layers fp32, see
    :func:`mp_wrappers.casting.cast_model`), build the optimizer over its parameters, and wrap it.
    Each fp16/bf16 parameter gets an fp32 master that the optimizer steps; gradients are unscaled into
    fp32 master gradients, and a step whose gradients hold inf/nan is skipped (with a static scale
    too). Loss scaling is orthogonal to the learning rate: gradients are unscaled before the step.

    Unlike apex, the default dynamic scaler uses apex *amp*'s defaults (start 2**16, double after
    2000 clean steps, max 2**24); ``dynamic_loss_args=dict(init_scale=2.**32, scale_window=1000,
    min_loss_scale=1.)`` restores the legacy ``FP16_Optimizer`` scaler.

    ``dtype`` says which precision the model trains in. A model built in half precision (apex's way:
    ``DigitsCNN(dtype='bfloat16')``, ``cast_model(model, torch.bfloat16)``) must be in that dtype
    (normalisation layers may stay fp32). A model built in fp32 with a half ``dtype`` (an OpenMMLab
    toolbox builds every model in fp32) is cast by the wrapper itself when training starts, as
    apex's ``network_to_half`` did (normalisation layers and ``fp32_modules`` kept fp32, inputs
    cast to the half dtype and outputs back to fp32, checkpoints in fp32, refused after DDP wrapped
    the model), and its fp32 weights become the masters bit for bit. ``dtype='auto'`` resolves to
    bf16 where the device computes it natively, else fp16 where native, else fp32, in which case
    the wrapper keeps no masters and does no scaling but still skips non-finite steps; the
    resolution is logged once and picks the loss-scaling default. A half dtype the device has no
    native instructions for is warned about once, with the reason. Without ``dtype`` (apex) the
    model is taken as it is, and an fp32 model trains in fp32 (with a warning).

    Args:
        optimizer (Optimizer): Optimizer over the (half) model parameters.
        static_loss_scale (float): The fixed scale when ``dynamic_loss_scale`` is False. Defaults
            to 1.0. Use 1.0 for bf16, which needs no scaling.
        dynamic_loss_scale (bool): Use a dynamic scale. Defaults to False (apex), or, when
            ``dtype`` is given, True exactly when it is (or resolves to) fp16.
        dynamic_loss_args (dict, optional): Dynamic scaler options: ``init_scale``,
            ``scale_factor``, ``scale_window``, ``min_loss_scale``, ``max_loss_scale``,
            ``hysteresis``.
        verbose (bool): Log skipped steps. Defaults to True.
        accumulative_counts (int): mmengine gradient accumulation. Defaults to 1.
        clip_grad (dict, optional): mmengine's ``clip_grad``, applied to unscaled fp32 master grads.
        dtype (str, optional): The precision the model trains in: ``'float16'``, ``'bfloat16'``,
            ``'float32'`` or ``'auto'`` (see above): a half model must be in it, an fp32 model is
            cast to it. None (default, apex) takes the model as it is.
        fp32_modules (list[str], optional): Submodules kept fp32 (with fp32 inputs and outputs)
            when the wrapper casts the model; see
            :class:`~mp_wrappers.wrappers.model_casting.ModelCastingOptimWrapper`.
        **kwargs: Options shared by all our wrappers (``overflow_report``, ``on_scale_collapse``,
            ``collapse_patience``, ``sync_found_inf``, ``log_interval``, ``grad_check``,
            ``compile_step``): see
            :mod:`mp_wrappers.wrappers.options`.

    Examples:
        >>> optim_wrapper = dict(
        ...     type='mp_wrappers.FP16OptimWrapper',
        ...     optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
        ...     dynamic_loss_scale=True,
        ...     dynamic_loss_args=dict(init_scale=2.**16, scale_window=2000, hysteresis=2),
        ...     accumulative_counts=4,
        ...     clip_grad=dict(max_norm=5.0))
    """

    def __init__(self, optimizer: Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: Any = DEFAULT, dynamic_loss_args: Optional[Dict[str, Any]] = None,
                 verbose: bool = True, accumulative_counts: int = 1,
                 clip_grad: Optional[dict] = None,
                 dtype: Union[str, torch.dtype, None] = None, **kwargs) -> None:
        self.dtype = _check_model_dtype(optimizer, dtype)
        if dynamic_loss_scale is DEFAULT:
            dynamic_loss_scale = self.dtype == torch.float16
        if not isinstance(dynamic_loss_scale, bool):
            raise TypeError(f'dynamic_loss_scale must be True or False, got {dynamic_loss_scale!r}')
        scaler = build_loss_scaler(dynamic_loss_scale, static_loss_scale, dynamic_loss_args)
        super().__init__(optimizer, [scaler], master_weights=True, verbose=verbose,
                         accumulative_counts=accumulative_counts, clip_grad=clip_grad, **kwargs)
        self.dynamic_loss_scale = dynamic_loss_scale
        self._master_params()  # create masters now, as FP16_Optimizer does at construction
        # An fp32 model with a half dtype: the wrapper casts it when training starts.
        self._casts_to: Optional[torch.dtype] = (
            self.dtype if self.dtype in HALF_DTYPES and not self._masters.has_half else None)
        # An fp32 model is only a surprise when no dtype says so: dtype='float32', or 'auto' on a
        # device without native half formats, asks for fp32 compute on purpose.
        if not self._masters.has_half and self.dtype is None:
            _warn_fp32_model()

    # ---- model preparation (ModelCastingOptimWrapper) ----------------------------------------------
    def _cast_plan(self) -> Optional[CastPlan]:
        cast = getattr(self, '_casts_to', None)
        if cast is None:
            # A half model built by the user: only fp32_modules' hooks to place (checked fp32).
            if not self.fp32_modules:
                return None
            return CastPlan(label='FP16OptimWrapper', level='O2', dtype=None,
                            keep_norm_fp32=True, output_dtype=torch.float32, masters=True,
                            ddp_config='')
        name = str(cast).replace('torch.', '')
        return CastPlan(
            label=f'FP16OptimWrapper(dtype={name!r})', level='O2', dtype=cast,
            keep_norm_fp32=True, output_dtype=torch.float32, masters=True,
            ddp_config=("model_wrapper_cfg=dict(type='mp_wrappers."
                        f"MixedPrecisionDistributedDataParallel', dtype='{name}', "
                        'keep_batchnorm_fp32=True'
                        + (f', fp32_modules={list(self.fp32_modules)!r}' if self.fp32_modules
                           else '') + ')'))

    def _model_prepared(self, module, device: torch.device) -> None:
        if self._casts_to is None:
            return
        name = str(self._casts_to).replace('torch.', '')
        reason = hardware.slowdown_reason(self._casts_to, device)
        if reason is not None:
            warnings.warn(f'FP16OptimWrapper(dtype={name!r}) on a device without native {name}: '
                          f'{reason}', UserWarning, stacklevel=5)
        kept = f', {list(self.fp32_modules)} kept fp32' if self.fp32_modules else ''
        print_log(f'mp_wrappers FP16OptimWrapper: cast {type(module).__name__} to {name} '
                  f'(normalisation layers{kept} kept fp32); fp32 masters start from its fp32 '
                  'weights', logger='current', level=logging.INFO)

    def trains_half_weights(self) -> bool:
        return self._casts_to is not None or super().trains_half_weights()

    # ---- apex FP16_Optimizer API -------------------------------------------------------------------
    def backward(self, loss: Tensor, update_master_grads: bool = True, retain_graph: bool = False,
                 loss_id: int = 0, **kwargs) -> None:
        """Scale ``loss``, back-propagate and (by default) unscale the grads into the masters.

        Args:
            loss (Tensor): The loss.
            update_master_grads (bool): Unscale into master grads now. With several backwards per
                step pass False and call :meth:`update_master_grads` (or just :meth:`step`) after
                the last one. Defaults to True (apex).
            retain_graph (bool): Passed to ``Tensor.backward``.
        """
        super().backward(loss, loss_id=loss_id, retain_graph=retain_graph, **kwargs)
        # Under FSDP while accumulating, the grads are unsharded partial sums until the last
        # micro-batch's backward: unscale then (the scale is the same for the whole step).
        if update_master_grads and not self._grads_unsynced:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the model gradients into fp32 master gradients, checking them for inf/nan."""
        self._unscale_pending()
        self._stash.hand_to_optimizer(self._master_params())

    def _backward_for_update(self, loss: Tensor, loss_id: int) -> None:
        # Unscaling once per optimizer step (not per accumulation iteration) is enough: the loss
        # scale only changes at a step, so every accumulated backward used the same one.
        self.backward(loss, update_master_grads=False, loss_id=loss_id)

    def step(self, closure: Optional[Callable[[], Tensor]] = None, **kwargs) -> Optional[Tensor]:
        """Step the masters and copy them to the model, or skip the step on overflow.

        Args:
            closure (callable, optional): As in apex: re-evaluates the model and calls
                ``self.backward(loss)`` itself, returning the loss. It is re-run (with a lowered
                scale) while the gradients overflow and the scale can still go down.

        Returns:
            The closure's loss, if a closure was given.
        """
        if closure is None:
            super().step(**kwargs)
            return None
        return self._step_with_closure(closure, **kwargs)

    def _step_with_closure(self, closure: Callable[[], Tensor], **kwargs) -> Tensor:
        scaler = self.loss_scalers[0]
        while True:
            self.zero_grad()
            loss = closure()
            self._unscale_pending()
            if not self._overflowed():
                break
            before = scaler.loss_scale
            self._finish_step(skipped=True)
            if not isinstance(scaler, DynamicLossScaler) or scaler.loss_scale == before:
                # A static (or bottomed-out) scale cannot fix the overflow: skip this step.
                return loss
        super().step(**kwargs)
        return loss

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the unscaled fp32 master gradients; return their total norm, or -1 on overflow."""
        self.update_master_grads()
        if self._overflowed():
            return -1.0
        grads_owner = [p for p in self.master_params() if p.grad is not None]
        if not grads_owner:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(grads_owner, max_norm, norm_type=norm_type)
        if not bool(torch.isfinite(norm)):  # an overflow (Note [non-finite norm], overflow.py)
            self._flags.flag_nonfinite_norm(norm)
            return -1.0
        return float(norm)

    def zero_grad(self, set_grads_to_None: bool = False, set_to_none: Optional[bool] = None,
                  **kwargs) -> None:
        """Clear gradients. Accepts apex's ``set_grads_to_None`` and torch's ``set_to_none``."""
        super().zero_grad(set_to_none=bool(set_grads_to_None if set_to_none is None
                                           else set_to_none))

    def inspect_master_grad_data(self) -> Optional[List[List[Optional[Tensor]]]]:
        """The fp32 master gradients per param group, or None (with a warning) after an overflow."""
        self.update_master_grads()
        if self._overflowed():
            print_log('inspect_master_grad_data called while in an overflow state: gradients are '
                      'invalid (inf, nan or stale); returning None.', logger='current',
                      level=logging.WARNING)
            return None
        return [[p.grad.detach() if p.grad is not None else None for p in g['params']]
                for g in self.optimizer.param_groups]

    # ---- checkpoint extras -----------------------------------------------------------------------
    def _extra_state(self) -> Dict[str, Any]:
        return dict(dynamic_loss_scale=self.dynamic_loss_scale, overflow=self.overflow,
                    first_closure_call_this_step=True)

    def _load_extra_state(self, ours: Dict[str, Any]) -> None:
        self._outcomes.last_skipped = bool(ours.get('overflow', False))
