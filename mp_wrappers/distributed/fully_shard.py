"""FSDP2 for mmengine's ``Runner``: a model wrapper that applies ``torch.distributed.fsdp.fully_shard``.

mmengine's ``Runner.train`` calls ``init_weights()`` and then broadcasts every state-dict entry from
rank 0, which fails on DTensors (and would copy rank 0's shards everywhere). :class:`FullyShardedModel`
therefore initialises the weights and broadcasts them *before* sharding, and
:class:`FullyShardedRunner` (``runner_type='mp_wrappers.FullyShardedRunner'``) skips that step for it.

mmengine 0.10.7 has no FSDP2 strategy; its ``Runner`` wraps the model with ``model_wrapper_cfg``
(``MODEL_WRAPPERS``), which is where :class:`FullyShardedModel` plugs in. It shards every module that
owns parameters on its own (one all-gather per layer) and then the root, with a
``MixedPrecisionPolicy`` whose ``param_dtype`` is the wrapper's ``dtype``: FSDP makes the half
copies and the fp32 shards are the master weights our optimizer wrappers step (Note [sharded
masters]). Normalisation layers keep fp32 parameters (no ``param_dtype``), apex O2's
``keep_batchnorm_fp32``.
"""
from typing import Any, Dict, Optional, Union

import torch
from mmengine.model.base_model.data_preprocessor import BaseDataPreprocessor
from torch import nn
from .. import compat
from ..casting import is_norm_layer, parse_dtype
from mmengine.dist import is_distributed
from mmengine.runner import Runner

from ..launch import init_gloo
from ..registry import MODEL_WRAPPERS, RUNNERS
from . import runner_checkpoint
from .sharded_ema import install_sharded_deepcopy

__all__ = ['FullyShardedModel', 'FullyShardedRunner', 'hsdp_mesh']

