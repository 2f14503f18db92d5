"""``ApexOptimWrapper``: mmengine's ApexOptimWrapper arguments and apex amp semantics, without apex."""
import contextlib
import logging
import warnings
from typing import Any, Dict, Optional

import torch
from mmengine.logging import print_log
from mmengine.optim import OptimWrapper
from torch import Tensor, nn
from torch.optim import Optimizer

from .. import compat, hardware
from ..autocast import o1_context
from ..casting import HALF_DTYPES
from ..master import MasterParams
from ..master_modes import LeanMasterParams
from ..policy import DEFAULT, Properties, resolve_properties
from ..registry import OPTIM_WRAPPERS
from ..scaler import DynamicLossScaler, LossScaler, StaticLossScaler
from .checkpoint_format import APEX_KEY, FOREIGN_KEYS, apex_amp_state
from .compiled_step import refuse_lr_as_number
from .model_casting import CastPlan, ModelCastingOptimWrapper

__all__ = ['ApexOptimWrapper']

_SHORT = {torch.float16: 'fp16', torch.bfloat16: 'bf16'}


def _optimizer_device(optimizer: Optimizer) -> torch.device:
    """The device of the optimizer's first parameter (CPU for an optimizer without any yet)."""
    for group in getattr(optimizer, 'param_groups', []):
        for p in group['params']:
            return p.device
    return torch.device('cpu')


