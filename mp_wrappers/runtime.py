"""Run-time setup around mmengine's Runner that mmengine 0.10.7 gets wrong on torch 2.13 without CUDA.

``launcher='pytorch'`` (and ``'slurm'``/``'mpi'``) makes mmengine's ``init_dist`` call
``torch.cuda.set_device`` and its ``wrap_model`` pass ``device_ids=[local_rank]`` to DDP, so a CPU-only
multi-process run dies before training. :func:`prepare_distributed` starts the gloo process group
itself when CUDA is unavailable (``Runner.setup_env`` then skips ``init_dist``, it only initialises an
uninitialised group) and makes the DDP wrapper CPU-friendly. With CUDA, mmengine's own nccl path is
left untouched.

:func:`enable_amp` is ``tools/train.py --amp``. :func:`add_mixed_precision_hook` adds :class:`mp_wrappers.MixedPrecisionHook` to configs that train
with one of our optimizer wrappers, so the ``amp_*`` log fields, the precision summary and
skip-aware schedules come without configuration.
"""
import datetime
import os
import subprocess
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ['LAUNCHERS', 'prepare_distributed', 'configure_torch_threads', 'backend_summary',
           'add_mixed_precision_hook', 'uses_our_optim_wrapper', 'enable_amp']

LAUNCHERS = ('none', 'pytorch', 'slurm', 'mpi')
_DEFAULT_PORT = '29500'  # torch.distributed's default, as in mmengine


