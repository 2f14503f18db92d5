"""The averaged model of mmengine's ``EMAHook`` over an FSDP2-sharded model, sharded like it.

Note [EMA of a sharded model]
    mmengine's ``EMAHook`` (and every toolbox's subclass) builds its averaged model
    (``BaseAveragedModel``: ``ExponentialMovingAverage``, mmdet's ``ExpMomentumEMA``, ...) around
    ``copy.deepcopy(model)``, and FSDP2 refuses to deepcopy a ``fully_shard`` module ("FSDP does
    not support deepcopy"). :class:`~mp_wrappers.distributed.fully_shard.FullyShardedModel` gives
    the root it shards a deepcopy of its own (an attribute of that one module instance:
    :func:`install_sharded_deepcopy`), which returns a :class:`ShardedShadow`: a plain module tree
    with the model's structure whose parameters are clones of the model's *sharded* parameters
    (DTensors on the same mesh with the same placements) and whose buffers are clones of its
    buffers, in the model's order. Every step of the hook then works shard by shard:

    * the update (``lerp_`` of two DTensors with equal placements) is elementwise on the local
      shards, with no communication, bit for bit what one process computes for those elements;
    * the swap before and after validation copies local shards (``p.data.copy_``); the next
      forward all-gathers the averaged weights;
    * ``state_dict()`` gives DTensors, which ``FullyShardedRunner``'s checkpoints write through DCP
      with every rank's shards (and re-slice on resume, onto any number of ranks); mmengine's swap
      of ``ema_state_dict`` with ``state_dict`` (the checkpoint's weights are the averaged ones)
      only exchanges dictionary entries with the same keys, layout and sharding;
    * ``load_state_dict`` takes those DTensors, or full tensors (an ordinary checkpoint or one
      consolidated by tools/consolidate_checkpoint.py): every rank reads the whole file and
      keeps its shards (``distribute_tensor``, collective, in the same order on every rank).

    Memory: one more copy of each rank's shards (4/N bytes per parameter for fp32 shards). The
    shadow has no ``forward``: the hook never runs the averaged model, it swaps its weights into
    the sharded model. FSDP1 is not covered: its parameters are per-rank flat views whose full
    state dict needs the model's own gather, and an EMAHook under FSDP1 is refused before the
    first step (:func:`mp_wrappers.distributed.runner_checkpoint.refuse_sharded_ema`).
"""
from typing import Any, Dict, Optional

import torch
from torch import nn

__all__ = ['ShardedShadow', 'install_sharded_deepcopy']


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == 'DTensor' and hasattr(t, 'placements')


class ShardedShadow(nn.Module):
    """A module tree with another module's structure, parameters and buffers, but no forward.

    Built by :meth:`of` from a sharded model (its DTensor parameters stay DTensors with the same
    placements); what ``copy.deepcopy`` of the model gives once :func:`install_sharded_deepcopy`
    ran (Note [EMA of a sharded model]).
    """

    @classmethod
    def of(cls, module: nn.Module, memo: Optional[Dict[int, Any]] = None) -> 'ShardedShadow':
        """A shadow of ``module``: shared submodules and tied parameters stay shared."""
        memo = {} if memo is None else memo
        if id(module) in memo:
            return memo[id(module)]
        out = cls()
        memo[id(module)] = out
        for name, p in module._parameters.items():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            out._parameters[name] = None if p is None else memo[id(p)]
        for name, b in module._buffers.items():
            out._buffers[name] = None if b is None else b.detach().clone()
        out._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
        for name, child in module._modules.items():
            out._modules[name] = None if child is None else cls.of(child, memo)
        return out

    def __deepcopy__(self, memo: Dict[int, Any]) -> 'ShardedShadow':
        # A DTensor's deepcopy depends on the torch version; a clone keeps mesh and placements.
        return type(self).of(self, memo)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "the averaged copy of an FSDP2-sharded model holds each rank's shards and cannot run: "
            "EMAHook swaps its weights into the sharded model for validation (Note [EMA of a "
            'sharded model] in mp_wrappers/distributed/sharded_ema.py)')

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any,
                              **kwargs: Any) -> None:
        # Full tensors (an ordinary or consolidated checkpoint) become this rank's shards.
        from torch.distributed.tensor import distribute_tensor
        for name, p in self._parameters.items():
            key = prefix + name
            value = state_dict.get(key)
            if p is not None and _is_dtensor(p) and torch.is_tensor(value) and \
                    not _is_dtensor(value) and value.shape == p.shape:
                state_dict[key] = distribute_tensor(value.to(p.dtype), p.device_mesh, p.placements)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def install_sharded_deepcopy(root: nn.Module) -> None:
    """Make ``copy.deepcopy(root)`` give a :class:`ShardedShadow` of the FSDP2 root ``root``.

    ``copy.deepcopy`` looks ``__deepcopy__`` up on the object, where an instance attribute comes
    before the FSDP class's refusal: only this module changes, torch's classes do not.
    """
    def sharded_deepcopy(memo: Dict[int, Any]) -> ShardedShadow:
        return ShardedShadow.of(root, memo)
    object.__setattr__(root, '__deepcopy__', sharded_deepcopy)
