"""Kept importable: the DDP wrapper lives in :mod:`mp_wrappers.distributed.ddp` now."""
from .distributed.ddp import MixedPrecisionDistributedDataParallel

__all__ = ['MixedPrecisionDistributedDataParallel']
