"""Whether a fused optimizer step's per-param tensors can go to an op as they are: one check per op
call, in C++ (Note [collect in one pass] in :mod:`mp_wrappers.optim.buckets`)."""
from typing import Any, List, Tuple

import torch

from . import reference
from ._extension import extension

__all__ = ['slots_dense']


def slots_dense(targets: List[Any], grads: List[Any], models: List[Any], states: List[List[Any]],
                allowed: Tuple[Tuple[torch.dtype, ...], ...]) -> bool:
    """True when the lists of one op call need no per-param handling: the targets dense (strided,
    contiguous) and of one device and dtype; the grads, and the model copies unless ``models`` is
    empty, dense floating-point tensors of one dtype on that device, each of its target's shape;
    every ``states[k]`` dense, of its target's shape and a dtype in ``allowed[k]`` (a ``None``
    state fails). The extension's ``slots_dense`` when it is loaded, else the reference: the same
    answers (tests/ops/test_slots.py)."""
    ext = extension()
    if ext is None:
        return reference.slots.slots_dense(targets, grads, models, states, allowed)
    return ext.slots_dense(targets, grads, models, states, allowed)
