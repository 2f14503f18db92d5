"""FSDP1 through mmengine's ``FlexibleRunner``: ``FSDPStrategy`` on CPU (gloo) and with our wrappers.

mmengine 0.10.7's ``FSDPStrategy`` assumes CUDA twice: ``init_dist`` calls ``torch.cuda.set_device``
and the FSDP wrapper gets ``device_id=int(LOCAL_RANK)``, a CUDA index. :class:`MixedPrecisionFSDPStrategy`
is that strategy through its own extension points (``_setup_distributed``, ``model_wrapper``):
without CUDA it starts a gloo group and gives FSDP ``device_id=torch.device('cpu')``; with CUDA it
is mmengine's strategy unchanged. It also fills in FSDP's ``mixed_precision`` from an
``mp_wrappers.ApexOptimWrapper`` config whose level runs the model in half precision (O2), so
FSDP makes the half copies from its fp32 shards and those shards are the masters (Note [sharded
masters] in :mod:`mp_wrappers.sharding`).
"""
from typing import Any, Optional

import torch
from mmengine._strategy import FSDPStrategy
from mmengine.dist import is_distributed
from mmengine.model import is_model_wrapper
from torch import nn

from .. import compat
from ..launch import init_gloo
from ..optim_config import optim_cfg_properties
from ..registry import STRATEGIES
from .sharded_ema import install_flat_shard_deepcopy

__all__ = ['MixedPrecisionFSDPStrategy', 'fsdp_mixed_precision', 'check_local_checkpoint',
           'release_unsharded_root']


def fsdp_mixed_precision(optim_wrapper: Any) -> Optional[dict]:
    """FSDP1 ``mixed_precision`` for an optim wrapper config, or None when FSDP should not cast.

    ``mp_wrappers.ApexOptimWrapper`` at a level that casts the model with fp32 masters (O2, or a
    half ``cast_model_type`` override) gives ``dict(param_dtype=<its dtype>, reduce_dtype='float32')``:
    half forward and backward, gradients reduced and kept in fp32 on the fp32 shards.
    """
    props = optim_cfg_properties(optim_wrapper)
    if props is None:
        return None
    cast = props.cast_model_type
    if not props.enabled or cast is None or cast == torch.float32 or not props.master_weights:
        return None
    return dict(param_dtype=str(cast).replace('torch.', ''), reduce_dtype='float32')


def _wrapper_extras(wrapper: Any) -> dict:
    """The top-level keys of ``wrapper.state_dict()`` besides the optimizer's own."""
    masters = getattr(wrapper, '_master_params', None)
    if masters is not None and masters().has_half:
        raise NotImplementedError(
            f'{type(wrapper).__name__} holds fp32 masters of half-precision FSDP shards (the model '
            'was cast before sharding); FSDP checkpoints support the layout where the fp32 shards '
            "are the masters: keep the model fp32 and set the strategy's model_wrapper="
            "dict(mixed_precision=dict(param_dtype=...)) (filled in for ApexOptimWrapper O2)")
    state = wrapper.state_dict()
    return {k: v for k, v in state.items() if k not in ('state', 'param_groups')}


def check_local_checkpoint(path: str) -> None:
    """Refuse an FSDP1 ``'local'`` checkpoint written by another number of ranks, or cut off.

    Raises:
        ValueError: ``path`` is not a directory of ``rank{i}.pth``, or their count differs from
            the world size (local shards cannot be re-sliced: use ``state_dict_cfg='full'``, or
            FSDP2, whose DCP checkpoints resume on any rank count).
    """
    import os
    import os.path as osp

    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else 1
    names = sorted(os.listdir(path)) if osp.isdir(path) else []
    ranks = [n for n in names if n.startswith('rank') and n.endswith('.pth')]
    if not ranks:
        raise ValueError(f"{path} is not an FSDP1 state_dict_cfg='local' checkpoint (a directory "
                         'of rank{i}.pth files)')
    if sorted(ranks) != sorted(f'rank{i}.pth' for i in range(len(ranks))) or len(ranks) != world:
        raise ValueError(
            f"{path} holds FSDP1 'local' shards of {len(ranks)} rank(s) ({', '.join(ranks)}) but "
            f'this run has {world}: local shards load on the rank count that wrote them only. '
            "Resume on that many ranks, or save with the strategy's state_dict_cfg='full' (any "
            'rank count), or use FSDP2 (DCP checkpoints re-slice)')


