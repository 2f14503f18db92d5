"""``ApexOptimWrapper``: mmengine's ApexOptimWrapper arguments and apex amp semantics, without apex."""
import contextlib
import logging
import warnings
from typing import Any, Dict, Optional

import torch
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapper
from torch import Tensor, nn
from torch.optim import Optimizer

from .. import hardware
from ..autocast import o1_context
from ..casting import (HALF_DTYPES, ForwardCaster, cast_model, fp32_state_dict_hook,
                       model_cast_dtype, owned_roots)
from ..distributed.sharding import check_fsdp_precision, sharding_of
from ..master import MasterParams
from ..master_modes import LeanMasterParams
from ..policy import DEFAULT, Properties, resolve_properties
from ..registry import OPTIM_WRAPPERS
from ..scaler import DynamicLossScaler, LossScaler, StaticLossScaler
from .base import STATE_KEY, MixedPrecisionOptimWrapper

__all__ = ['ApexOptimWrapper']

_SHORT = {torch.float16: 'fp16', torch.bfloat16: 'bf16'}


def _optimizer_device(optimizer: Optimizer) -> torch.device:
    """The device of the optimizer's first parameter (CPU for an optimizer without any yet)."""
    for group in getattr(optimizer, 'param_groups', []):
        for p in group['params']:
            return p.device
    return torch.device('cpu')


