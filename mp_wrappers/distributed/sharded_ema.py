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
    the sharded model.

    FSDP1 (:class:`~mp_wrappers.distributed.fsdp.MixedPrecisionFSDPStrategy`) is the same idea
    with one difference. Its parameters (``use_orig_params=True``: views of each rank's piece of
    a flat shard, 1-D or empty; otherwise the flat shards) are plain tensors, so update and swap
    work elementwise as above, but their state dict (``'full'``: gathered, ``'local'``: flat
    shards) is the *model's*: only FSDP knows how its pieces make up a parameter. So
    :class:`FlatShardShadow` saves and loads through the model, collectively (mmengine calls the
    checkpoint hooks on every rank): it puts the average into the model's parameters, asks the
    strategy for the model's state dict (or loads one into it) in the strategy's format, and puts
    the model's own values back. A ``'full'`` checkpoint then holds the gathered average, a
    ``'local'`` one each rank's flat pieces of it, as the model's own state.
"""
import copy
import itertools
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from ..sharding import is_dtensor

__all__ = ['ShardedShadow', 'FlatShardShadow', 'has_sharded_deepcopy', 'install_sharded_deepcopy',
           'install_flat_shard_deepcopy']


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
            if p is not None and is_dtensor(p) and torch.is_tensor(value) and \
                    not is_dtensor(value) and value.shape == p.shape:
                state_dict[key] = distribute_tensor(value.to(p.dtype), p.device_mesh, p.placements)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _exchange(live: List[torch.Tensor], values: List[torch.Tensor]) -> List[torch.Tensor]:
    """Copy ``values`` into ``live`` in place; return clones of what ``live`` held."""
    kept = [t.detach().clone() for t in live]
    with torch.no_grad():
        for t, v in zip(live, values, strict=True):
            t.copy_(v)
    return kept


class FlatShardShadow(ShardedShadow):
    """:class:`ShardedShadow` of an FSDP1 model: state dicts through the model's own (collective).

    The root holds ``_via = (source module, strategy)``; the other nodes leave loading to it
    (Note [EMA of a sharded model]).
    """

    _via: Optional[tuple] = None

    def __deepcopy__(self, memo: Dict[int, Any]) -> 'FlatShardShadow':
        out = type(self).of(self, memo)
        object.__setattr__(out, '_via', self._via)
        return out

    def _through_model(self, action: Callable[[], Any], read_back: bool = False) -> Any:
        """Run ``action`` with this average in the model's tensors (``read_back``: then take what
        the action left there as the new average), then put the model's own values back."""
        source, _ = self._via
        live = list(itertools.chain(source.parameters(), source.buffers()))
        own = list(itertools.chain(self.parameters(), self.buffers()))
        kept = _exchange(live, own)
        try:
            result = action()
            if read_back:
                _exchange(own, live)
        finally:
            _exchange(live, kept)
        return result

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = '',
                   keep_vars: bool = False) -> Dict[str, Any]:
        if self._via is None:
            return super().state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)
        _, strategy = self._via
        # copies: a 'local' state dict's ShardedTensors alias the model's flat shards, which get
        # the model's own values back
        own = self._through_model(lambda: copy.deepcopy(strategy.model_state_dict()))
        destination = OrderedDict() if destination is None else destination
        for key, value in own.items():
            destination[prefix + key] = value
        return destination

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any,
                              **kwargs: Any) -> None:
        if self._via is None:  # a node under the root: the root loaded the whole tree
            return
        _, strategy = self._via
        missing, unexpected = args[2], args[3]  # torch's (local_metadata, strict, missing, ...)
        ours = {k[len(prefix):]: state_dict.pop(k) for k in list(state_dict)
                if k.startswith(prefix)}
        # the strategy set the model's state dict type ('full' or 'local') when it wrapped it
        result = self._through_model(lambda: strategy.model.load_state_dict(ours, strict=False),
                                     read_back=True)
        missing += [prefix + k for k in result.missing_keys]
        unexpected += [prefix + k for k in result.unexpected_keys]


def has_sharded_deepcopy(module: Any) -> bool:
    """Whether ``copy.deepcopy(module)`` gives one of this module's shadows."""
    return isinstance(module, nn.Module) and '__deepcopy__' in vars(module)


def install_sharded_deepcopy(root: nn.Module) -> None:
    """Make ``copy.deepcopy(root)`` give a :class:`ShardedShadow` of the FSDP2 root ``root``.

    ``copy.deepcopy`` looks ``__deepcopy__`` up on the object, where an instance attribute comes
    before the FSDP class's refusal: only this module changes, torch's classes do not.
    """
    def sharded_deepcopy(memo: Dict[int, Any]) -> ShardedShadow:
        return ShardedShadow.of(root, memo)
    object.__setattr__(root, '__deepcopy__', sharded_deepcopy)


def install_flat_shard_deepcopy(module: nn.Module, strategy: Any) -> None:
    """Make ``copy.deepcopy(module)`` give a :class:`FlatShardShadow` (``module``: what an FSDP1
    strategy's wrapper holds; ``strategy``: the one whose state dict format checkpoints use)."""
    def flat_shard_deepcopy(memo: Dict[int, Any]) -> FlatShardShadow:
        shadow = FlatShardShadow.of(module, memo)
        object.__setattr__(shadow, '_via', (module, strategy))
        return shadow
    object.__setattr__(module, '__deepcopy__', flat_shard_deepcopy)