@STRATEGIES.register_module()
class MixedPrecisionFSDPStrategy(FSDPStrategy):
    """mmengine's ``FSDPStrategy`` (FSDP1) that also runs on CPU with gloo, for our wrappers.

    Takes every argument of ``FSDPStrategy`` (``model_wrapper``, ``state_dict_cfg``,
    ``skip_init_weights``, ``activation_checkpointing``, ...). Differences:

    * without CUDA, ``_setup_distributed`` starts a gloo group from the launcher's environment
      (as :func:`mp_wrappers.launch.prepare_distributed` does for ``Runner``) and FSDP gets
      ``device_id=torch.device('cpu')``; with CUDA nothing changes;
    * when ``model_wrapper`` has no ``mixed_precision`` and the optim wrapper is
      ``mp_wrappers.ApexOptimWrapper`` at O2, ``mixed_precision=dict(param_dtype=<dtype>,
      reduce_dtype='float32')`` is added (:func:`fsdp_mixed_precision`);
    * with mixed precision and no ``auto_wrap_policy``, a policy that wraps nothing is set, so
      that FSDP wraps BatchNorm layers on their own in fp32 (its ``_module_classes_to_ignore``):
      apex O2's ``keep_batchnorm_fp32``.

    Examples:
        >>> runner_type = 'FlexibleRunner'
        >>> strategy = dict(type='mp_wrappers.MixedPrecisionFSDPStrategy',
        ...                 model_wrapper=dict(use_orig_params=True), state_dict_cfg='local')
        >>> optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2',
        ...                      dtype='bfloat16', optimizer=dict(type='mp_wrappers.FusedAdam'))
    """

    _optim_wrapper_cfg: Any = None

    def __init__(self, *, state_dict_cfg: Any = 'local', **kwargs: Any) -> None:
        if state_dict_cfg == 'full' and not torch.cuda.is_available():
            # mmengine's 'full' offloads to CPU, which on CPU tensors crashed the process
            # (SIGSEGV, torch 2.13, gloo): the state is on the CPU already.
            from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig,
                                                StateDictType)
            state_dict_cfg = dict(
                state_dict_type=StateDictType.FULL_STATE_DICT,
                state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False,
                                                                 rank0_only=True))
        super().__init__(state_dict_cfg=state_dict_cfg, **kwargs)

    # ---- checkpoints: FSDP's optimizer state dict plus our wrapper's keys ------------------------
    def optim_state_dict(self) -> dict:
        """FSDP's optimizer state dict (full or local, per ``state_dict_cfg``) + the wrapper's state.

        ``FSDP.optim_state_dict`` keeps only ``state`` and ``param_groups``: the loss scalers and
        counters (``mp_wrappers``, ``apex_amp``) and ``base_param_settings`` are added back here.
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        from .checkpoint import refuse_optim_wrapper_dict
        wrapper = self.optim_wrapper
        # Refused before training when our wrappers are in it (runner_checkpoint.attach); an
        # OptimWrapperDict of other wrappers gets the same message here, at its first save.
        refuse_optim_wrapper_dict(wrapper, 'FSDP1', saving=True)
        extra = _wrapper_extras(wrapper)
        state = FSDP.optim_state_dict(self.model, wrapper.optimizer)
        state.update(extra)
        return state

    def load_optim_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`optim_state_dict` wrote (mmengine 0.10.7 passes the arguments of
        ``FSDP.optim_state_dict_to_load`` in torch 1.x's order; keywords here)."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        optim_part = {k: state_dict[k] for k in ('state', 'param_groups') if k in state_dict}
        extra = {k: v for k, v in state_dict.items() if k not in optim_part}
        loaded = FSDP.optim_state_dict_to_load(model=self.model,
                                               optim=self.optim_wrapper.optimizer,
                                               optim_state_dict=optim_part)
        loaded.update(extra)
        self.optim_wrapper.load_state_dict(loaded)

    def load_checkpoint(self, filename: str, **kwargs: Any) -> dict:
        """mmengine's load, plus torch's ``ShardedTensor`` classes allowed for a ``'local'`` one.

        A ``'local'`` checkpoint is a directory of ``rank{i}.pth``, one per rank of the run that
        wrote it, holding ``ShardedTensor`` objects: it loads on that many ranks only (refused otherwise,
        before anything is read), with exactly :func:`mp_wrappers.checkpoint.
        sharded_tensor_safe_globals` added to the ``weights_only`` allow-list for the load.
        """
        if self._is_full_state_dict():
            return super().load_checkpoint(filename, **kwargs)
        check_local_checkpoint(filename)
        from ..checkpoint import sharded_tensor_safe_globals
        with torch.serialization.safe_globals(sharded_tensor_safe_globals()):
            return super().load_checkpoint(filename, **kwargs)

    def prepare(self, model: Any, *, optim_wrapper: Any = None, **kwargs: Any) -> Any:
        # The model is wrapped before the optim wrapper is built: keep its config for
        # _wrap_model's mixed precision.
        self._optim_wrapper_cfg = optim_wrapper
        return super().prepare(model, optim_wrapper=optim_wrapper, **kwargs)

    def _setup_distributed(self, launcher: str = 'pytorch', backend: str = 'nccl',
                           **kwargs: Any) -> None:
        if torch.cuda.is_available():
            super()._setup_distributed(launcher, backend, **kwargs)
            return
        if not is_distributed():
            init_gloo(launcher, dict(kwargs, backend=backend))

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        if not is_model_wrapper(model):
            cfg = dict(self.model_wrapper or dict(type='MMFullyShardedDataParallel'))
            if not torch.cuda.is_available():
                compat.require('fsdp_cpu')
                # mmengine's default is device_id=int(LOCAL_RANK), a CUDA device.
                cfg.setdefault('device_id', torch.device('cpu'))
            if cfg.get('mixed_precision', None) is None:
                mixed = fsdp_mixed_precision(self._optim_wrapper_cfg)
                if mixed is not None:
                    cfg['mixed_precision'] = mixed
            if cfg.get('mixed_precision', None) is not None and cfg.get('auto_wrap_policy') is None:
                # FSDP keeps BatchNorm in fp32 (MixedPrecision._module_classes_to_ignore, apex's
                # keep_batchnorm_fp32) only through an auto-wrap policy; this one wraps nothing else.
                from torch.distributed.fsdp.wrap import ModuleWrapPolicy
                cfg['auto_wrap_policy'] = ModuleWrapPolicy(set())
            self.model_wrapper = cfg
        wrapped = super()._wrap_model(model)
        # EMAHook's averaged model: a copy of the local pieces (Note [EMA of a sharded model])
        install_flat_shard_deepcopy(wrapped.module, self)
        return wrapped


def release_unsharded_root(model: Any) -> None:
    """Free the root's gathered weights that FSDP1 keeps after a forward without backward.

    Note [FSDP1 root after evaluation]
        FSDP1 does not reshard its root module after forward (its weights are needed again in
        backward). After an evaluation forward there is no backward, and the root keeps its
        gathered (unsharded) weights; the next forward reuses them without gathering again. So
        anything written into the shards in between is not seen by that forward. mmengine's
        ``EMAHook`` does exactly that: it swaps the average into the shards before validation
        and the trained weights back after it, and the first training step after each
        validation would then run forward and backward on the *average* (found through the
        bitwise-resume test). The wrappers' lifecycle hook calls this around validation and test
        epochs, so the next forward gathers what the shards hold. FSDP2 modules are resharded
        with their public ``reshard()`` for the same reason (``reshard_after_forward=False``).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    handle = getattr(model, '_handle', None) if isinstance(model, FullyShardedDataParallel) else None
    if handle is not None and handle.uses_sharded_strategy and not handle.needs_unshard():
        # what FSDP1's own reshard does, without its CUDA event bookkeeping
        handle.reshard(True)
        handle.post_reshard()
        handle._prefetched = False
    if compat.has('fsdp2') and isinstance(model, nn.Module):
        from torch.distributed.fsdp import FSDPModule
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
