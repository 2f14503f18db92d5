"""Scaling out on torch.distributed: DDP, FSDP1 (mmengine's FlexibleRunner) and FSDP2.

The strategies, model wrappers and checkpoints that drive torch.distributed live here. What a
sharded model means to our wrappers and fused optimizers (FSDP's fp32 shards are the masters, local
shards of DTensors, global norms, ``no_sync`` while accumulating) sits below them, in
:mod:`mp_wrappers.sharding`; ``Sharding`` and ``sharding_of`` are re-exported here.

* :mod:`.ddp`: :class:`MixedPrecisionDistributedDataParallel`, DDP over a model cast first.
* :mod:`.fsdp`: :class:`MixedPrecisionFSDPStrategy`, mmengine's ``FSDPStrategy`` that also runs on
  CPU with gloo and takes FSDP's mixed precision from our optimizer wrapper's config.
* :mod:`.fully_shard`: :class:`FullyShardedModel`, an mmengine model wrapper applying FSDP2's
  ``fully_shard``, and :mod:`.checkpoint`: sharded checkpoints through
  ``torch.distributed.checkpoint`` with our wrapper state.
* :mod:`.runner_checkpoint`: mmengine Runner checkpoints of an FSDP2 model, saved and loaded by
  every rank, in the DCP directory format of :mod:`.dcp_format`.
* :mod:`.sharded_ema`: the copy mmengine's ``EMAHook`` averages into under FSDP2, sharded like the
  model.

See docs/distributed.md.
"""
from .ddp import MixedPrecisionDistributedDataParallel
from .fsdp import MixedPrecisionFSDPStrategy
from .fully_shard import FullyShardedModel, FullyShardedRunner
from ..sharding import Sharding, sharding_of

__all__ = ['MixedPrecisionDistributedDataParallel', 'MixedPrecisionFSDPStrategy',
           'FullyShardedModel', 'FullyShardedRunner', 'Sharding', 'sharding_of']
