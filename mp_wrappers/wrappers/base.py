"""The machinery shared by our mixed-precision optimizer wrappers.

:class:`MixedPrecisionOptimWrapper` is an ``mmengine.optim.OptimWrapper`` that owns backward, step and
state_dict with loss scaling and fp32 master weights:

* ``backward(loss, loss_id=k)`` scales the loss with scaler ``k`` and back-propagates. Gradients stay
  scaled in the model until they must be unscaled: at ``step()``, or when a backward with a different
  scaler comes first (several losses, apex's ``num_losses``), so accumulation never needs apex's
  ``delay_unscale``.
* ``step()`` unscales the model gradients (with a non-finite check), skips the optimizer step if any
  gradient is inf/nan, static scales included, else clips the unscaled gradients (``clip_grad``),
  steps and copies the masters back into the model; each scaler used is then updated with its own
  overflow flag.
* ``state_dict()`` is the inner optimizer's state plus our own key (scalers, masters):
  :mod:`mp_wrappers.wrappers.checkpoint_format`.

Masters are made lazily from ``self.optimizer`` and bound to the model's weights when training starts
(:mod:`mp_wrappers.master_binding`, Note [masters lifecycle] in :mod:`mp_wrappers.master`).
"""
import contextlib
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from mmengine.optim import OptimWrapper, OptimWrapperDict
from torch import Tensor, nn
from torch.optim import Optimizer

from .. import sharding as _sharding
from ..half_errors import add_half_hint
from ..master import MasterMismatchWarning, MasterParams, zero_grads
from ..master_binding import MasterBinding, WrapperMasters
from ..scaler import LossScaler
from ..step_outcomes import OutcomeLedger, defers_host_reads, where_direct
from . import options, publishing
from .checkpoint_format import STATE_KEY, CheckpointMismatchWarning, WrapperCheckpoint
from .model_view import ModelView
from .overflow import StepFlags
from .runner_link import RunnerLink
from .compiled_step import DeviceStages
from .unscale import InPlaceGrads, StashedGrads, fusable, nonfinite_param_names, unscale_in_place

# The warnings are importable from here, beside the wrapper that raises them, as before.
__all__ = ['MixedPrecisionOptimWrapper', 'STATE_KEY', 'CheckpointMismatchWarning',
           'MasterMismatchWarning', 'mixed_precision_wrappers']


