"""Fake (meta) kernels of the ``torch.ops.mp_wrappers`` ops, for ``torch.compile`` and meta tensors.

A fake kernel computes only output metadata. The two l2norm ops return new tensors and need one.
The mutating ops that return nothing pass ``torch.library.opcheck`` without one on torch 2.13 (it
treats them as returning nothing to fake), but they get one anyway so that traces and meta-tensor
calls (the Meta key also serves calls that mix meta and real tensors) validate their tensor lists
the way the public API does and fail with the same message as in eager mode.

Imported by :mod:`mp_wrappers.ops._extension` right after ``mp_wrappers._C`` has registered the op
schemas; it must not be imported when the extension is missing. An op an older build does not
declare gets no fake kernel (its reference serves it).
"""
from typing import List, Tuple

import torch
from torch import Tensor

from ._checks import check_tensor_lists
from ._registration import register_fake_if_declared

__all__: List[str] = []


def _l2norm_outputs(tensors: List[Tensor], per_tensor: bool) -> Tuple[Tensor, Tensor]:
    device = tensors[0].device if tensors else torch.device('cpu')
    total = torch.empty((), dtype=torch.float32, device=device)
    norms = torch.empty((len(tensors) if per_tensor else 0,), dtype=torch.float32, device=device)
    return total, norms


@register_fake_if_declared('multi_tensor_l2norm')
def _multi_tensor_l2norm_fake(tensors: List[Tensor], per_tensor: bool) -> Tuple[Tensor, Tensor]:
    check_tensor_lists('multi_tensor_l2norm', ('tensors',), (tensors,))
    return _l2norm_outputs(tensors, per_tensor)


@register_fake_if_declared('multi_tensor_unscale_l2norm')
def _multi_tensor_unscale_l2norm_fake(tensors: List[Tensor], inv_scale: Tensor, found_inf: Tensor,
                                      per_tensor: bool) -> Tuple[Tensor, Tensor]:
    check_tensor_lists('multi_tensor_unscale_l2norm', ('tensors',), (tensors,))
    return _l2norm_outputs(tensors, per_tensor)


@register_fake_if_declared('multi_tensor_scale_')
def _multi_tensor_scale_fake(inputs: List[Tensor], outputs: List[Tensor], scale: Tensor,
                             found_inf: Tensor) -> None:
    check_tensor_lists('multi_tensor_scale_', ('inputs', 'outputs'), (inputs, outputs))


@register_fake_if_declared('multi_tensor_axpby_')
def _multi_tensor_axpby_fake(x: List[Tensor], y: List[Tensor], out: List[Tensor], a: float,
                             b: float, arg_to_check: int, found_inf: Tensor) -> None:
    check_tensor_lists('multi_tensor_axpby_', ('x', 'y', 'out'), (x, y, out))


@register_fake_if_declared('update_scale_hysteresis_')
def _update_scale_hysteresis_fake(scale: Tensor, growth_tracker: Tensor,
                                  hysteresis_tracker: Tensor, found_inf: Tensor,
                                  growth_factor: float, backoff_factor: float,
                                  growth_interval: int, hysteresis: int, min_scale: float,
                                  max_scale: float) -> None:
    return None
