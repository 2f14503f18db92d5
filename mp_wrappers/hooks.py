"""``MixedPrecisionHook``: what mixed precision is doing, in the logs, and schedules that skip with it.

Optional extras for every optimizer wrapper of ours (:class:`~mp_wrappers.MixedPrecisionOptimWrapper`
subclasses) in ``runner.optim_wrapper``, including those inside an ``OptimWrapperDict``. Nothing
correct depends on it: the wrappers attach what they need to any mmengine runner by themselves
(Note [wrapper lifecycle] in :mod:`mp_wrappers.lifecycle`: the cast before training, a full-precision
``EMAHook``, the ``amp_*`` log values at the LoggerHook's interval). This hook adds:

* **Precision summary.** At the start of training it logs the precision in use (wrapper, opt level
  and properties or model dtype, loss scaler, fused master step or not) and stores it in the
  MessageHub runtime info under ``'mp_wrappers/precision'``.
* **Skip-aware schedules** (on by default). A skipped optimizer step (non-finite gradients) did not
  train, so iteration-based parameter schedulers should not advance either: otherwise every overflow
  silently shortens warm-ups and moves decay milestones. The hook snapshots the iteration-based
  schedulers (their ``state_dict()``: step counters and last values) and the scheduled values of the
  param groups before the iteration, and restores them (``load_state_dict``) after mmengine's
  ``ParamSchedulerHook`` stepped them when the wrapper's step of this iteration was skipped. The
  MessageHub runtime info ``'mp_wrappers/last_step_skipped'`` (bool) and
  ``'mp_wrappers/skipped_iters'`` (count) tell other hooks about it.
* **Overflow reports.** ``overflow_report=True`` turns on the wrappers' ``overflow_report`` (the first
  parameters with non-finite gradients and whether the loss itself was non-finite, on every skip).

``tools/train.py`` adds the hook automatically when the config's optimizer wrapper is one of ours
(:func:`mp_wrappers.train_config.add_mixed_precision_hook`); with a toolbox's own train script, list it in
``custom_hooks`` to get these extras.
"""
import copy
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

from mmengine.hooks import Hook
from mmengine.logging import print_log

from .registry import HOOKS
from .wrappers.base import MixedPrecisionOptimWrapper, mixed_precision_wrappers

__all__ = ['MixedPrecisionHook', 'PRECISION_INFO_KEY', 'SKIPPED_INFO_KEY', 'SKIPPED_ITERS_KEY']

PRECISION_INFO_KEY = 'mp_wrappers/precision'
SKIPPED_INFO_KEY = 'mp_wrappers/last_step_skipped'
SKIPPED_ITERS_KEY = 'mp_wrappers/skipped_iters'

# After ParamSchedulerHook ('LOW', 70), whose scheduler steps a skipped iteration must undo, and
# before CheckpointHook ('VERY_LOW', 90), so a checkpoint saved after a skipped iteration holds the
# restored schedule.
_PRIORITY = 80