class MixedPrecisionOptimWrapper(WrapperMasters, WrapperCheckpoint, OptimWrapper):
    """Loss scaling, fp32 master weights and overflow skipping for mmengine.

    Subclasses choose the scalers and the precision policy; see :class:`FP16OptimWrapper` and
    :class:`ApexOptimWrapper` for the user-facing arguments.

    Args:
        optimizer (Optimizer): The optimizer, built over the model's (possibly half) parameters.
        loss_scalers (Sequence[LossScaler]): One scaler per loss id.
        master_weights (bool): Give fp16/bf16 parameters fp32 master copies.
        verbose (bool): Log every skipped step (always on rank 0 only).
        accumulative_counts (int): Iterations per optimizer step (mmengine). Defaults to 1.
        clip_grad (dict, optional): mmengine's ``clip_grad``; applied to unscaled fp32 gradients.
        overflow_report, on_scale_collapse, collapse_patience, sync_found_inf, log_interval,
            grad_check, compile_step: The options every wrapper shares, described in
            :mod:`mp_wrappers.wrappers.options`.

    Stages of :meth:`step`: unscale and check the gradients (fused, in place or into the fp32
    stash: :mod:`~mp_wrappers.wrappers.unscale`; flags: :mod:`~mp_wrappers.wrappers.overflow`),
    decide to skip, clip (or measure the norm), step the optimizer, copy the masters to the model,
    then update the scalers, account for the step (:mod:`mp_wrappers.step_outcomes`) and publish
    (:mod:`~mp_wrappers.wrappers.publishing`). The masters' API is :class:`WrapperMasters`
    (:mod:`mp_wrappers.master_binding`), ``state_dict`` is :class:`WrapperCheckpoint`'s.
    """

    def __init__(self, optimizer: Optimizer, loss_scalers: Sequence[LossScaler],
                 master_weights: bool = True, verbose: bool = True, accumulative_counts: int = 1,
                 clip_grad: Optional[dict] = None, overflow_report: bool = False,
                 on_scale_collapse: str = 'warn', collapse_patience: int = 10,
                 sync_found_inf: Optional[bool] = None,
                 log_interval: Optional[int] = None, grad_check: str = 'auto',
                 compile_step: Union[bool, dict] = False) -> None:
        options.check_options(optimizer, accumulative_counts, clip_grad, on_scale_collapse,
                              collapse_patience, log_interval, grad_check, sync_found_inf)
        self._device_stages = DeviceStages(compile_step, optimizer)  # Note [compiled step]
        options.check_optimizer(optimizer, master_weights, type(self).__name__)
        # mmengine pops 'type' from clip_grad; give it a copy so the user's config stays intact.
        super().__init__(optimizer, accumulative_counts=accumulative_counts,
                         clip_grad=dict(clip_grad) if clip_grad else None)
        self.loss_scalers: List[LossScaler] = list(loss_scalers)
        self.master_weights = bool(master_weights)
        self.verbose = options.flag('verbose', verbose)
        self.overflow_report = options.flag('overflow_report', overflow_report)
        self.on_scale_collapse = on_scale_collapse
        self.collapse_patience = collapse_patience
        self.sync_found_inf = sync_found_inf
        self.log_interval = log_interval
        self.grad_check = grad_check
        # Set per iteration by the lifecycle hook (True/False) so publications follow the LoggerHook
        # exactly: in epoch-based loops it counts iterations within the epoch and logs the last one
        # of each epoch, which ``log_interval`` arithmetic on the global iteration cannot match.
        self.publish_now: Optional[bool] = None
        self._flags = StepFlags(self.loss_scalers)  # this step's overflow flags and scalers
        self._outcomes = OutcomeLedger()  # the finished steps (and those on their way to the host)
        self._skipped_published = 0
        self._seen = ModelView()
        self._grads_unsynced = False  # FSDP no_sync: grads are unsharded partial sums
        self._binding = MasterBinding()  # the masters, their stash, their binding to the model
        self._runner = RunnerLink()  # Note [wrapper lifecycle]: the runner gets our lifecycle hook
        self._attach_to_runner('build')

    # ---- the runner and the model ----------------------------------------------------------------
    def _attach_to_runner(self, stage: str) -> None:
        self._runner.attach(stage)  # Note [wrapper lifecycle]: mp_wrappers.wrappers.runner_link

    def prepare_for_training(self, model: nn.Module) -> None:
        """Prepare ``model`` before the first forward of a training run (subclasses that cast the
        model do it here); called by the lifecycle hook in ``before_train``."""

    def initialize_count_status(self, model: nn.Module, init_counts: int,
                                max_counts: int) -> None:
        """mmengine's hook at training start (after init_weights, load_from and resume): also
        binds the masters to the model's weights (Note [masters lifecycle])."""
        super().initialize_count_status(model, init_counts, max_counts)
        self._attach_to_runner('count_status')
        self._prepare_model(model)
        # Hooks' before_train / before_train_iter run between here and the first forward and may
        # write the weights too: check once more then (one comparison pass).
        self._binding.check_at_first_forward = True

    # ---- the model (seen only in optim_context) ---------------------------------------------------
    @contextlib.contextmanager
    def optim_context(self, model: nn.Module):
        """mmengine's forward context (DDP ``no_sync`` while accumulating); records param names."""
        module, new = self._seen.see(model, self.optimizer)
        if new:
            self._attach_to_runner('forward')
        self._prepare_model(model)
        with super().optim_context(model):
            try:
                yield
            except (TypeError, RuntimeError, NotImplementedError) as exc:
                hinted = add_half_hint(exc, module)
                if hinted is exc:
                    raise
                raise hinted from exc

    # ---- backward --------------------------------------------------------------------------------
    def backward(self, loss: Tensor, loss_id: int = 0, **kwargs) -> None:
        """Scale ``loss`` with scaler ``loss_id`` and back-propagate.

        Args:
            loss (Tensor): The (already accumulation-divided) loss.
            loss_id (int): Which loss scaler to use. Defaults to 0.
            **kwargs: Passed on to ``Tensor.backward`` (e.g. ``retain_graph``).
        """
        options.check_loss_id(loss_id, len(self.loss_scalers))
        if self._stash.holds_grads and self._masters is not None:
            self._stash.withdraw(self._masters)
        if self._flags.pending is not None and self._flags.pending != loss_id:
            # The model grads were scaled by another scaler: move them to the fp32 stash first.
            self._unscale_pending()
        self._flags.check_loss(loss, loss_id, report=self.overflow_report)
        # FSDP reads its gradient-sync flag during backward, not in the forward like DDP.
        sync = self.should_sync()
        sharding = self._seen.sharding
        with _sharding.no_sync_for_backward(sharding, sync):
            self.loss_scalers[loss_id].scale_loss(loss).backward(**kwargs)
        self._grads_unsynced = sharding is not None and not sync
        self._flags.backward_done(loss_id)
        self._inner_count += 1

    def update_params(self, loss: Tensor, step_kwargs: Optional[Dict] = None,
                      zero_kwargs: Optional[Dict] = None, loss_id: int = 0) -> None:
        """mmengine's update: divide by the accumulation factor, backward, step when due.

        Args:
            loss (Tensor): The loss of this iteration.
            step_kwargs (dict, optional): Passed to :meth:`step`.
            zero_kwargs (dict, optional): Passed to :meth:`zero_grad`.
            loss_id (int): The loss scaler to use. Defaults to 0.
        """
        loss = self.scale_loss(loss)
        self._backward_for_update(loss, loss_id)
        if self.should_update():
            self.step(**(step_kwargs or {}))
            self.zero_grad(**(zero_kwargs or {}))
        if self.message_hub.get_info('iter') is not None and self._publish_due():
            self.publish_scalars()

    def _backward_for_update(self, loss: Tensor, loss_id: int) -> None:
        self.backward(loss, loss_id=loss_id)

    def _unscale_pending(self) -> None:
        """Unscale the model's pending gradients into the fp32 stash (checking them)."""
        k = self._flags.pending
        if k is None:
            return
        self._stash.absorb(self._master_params(), self.loss_scalers[k].inv_scale(),
                           self._flags.flag(k))
        self._flags.pending = None

    def _overflowed(self) -> bool:
        """Whether any scaler used since the last step saw inf/nan (a host read of the flags)."""
        return self._flags.overflowed()

    # ---- step ------------------------------------------------------------------------------------
    def step(self, **kwargs) -> None:
        """Unscale, check, clip and step; skip the update when any gradient is not finite.

        With an optimizer that implements the fused master step (``mp_wrappers.FusedAdam`` and
        friends) and gradients from a single scaler, the half gradients are read once for the
        inf check and the norm, and once by the fused update, which writes masters, moments and the
        half model copy together: no fp32 master-gradient buffers (docs/semantics.md section 7).

        Args:
            **kwargs: Passed on to the inner optimizer's ``step``.
        """
        masters = self._master_params()
        if not kwargs and self._fusable():
            self._fused_step(masters)  # the same stages, in the kernels, decided on the device
            return
        grads = self._unscale_and_check(masters)
        # One host read per step, as torch's GradScaler does: whether to call the optimizer at all.
        skipped = self._overflowed()
        if not skipped:
            skipped = not self._clip_or_measure(grads)
        if not skipped:
            self.optimizer.step(**kwargs)
            masters.copy_masters_to_model()  # nothing to copy when unscaled in place
        self._finish_step(skipped)
        grads.release()

    def _unscale_and_check(self, masters: MasterParams) -> Union[InPlaceGrads, StashedGrads]:
        """Unscale this step's gradients, in place or into the fp32 stash, setting the flags."""
        flags = self._flags
        if (flags.pending is not None and len(flags.used) == 1 and not self._stash.holds_grads
                and not masters.has_half):  # Note [in-place unscale]
            scaler = self.loss_scalers[flags.pending]
            grads = unscale_in_place(masters, scaler, flags.flag(flags.pending), self.grad_check,
                                     self._seen.sharding)
            flags.pending = None
            self._sync_flags(loss_only=scaler.is_unit and self.grad_check == 'auto')
            return grads
        self._unscale_pending()
        self._sync_flags()
        return StashedGrads(self._stash, masters)

    def _sync_flags(self, loss_only: bool = False) -> None:
        self._flags.sync(self.sync_found_inf, self._seen.is_ddp, loss_only)

    def _clip_or_measure(self, grads: Union[InPlaceGrads, StashedGrads]) -> bool:
        """Hand the unscaled grads to the optimizer and clip them (``clip_grad``), or take the
        norm to publish. False when the norm is not finite: the step is skipped."""
        grads.hand_to_optimizer()
        if self.clip_grad_kwargs:
            return self._clip_grad()
        outcomes = self._outcomes
        outcomes.grad_norm = grads.norm_to_publish(self._publish_due(), self._seen.sharding,
                                                   outcomes.grad_norm)
        return True

    def _clip_grad(self) -> bool:
        """mmengine's clipping on the optimizer's (unscaled fp32) grads, keeping the norm for
        amp_gnorm. False when the norm is not finite: the step must be skipped (Note [non-finite
        norm] in mp_wrappers.wrappers.overflow)."""
        params = [p for g in self.optimizer.param_groups for p in g['params'] if p.grad is not None]
        if params:
            sharding = self._seen.sharding
            if sharding is not None and self.grad_name == 'grad_norm':
                norm = _sharding.clip_grad_norm_sharded(params, sharding, **self.clip_grad_kwargs)
            else:
                norm = self.clip_func(params, **self.clip_grad_kwargs)
            if norm is not None:
                if not bool(torch.isfinite(norm)):
                    self._flags.flag_nonfinite_norm(norm)
                    return False
                self.message_hub.update_scalar(f'train/{self.grad_name}', float(norm))
                if self.grad_name == 'grad_norm':
                    self._outcomes.grad_norm = norm
        return True

    def _fusable(self) -> bool:
        return fusable(self.optimizer, self._flags, self._stash, self.clip_grad_kwargs,
                       getattr(self, 'grad_name', 'grad_norm'))

    def _fused_step(self, masters: MasterParams) -> None:
        """:meth:`step` through the fused update, which skips itself on the device."""
        flag = self._flags.flag(self._flags.pending)
        total, updated = self._device_stages(  # Note [compiled step]: eager, or compiled whole
            self.optimizer, masters, self.loss_scalers[self._flags.pending], self._flags,
            self.clip_grad_kwargs, self._seen.sharding, self._sync_flags)
        self._outcomes.grad_norm = total
        clipped_norm = total if self.clip_grad_kwargs else None
        # The host needs the flag only for bookkeeping: on an accelerator it arrives later, with
        # no sync (Note [deferred outcomes] in mp_wrappers.step_outcomes); on the CPU a read is
        # free. overflow_report names the parameters with bad gradients: it reads them now.
        if defers_host_reads(flag.device) and not self.overflow_report:
            self._finish_step_deferred(clipped_norm, updated)
            return
        skipped = bool(flag.item() > 0)
        self._finish_step(skipped, updated)
        if clipped_norm is not None and not skipped:
            self.message_hub.update_scalar(f'train/{self.grad_name}', float(clipped_norm))

    # ---- finishing a step: the scalers and the bookkeeping (step_outcomes.OutcomeLedger) ----------
    def _finish_step(self, skipped: bool, updated: Optional[List[Tensor]] = None) -> None:
        """Update the scalers (unless the step did: ``updated``) and account for it (host reads)."""
        # Earlier deferred steps first: outcomes are accounted in step order (this step has read
        # the device already).
        self._take_outcomes(wait=True)
        where = where_direct(self.message_hub.get_info('iter'),
                             self.loss_scalers[0].steps) if skipped else ''
        outcome = self._outcomes.settle(self.loss_scalers, list(self._flags.used),
                                        self._flags.used_flags(), skipped, updated)
        # The gradients are still here: the reports can name the parameters that overflowed.
        self._outcomes.account(outcome, self, where, self.nonfinite_param_names,
                               self._flags.loss_nonfinite)
        self._reset_step_state()
        if publishing.publishes_every_step(self.message_hub, self.publish_now):
            self.publish_scalars()

    def _finish_step_deferred(self, clipped_norm: Optional[Tensor],
                              updated: Optional[List[Tensor]] = None) -> None:
        """:meth:`_finish_step` without host reads (Note [deferred outcomes])."""
        self._outcomes.settle_deferred(self.loss_scalers, list(self._flags.used),
                                       self._flags.used_flags(),
                                       self.message_hub.get_info('iter'), clipped_norm, updated)
        self._reset_step_state()
        self._take_outcomes(wait=False)
        if publishing.publishes_every_step(self.message_hub, self.publish_now):
            self.publish_scalars()

    def _take_outcomes(self, wait: bool) -> None:
        """Account for the deferred outcomes that have arrived (all of them with ``wait``)."""
        self._outcomes.catch_up(self, wait)

    def nonfinite_param_names(self, limit: int = 5) -> List[str]:
        """Names (or shapes, when the model was never seen) of parameters with inf/nan gradients
        in this step's unscaled stash or the model gradients still present; a host sync."""
        return nonfinite_param_names(self._master_params(), self._stash, self._seen.name_of, limit)

    def _reset_step_state(self) -> None:
        self._flags.reset()
        if self._masters is not None:
            self._stash.clear(self._masters)

    # ---- what the logs show (mp_wrappers.wrappers.publishing) --------------------------------------
    def _publish_due(self) -> bool:
        return publishing.publish_due(self.message_hub, self.publish_now, self.log_interval)

    def publish_scalars(self) -> None:
        """Write the ``amp_*`` scalars to the MessageHub (reads device state: a host sync).

        Called by :meth:`update_params` when a log line is due (see ``log_interval`` and
        ``publish_now``).
        """
        self._take_outcomes(wait=True)
        self._skipped_published = publishing.publish_amp_scalars(
            self.message_hub, self.loss_scalers, self._skipped_published, self._outcomes.grad_norm)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent ``step()`` was skipped because of non-finite gradients.

        After a fused step on an accelerator this waits for the step's outcome (a host sync,
        Note [deferred outcomes]).
        """
        self._take_outcomes(wait=True)
        return self._outcomes.last_skipped

    @property
    def overflow(self) -> bool:
        """apex's ``overflow``: whether the last step found non-finite gradients."""
        return self.last_step_skipped

    # ---- zero_grad ---------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True, **kwargs) -> None:
        """Clear model gradients, master gradients and the per-step overflow state."""
        masters = self._master_params()
        # Detach the fp32 stash first: it is rewritten before its next use, zeroing it is waste.
        self._reset_step_state()
        zero_grads(masters, set_to_none)

    # ---- apex/mmengine attributes ------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current scale of loss scaler 0 (host read)."""
        return self.loss_scalers[0].loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scalers[0].loss_scale = value


def mixed_precision_wrappers(optim_wrapper: Any) -> List[Tuple[str, 'MixedPrecisionOptimWrapper']]:
    """``(name, wrapper)`` for each of our wrappers in a runner's ``optim_wrapper``: the wrapper
    itself (name ``''``) or the members of an ``OptimWrapperDict``; none while it is still a config
    dict (val/test-only runs)."""
    if isinstance(optim_wrapper, OptimWrapperDict):
        items = list(optim_wrapper.items())
    else:
        items = [('', optim_wrapper)]
    return [(name, w) for name, w in items if isinstance(w, MixedPrecisionOptimWrapper)]