@MODEL_WRAPPERS.register_module()
class FullyShardedModel(nn.Module):
    """``fully_shard`` (FSDP2) a model for mmengine's ``Runner``, with FSDP's mixed precision.

    Args:
        module (nn.Module): The model (mmengine passes it); sharded in place.
        dtype (str | torch.dtype, optional): FSDP's ``param_dtype``, the dtype forward and backward
            run in (``'bfloat16'``, ``'float16'``), or None for fp32.
        reduce_dtype (str | torch.dtype): dtype of the gradient reduce-scatter. Defaults to
            ``'float32'``.
        keep_norm_fp32 (bool): Shard normalisation layers without ``param_dtype`` (fp32 weights).
            Defaults to True.
        reshard_after_forward (bool): FSDP2's option (free the gathered weights after forward).
        replicate (int | str, optional): HSDP: shard over groups of ``world_size / replicate``
            ranks and replicate across ``replicate`` of them (a 2-D ``(replicate, shard)`` device
            mesh, Note [HSDP]). ``'nodes'``: one replica per machine, sharded within it
            (``WORLD_SIZE / LOCAL_WORLD_SIZE`` replicas, from torchrun's environment). Defaults
            to None: shard over all ranks.

    Examples:
        >>> model_wrapper_cfg = dict(type='mp_wrappers.FullyShardedModel', dtype='bfloat16')
        >>> # several machines: shard within each, replicate across them
        >>> model_wrapper_cfg = dict(type='mp_wrappers.FullyShardedModel', dtype='bfloat16',
        ...                          replicate='nodes')
        >>> optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2',
        ...                      dtype='bfloat16', optimizer=dict(type='mp_wrappers.FusedAdam'))
    """

    def __init__(self, module: nn.Module, dtype: Union[str, torch.dtype, None] = None,
                 reduce_dtype: Union[str, torch.dtype] = 'float32', keep_norm_fp32: bool = True,
                 reshard_after_forward: bool = True,
                 replicate: Union[int, str, None] = None) -> None:
        compat.require('fsdp2')
        if not torch.cuda.is_available():
            compat.require('fsdp2_cpu')
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        super().__init__()
        mesh = hsdp_mesh(replicate)
        param_dtype = parse_dtype(dtype, option='FullyShardedModel(dtype)')
        reduce = parse_dtype(reduce_dtype, option='FullyShardedModel(reduce_dtype)',
                             allowed=('float32', 'float16', 'bfloat16'))
        _init_and_broadcast(module)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce)
        fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce)
        for m in list(module.modules())[1:]:
            if isinstance(m, BaseDataPreprocessor) or not any(
                    True for _ in m.parameters(recurse=False)):
                continue
            keep = keep_norm_fp32 and is_norm_layer(m)
            fully_shard(m, mesh=mesh, mp_policy=fp32 if keep else policy,
                        reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
        install_sharded_deepcopy(module)  # for EMAHook's averaged model (Note [EMA of a sharded model])
        self.module = module

    # ---- mmengine's model-wrapper contract (as MMDistributedDataParallel) ------------------------
    def train_step(self, data: Union[dict, tuple, list], optim_wrapper: Any) -> Dict[str, torch.Tensor]:
        """Preprocess, forward in ``optim_wrapper.optim_context``, parse losses, update."""
        with optim_wrapper.optim_context(self):
            data = self.module.data_preprocessor(data, training=True)
            losses = self._run_forward(data, mode='loss')
        parsed_loss, log_vars = self.module.parse_losses(losses)
        optim_wrapper.update_params(parsed_loss)
        return log_vars

    def val_step(self, data: Union[dict, tuple, list]) -> list:
        return self.module.val_step(data)

    def test_step(self, data: Union[dict, tuple, list]) -> list:
        return self.module.test_step(data)

    def _run_forward(self, data: Union[dict, tuple, list], mode: str) -> Any:
        # Through the root's __call__: FSDP2's hooks all-gather the parameters.
        if isinstance(data, dict):
            return self.module(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return self.module(*data, mode=mode)
        raise TypeError(f'Output of data_preprocessor should be a dict, list or tuple, got '
                        f'{type(data).__name__}')

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # FSDP2 modules have no no_sync(): our wrappers skip the reduce-scatter while accumulating
    # through set_requires_gradient_sync (mp_wrappers.sharding.no_sync_for_backward).
    @property
    def sharded_root(self) -> Optional[nn.Module]:
        return self.module


def hsdp_mesh(replicate: Union[int, str, None]) -> Any:
    """The 2-D ``(replicate, shard)`` device mesh for ``FullyShardedModel(replicate=...)``, or None.

    Raises:
        ValueError: ``replicate`` is not a positive int dividing the world size, nor ``'nodes'``
            (which needs torchrun's ``LOCAL_WORLD_SIZE``).
    """
    import os

    import torch.distributed as dist
    if replicate is None:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if replicate == 'nodes':
        local = os.environ.get('LOCAL_WORLD_SIZE')
        if local is None:
            raise ValueError("FullyShardedModel(replicate='nodes') needs LOCAL_WORLD_SIZE (set by "
                             'torchrun: the processes per machine); give the number of replicas '
                             'as an int instead')
        replicate = world // int(local)
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1 \
            or world % replicate:
        raise ValueError(f'FullyShardedModel(replicate={replicate!r}): need a positive int that '
                         f"divides the world size ({world}), or 'nodes'")
    from torch.distributed.device_mesh import init_device_mesh
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    return init_device_mesh(device, (replicate, world // replicate),
                            mesh_dim_names=('replicate', 'shard'))


def _init_and_broadcast(module: nn.Module) -> None:
    """What ``Runner._init_model_weights`` does, on full tensors: init, then rank 0's values."""
    import torch.distributed as dist
    if hasattr(module, 'init_weights'):
        module.init_weights()
    if dist.is_available() and dist.is_initialized():
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=0)


@RUNNERS.register_module()
class FullyShardedRunner(Runner):
    """mmengine's ``Runner`` for :class:`FullyShardedModel` (FSDP2), with sharded checkpoints.

    Differences, only when the model is FSDP2-sharded (other models go through ``Runner``
    unchanged):

    * weights are initialised and broadcast by :class:`FullyShardedModel` before sharding, so the
      Runner's own init-and-broadcast (which cannot broadcast DTensors) is skipped;
    * ``save_checkpoint`` runs on every rank and writes a ``torch.distributed.checkpoint``
      directory holding every rank's shards, ``load_checkpoint`` (``load_from``) reads such a
      directory or an ordinary full checkpoint, and ``resume`` (mmengine's, through
      ``load_checkpoint``) continues from such a directory on any number of ranks (Note [runner checkpoints under FSDP2] in
      :mod:`mp_wrappers.distributed.runner_checkpoint`). mmengine's ``CheckpointHook`` drives
      them as it is (``interval``, ``max_keep_ckpts``, ``save_best``, ``save_last``,
      ``last_checkpoint``).

    Examples:
        >>> runner_type = 'mp_wrappers.FullyShardedRunner'
        >>> model_wrapper_cfg = dict(type='mp_wrappers.FullyShardedModel', dtype='bfloat16')
        >>> default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1))
    """

    def setup_env(self, env_cfg: Dict) -> None:
        # Without CUDA mmengine's init_dist calls torch.cuda.set_device (and takes nccl): start a
        # gloo group from the launcher's environment first, as MixedPrecisionFSDPStrategy does for
        # FSDP1, so that a toolbox's own train script runs an FSDP2 config on CPU too.
        if self.distributed and not torch.cuda.is_available() and not is_distributed():
            init_gloo(self.launcher, env_cfg.get('dist_cfg', {}) or {})
        super().setup_env(env_cfg)

    def _init_model_weights(self) -> None:
        if isinstance(self.model, FullyShardedModel):
            return
        super()._init_model_weights()

    def build_optim_wrapper(self, optim_wrapper: Any) -> Any:
        """mmengine's, refusing an ``OptimWrapperDict`` over an FSDP2 model whose checkpoints
        would save the optimizer state (they hold one optimizer's)."""
        from .checkpoint import refuse_optim_wrapper_dict, saves_optimizer_state
        built = super().build_optim_wrapper(optim_wrapper)
        if self._sharded():
            refuse_optim_wrapper_dict(built, 'FSDP2', saves_optimizer_state(self.hooks))
        return built

    def _sharded(self) -> bool:
        return runner_checkpoint.fsdp2_root(self.model) is not None

    @runner_checkpoint._collective
    def save_checkpoint(self, out_dir: str, filename: str, *args: Any, **kwargs: Any) -> None:
        # Not @master_only (mmengine's is): every rank writes its shards.
        if self._sharded():
            runner_checkpoint.save_checkpoint(self, out_dir, filename, *args, **kwargs)
        else:
            super().save_checkpoint(out_dir, filename, *args, **kwargs)

    def load_checkpoint(self, filename: str, *args: Any, **kwargs: Any) -> dict:
        if self._sharded():
            return runner_checkpoint.load_checkpoint(self, filename, *args, **kwargs)
        return super().load_checkpoint(filename, *args, **kwargs)

