"""The one place where mp_wrappers reaches into mmengine's runner (Note [runner adapter]).

Note [runner adapter]
    Users adopt mp_wrappers by changing one config line and running their toolbox's own
    ``tools/train.py``, which knows nothing about us. Some of what an optimizer wrapper must get
    right depends on the runner's lifecycle, which mmengine never hands to a wrapper:

    * mmengine's ``EMAHook`` deep-copies the model in ``before_run``, before a wrapper casts it;
    * an ``OptimWrapperDict`` does not forward ``initialize_count_status`` to its wrappers, so
      nothing tells them that loading and resuming are over and training starts;
    * the ``LoggerHook`` decides when a log line is printed, and the ``amp_*`` values must be in
      the MessageHub then.

    mmengine 0.10.x (``Runner.train`` and ``FlexibleRunner.train``) builds the optimizer wrappers
    from inside the runner's own ``train`` method, before ``before_run``. So a wrapper finds the
    runner that is building it on the call stack (:func:`find_runner`) and registers an mmengine
    hook of ours in it (:func:`ensure_hook`): mmengine's own machinery then calls it at every
    lifecycle event, with no config line and no train script of ours. A wrapper built outside a
    runner and handed to one finds it later, at ``initialize_count_status`` or its first
    ``optim_context`` (both called from ``Runner.train``).

    What this module touches that is not public mmengine API: the frames of the call stack (the
    runner is the ``self`` of one of them) and ``runner._hooks`` (to put one hook in place of
    another: mmengine has ``register_hook`` but no way to replace one). Both are checked against the
    mmengine versions in :data:`CHECKED_MMENGINE_VERSIONS` by ``tests/base/test_runner_adapter.py``,
    which fails on any other version until it has been checked.
"""
import sys
from typing import Any, Callable, Optional

from mmengine.hooks import Hook

__all__ = ['CHECKED_MMENGINE_VERSIONS', 'find_runner', 'ensure_hook', 'replace_hook',
           'is_runner']

# mmengine releases whose Runner and FlexibleRunner were read to build optimizer wrappers inside
# ``train()`` before ``before_run`` and to keep their hooks in ``_hooks``, and whose EMAHook and
# OptimWrapperDict behave as described above. 0.10.12 is the maintained fork (onedl-mmengine, which
# installs as ``mmengine``); mmengine itself stopped at 0.10.7.
CHECKED_MMENGINE_VERSIONS = ('0.10.4', '0.10.5', '0.10.6', '0.10.7', '0.10.12')

# Deep enough for Runner.train -> build_optim_wrapper -> constructor -> Registry.build ->
# build_from_cfg -> __init__ of a subclass of a subclass (about 10 frames), with room for a
# toolbox's own constructor layers.
_MAX_DEPTH = 40


def _runner_classes() -> tuple:
    from mmengine.runner import Runner
    classes = [Runner]
    try:
        from mmengine.runner import FlexibleRunner
        classes.append(FlexibleRunner)
    except ImportError:  # older mmengine releases have no FlexibleRunner
        pass
    return tuple(classes)


def is_runner(obj: Any) -> bool:
    """Whether ``obj`` is an mmengine ``Runner`` or ``FlexibleRunner`` (or a subclass)."""
    return isinstance(obj, _runner_classes())


def find_runner(max_depth: int = _MAX_DEPTH) -> Optional[Any]:
    """The mmengine runner whose method is on the current call stack, or None.

    Only ``self`` of each frame is looked at (no frame's locals are copied), innermost first.
    """
    classes = _runner_classes()
    frame = sys._getframe(1)
    depth = 0
    while frame is not None and depth < max_depth:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == 'self':
            obj = frame.f_locals.get('self')
            if isinstance(obj, classes):
                return obj
        frame = frame.f_back
        depth += 1
    return None


def ensure_hook(runner: Any, hook_type: type, build: Callable[[], Hook]) -> Hook:
    """The runner's hook of exactly ``hook_type``; one is built and registered if there is none.

    Registered with ``runner.register_hook`` (public API), so its priority orders it among the
    others as any hook from a config would be.
    """
    for hook in runner.hooks:
        if type(hook) is hook_type:
            return hook
    hook = build()
    runner.register_hook(hook)
    return hook


def replace_hook(runner: Any, old: Hook, new: Hook) -> None:
    """Put ``new`` where ``old`` is in the runner's hook list (same position, same priority).

    Safe while ``runner.call_hook`` iterates the list: the list keeps its length.
    """
    hooks = runner._hooks  # private: see Note [runner adapter]
    for i, hook in enumerate(hooks):
        if hook is old:
            hooks[i] = new
            return
    raise ValueError(f'{type(old).__name__} is not registered in this runner')