def prepare_distributed(cfg: Any, launcher: str) -> Any:
    """Set ``cfg.launcher`` and, on a machine without CUDA, start a gloo group for the Runner.

    Call this after the config is loaded and before ``Runner.from_cfg(cfg)``. Without CUDA and with
    ``launcher != 'none'`` it:

    * initialises ``torch.distributed`` with the gloo backend from the launcher's environment
      (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` from torchrun; ``SLURM_*`` or ``OMPI_COMM_WORLD_*``
      translated the way mmengine does) unless a group is already initialised;
    * (with or without CUDA) when the optim wrapper is ``mp_wrappers.ApexOptimWrapper`` at a level
      that casts the model (O2/O3, or any ``cast_model_type`` override to a half type) and the
      config has no ``model_wrapper_cfg``, sets ``model_wrapper_cfg=dict(
      type='mp_wrappers.MixedPrecisionDistributedDataParallel', dtype=..., keep_batchnorm_fp32=...)``
      from the resolved opt-level properties, so that the model is cast *before* DDP wraps it
      (casting after wrapping silently stops gradient all-reduce);
    * sets ``cfg.model_wrapper_cfg = dict(type='MMDistributedDataParallel', device_ids=None,
      broadcast_buffers=False, find_unused_parameters=...)`` (mmengine's GPU defaults, minus the
      device) when the config has none, or adds ``device_ids=None`` to a configured wrapper that lacks
      it, so DDP wraps a CPU module.

    Args:
        cfg: The mmengine ``Config`` (modified in place and returned).
        launcher: One of ``'none'``, ``'pytorch'``, ``'slurm'``, ``'mpi'``.

    Returns:
        The same config, for chaining.

    Raises:
        ValueError: ``launcher`` is not one of :data:`LAUNCHERS`.
        RuntimeError: the launcher's environment variables are missing.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f'launcher={launcher!r} is not supported; allowed: '
                         f'{", ".join(repr(x) for x in LAUNCHERS)}')
    cfg.launcher = launcher
    if launcher != 'none':
        _apex_model_wrapper_cfg(cfg)
    if launcher == 'none' or torch.cuda.is_available():
        return cfg  # mmengine's own path: init_dist with the configured backend (nccl) and device ids
    if not (dist.is_available() and dist.is_initialized()):
        _init_gloo(launcher, cfg.get('env_cfg', {}).get('dist_cfg', {}) or {})
    _cpu_model_wrapper_cfg(cfg)
    return cfg


_APEX_TYPES = ('mp_wrappers.ApexOptimWrapper',)
_FP16_TYPES = ('mp_wrappers.FP16OptimWrapper',)
_PROPERTY_KEYS = ('enabled', 'loss_scale', 'cast_model_type', 'patch_torch_functions',
                  'keep_batchnorm_fp32', 'master_weights', 'cast_model_outputs', 'dtype')


def _apex_model_wrapper_cfg(cfg: Any) -> None:
    """Cast-before-DDP wrapper for the wrappers that cast the model: ApexOptimWrapper O2/O3, and
    FP16OptimWrapper with a half ``dtype`` (over an fp32 model; a half model is left as it is)."""
    optim = cfg.get('optim_wrapper', None)
    if cfg.get('model_wrapper_cfg', None) is not None or not hasattr(optim, 'get'):
        return
    cast, keep_bn = _model_cast_of(optim)
    if cast is None:
        return
    cfg.model_wrapper_cfg = dict(
        type='mp_wrappers.MixedPrecisionDistributedDataParallel',
        dtype=str(cast).replace('torch.', ''), keep_batchnorm_fp32=keep_bn,
        broadcast_buffers=False, find_unused_parameters=cfg.get('find_unused_parameters', False))
    if optim.get('fp32_modules', None):
        cfg.model_wrapper_cfg['fp32_modules'] = list(optim['fp32_modules'])


def _model_cast_of(optim: Any) -> Tuple[Optional[torch.dtype], bool]:
    """(the dtype the configured wrapper casts the model to, keep norm layers fp32), or (None, _)."""
    from .wrappers import ApexOptimWrapper, FP16OptimWrapper
    wrapper_type = optim.get('type', None)
    if wrapper_type in _FP16_TYPES or wrapper_type is FP16OptimWrapper:
        dtype = optim.get('dtype', None)
        if isinstance(dtype, str) and dtype in ('float16', 'bfloat16'):
            return getattr(torch, dtype), True
        return None, True  # None, fp32 or 'auto' (resolved per device by the wrapper)
    if not (wrapper_type in _APEX_TYPES or wrapper_type is ApexOptimWrapper):
        return None, True
    from .policy import resolve_properties
    kwargs = {k: optim[k] for k in _PROPERTY_KEYS if optim.get(k, None) is not None}
    props = resolve_properties(optim.get('opt_level', 'O1'), **kwargs)
    cast = props.cast_model_type
    if not props.enabled or cast is None or cast == torch.float32:
        return None, True
    return cast, bool(props.keep_batchnorm_fp32)


def _cpu_model_wrapper_cfg(cfg: Any) -> None:
    wrapper = cfg.get('model_wrapper_cfg', None)
    if wrapper is None:
        cfg.model_wrapper_cfg = dict(
            type='MMDistributedDataParallel', device_ids=None, broadcast_buffers=False,
            find_unused_parameters=cfg.get('find_unused_parameters', False))
        return
    from mmengine.registry import MODEL_WRAPPERS
    wrapper_type = wrapper.get('type', 'MMDistributedDataParallel')
    wrapper_cls = MODEL_WRAPPERS.get(wrapper_type) if isinstance(wrapper_type, str) else wrapper_type
    if wrapper_cls is None:
        raise ValueError(f'model_wrapper_cfg.type={wrapper_type!r} is not a registered model wrapper')
    # mmengine adds device_ids=[LOCAL_RANK] for every DDP subclass; a CPU module needs None.
    if isinstance(wrapper_cls, type) and issubclass(wrapper_cls, torch.nn.parallel.DistributedDataParallel):
        wrapper.setdefault('device_ids', None)


def _env(name: str, launcher: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f'launcher={launcher!r} needs the environment variable {name}, which is not '
                           f'set; start the processes with the matching launcher (e.g. torchrun for '
                           f"'pytorch') or use --launcher none")
    return value


def _init_gloo(launcher: str, dist_cfg: Dict[str, Any]) -> None:
    backend = dist_cfg.get('backend', 'gloo')
    # nccl is the usual config value and means "the GPU collective": without CUDA that is gloo. Any
    # other explicit choice (e.g. 'mpi') is honoured.
    if backend in ('nccl', None):
        backend = 'gloo'
    kwargs: Dict[str, Any] = {}
    timeout: Optional[float] = dist_cfg.get('timeout')
    if timeout is not None:
        kwargs['timeout'] = datetime.timedelta(seconds=timeout)
    if launcher == 'slurm':
        proc_id = _env('SLURM_PROCID', launcher)
        os.environ.setdefault('MASTER_PORT', str(dist_cfg.get('port', _DEFAULT_PORT)))
        if 'MASTER_ADDR' not in os.environ:
            node_list = _env('SLURM_NODELIST', launcher)
            os.environ['MASTER_ADDR'] = subprocess.getoutput(
                f'scontrol show hostname {node_list} | head -n1')
        os.environ['WORLD_SIZE'] = _env('SLURM_NTASKS', launcher)
        os.environ['RANK'] = proc_id
        os.environ['LOCAL_RANK'] = os.environ.get('SLURM_LOCALID', '0')
    elif launcher == 'mpi':
        os.environ.setdefault('MASTER_PORT', _DEFAULT_PORT)
        _env('MASTER_ADDR', launcher)
        os.environ['WORLD_SIZE'] = _env('OMPI_COMM_WORLD_SIZE', launcher)
        os.environ['RANK'] = _env('OMPI_COMM_WORLD_RANK', launcher)
        os.environ['LOCAL_RANK'] = _env('OMPI_COMM_WORLD_LOCAL_RANK', launcher)
    else:  # pytorch: torchrun sets all of these
        for name in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'):
            _env(name, launcher)
        # mmengine's wrap_model reads LOCAL_RANK even when device_ids is None.
        os.environ.setdefault('LOCAL_RANK', os.environ['RANK'])
    dist.init_process_group(backend=backend, init_method='env://', rank=int(os.environ['RANK']),
                            world_size=int(os.environ['WORLD_SIZE']), **kwargs)


def configure_torch_threads(cfg: Any) -> Optional[int]:
    """Apply the config's ``torch_num_threads`` (intra-op CPU threads) if it is set.

    ``None`` or absent leaves torch's default (one thread per core, or ``OMP_NUM_THREADS``; torchrun
    sets that to 1 per process).

    Args:
        cfg: The mmengine ``Config``.

    Returns:
        The number of threads set, or ``None`` when the config leaves it alone.

    Raises:
        ValueError: ``torch_num_threads`` is not a positive integer.
    """
    value = cfg.get('torch_num_threads', None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'torch_num_threads={value!r} must be a positive integer or None')
    torch.set_num_threads(value)
    return value


def backend_summary() -> str:
    """One line naming the op implementation in use (compiled extension or pure-PyTorch reference)."""
    from . import ops
    backend_fn = getattr(ops, 'backend', None)
    if backend_fn is None:
        return 'mp_wrappers ops backend: unknown (mp_wrappers.ops.backend() is absent)'
    try:
        return f'mp_wrappers ops backend: {backend_fn()}'
    except Exception as exc:  # reporting must never stop training; the ops report again at first use
        return f'mp_wrappers ops backend: unavailable ({type(exc).__name__}: {exc})'


def _resolve_optim_wrapper_type(type_: Any, default_scope: Optional[str]) -> Any:
    """The class a config's ``optim_wrapper.type`` names, resolved as the Runner would."""
    if not isinstance(type_, str):
        return type_
    from mmengine.registry import OPTIM_WRAPPERS as ROOT
    from .registry import OPTIM_WRAPPERS as OURS
    if '.' in type_:
        return ROOT.get(type_)  # 'mp_wrappers.X' finds our child registry from the root
    # Unprefixed: the default scope decides (mmengine has an ApexOptimWrapper of its own).
    return OURS.get(type_) if default_scope == OURS.scope else ROOT.get(type_)


