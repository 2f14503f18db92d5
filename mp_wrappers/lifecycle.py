"""What our optimizer wrappers need from the runner's lifecycle, attached by the wrappers themselves.

Note [wrapper lifecycle]
    An mp_wrappers optimizer wrapper built by an mmengine runner registers one
    :class:`WrapperLifecycleHook` in it (found through :mod:`mp_wrappers.runner_adapter`), so a
    config that only names our wrapper trains the same through any toolbox's ``tools/train.py`` as
    through ours. The hook does exactly what correctness needs, nothing optional:

    * ``before_run`` (before any other hook's): an FSDP2 model under a runner whose checkpoints
      would hold rank 0's shards only, and an ``EMAHook`` over an FSDP1 model not wrapped by our
      strategy, are refused
      (:func:`mp_wrappers.distributed.runner_checkpoint.attach`); mmengine's ``EMAHook`` averages
      the full-precision weights when a wrapper trains half weights
      (:func:`mp_wrappers.ema.adopt_ema_hooks`);
    * ``before_train`` (after ``load_from``/``resume``): every wrapper prepares the model (O2/O3
      and a casting ``FP16OptimWrapper`` cast it and start their masters from its fp32 weights),
      including the wrappers of an ``OptimWrapperDict``, which mmengine never tells that training
      starts: no forward of the run, a GAN's discriminator step through the generator included,
      sees the model in another dtype, so a resumed run continues bitwise;
    * ``after_load_checkpoint``: a full checkpoint of a sharded run (FSDP1 ``'full'``, a
      consolidated FSDP2 one), whose optimizer state is keyed by parameter name, resumes an
      unsharded model (:func:`mp_wrappers.distributed.runner_checkpoint.adapt_loaded_checkpoint`);
      under ``FlexibleRunner``, which loads before ``before_run``, an ``EMAHook`` gets its averaged
      model in time to load it, and keeps it (Note [EMA loaded before before_run]);
    * around validation and test epochs: a sharded model's gathered weights are released, so that
      weights written into the shards in between (``EMAHook``'s swaps) are what the next forward
      uses (Note [FSDP1 root after evaluation] in :mod:`mp_wrappers.distributed.fsdp`);
    * every iteration: the wrappers publish ``amp_scale``/``amp_skipped``/``amp_gnorm`` to the
      MessageHub exactly when the ``LoggerHook`` will print (a host read on GPU only then), so
      every log line and visualizer backend has them at the LoggerHook's interval.

    ``mp_wrappers.MixedPrecisionHook`` adds optional behaviour on top (skip-aware schedules, the
    precision summary, overflow reports) and is no longer needed for any of the above.
"""
from typing import Any, List, Optional

from mmengine.hooks import Hook, LoggerHook

from .distributed.fsdp import release_unsharded_root
from .distributed.runner_checkpoint import adapt_loaded_checkpoint, refuse_sharded_ema
from .distributed.runner_checkpoint import attach as attach_sharded_checkpoints
from .ema import adopt_ema_hooks, build_averages_before_load, keep_loaded_averages
from .registry import HOOKS
from .wrappers.base import MixedPrecisionOptimWrapper, mixed_precision_wrappers

__all__ = ['WrapperLifecycleHook', 'our_wrappers']


def our_wrappers(runner) -> List[MixedPrecisionOptimWrapper]:
    """Every mp_wrappers optimizer wrapper in ``runner.optim_wrapper`` (an ``OptimWrapperDict``'s
    too)."""
    return [w for _, w in mixed_precision_wrappers(getattr(runner, 'optim_wrapper', None))]


# The stages of Runner.train at which a wrapper can meet its runner (Note [runner adapter]).
STAGES = ('build', 'count_status', 'forward')


