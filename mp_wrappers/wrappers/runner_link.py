"""The one place where a wrapper reaches up to the runner that builds it (Note [wrapper lifecycle]).

A wrapper built by mmengine's Runner registers the wrappers' lifecycle hook in that runner, so
users need not list it in ``custom_hooks``. The runner is found on the call stack by
:mod:`mp_wrappers.runner_adapter` (which depends on mmengine alone) and the hook is looked up by its
registered name, so the wrappers never import :mod:`mp_wrappers.lifecycle` (which imports them).
This module is the wrappers' only import of the runner glue above them.
"""
from typing import Any, Optional, Tuple

from .. import runner_adapter  # the seam: runner glue sits above the wrappers
from ..registry import HOOKS

__all__ = ['find_runner_and_hook']


def find_runner_and_hook() -> Optional[Tuple[Any, Any]]:
    """``(runner, its WrapperLifecycleHook)`` for the runner on the call stack (adding the hook
    when missing), or None without a runner."""
    runner = runner_adapter.find_runner()
    if runner is None:
        return None
    hook_type = HOOKS.get('WrapperLifecycleHook')
    return runner, runner_adapter.ensure_hook(runner, hook_type, hook_type)