@OPTIM_WRAPPERS.register_module()
class ApexOptimWrapper(ModelCastingOptimWrapper):
    """apex amp's opt levels O0-O3 for mmengine, on CPU and CUDA, with no apex installed.

    A drop-in for ``mmengine.optim.ApexOptimWrapper``: every argument has the same meaning and
    default, and ``state_dict()`` has the ``apex_amp`` entry real apex checkpoints have. On the first
    :meth:`optim_context` the model is prepared like ``amp.initialize`` did: O1 runs the forward under
    ``torch.autocast``; O2/O3 cast the model to the half dtype (affine BatchNorm kept fp32 with
    ``keep_batchnorm_fp32``), cast inputs to it and outputs back to fp32; O2 steps fp32 master
    weights. Unlike apex, every level skips steps that are not finite (at a static scale of 1.0, by
    default, steps whose loss is not finite: see ``grad_check``), ``num_losses`` works with
    accumulation without ``delay_unscale``, nothing global is patched, and bf16 is supported.

    Args:
        optimizer (Optimizer): The optimizer over the model's fp32 parameters.
        opt_level (str): ``'O0'``, ``'O1'``, ``'O2'`` or ``'O3'``. Defaults to ``'O1'``.
        loss_scale (float | str): ``'dynamic'``, a number or a numeric string. Default: ``'dynamic'``
            for fp16 (overriding O0/O3's 1.0, as mmengine does) and 1.0 (no scaling) for bf16; an
            explicit value always wins.
        enabled (bool): False makes the wrapper behave exactly like a plain fp32 ``OptimWrapper``.
        cast_model_type (torch.dtype, optional): Override of the level's model dtype.
        patch_torch_functions (bool, optional): Override (only True with O1).
        keep_batchnorm_fp32 (bool | str, optional): Override; ``"True"``/``"False"`` accepted.
        master_weights (bool | str, optional): Override (not with O1). Beyond apex, a bf16 model
            (O2/O3, ``dtype='bfloat16'``) also takes ``'split'`` (the bf16 params plus a uint16
            low half ARE the fp32 masters: O2's masters bit for bit, forward weights rounded
            toward zero, 2 B/param less), ``'kahan'`` (bf16 params with a bf16 Kahan compensation,
            no master) or ``'stochastic'`` (stochastically rounded bf16 updates, no master). These
            need ``mp_wrappers.FusedAdam`` or ``FusedSGD``; see :mod:`mp_wrappers.master_modes`.
        cast_model_outputs (torch.dtype, optional): dtype of the model's outputs under O2/O3
            (default fp32).
        num_losses (int): Number of independent loss scalers (``backward(loss, loss_id=k)``).
        verbosity (int): 1 logs the resolved properties once (rank 0); 0 is silent.
        min_loss_scale (float, optional): Floor of dynamic scales.
        max_loss_scale (float): Ceiling of dynamic scales. Defaults to 2**24.
        dtype (str): The compute type of O1-O3: ``'float16'`` (apex), ``'bfloat16'``, ``'float32'``
            or ``'auto'``: the format the optimizer's device computes natively (bf16, else fp16,
            else fp32; :func:`mp_wrappers.hardware.auto_dtype`), logged once with the reason. An
            explicit half type the device has no instructions for is honoured with a warning.
        hysteresis (int): Consecutive overflows before a dynamic scale backs off. Defaults to 1.
        scale_window (int): Clean steps before a dynamic scale grows. Defaults to 2000.
        init_scale (float): Initial dynamic scale. Defaults to 2**16.
        accumulative_counts (int): mmengine gradient accumulation. Defaults to 1.
        clip_grad (dict, optional): mmengine's ``clip_grad``, applied to unscaled fp32 gradients.
        **kwargs: Options shared by all our wrappers (``overflow_report``, ``on_scale_collapse``,
            ``collapse_patience``, ``sync_found_inf``, ``log_interval``, ``grad_check``,
            ``compile_step``): see
            :mod:`mp_wrappers.wrappers.options`.

    Examples:
        >>> optim_wrapper = dict(
        ...     type='mp_wrappers.ApexOptimWrapper', opt_level='O2', loss_scale='dynamic',
        ...     optimizer=dict(type='SGD', lr=0.1, momentum=0.9), accumulative_counts=4)
        >>> # bf16 on CPU (no loss scaling unless asked for):
        >>> optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O1',
        ...                      dtype='bfloat16', optimizer=dict(type='AdamW', lr=1e-3))
    """

    def __init__(self, optimizer: Optimizer, opt_level: str = 'O1', loss_scale: Any = DEFAULT,
                 enabled: bool = True, cast_model_type: Optional[torch.dtype] = None,
                 patch_torch_functions: Optional[bool] = None,
                 keep_batchnorm_fp32: Any = None, master_weights: Optional[bool] = None,
                 cast_model_outputs: Optional[torch.dtype] = None, num_losses: int = 1,
                 verbosity: int = 1, min_loss_scale: Optional[float] = None,
                 max_loss_scale: Optional[float] = 2.**24, dtype: str = 'float16',
                 hysteresis: int = 1, scale_window: int = 2000, init_scale: float = 2.**16,
                 accumulative_counts: int = 1, clip_grad: Optional[dict] = None,
                 **kwargs) -> None:
        if 'verbose' in kwargs:  # the base class's name for it; apex's option is verbosity
            raise TypeError(f"ApexOptimWrapper takes verbosity=0 or 1 (apex's option), not "
                            f"verbose={kwargs['verbose']!r}")
        device = _optimizer_device(optimizer)
        self.properties: Properties = resolve_properties(
            opt_level, dtype=dtype, enabled=enabled, loss_scale=loss_scale,
            cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
            keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
            cast_model_outputs=cast_model_outputs, device=device)
        if isinstance(dtype, str) and dtype == 'auto' and enabled:
            print_log('mp_wrappers ApexOptimWrapper: ' + hardware.auto_dtype(device).reason,
                      logger='current', level=logging.INFO)
        if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
            raise ValueError(f'num_losses must be an integer >= 1, got {num_losses!r}')
        if isinstance(verbosity, bool) or not isinstance(verbosity, int) or verbosity < 0:
            raise ValueError(f'verbosity must be an integer >= 0 (0: quiet, 1: the level and '
                             f'scale messages), got {verbosity!r}')
        if self.properties.lean_storage is not None and self.properties.enabled:
            refuse_lr_as_number(kwargs.get('compile_step', False),
                                f'master_weights={self.properties.lean_storage!r}')
        scalers = [self._build_scaler(min_loss_scale, max_loss_scale, hysteresis, scale_window,
                                      init_scale) for _ in range(num_losses)]
        # enabled=False makes no masters (a plain OptimWrapper): the checks of an optimizer under
        # fp32 masters (ZeRO, an unused bf16 storage) do not apply then.
        super().__init__(optimizer, scalers,
                         master_weights=self.properties.master_weights is True
                         and self.properties.enabled,
                         verbose=verbosity > 0, accumulative_counts=accumulative_counts,
                         clip_grad=clip_grad, **kwargs)
        self.num_losses = num_losses
        self.verbosity = verbosity
        self._lean_state_dict_hook = None
        if self.properties.lean_storage is not None and self.properties.enabled:
            LeanMasterParams(optimizer, self.properties.lean_storage)  # refuse a wrong optimizer now

    def _new_masters(self, initial_values: Optional[Dict[int, Tensor]] = None) -> MasterParams:
        if self.properties.lean_storage is not None and self.properties.enabled:
            return LeanMasterParams(self.optimizer, self.properties.lean_storage,
                                    initial_values=initial_values)
        return super()._new_masters(initial_values)

    def _build_scaler(self, min_loss_scale, max_loss_scale, hysteresis, scale_window,
                      init_scale) -> LossScaler:
        if self.properties.dynamic_loss_scale:
            return DynamicLossScaler(init_scale=init_scale, scale_window=scale_window,
                                     min_loss_scale=min_loss_scale,
                                     max_loss_scale=max_loss_scale, hysteresis=hysteresis)
        # Validate the dynamic options even when unused (bf16, a numeric loss_scale): a wrong
        # value is a mistake either way. The dynamic scaler's own checks give the same messages.
        # enabled=False (a plain OptimWrapper) ignores them, as it ignores every amp option.
        if self.properties.enabled:
            DynamicLossScaler(init_scale=init_scale, scale_window=scale_window,
                              min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
                              hysteresis=hysteresis)
        return StaticLossScaler(self.properties.loss_scale)

    @property
    def opt_level(self) -> str:
        return self.properties.opt_level

    @property
    def initialized(self) -> bool:
        """Whether the model has been prepared (cast, hooks) by :meth:`initialize`."""
        return self._model is not None

    # ---- model preparation (apex's amp.initialize, ModelCastingOptimWrapper) ----------------------
    def _cast_plan(self) -> Optional[CastPlan]:
        props = self.properties
        if not props.enabled:
            return None
        cast = props.cast_model_type
        keep_bn = bool(props.keep_batchnorm_fp32)
        kept = f', fp32_modules={list(self.fp32_modules)!r}' if self.fp32_modules else ''
        ddp = ("model_wrapper_cfg=dict(type='mp_wrappers.MixedPrecisionDistributedDataParallel', "
               f"dtype='{str(cast).replace('torch.', '')}', keep_batchnorm_fp32={keep_bn}{kept})")
        return CastPlan(label=f'ApexOptimWrapper(opt_level={props.opt_level!r})',
                        level=props.opt_level, dtype=cast, keep_norm_fp32=keep_bn,
                        output_dtype=props.cast_model_outputs or torch.float32,
                        masters=bool(props.master_weights), ddp_config=ddp)

    def _check_model(self, params) -> None:
        if self.properties.opt_level != 'O1':
            return
        half = [i for i, p in enumerate(params) if p.dtype in HALF_DTYPES]
        if half:
            raise ValueError(f'opt_level O1 expects fp32 model weights, but parameter {half[0]} '
                             f'of the optimizer is {params[half[0]].dtype}. O1 casts per op '
                             "with autocast; build the model in fp32, or use opt_level 'O2'/'O3'"
                             ' for a half-precision model')

    def _model_prepared(self, module: nn.Module, device: torch.device) -> None:
        props = self.properties
        cast = props.cast_model_type
        computes_in = {cast} if cast in HALF_DTYPES else set()
        if props.opt_level == 'O1' and props.dtype in HALF_DTYPES:
            computes_in.add(props.dtype)
        for half_dtype in sorted(computes_in, key=str):
            compat.require_dtype_on(half_dtype, device)
            reason = hardware.slowdown_reason(half_dtype, device)
            if reason is not None:
                warnings.warn(f'ApexOptimWrapper(opt_level={props.opt_level!r}, dtype='
                              f"{str(half_dtype).replace('torch.', '')}) on a device without "
                              f'native {_SHORT[half_dtype]}: {reason}', UserWarning, stacklevel=5)
        if isinstance(self._masters, LeanMasterParams):
            # After the fp32 hook: the checkpoint's weights are the full-precision ones.
            self._lean_state_dict_hook = self._masters.register_state_dict_hook(module)
        if self.verbosity >= 1:
            print_log(props.describe(), logger='current', level=logging.INFO)

    def release(self) -> None:
        """Remove the hooks this wrapper put on the model (the cast itself stays)."""
        super().release()
        if self._lean_state_dict_hook is not None:
            self._lean_state_dict_hook.remove()
            self._lean_state_dict_hook = None

    def initialize_count_status(self, model: nn.Module, init_counts: int,
                                max_counts: int) -> None:
        """mmengine's hook at training start (after init_weights, load_from and resume).

        The model is prepared (cast) and the masters bound here rather than at the first forward, so
        every forward of the run, including those another wrapper's step makes through this
        wrapper's modules, sees one dtype, and a resumed run matches an uninterrupted one. The
        whole model is fine for a GAN: only the modules this optimizer owns are cast
        (``owned_roots``). An ``OptimWrapperDict`` does not forward this call; the wrappers'
        lifecycle hook prepares its wrappers in ``before_train`` (Note [wrapper lifecycle]), and the
        first :meth:`optim_context` prepares any wrapper still unprepared.
        """
        super().initialize_count_status(model, init_counts, max_counts)

    def _prepare_model(self, model: nn.Module) -> None:
        if self.properties.enabled:  # enabled=False: a plain OptimWrapper, the model untouched
            super()._prepare_model(model)

    def trains_half_weights(self) -> bool:
        props = self.properties
        return bool(props.enabled) and props.cast_model_type in HALF_DTYPES

    @contextlib.contextmanager
    def optim_context(self, model: nn.Module):
        """The forward context: DDP ``no_sync`` while accumulating, and O1's autocast."""
        with super().optim_context(model):  # prepares the model (initialize) on first use
            if not self.properties.enabled:
                yield
                return
            if self.properties.patch_torch_functions:
                device = next(iter(self.optimizer.param_groups[0]['params'])).device
                with o1_context(device.type, self.properties.dtype):
                    yield
            else:
                yield

    # ---- the wrapper contract, with enabled=False as a true no-op ----------------------------------
    def backward(self, loss: Tensor, loss_id: int = 0, **kwargs) -> None:
        """Scale ``loss`` with scaler ``loss_id`` and back-propagate (see ``num_losses``)."""
        if not self.properties.enabled:
            OptimWrapper.backward(self, loss, **kwargs)
            return
        super().backward(loss, loss_id=loss_id, **kwargs)

    def update_params(self, loss: Tensor, step_kwargs: Optional[Dict] = None,
                      zero_kwargs: Optional[Dict] = None, loss_id: int = 0) -> None:
        if not self.properties.enabled:
            OptimWrapper.update_params(self, loss, step_kwargs, zero_kwargs)
            return
        super().update_params(loss, step_kwargs, zero_kwargs, loss_id=loss_id)

    def step(self, **kwargs) -> None:
        if not self.properties.enabled:
            OptimWrapper.step(self, **kwargs)
            return
        super().step(**kwargs)

    def zero_grad(self, **kwargs) -> None:
        if not self.properties.enabled:
            OptimWrapper.zero_grad(self, **kwargs)
            return
        super().zero_grad(**kwargs)

    # ---- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Optimizer state + ``apex_amp`` (apex's format) + our scalers/masters under our own key."""
        if not self.properties.enabled:
            return OptimWrapper.state_dict(self)
        if self._deferred_state is not None:
            return super().state_dict()  # loaded but not applied yet: what we hold
        state = super().state_dict()
        state[APEX_KEY] = apex_amp_state(self.loss_scalers)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load now, or keep it until the model is prepared (mmengine resumes before any forward)."""
        if not self.properties.enabled:
            state = dict(state_dict)
            for key in FOREIGN_KEYS:
                state.pop(key, None)
            OptimWrapper.load_state_dict(self, state)
            return
        super().load_state_dict(state_dict)

    def _extra_state(self) -> Dict[str, Any]:
        return self._policy()

    def _policy(self) -> Dict[str, Any]:
        policy = dict(opt_level=self.opt_level, dtype=str(self.properties.dtype))
        if self.properties.lean_storage is not None:
            policy['master_weights'] = self.properties.lean_storage
        return policy