@OPTIM_WRAPPERS.register_module()
class ApexOptimWrapper(MixedPrecisionOptimWrapper):
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
            ``collapse_patience``, ``sync_found_inf``, ``log_interval``, ``grad_check``): see
            :class:`~mp_wrappers.wrappers.base.MixedPrecisionOptimWrapper`.

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
            raise ValueError(f'verbosity must be 0 or 1, got {verbosity!r}')
        scalers = [self._build_scaler(min_loss_scale, max_loss_scale, hysteresis, scale_window,
                                      init_scale) for _ in range(num_losses)]
        super().__init__(optimizer, scalers,
                         master_weights=self.properties.master_weights is True,
                         verbose=verbosity > 0, accumulative_counts=accumulative_counts,
                         clip_grad=clip_grad, **kwargs)
        self.num_losses = num_losses
        self.verbosity = verbosity
        self._model: Optional[nn.Module] = None
        self._seen_modules: set = set()  # ids of parts or wholes of _model seen by initialize
        self._forward_caster: Optional[ForwardCaster] = None
        self._state_dict_hook = None
        self._deferred_state: Optional[dict] = None
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
        # Validate the bounds even when unused: a contradictory config is a mistake either way.
        if (min_loss_scale is not None and max_loss_scale is not None
                and min_loss_scale > max_loss_scale):
            raise ValueError(f'min_loss_scale={min_loss_scale!r} is greater than '
                             f'max_loss_scale={max_loss_scale!r}')
        return StaticLossScaler(self.properties.loss_scale)

    @property
    def opt_level(self) -> str:
        return self.properties.opt_level

    @property
    def initialized(self) -> bool:
        """Whether the model has been prepared (cast, hooks) by :meth:`initialize`."""
        return self._model is not None

    # ---- model preparation (apex's amp.initialize) -------------------------------------------------
    def initialize(self, model: nn.Module) -> None:
        """Prepare ``model`` for the opt level. Called by the first :meth:`optim_context`.

        Raises:
            RuntimeError: the model is wrapped in DDP but was not cast before wrapping (O2/O3), or
                a different model was already initialized.
            ValueError: O1 with half-precision parameters.
        """
        wrapped = is_model_wrapper(model)
        module = model.module if wrapped else model
        if self._model is not None:
            if module is not self._model and id(module) not in self._seen_modules:
                # The same network passed whole or in part (a GAN's generator wrapper prepared
                # with the whole model by the lifecycle hook, then given model.generator) is fine.
                if not (_contains(self._model, module) or _contains(module, self._model)):
                    raise RuntimeError('this ApexOptimWrapper was initialized with another model; '
                                       'use one wrapper per model (e.g. an OptimWrapperDict for '
                                       'GANs)')
                self._seen_modules.add(id(module))
            return
        props = self.properties
        params = [p for g in self.optimizer.param_groups for p in g['params']]
        device = params[0].device
        # The fp32 weights the cast is about to round (pretrained, init_cfg, resumed): O2's masters
        # start from them exactly (Note [masters lifecycle]). These are aliases of the fp32
        # storages, which the cast replaces rather than overwrites: no copy is made here.
        full_precision = {id(p): p.detach() for p in params if p.dtype == torch.float32}
        if props.opt_level == 'O1':
            half = [i for i, p in enumerate(params) if p.dtype in HALF_DTYPES]
            if half:
                raise ValueError(f'opt_level O1 expects fp32 model weights, but parameter {half[0]} '
                                 f'of the optimizer is {params[half[0]].dtype}. O1 casts per op '
                                 "with autocast; build the model in fp32, or use opt_level 'O2'/'O3'"
                                 ' for a half-precision model')
        cast = props.cast_model_type
        sharding = sharding_of(model)
        if cast is not None:
            keep_bn = bool(props.keep_batchnorm_fp32)
            done = model_cast_dtype(module)
            if sharding is not None:
                # FSDP makes the half copies, or the model was cast before sharding.
                if cast != torch.float32:
                    check_fsdp_precision(props.opt_level, cast, bool(props.master_weights),
                                         sharding, params)
                roots = [module]
            elif wrapped and isinstance(model, torch.nn.parallel.DistributedDataParallel):
                # O0 "casts" to fp32: an fp32 model under DDP needs nothing, so nothing to refuse.
                already_fp32 = cast == torch.float32 and all(
                    p.dtype == torch.float32 for p in module.parameters() if p.is_floating_point())
                if (done is None or done[0] != cast) and not already_fp32:
                    raise RuntimeError(
                        f'ApexOptimWrapper(opt_level={props.opt_level!r}) must cast the model to '
                        f'{cast} before DistributedDataParallel wraps it: casting afterwards silently'
                        ' stops gradient all-reduce. Add to the config:  model_wrapper_cfg=dict('
                        "type='mp_wrappers.MixedPrecisionDistributedDataParallel', "
                        f"dtype='{str(cast).replace('torch.', '')}', keep_batchnorm_fp32={keep_bn})"
                        '  (tools/train.py adds it by itself).')
                roots = [module]
            else:
                # Only the modules this optimizer owns (a GAN's generator wrapper must leave the
                # discriminator alone, however the model is passed), each with its own input cast:
                # mmagic's train_step calls self.generator(...) directly, never the top forward.
                roots = owned_roots(module, self._model_params())
                if not roots:
                    warnings.warn(
                        f'ApexOptimWrapper(opt_level={props.opt_level!r}) found no submodule of '
                        f'{type(module).__name__} whose parameters all belong to its optimizer, so '
                        f'nothing is cast to {cast}: its parameters train in their own dtype. Give '
                        'each wrapper the parameters of whole modules.', UserWarning, stacklevel=3)
                for root in roots:
                    if model_cast_dtype(root) != (cast, keep_bn):
                        cast_model(root, cast, keep_norm_fp32=keep_bn)
            self._forward_caster = ForwardCaster(
                roots, cast, props.cast_model_outputs or torch.float32)
            if cast in HALF_DTYPES and sharding is None:
                # Checkpoints stay fp32, whatever the training dtype.
                self._state_dict_hook = module._register_state_dict_hook(fp32_state_dict_hook)
        computes_in = {cast} if cast in HALF_DTYPES else set()
        if props.opt_level == 'O1' and props.dtype in HALF_DTYPES:
            computes_in.add(props.dtype)
        for half_dtype in sorted(computes_in, key=str):
            reason = hardware.slowdown_reason(half_dtype, device)
            if reason is not None:
                warnings.warn(f'ApexOptimWrapper(opt_level={props.opt_level!r}, dtype='
                              f"{str(half_dtype).replace('torch.', '')}) on a device without "
                              f'native {_SHORT[half_dtype]}: {reason}', UserWarning, stacklevel=3)
        for scaler in self.loss_scalers:
            scaler.to(device)
        self._model = module
        # Masters made before the cast (e.g. by zero_grad) would miss params: make them now.
        self._rebuild_masters(initial_values=full_precision)
        # Also for the bind: deferred optimizer state loaded below may disagree with them.
        self._precast_weights = full_precision
        if isinstance(self._masters, LeanMasterParams):
            # After the fp32 hook: the checkpoint's weights are the full-precision ones.
            self._lean_state_dict_hook = self._masters.register_state_dict_hook(module)
        if self._deferred_state is not None:
            state, self._deferred_state = self._deferred_state, None
            super().load_state_dict(state)  # warns nothing twice: the same dict was checked
        if self.verbosity >= 1:
            print_log(props.describe(), logger='current', level=logging.INFO)

    def _model_params(self):
        """The model parameters this wrapper's optimizer trains (behind masters, if any exist)."""
        if self._masters is not None and self._masters.optimizer is self.optimizer:
            return [model_p if model_p is not None else slot
                    for slot, model_p in self._masters.slots()]
        return [p for g in self.optimizer.param_groups for p in g['params']]

    def release(self) -> None:
        """Remove the hooks this wrapper put on the model (the cast itself stays)."""
        if self._forward_caster is not None:
            self._forward_caster.remove()
            self._forward_caster = None
        if self._state_dict_hook is not None:
            self._state_dict_hook.remove()
            self._state_dict_hook = None
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

    def trains_half_weights(self) -> bool:
        props = self.properties
        return bool(props.enabled) and props.cast_model_type in HALF_DTYPES

    def prepare_for_training(self, model: nn.Module) -> None:
        """Cast the model for the level now (Note [wrapper lifecycle]); once."""
        if self.properties.enabled:
            self.initialize(model)

    def _prepare_model(self, model: nn.Module) -> None:
        """Prepare the model for the level (once), then bind the masters to it."""
        if not self.properties.enabled:
            return
        self.initialize(model)
        super()._prepare_model(model)

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
    def _needs_initialize(self) -> bool:
        return self.properties.cast_model_type not in (None, torch.float32) and not self.initialized

    def backward(self, loss: Tensor, loss_id: int = 0, **kwargs) -> None:
        """Scale ``loss`` with scaler ``loss_id`` and back-propagate (see ``num_losses``)."""
        if not self.properties.enabled:
            OptimWrapper.backward(self, loss, **kwargs)
            return
        if self._needs_initialize():
            raise RuntimeError(f'ApexOptimWrapper(opt_level={self.opt_level!r}) has not prepared '
                               'the model yet: run the forward inside optim_context(model) or call '
                               'initialize(model) first')
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
            return dict(self._deferred_state)  # loaded but not applied yet: hand back what we hold
        state = super().state_dict()
        state['apex_amp'] = {f'loss_scaler{k}': dict(loss_scale=s.loss_scale, unskipped=s.unskipped)
                             for k, s in enumerate(self.loss_scalers)}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load now, or keep it until the model is prepared (mmengine resumes before any forward)."""
        if not self.properties.enabled:
            state = dict(state_dict)
            for key in ('mp_wrappers', 'apex_amp', 'loss_scaler'):
                state.pop(key, None)
            OptimWrapper.load_state_dict(self, state)
            return
        if self._needs_initialize():
            if not isinstance(state_dict, dict):
                raise TypeError(f'state_dict must be a dict, got {type(state_dict).__name__}')
            self._check_optimizer_state(dict(state_dict))
            ours = state_dict.get(STATE_KEY)
            if isinstance(ours, dict):
                self._warn_if_foreign(ours)  # now, at resume time, not at the first forward
            self._deferred_state = dict(state_dict)
            return
        super().load_state_dict(state_dict)

    def _extra_state(self) -> Dict[str, Any]:
        return self._policy()

    def _policy(self) -> Dict[str, Any]:
        policy = dict(opt_level=self.opt_level, dtype=str(self.properties.dtype))
        if self.properties.lean_storage is not None:
            policy['master_weights'] = self.properties.lean_storage
        return policy


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())
