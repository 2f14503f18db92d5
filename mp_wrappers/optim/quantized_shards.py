"""8-bit Adam moments of FSDP2 params (DTensors): which params qualify, and their state as DTensors.

:class:`~mp_wrappers.optim.quantized_state.QuantizedStateMixin` asks this module about DTensor
params only; plain params never reach it.

Note [8-bit blocks on FSDP2 shards]
    FSDP2 (``fully_shard``) splits each param on dim 0 (``Shard(0)``, the last placement; HSDP's
    first is ``Replicate()``), chunk by chunk as ``torch.chunk`` does: uneven, a rank may hold no
    rows. A rank's shard is rows ``[a, b)``, i.e. elements ``[a * row, b * row)`` of the param's
    row-major order, where ``row = numel / size(0)``. When ``row`` is a multiple of the block size
    (256) every shard starts and ends on a block boundary of the whole param, so the 8-bit kernel
    runs on each local shard unchanged and its blocks are exactly those of an unsharded run of the
    same (contiguous) param: bitwise the same codes and absmax.

    The state then is DTensors with the param's mesh and placements: the codes (uint8) shaped like
    the param, and each absmax shaped ``(size(0), row / 256)``, one row of absmax per param row,
    so torch splits it on dim 0 exactly as it splits the param. ``get_state_dict`` and DCP
    re-slice both for any rank count, and a resume on another rank count is bitwise.

    Other DTensor params (1-D ones, a row size that is not a multiple of 256, another placement)
    keep float32 moments. The choice reads the *global* shape only, so every rank of every rank
    count makes it alike; it is logged once per optimizer.
"""
import logging
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..ops.reference.quant import BLOCK_SIZE

__all__ = ['blocks_follow_shards', 'log_ineligible', 'local', 'like_param', 'absmax_like',
           'local_rows_of_full_absmax']

_LOG = logging.getLogger(__name__)


def blocks_follow_shards(param: Tensor) -> bool:
    """Whether the 256-element blocks of DTensor ``param`` never straddle its shards (Note [8-bit
    blocks on FSDP2 shards]): at least 2-D, rows a multiple of 256 elements, and every placement
    ``Shard(0)`` or ``Replicate()``."""
    from torch.distributed.tensor import Replicate, Shard
    if param.dim() < 2 or param.shape[0] == 0:
        return False
    if (param.numel() // param.shape[0]) % BLOCK_SIZE:
        return False
    # type(), not isinstance: a strided shard (FSDP2 over tensor parallelism) subclasses Shard
    return all(isinstance(p, Replicate) or (type(p) is Shard and p.dim == 0)
               for p in param.placements)


def log_ineligible(owner: object, param: Tensor) -> None:
    """Say once per optimizer that a DTensor param keeps float32 moments, and why."""
    if getattr(owner, '_logged_fp32_shards', False):
        return
    owner._logged_fp32_shards = True  # type: ignore[attr-defined]
    _LOG.warning("%s: state_dtype='int8' under FSDP2 keeps float32 moments for params whose "
              '256-element blocks would straddle shards (1-D, a row size not a multiple of 256, '
              'or not sharded on dim 0), e.g. one of shape %s with placements %s '
              '(docs/quantized_states.md)', type(owner).__name__, tuple(param.shape),
              tuple(param.placements))


def local(t: Optional[Tensor]) -> Optional[Tensor]:
    """The local tensor of a DTensor (the same storage), other tensors as they are."""
    if t is None or type(t) is Tensor:  # noqa: E721 - plain tensors skip the DTensor import
        return t
    from ..sharding import is_dtensor
    if not is_dtensor(t):
        return t
    if not torch.is_grad_enabled():  # a step: already under no_grad
        return t.to_local()
    with torch.no_grad():
        return t.to_local()


def like_param(param: Tensor, values: Tensor) -> Tensor:
    """A DTensor laid out as ``param`` whose local tensor is ``values`` (as many elements as
    ``param``'s local shard)."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(values.reshape(local(param).shape), param.device_mesh,
                              param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def absmax_like(param: Tensor, values: Tensor) -> Tensor:
    """The DTensor of one moment's absmax of DTensor ``param``: global ``(size(0), row / 256)``,
    split on dim 0 as the param is; ``values`` is this rank's (one per block of its shard)."""
    from torch.distributed.tensor import DTensor
    shape = _absmax_shape(param)
    rows = local(param).shape[0]
    return DTensor.from_local(values.reshape(rows, shape[1]), param.device_mesh,
                              param.placements, run_check=False, shape=torch.Size(shape),
                              stride=(shape[1], 1))


def local_rows_of_full_absmax(param: Tensor, full: Tensor) -> Optional[Tensor]:
    """This rank's rows of a whole (unsharded) absmax of DTensor ``param``, or None when ``full``
    is not one (a size other than ``size(0) * row / 256``).

    A consolidated checkpoint loaded into an optimizer whose state for ``param`` is float32 has
    no absmax template to shard into (torch's ``set_optimizer_state_dict`` distributes only the
    keys the live state has), so the absmax arrives whole; the rows of this rank's shard are the
    ones its dequantization needs. No collective: the offset is computed as DTensor splits."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape = _absmax_shape(param)
    if full.numel() != shape[0] * shape[1]:
        return None
    (rows, _), (first, _) = compute_local_shape_and_global_offset(
        torch.Size(shape), param.device_mesh, param.placements)
    return full.reshape(shape)[first:first + rows]


def _absmax_shape(param: Tensor) -> Tuple[int, int]:
    rows = param.shape[0]
    return rows, param.numel() // rows // BLOCK_SIZE