@HOOKS.register_module()
class WrapperLifecycleHook(Hook):
    """Registered in a runner by our optimizer wrappers themselves (Note [wrapper lifecycle]).

    Not meant for configs: a wrapper built by the runner adds it. Listing it does no harm (the
    wrappers then use that one).
    """

    # before_run must precede EMAHook's (which deep-copies the model there).
    priority = 'HIGHEST'

    def __init__(self) -> None:
        self._ran: set = set()
        self._logger_hook: Optional[LoggerHook] = None

    def catch_up(self, runner, stage: str) -> None:
        """Do now what the events that passed before the wrapper found the runner would have done.

        ``stage``: where the wrapper met the runner (:data:`STAGES`): while being built (nothing
        has happened yet), at ``initialize_count_status`` (after ``before_run``), or at its first
        forward (inside the train loop).
        """
        if stage not in STAGES:
            raise ValueError(f'stage={stage!r} is not one of {STAGES}')
        if stage == 'build':
            return
        if 'before_run' not in self._ran:
            self.before_run(runner)
        if stage == 'forward' and 'before_train' not in self._ran:
            self.before_train(runner)

    def before_run(self, runner) -> None:
        self._ran.add('before_run')
        # An FSDP2 model under a runner that would save rank 0's shards only, or an FSDP1 or
        # FSDP2 model with an EMAHook, is refused before anything is saved or averaged (Note
        # [runner checkpoints under FSDP2], Note [EMA of a sharded model]).
        attach_sharded_checkpoints(runner)
        adopt_ema_hooks(runner)

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        """A sharded run's full checkpoint resumed without sharding: the optimizer state keyed
        by parameter name is re-keyed by position (``runner_checkpoint.adapt_loaded_checkpoint``)."""
        # FlexibleRunner loads before before_run: refuse an EMAHook over an FSDP1 model we cannot
        # average before its after_load_checkpoint runs, and build the others' averaged models
        # for them to load into (Note [EMA loaded before before_run] in mp_wrappers/ema.py)
        refuse_sharded_ema(runner)
        build_averages_before_load(runner)
        adapt_loaded_checkpoint(runner, checkpoint)

    # Around evaluation (before EMAHook swaps weights in or out): a sharded model gathers again
    # what its shards hold at the next forward (Note [FSDP1 root after evaluation]).
    def before_val_epoch(self, runner) -> None:
        release_unsharded_root(runner.model)

    def after_val_epoch(self, runner, metrics=None) -> None:
        release_unsharded_root(runner.model)

    def before_test_epoch(self, runner) -> None:
        release_unsharded_root(runner.model)

    def after_test_epoch(self, runner, metrics=None) -> None:
        release_unsharded_root(runner.model)

    def before_train(self, runner) -> None:
        self._ran.add('before_train')
        keep_loaded_averages(runner)
        adopt_ema_hooks(runner)  # an EMAHook registered after before_run, or a late wrapper
        self._logger_hook = next((h for h in runner.hooks if isinstance(h, LoggerHook)), None)
        for wrapper in our_wrappers(runner):
            wrapper.prepare_for_training(runner.model)
            if self._logger_hook is not None:
                wrapper.log_interval = int(self._logger_hook.interval)

    def before_train_iter(self, runner, batch_idx: int, data_batch: Any = None) -> None:
        """Tell the wrappers whether the LoggerHook prints after this iteration."""
        ours = our_wrappers(runner)
        if not ours:
            return
        due = self._logger_will_log(runner, batch_idx)
        for wrapper in ours:
            wrapper.publish_now = due

    def after_train(self, runner) -> None:
        """Hand log cadence back to ``log_interval`` (the wrappers may be used without a runner)."""
        for wrapper in our_wrappers(runner):
            wrapper.publish_now = None

    def _logger_will_log(self, runner, batch_idx: int) -> Optional[bool]:
        """The LoggerHook's own condition for printing a train log line after this iteration."""
        hook = self._logger_hook
        if hook is None:
            return None  # no LoggerHook: the wrappers fall back to log_interval
        if hook.every_n_inner_iters(batch_idx, hook.interval):
            return True
        try:
            n = len(runner.train_dataloader)
        except TypeError:  # an iterable dataset without a length: no end-of-epoch line
            return False
        return bool(hook.end_of_epoch(runner.train_dataloader, batch_idx)
                    and (not hook.ignore_last or n <= hook.interval))
