"""Wrappers that prepare the model themselves: cast it, hook its forward, start masters from it.

``ApexOptimWrapper`` (O2/O3 cast the model; O1 only hooks it) and ``FP16OptimWrapper`` over an fp32
model with a half ``dtype`` (apex's ``network_to_half``, done by the wrapper because a toolbox
builds its models in fp32) share this: :class:`ModelCastingOptimWrapper` prepares the model once,
at ``initialize_count_status``, in the lifecycle hook's ``before_train`` or at the first
``optim_context`` (Note [wrapper lifecycle]), whichever comes first; optimizer state loaded before
that (mmengine resumes before any forward) is kept and applied once the masters exist.
"""
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from mmengine.model import is_model_wrapper
from torch import Tensor, nn

from ..casting import (HALF_DTYPES, ForwardCaster, Fp32Modules, cast_model,
                       check_module_patterns, fp32_state_dict_hook, match_modules,
                       model_cast_dtype, owned_roots)
from ..sharding import check_fsdp_precision, sharding_of
from .base import MixedPrecisionOptimWrapper
from .checkpoint_format import STATE_KEY, check_optimizer_state

__all__ = ['CastPlan', 'ModelCastingOptimWrapper']


@dataclass(frozen=True)
class CastPlan:
    """How a wrapper prepares its model.

    Attributes:
        label: The wrapper as messages name it, e.g. ``"ApexOptimWrapper(opt_level='O2')"``.
        level: The opt level FSDP checks are phrased in (``'O2'`` for a casting FP16OptimWrapper).
        dtype: The dtype the model's weights are cast to; None casts nothing (O1).
        keep_norm_fp32: Keep normalisation layers fp32 (apex's ``keep_batchnorm_fp32``).
        output_dtype: The dtype of the model's floating outputs after a cast.
        masters: Whether the wrapper keeps fp32 masters of the half weights.
        ddp_config: The ``model_wrapper_cfg`` line that casts before DDP wraps the model.
    """
    label: str
    level: str
    dtype: Optional[torch.dtype]
    keep_norm_fp32: bool
    output_dtype: torch.dtype
    masters: bool
    ddp_config: str


