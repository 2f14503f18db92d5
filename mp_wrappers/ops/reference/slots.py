"""Reference of the extension's ``slots_dense``: whether a fused step's lists can go to an op as
they are (Note [collect in one pass] in :mod:`mp_wrappers.optim.buckets`).

Same answers as ``csrc/slot_check.cpp`` for any tensors; the tests compare the two. It is what a
build without the extension uses, at about the cost of the per-param checks it replaces.
"""
from typing import Any, List, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ['slots_dense']


def _dense(t: Any) -> bool:
    return isinstance(t, Tensor) and t.layout == torch.strided and t.is_contiguous()


def _column(tensors: Sequence[Any], targets: Sequence[Tensor]) -> bool:
    """Dense floating-point tensors of one dtype, on the targets' device, each of its row's
    target's shape."""
    device = targets[0].device
    if not all(_dense(t) and t.shape == r.shape and t.device == device
               for t, r in zip(tensors, targets)):
        return False
    dtype = tensors[0].dtype
    return dtype.is_floating_point and all(t.dtype == dtype for t in tensors)


def slots_dense(targets: List[Any], grads: List[Any], models: List[Any], states: List[List[Any]],
                allowed: Tuple[Tuple[torch.dtype, ...], ...]) -> bool:
    """True when ``targets`` are dense tensors of one device and dtype; ``grads`` (and ``models``
    unless empty) dense floating-point tensors of one dtype on that device, each of its target's
    shape; and each ``states[k]`` dense tensors of their targets' shapes with dtypes in
    ``allowed[k]``. "Dense": strided and contiguous. ValueError for arguments of other types."""
    for what, value in (('targets', targets), ('grads', grads), ('models', models),
                        ('states', states)):
        if not isinstance(value, list):
            raise ValueError(f'slots_dense: {what} must be a list')
    if not isinstance(allowed, tuple) or len(allowed) != len(states):
        raise ValueError('slots_dense: allowed must be a tuple with one entry per state list')
    for dtypes in allowed:
        if not isinstance(dtypes, tuple) or not all(isinstance(d, torch.dtype) for d in dtypes):
            raise ValueError('slots_dense: allowed[k] must be a tuple of torch.dtype')
    for column in states:
        if not isinstance(column, list):
            raise ValueError('slots_dense: states[k] must be a list')
    n = len(targets)
    if len(grads) != n or (models and len(models) != n):
        return False
    if not n:
        return True
    first = targets[0]
    if not all(_dense(t) and t.device == first.device and t.dtype == first.dtype for t in targets):
        return False
    if not _column(grads, targets) or (models and not _column(models, targets)):
        return False
    return all(len(column) == n
               and all(_dense(t) and t.shape == r.shape and t.dtype in dtypes
                       for t, r in zip(column, targets))
               for column, dtypes in zip(states, allowed))