@HOOKS.register_module()
class MixedPrecisionHook(Hook):
    """Log what mixed precision does and keep parameter schedules in step with real optimizer steps.

    Args:
        skip_aware_schedules (bool): Undo the iteration-based parameter schedulers' step (learning
            rate, momentum, ...) on iterations whose optimizer step was skipped because of
            non-finite gradients, so a schedule counts optimizer updates, not iterations. Epoch-based
            schedulers are left alone. Defaults to True.
        overflow_report (bool, optional): True turns on the wrappers' ``overflow_report`` (log the
            first parameters with inf/nan gradients on every skipped step), False turns it off,
            None (default) keeps what the optimizer wrapper config says.
        log_precision (bool): Log the precision summary once at the start of training. The summary
            is stored in the MessageHub runtime info either way. Defaults to True.

    Examples:
        >>> custom_hooks = [dict(type='mp_wrappers.MixedPrecisionHook')]
        >>> # Count iterations, not optimizer updates, in the schedules; report overflows:
        >>> custom_hooks = [dict(type='mp_wrappers.MixedPrecisionHook',
        ...                      skip_aware_schedules=False, overflow_report=True)]
    """

    priority = _PRIORITY

    def __init__(self, skip_aware_schedules: bool = True, overflow_report: Optional[bool] = None,
                 log_precision: bool = True) -> None:
        for name, value, allowed in (('skip_aware_schedules', skip_aware_schedules, (True, False)),
                                     ('overflow_report', overflow_report, (True, False, None)),
                                     ('log_precision', log_precision, (True, False))):
            if not any(value is a for a in allowed):
                raise ValueError(f'MixedPrecisionHook: {name}={value!r} is not allowed; expected '
                                 f'one of {allowed}')
        self.skip_aware_schedules = skip_aware_schedules
        self.overflow_report = overflow_report
        self.log_precision = log_precision
        self._snapshot: Optional[List[Tuple[Any, Dict[str, Any]]]] = None
        self._group_snapshot: Optional[List[Tuple[Any, dict, str, Any]]] = None
        self._skipped_iters = 0

    # ---- the wrappers --------------------------------------------------------------------------
    @staticmethod
    def wrappers(runner) -> Iterator[Tuple[str, MixedPrecisionOptimWrapper]]:
        """``(name, wrapper)`` for every wrapper of ours in ``runner.optim_wrapper``."""
        return iter(mixed_precision_wrappers(getattr(runner, 'optim_wrapper', None)))

    # ---- start of training ---------------------------------------------------------------------
    def before_train(self, runner) -> None:
        """Apply options and log the precision (the wrappers' lifecycle hook ran before: they are
        prepared and publish at the LoggerHook's cadence, Note [wrapper lifecycle])."""
        self._skipped_iters = int(runner.message_hub.get_info(SKIPPED_ITERS_KEY, 0) or 0)
        summaries = {}
        for name, wrapper in self.wrappers(runner):
            if self.overflow_report is not None:
                wrapper.overflow_report = self.overflow_report
            summaries[name or 'optim_wrapper'] = describe_precision(wrapper, runner.model)
        if not summaries:
            # INFO, not a warning: the shared runtime config lists the hook for fp32 runs too.
            print_log('MixedPrecisionHook: runner.optim_wrapper holds no mp_wrappers optimizer '
                      'wrapper; nothing to do', logger='current', level=logging.INFO)
            return
        runner.message_hub.update_info(PRECISION_INFO_KEY, summaries)
        if self.log_precision:
            for name, summary in summaries.items():
                text = ', '.join(f'{k}={v}' for k, v in summary.items())
                print_log(f'mp_wrappers precision ({name}): {text}', logger='current',
                          level=logging.INFO)

    # ---- every iteration -----------------------------------------------------------------------
    def before_train_iter(self, runner, batch_idx: int, data_batch: Any = None) -> None:
        """Snapshot the schedules (at the first iteration of an accumulation window)."""
        # With gradient accumulation the snapshot taken at the first iteration of the window is
        # kept until the window's optimizer step: a skipped step wasted the whole window.
        if self.skip_aware_schedules and self._snapshot is None and any(self.wrappers(runner)):
            self._take_snapshot(runner)

    def after_train_iter(self, runner, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        """Record whether this iteration's step was skipped; if so, undo the schedulers' step."""
        stepped, skipped = [], []
        ours = [w for _, w in self.wrappers(runner)]
        if not ours:
            return
        for wrapper in ours:
            # should_update() after update_params: this iteration ended an accumulation window, so
            # step() ran. last_step_skipped is a host bool the wrapper read at the step, or, after
            # a fused step on a GPU, waits for that step's outcome (Note [deferred outcomes]); the
            # loop's own loss logging reads the device every iteration anyway.
            if wrapper.should_update():
                stepped.append(wrapper)
                if wrapper.last_step_skipped:
                    skipped.append(wrapper)
        any_skipped = bool(skipped)
        if any_skipped:
            self._skipped_iters += 1
        runner.message_hub.update_info(SKIPPED_INFO_KEY, any_skipped)
        runner.message_hub.update_info(SKIPPED_ITERS_KEY, self._skipped_iters)
        if not self.skip_aware_schedules or self._snapshot is None:
            return
        if skipped:
            self._restore_snapshot({id(w) for w in skipped})
        if stepped:
            self._snapshot = self._group_snapshot = None

    # ---- skip-aware schedules ------------------------------------------------------------------
    @staticmethod
    def _iter_schedulers(runner) -> List[Any]:
        schedulers = getattr(runner, 'param_schedulers', None)
        if schedulers is None:
            return []
        groups = schedulers.values() if isinstance(schedulers, dict) else [schedulers]
        return [s for group in groups if isinstance(group, list) for s in group
                if not getattr(s, 'by_epoch', True) and hasattr(s, 'last_step')]

    def _take_snapshot(self, runner) -> None:
        snapshot, seen, group_values = [], set(), []
        for sched in self._iter_schedulers(runner):
            # The scheduler's own state_dict (its whole state but the optimizer: step counters and
            # last values included), copied: step() rebinds some of it, and a subclass might change a
            # list in place.
            snapshot.append((sched, copy.deepcopy(sched.state_dict())))
            # Chained schedulers (warm-up then cosine) multiply the group's current value, so the
            # group values must be restored too, not only the schedulers' counters.
            for group in sched.optimizer.param_groups:
                key = (id(group), sched.param_name)
                if key not in seen and sched.param_name in group:
                    seen.add(key)
                    group_values.append((sched, group, sched.param_name, group[sched.param_name]))
        self._snapshot = snapshot
        self._group_snapshot = group_values

    def _restore_snapshot(self, skipped_wrappers: set) -> None:
        for sched, state in self._snapshot or []:
            if id(sched.optimizer) not in skipped_wrappers:
                continue
            sched.load_state_dict(state)  # the snapshot is dropped after this iteration
        for sched, group, name, value in self._group_snapshot or []:
            if id(sched.optimizer) in skipped_wrappers:
                group[name] = value


def describe_precision(wrapper: MixedPrecisionOptimWrapper, model: Any = None) -> Dict[str, Any]:
    """A plain-data summary of the precision a wrapper trains with (for logs and runtime info).

    Args:
        wrapper: One of our optimizer wrappers.
        model: The runner's model, to report the parameter dtypes (optional).

    Returns:
        dict with ``wrapper``, ``opt_level`` and ``properties`` (ApexOptimWrapper) or
        ``param_dtypes``, ``loss_scaler``, ``loss_scale``, ``master_weights`` and
        ``fused_master_step``: only strings, numbers and bools, so checkpoints stay
        ``weights_only``-loadable.
    """
    summary: Dict[str, Any] = {'wrapper': type(wrapper).__name__}
    props = getattr(wrapper, 'properties', None)
    if props is not None:
        summary['opt_level'] = props.opt_level
        summary['enabled'] = bool(props.enabled)
        summary['dtype'] = str(props.dtype).replace('torch.', '')
        summary['cast_model_type'] = str(props.cast_model_type).replace('torch.', '')
        summary['patch_torch_functions'] = bool(props.patch_torch_functions)
        summary['keep_batchnorm_fp32'] = str(props.keep_batchnorm_fp32)
    if model is not None:
        module = getattr(model, 'module', model)
        dtypes = sorted({str(p.dtype).replace('torch.', '') for p in module.parameters()})
        # O2/O3 cast the model at the first forward, so before training this is still fp32.
        summary['param_dtypes'] = '/'.join(dtypes)
    scalers = wrapper.loss_scalers
    summary['loss_scaler'] = '/'.join(sorted({type(s).__name__ for s in scalers}))
    summary['loss_scale'] = scalers[0].loss_scale
    summary['num_losses'] = len(scalers)
    summary['master_weights'] = bool(wrapper.master_weights)
    summary['fused_master_step'] = bool(getattr(wrapper.optimizer, 'supports_fused_master_step',
                                                False))
    summary['optimizer'] = type(wrapper.optimizer).__name__
    return summary