class ModelCastingOptimWrapper(MixedPrecisionOptimWrapper):
    """A :class:`MixedPrecisionOptimWrapper` that prepares the model itself (see module doc).

    Args:
        fp32_modules (list[str], optional): Submodules that stay fp32, with fp32 inputs and outputs
            and autocast off while they run, whatever the level: globs over qualified module names
            (``'cls_head'``, ``'backbone.layer4.*'``) or class names (``'LayerNorm'``); see
            :func:`mp_wrappers.casting.match_modules`. For code that cannot take half tensors, e.g.
            a head computing its accuracy with numpy inside the model's forward.
        *args, **kwargs: :class:`MixedPrecisionOptimWrapper`'s.
    """

    def __init__(self, *args, fp32_modules: Optional[List[str]] = None, **kwargs) -> None:
        self.fp32_modules: Tuple[str, ...] = check_module_patterns(fp32_modules, 'fp32_modules')
        self._model: Optional[nn.Module] = None
        self._seen_modules: set = set()  # ids of parts or wholes of _model seen by initialize
        self._forward_caster: Optional[ForwardCaster] = None
        self._fp32_hooks: Optional[Fp32Modules] = None
        self._state_dict_hook = None
        self._deferred_state: Optional[dict] = None
        super().__init__(*args, **kwargs)

    # ---- what subclasses decide ------------------------------------------------------------------
    def _cast_plan(self) -> Optional[CastPlan]:
        """How to prepare the model; None: this wrapper leaves the model alone."""
        raise NotImplementedError

    def _check_model(self, params: List[Tensor]) -> None:
        """Refuse parameters the plan cannot train (before anything is changed)."""

    def _model_prepared(self, module: nn.Module, device: torch.device) -> None:
        """Called once the model is cast and the masters exist (warnings, extra hooks, logs)."""

    # ---- preparation -----------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        """Whether the model has been prepared (cast, hooks) by :meth:`initialize`."""
        return self._model is not None

    def _needs_initialize(self) -> bool:
        plan = self._cast_plan()
        return (plan is not None and plan.dtype not in (None, torch.float32)
                and not self.initialized)

    def prepare_for_training(self, model: nn.Module) -> None:
        """Prepare the model now (Note [wrapper lifecycle]); once."""
        if self._cast_plan() is not None:
            self.initialize(model)

    def _prepare_model(self, model: nn.Module) -> None:
        """Prepare the model (once, if the plan says how), then bind the masters to it."""
        if self._cast_plan() is not None:
            self.initialize(model)
        super()._prepare_model(model)

    def initialize(self, model: nn.Module) -> None:
        """Prepare ``model`` as the plan says. Called by the first :meth:`optim_context` at latest.

        Raises:
            RuntimeError: the model is wrapped in DDP but was not cast before wrapping, or a
                different model was already initialized.
            ValueError: ``fp32_modules`` names no submodule of the model.
        """
        wrapped = is_model_wrapper(model)
        module = model.module if wrapped else model
        if self._model is not None:
            if module is not self._model and id(module) not in self._seen_modules:
                # The same network passed whole or in part (a GAN's generator wrapper prepared
                # with the whole model by the lifecycle hook, then given model.generator) is fine.
                if not (_contains(self._model, module) or _contains(module, self._model)):
                    raise RuntimeError(f'this {type(self).__name__} was initialized with another '
                                       'model; use one wrapper per model (e.g. an '
                                       'OptimWrapperDict for GANs)')
                self._seen_modules.add(id(module))
            return
        plan = self._cast_plan()
        params = [p for g in self.optimizer.param_groups for p in g['params']]
        device = params[0].device
        # The fp32 weights the cast is about to round (pretrained, init_cfg, resumed): masters
        # start from them exactly (Note [masters lifecycle]). These are aliases of the fp32
        # storages, which the cast replaces rather than overwrites: no copy is made here.
        full_precision = {id(p): p.detach() for p in params if p.dtype == torch.float32}
        self._check_model(params)
        roots = self._cast(model, module, plan, params)
        self._hook_fp32_modules(module, roots, plan, device)
        for scaler in self.loss_scalers:
            scaler.to(device)
        self._model = module
        # Masters made before the cast (e.g. by zero_grad) would miss params: make them now.
        self._rebuild_masters(initial_values=full_precision)
        # Also for the bind: deferred optimizer state loaded below may disagree with them.
        self._binding.precast_weights = full_precision
        self._model_prepared(module, device)
        if self._deferred_state is not None:
            state, self._deferred_state = self._deferred_state, None
            MixedPrecisionOptimWrapper.load_state_dict(self, state)  # checked when it was loaded

    def _cast(self, model: nn.Module, module: nn.Module, plan: CastPlan,
              params: List[Tensor]) -> List[nn.Module]:
        """Cast what this optimizer owns (if the plan casts); the roots its forward hooks go on."""
        cast = plan.dtype
        if cast is None:
            return [module]
        keep_bn = plan.keep_norm_fp32
        sharding = sharding_of(model)
        if sharding is not None:
            # FSDP makes the half copies, or the model was cast before sharding.
            if cast != torch.float32:
                check_fsdp_precision(plan.level, cast, plan.masters, sharding, params)
            roots = [module]
        elif is_model_wrapper(model) and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            done = model_cast_dtype(module)
            # O0 "casts" to fp32: an fp32 model under DDP needs nothing, so nothing to refuse.
            already_fp32 = cast == torch.float32 and all(
                p.dtype == torch.float32 for p in module.parameters() if p.is_floating_point())
            if (done is None or done[0] != cast) and not already_fp32:
                raise RuntimeError(
                    f'{plan.label} must cast the model to {cast} before DistributedDataParallel '
                    'wraps it: casting afterwards silently stops gradient all-reduce. Add to the '
                    f'config:  {plan.ddp_config}  (tools/train.py adds it by itself).')
            roots = [module]
        else:
            # Only the modules this optimizer owns (a GAN's generator wrapper must leave the
            # discriminator alone, however the model is passed), each with its own input cast:
            # mmagic's train_step calls self.generator(...) directly, never the top forward.
            roots = owned_roots(module, self._model_params())
            if not roots:
                warnings.warn(
                    f'{plan.label} found no submodule of {type(module).__name__} whose parameters '
                    f'all belong to its optimizer, so nothing is cast to {cast}: its parameters '
                    'train in their own dtype. Give each wrapper the parameters of whole modules.',
                    UserWarning, stacklevel=4)
            for root in roots:
                if model_cast_dtype(root) != (cast, keep_bn):
                    keep = [name for name, _ in match_modules(root, self.fp32_modules)]
                    cast_model(root, cast, keep_norm_fp32=keep_bn, keep_fp32_modules=keep)
        self._forward_caster = ForwardCaster(roots, cast, plan.output_dtype)
        if cast in HALF_DTYPES and sharding is None:
            # Checkpoints stay fp32, whatever the training dtype.
            self._state_dict_hook = module._register_state_dict_hook(fp32_state_dict_hook)
        return roots

    def _hook_fp32_modules(self, module: nn.Module, roots: List[nn.Module], plan: CastPlan,
                           device: torch.device) -> None:
        """Run the ``fp32_modules`` in fp32 (Fp32Modules), after checking they are fp32."""
        if not self.fp32_modules:
            return
        found = [(name, m) for root in roots for name, m in match_modules(root, self.fp32_modules)]
        if not found:
            names = ', '.join(repr(n) for n, _ in list(module.named_children())[:8])
            raise ValueError(
                f'{plan.label}: fp32_modules={list(self.fp32_modules)!r} matches no submodule of '
                f'{type(module).__name__} that this optimizer trains (its children: {names}); '
                'give qualified module names such as cls_head or backbone.layer4.*, or class '
                'names such as LayerNorm')
        for name, m in found:
            half = [n for n, p in m.named_parameters() if p.dtype in HALF_DTYPES]
            if half:
                raise RuntimeError(
                    f'{plan.label}: fp32_modules names {type(m).__name__} {name!r}, but its '
                    f'parameter {half[0]!r} is already {dict(m.named_parameters())[half[0]].dtype}:'
                    ' the model was cast before this wrapper saw it (a half model, or a cast '
                    'before DDP/FSDP wrapped it). Build the model with that module in fp32, or '
                    'drop model_wrapper_cfg and let the wrapper cast the model.')
        self._fp32_hooks = Fp32Modules([m for _, m in found], device.type)

    def _model_params(self):
        """The model parameters this wrapper's optimizer trains (behind masters, if any exist)."""
        if self._masters is not None and self._masters.optimizer is self.optimizer:
            return [model_p if model_p is not None else slot
                    for slot, model_p in self._masters.slots()]
        return [p for g in self.optimizer.param_groups for p in g['params']]

    def release(self) -> None:
        """Remove the hooks this wrapper put on the model (the cast itself stays)."""
        for name in ('_forward_caster', '_fp32_hooks'):
            hooks = getattr(self, name)
            if hooks is not None:
                hooks.remove()
                setattr(self, name, None)
        if self._state_dict_hook is not None:
            self._state_dict_hook.remove()
            self._state_dict_hook = None

    def backward(self, loss: Tensor, loss_id: int = 0, **kwargs) -> None:
        if self._needs_initialize():
            raise RuntimeError(f'{self._cast_plan().label} has not prepared the model yet: run the '
                               'forward inside optim_context(model) or call initialize(model) '
                               'first')
        super().backward(loss, loss_id=loss_id, **kwargs)

    # ---- checkpoints before the model is prepared ------------------------------------------------
    def state_dict(self) -> dict:
        if self._deferred_state is not None:
            return dict(self._deferred_state)  # loaded but not applied yet: hand back what we hold
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load now, or keep it until the model is prepared (mmengine resumes before any forward)."""
        if self._needs_initialize():
            if not isinstance(state_dict, dict):
                raise TypeError(f'state_dict must be a dict, got {type(state_dict).__name__}')
            check_optimizer_state(self.optimizer, dict(state_dict))
            ours = state_dict.get(STATE_KEY)
            if isinstance(ours, dict):
                self._warn_if_foreign(ours)  # now, at resume time, not at the first forward
            self._deferred_state = dict(state_dict)
            return
        super().load_state_dict(state_dict)


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())

