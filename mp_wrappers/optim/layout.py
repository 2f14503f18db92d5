"""Memory layouts for the fused optimizers: which tensors one flat view covers, and state tensors
laid out like their param.

The multi-tensor ops walk flat lists of elements. A param and its grad, model copy and state pair
up element by element when their memory orders agree, which holds for contiguous tensors and for
dense ones with the same strides (channels_last params and their grads); anything else is copied
into the param's order first (:func:`mp_wrappers.optim.buckets.add_strided`).
"""
import torch
from torch import Tensor

__all__ = ['is_dense', 'same_order', 'flat', 'like']


def is_dense(t: Tensor) -> bool:
    """Whether ``t`` covers a gap-free, non-overlapping block of memory (any dim order)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_order(t: Tensor, ref: Tensor) -> bool:
    """Whether the memory-order flat views of ``t`` and ``ref`` pair up the same elements."""
    if t.is_contiguous() and ref.is_contiguous():
        return True
    return t.shape == ref.shape and t.stride() == ref.stride() and is_dense(t)


def flat(t: Tensor) -> Tensor:
    """The 1-D view of a dense tensor in memory order (channels_last tensors included)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def like(ref: Tensor, dtype: torch.dtype) -> Tensor:
    """An empty tensor with ``ref``'s shape and memory order (contiguous when ``ref`` is not dense)."""
    if is_dense(ref):
        return torch.empty_like(ref, dtype=dtype, memory_format=torch.preserve_format)
    return torch.empty(ref.shape, dtype=dtype, device=ref.device)
