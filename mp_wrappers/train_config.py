"""The config edits of ``tools/train.py``: the automatic ``MixedPrecisionHook`` and ``--amp``.

:func:`add_mixed_precision_hook` adds :class:`mp_wrappers.MixedPrecisionHook` to configs that train
with one of our optimizer wrappers, so the ``amp_*`` log fields, the precision summary and
skip-aware schedules come without configuration. :func:`enable_amp` is ``tools/train.py --amp``.
"""
import logging
from typing import Any

from mmengine.logging import print_log
from mmengine.optim import OptimWrapper

from .hooks import MixedPrecisionHook
from .optim_config import uses_our_optim_wrapper

__all__ = ['add_mixed_precision_hook', 'enable_amp']


def _is_mixed_precision_hook(hook_cfg: Any) -> bool:
    if isinstance(hook_cfg, MixedPrecisionHook):
        return True
    type_ = hook_cfg.get('type') if isinstance(hook_cfg, dict) else None
    if isinstance(type_, str):
        return type_.split('.')[-1] == MixedPrecisionHook.__name__
    return isinstance(type_, type) and issubclass(type_, MixedPrecisionHook)


def add_mixed_precision_hook(cfg: Any) -> bool:
    """Append ``dict(type='mp_wrappers.MixedPrecisionHook')`` to ``cfg.custom_hooks`` when useful.

    The hook is added when the config trains with one of our optimizer wrappers, has no
    ``MixedPrecisionHook`` in ``custom_hooks`` yet, and does not opt out with
    ``mixed_precision_hook = False``. ``mixed_precision_hook`` may also be a dict of hook options,
    e.g. ``mixed_precision_hook = dict(skip_aware_schedules=False)``.

    Args:
        cfg: The mmengine ``Config`` (modified in place).

    Returns:
        True when the hook was added.

    Raises:
        ValueError: ``mixed_precision_hook`` is neither True, False, None nor a dict.

    Examples:
        >>> # in a config: keep the hook out
        >>> mixed_precision_hook = False
        >>> # or configure the automatic one
        >>> mixed_precision_hook = dict(overflow_report=True)
    """
    option = cfg.get('mixed_precision_hook', True)
    if option is None:
        option = True
    if not (option is True or option is False or isinstance(option, dict)):
        raise ValueError(f'mixed_precision_hook={option!r} is not allowed; expected True, False or '
                         'a dict of MixedPrecisionHook options')
    if option is False or not uses_our_optim_wrapper(cfg):
        return False
    hooks = list(cfg.get('custom_hooks', None) or [])
    if any(_is_mixed_precision_hook(h) for h in hooks):
        return False
    options = dict(option) if isinstance(option, dict) else {}
    options.pop('type', None)
    hooks.append(dict(type='mp_wrappers.MixedPrecisionHook', **options))
    cfg.custom_hooks = hooks
    return True


_PLAIN_OPTIM_WRAPPERS = ('OptimWrapper', 'mmengine.OptimWrapper')


def enable_amp(cfg: Any) -> bool:
    """``tools/train.py --amp``: train the config's plain ``OptimWrapper`` with mixed precision.

    Like OpenMMLab's train scripts (which switch to ``AmpOptimWrapper``), the ``optim_wrapper`` type
    becomes ``mp_wrappers.ApexOptimWrapper`` with ``opt_level='O1'`` (autocast) and ``dtype='auto'``
    (bf16 where native, fp16 on CUDA before sm_80, fp32 on a CPU without native half formats); the
    optimizer, ``accumulative_counts``, ``clip_grad`` and constructor options are kept.

    Args:
        cfg: The mmengine ``Config`` (modified in place).

    Returns:
        True when the wrapper was switched, False when the config already trains with one of our
        wrappers (a warning says so).

    Raises:
        ValueError: the config has no ``optim_wrapper``, or one of another type (e.g. mmengine's
            ``AmpOptimWrapper`` or an ``OptimWrapperDict`` constructor), which ``--amp`` cannot
            convert without changing its meaning.
    """
    optim = cfg.get('optim_wrapper', None)
    if not isinstance(optim, dict):
        raise ValueError('--amp needs an optim_wrapper dict in the config, found '
                         f'{type(optim).__name__}')
    if uses_our_optim_wrapper(cfg):
        print_log('--amp: the config already trains with an mp_wrappers optimizer wrapper '
                  f'({optim.get("type")!r}); left unchanged', logger='current', level=logging.WARNING)
        return False
    wrapper_type = optim.get('type', 'OptimWrapper')
    if not (wrapper_type in _PLAIN_OPTIM_WRAPPERS or wrapper_type is OptimWrapper):
        raise ValueError(f'--amp switches a plain OptimWrapper to mixed precision, but '
                         f'optim_wrapper.type is {wrapper_type!r}; allowed: '
                         f'{", ".join(repr(t) for t in _PLAIN_OPTIM_WRAPPERS)} (or drop --amp and '
                         "configure type='mp_wrappers.ApexOptimWrapper' yourself)")
    optim['type'] = 'mp_wrappers.ApexOptimWrapper'
    optim['opt_level'] = 'O1'
    optim['dtype'] = 'auto'
    print_log("--amp: optim_wrapper is now mp_wrappers.ApexOptimWrapper(opt_level='O1', "
              "dtype='auto')", logger='current', level=logging.INFO)
    return True