def uses_our_optim_wrapper(cfg: Any) -> bool:
    """Whether ``cfg.optim_wrapper`` builds an mp_wrappers optimizer wrapper.

    Looks at ``optim_wrapper.type`` and, for multi-optimizer configs (an ``OptimWrapperDict`` built
    by a constructor), at the ``type`` of every sub-dict.

    Args:
        cfg: The mmengine ``Config``.

    Returns:
        True when at least one wrapper is a :class:`~mp_wrappers.MixedPrecisionOptimWrapper`.
    """
    from .wrappers.base import MixedPrecisionOptimWrapper
    optim = cfg.get('optim_wrapper', None)
    if not isinstance(optim, dict):
        return False
    scope = cfg.get('default_scope', None)
    candidates = [optim] + [v for v in optim.values() if isinstance(v, dict) and 'type' in v]
    for entry in candidates:
        if 'type' not in entry:
            continue
        cls = _resolve_optim_wrapper_type(entry['type'], scope)
        if isinstance(cls, type) and issubclass(cls, MixedPrecisionOptimWrapper):
            return True
    return False


def _is_mixed_precision_hook(hook_cfg: Any) -> bool:
    from .hooks import MixedPrecisionHook
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
    import logging

    from mmengine.logging import print_log
    from mmengine.optim import OptimWrapper
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
