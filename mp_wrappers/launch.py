"""Launch set-up around mmengine's Runner that mmengine 0.10.7 gets wrong on torch 2.13 without CUDA.

``launcher='pytorch'`` (and ``'slurm'``/``'mpi'``) makes mmengine's ``init_dist`` call
``torch.cuda.set_device`` and its ``wrap_model`` pass ``device_ids=[local_rank]`` to DDP, so a CPU-only
multi-process run dies before training. :func:`prepare_distributed` starts the gloo process group
itself when CUDA is unavailable (``Runner.setup_env`` then skips ``init_dist``, it only initialises an
uninitialised group) and makes the DDP wrapper CPU-friendly. With CUDA, mmengine's own nccl path is
left untouched. :func:`configure_torch_threads` and :func:`backend_summary` are the rest of what
``tools/train.py`` sets up and reports before building the Runner.
"""
import datetime
import os
import subprocess
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from .optim_config import model_cast_of

__all__ = ['LAUNCHERS', 'prepare_distributed', 'init_gloo', 'configure_torch_threads',
           'backend_summary']

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
        init_gloo(launcher, cfg.get('env_cfg', {}).get('dist_cfg', {}) or {})
    _cpu_model_wrapper_cfg(cfg)
    return cfg


def _apex_model_wrapper_cfg(cfg: Any) -> None:
    """Cast-before-DDP wrapper for the wrappers that cast the model: ApexOptimWrapper O2/O3, and
    FP16OptimWrapper with a half ``dtype`` (over an fp32 model; a half model is left as it is)."""
    optim = cfg.get('optim_wrapper', None)
    if cfg.get('model_wrapper_cfg', None) is not None or not hasattr(optim, 'get'):
        return
    cast, keep_bn = model_cast_of(optim)
    if cast is None:
        return
    cfg.model_wrapper_cfg = dict(
        type='mp_wrappers.MixedPrecisionDistributedDataParallel',
        dtype=str(cast).replace('torch.', ''), keep_batchnorm_fp32=keep_bn,
        broadcast_buffers=False, find_unused_parameters=cfg.get('find_unused_parameters', False))
    if optim.get('fp32_modules', None):
        cfg.model_wrapper_cfg['fp32_modules'] = list(optim['fp32_modules'])


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


def init_gloo(launcher: str, dist_cfg: Dict[str, Any]) -> None:
    """Initialise ``torch.distributed`` from ``launcher``'s environment, gloo for a configured nccl.

    Shared by :func:`prepare_distributed` (``Runner``) and the FSDP1 strategy (``FlexibleRunner``).
    ``dist_cfg`` is the config's ``env_cfg.dist_cfg`` (``backend``, ``timeout``, ``port``).
    """
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
