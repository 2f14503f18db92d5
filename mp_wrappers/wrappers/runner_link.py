"""The one place where a wrapper reaches up to the runner that builds it (Note [wrapper lifecycle]).

A wrapper built by mmengine's Runner registers the wrappers' lifecycle hook in that runner, so
users need not list it in ``custom_hooks``. The runner is found on the call stack by
:mod:`mp_wrappers.runner_adapter` (which depends on mmengine alone) and the hook is looked up by its
registered name, so the wrappers never import :mod:`mp_wrappers.lifecycle` (which imports them).
This module is the wrappers' only import of the runner glue above them.
"""
import weakref
from typing import Optional

from .. import runner_adapter  # the seam: runner glue sits above the wrappers
from ..registry import HOOKS

__all__ = ['RunnerLink']


class RunnerLink:
    """A wrapper's link to its runner (held weakly), looked for at most once per stage.

    Attributes:
        ref (weakref.ref, optional): The runner whose lifecycle hook now serves the wrapper.
    """

    def __init__(self) -> None:
        self.ref: Optional['weakref.ref'] = None
        self._looked_up: set = set()

    def attach(self, stage: str) -> None:
        """Register the lifecycle hook in the runner on the call stack (once per wrapper).

        Looked for at most once per stage (``'build'``, ``'count_status'``, ``'forward'``): a
        wrapper used without a runner pays one stack walk per stage, never per iteration. The hook
        then catches up with the stages of the wrapper's runner already past.
        """
        if self.ref is not None or stage in self._looked_up:
            return
        self._looked_up.add(stage)
        runner = runner_adapter.find_runner()
        if runner is None:
            return
        hook_type = HOOKS.get('WrapperLifecycleHook')
        hook = runner_adapter.ensure_hook(runner, hook_type, hook_type)
        self.ref = weakref.ref(runner)
        hook.catch_up(runner, stage)
