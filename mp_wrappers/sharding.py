"""What our wrappers and fused optimizers need to know about sharded parameters (FSDP1, FSDP2).

Below the fused optimizers, the masters and the wrappers, which all use it; it imports nothing of
mp_wrappers. What drives torch.distributed (strategies, runners, checkpoints) is in
:mod:`mp_wrappers.distributed`, above them.

Note [sharded masters]
    Under FSDP every rank holds one shard of every parameter, and torch's engine does the rest
    (all-gather for the forward, reduce-scatter of the gradients). With FSDP's own mixed precision
    (FSDP1 ``MixedPrecision(param_dtype=...)``, FSDP2 ``MixedPrecisionPolicy(param_dtype=...)``)
    the sharded parameters stay fp32 and FSDP makes the half copies the forward runs with: the fp32
    shards *are* the master weights, so our wrappers create no masters of their own and the
    optimizer steps the local fp32 shards. A model cast to half before sharding (e.g. ``model.dtype``
    in the config with ``FP16OptimWrapper``) has half shards instead, and the wrappers give each
    local shard an fp32 master. Either way there is exactly one fp32 copy of each element in the
    whole job.

    Three things stop being local and are made global here: the overflow flag (all-reduced MAX by
    the wrapper's ``sync_found_inf``), the gradient norm for ``clip_grad`` (:func:`global_norm`:
    squared norms of the local shards summed over ranks, replicated tensors counted once) and
    gradient synchronisation while accumulating (:func:`no_sync_for_backward`).

Note [HSDP]
    Hybrid sharding (FSDP2 ``fully_shard(mesh=...)`` on a 2-D ``(replicate, shard)`` mesh, FSDP1
    ``ShardingStrategy.HYBRID_SHARD``): each replica group (e.g. one node) holds one sharded copy of
    the model; FSDP reduce-scatters gradients within the shard group and all-reduces them across
    replicas, so every replica holds the same gradient shards. Elementwise updates of local shards
    are unchanged; the gradient norm sums squared shard norms over the *shard group* only
    (:attr:`Sharding.group`), and the overflow flag is all-reduced (MAX) over all ranks, as without
    HSDP. DTensors then carry placements ``(Replicate(), Shard(dim))``.

Note [DTensor to local]
    FSDP2 parameters, gradients and optimizer state are ``DTensor``. Our multi-tensor ops are
    elementwise over lists (plus norms), and have no DTensor sharding rule, so they are handed the
    local shards (:func:`local_tensor`): for an elementwise update that is exact for any ``Shard``
    or ``Replicate`` placement, and the optimizer state stays a DTensor that torch's distributed
    checkpoint can save and reshard. ``Partial`` placements (pending reductions) are refused, as are
    meshes of more than two dimensions and 2-D meshes other than HSDP's (Note [HSDP]).
"""
import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ['Sharding', 'sharding_of', 'dtensor_type', 'is_dtensor', 'local_tensor', 'local_tensors',
           'is_sharded', 'is_fsdp1_flattened', 'global_norm', 'clip_grad_norm_sharded',
           'no_sync_for_backward', 'check_elementwise_optimizer']


def dtensor_type() -> Optional[type]:
    """``torch.distributed.tensor.DTensor``, or None where torch has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def _check_placements(t: Tensor, what: str) -> None:
    from torch.distributed.tensor import Replicate, Shard
    mesh = t.device_mesh
    placements = tuple(t.placements)
    hsdp = (mesh.ndim == 2 and isinstance(placements[0], Replicate)
            and isinstance(placements[1], (Shard, Replicate)))
    if mesh.ndim > 2 or (mesh.ndim == 2 and not hsdp):
        raise NotImplementedError(
            f'{what} is a DTensor on a {mesh.ndim}-D device mesh with placements {placements}; '
            'mp_wrappers supports 1-D meshes (FSDP2 fully_shard over one process group) and HSDP '
            '(a 2-D mesh (replicate, shard) with placements (Replicate(), Shard(dim)))')
    for placement in placements:
        if not isinstance(placement, (Shard, Replicate)):
            raise NotImplementedError(
                f'{what} is a DTensor with placement {placement}; mp_wrappers steps local shards '
                'and supports Shard(dim) and Replicate() placements only (a Partial placement '
                'is a pending reduction: reduce it, e.g. with redistribute(), first)')


def local_tensor(t: Optional[Tensor], what: str = 'a tensor') -> Optional[Tensor]:
    """The local shard of a DTensor (a view sharing its storage); other tensors unchanged.

    Raises:
        NotImplementedError: the DTensor's placement or mesh is not supported (see
            Note [DTensor to local]).
    """
    if t is None or not is_dtensor(t):
        return t
    _check_placements(t, what)
    with torch.no_grad():  # the local tensor itself (its storage), not an autograd view of it
        return t.to_local()


def local_tensors(ts: Sequence[Optional[Tensor]], what: str = 'a tensor') -> List[Optional[Tensor]]:
    """:func:`local_tensor` of every element."""
    return [local_tensor(t, what) for t in ts]


def is_fsdp1_flattened(t: Tensor) -> bool:
    """Whether FSDP1 (``FullyShardedDataParallel``) manages ``t``: a flat parameter, or an original
    parameter it flattened into one (the attribute torch's FSDP1 sets on both since 1.12)."""
    return bool(getattr(t, '_fsdp_flattened', False))


def is_sharded(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor with a ``Shard`` placement (each element on one rank only)."""
    if not is_dtensor(t):
        return False
    from torch.distributed.tensor import Shard
    return any(isinstance(p, Shard) for p in t.placements)


@dataclass
class Sharding:
    """How a model is sharded, as seen by an optimizer wrapper in ``optim_context``.

    Attributes:
        kind: ``'fsdp1'`` (``FullyShardedDataParallel``: every optimizer param is a local shard,
            a plain tensor) or ``'fsdp2'`` (``fully_shard``: params are DTensors).
        model: The FSDP1 wrapper or the FSDP2 root module (what ``no_sync`` applies to).
        param_dtype: The dtype FSDP's mixed precision runs the forward in, or None (FSDP keeps
            the params' own dtype).
        group: The process group one copy of the model is sharded over (None: all ranks). Under
            HSDP (FSDP2 on a 2-D mesh, FSDP1 ``HYBRID_SHARD``) each replica's shards live in one
            group, and norms of shards are summed over that group only (Note [HSDP]).
    """

    kind: str
    model: nn.Module
    param_dtype: Optional[torch.dtype]
    group: Optional[object] = None

    def slot_is_sharded(self, t: Tensor) -> bool:
        """Whether the elements of optimizer slot (or grad) ``t`` are split among the ranks."""
        return True if self.kind == 'fsdp1' else is_sharded(t)


def _fsdp2_param_dtype(root: nn.Module) -> Optional[torch.dtype]:
    """The half dtype of the ``MixedPrecisionPolicy`` of the FSDP2 groups under ``root``.

    Groups may differ (e.g. norm layers sharded separately without a policy keep fp32, apex's
    keep_batchnorm_fp32): the half dtype any group uses is the model's compute dtype.
    """
    from torch.distributed.fsdp import FSDPModule
    found = set()
    for m in root.modules():
        if not isinstance(m, FSDPModule):
            continue
        # fully_shard keeps its policy on the module's param group (private in torch 2.13; read
        # defensively so a rename degrades to "unknown", which the wrapper then refuses).
        group = getattr(m._get_fsdp_state(), '_fsdp_param_group', None)
        dtype = getattr(getattr(group, 'mp_policy', None), 'param_dtype', None)
        if dtype is not None:
            found.add(dtype)
    half = [d for d in found if d in (torch.float16, torch.bfloat16)]
    return half[0] if len(half) == 1 else None


def sharding_of(model: nn.Module) -> Optional[Sharding]:
    """The :class:`Sharding` of ``model`` (FSDP1 wrapper or FSDP2 root), or None if not sharded."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        FSDPModule = ()  # noqa: N806
    if isinstance(model, FullyShardedDataParallel):
        policy = getattr(model, 'mixed_precision', None)
        return Sharding('fsdp1', model, getattr(policy, 'param_dtype', None),
                        _fsdp1_shard_group(model))
    inner = getattr(model, 'module', None)
    candidates = [model] + ([inner] if isinstance(inner, nn.Module) else [])
    for m in candidates:
        if FSDPModule and isinstance(m, FSDPModule):
            return Sharding('fsdp2', m, _fsdp2_param_dtype(m), _fsdp2_shard_group(m))
    return None


def _fsdp1_shard_group(model: nn.Module) -> Optional[object]:
    """FSDP1's shard group under ``HYBRID_SHARD`` (its ``process_group``), else None (all ranks)."""
    from torch.distributed.fsdp import ShardingStrategy
    strategy = getattr(model, 'sharding_strategy', None)
    if strategy in (ShardingStrategy.HYBRID_SHARD,
                    getattr(ShardingStrategy, '_HYBRID_SHARD_ZERO2', None)):
        return model.process_group
    return None


def _fsdp2_shard_group(root: nn.Module) -> Optional[object]:
    """The shard dimension's group of a 2-D (replicate, shard) mesh, else None (all ranks)."""
    for p in root.parameters():
        if is_dtensor(p):
            mesh = p.device_mesh
            return mesh.get_group(1) if mesh.ndim == 2 else None
    return None


def global_norm(norms: Dict[bool, List[Tensor]], norm_type: float = 2.0,
                group: Optional[object] = None) -> Tensor:
    """Combine norms of local tensors into the norm over the whole job.

    Args:
        norms: ``{True: norms of local shards, False: norms of replicated tensors}`` (each a
            0-dim or 1-element float32 tensor). Shards are reduced across ``group`` (sum of
            squares, or max for ``inf``); replicated tensors are the same on every rank and
            counted once.
        norm_type: 2.0 or ``inf``.
        group: The ranks one copy of the model is sharded over (:attr:`Sharding.group`; None: all
            ranks). Under HSDP the replicas hold the same (all-reduced) gradients: summing over
            all ranks would count each element once per replica.

    Returns:
        A 1-element float32 tensor, equal on every rank.
    """
    if norm_type not in (2.0, float('inf')):
        raise ValueError(f'norm_type={norm_type!r} is not supported for sharded gradients; '
                         'use 2.0 or inf')
    device = next((t.device for ts in norms.values() for t in ts), torch.device('cpu'))
    parts = {}
    # Squares summed in float64: a finite norm above ~1.8e19 would square to inf in fp32
    # (Note [non-finite norm] in wrappers/overflow.py).
    for sharded in (True, False):
        ts = [t.reshape(1).double() for t in norms.get(sharded, [])]
        zero = torch.zeros(1, dtype=torch.float64, device=device)
        if norm_type == 2.0:
            parts[sharded] = torch.cat(ts).square().sum().reshape(1) if ts else zero
        else:
            parts[sharded] = torch.cat(ts).amax().reshape(1) if ts else zero
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
        dist.all_reduce(parts[True], op=op, group=group)
    if norm_type == 2.0:
        return (parts[True] + parts[False]).sqrt().float()
    return torch.maximum(parts[True], parts[False]).float()


@torch.no_grad()
def clip_grad_norm_sharded(params: Sequence[Tensor], sharding: Sharding, max_norm: float,
                           norm_type: float = 2.0, error_if_nonfinite: bool = False,
                           foreach: Optional[bool] = None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over sharded gradients: the norm of the whole model.

    Same coefficient as torch's (``max_norm / (norm + 1e-6)``, clamped to 1), applied to the local
    shards; the returned norm is the same on every rank. ``foreach`` is accepted for signature
    compatibility with mmengine's ``clip_grad`` options.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
    """
    norm_type = float(norm_type)
    grads = [(p.grad, sharding.slot_is_sharded(p.grad)) for p in params if p.grad is not None]
    norms: Dict[bool, List[Tensor]] = {True: [], False: []}
    for g, sharded in grads:
        norms[sharded].append(torch.linalg.vector_norm(local_tensor(g, 'a gradient'), norm_type))
    total = global_norm(norms, norm_type, sharding.group)
    if error_if_nonfinite and not bool(torch.isfinite(total).all()):
        raise RuntimeError(f'the total norm of order {norm_type} of the gradients is non-finite, '
                           'so it cannot be clipped (error_if_nonfinite=True)')
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_dtype: Dict[torch.dtype, List[Tensor]] = {}
    for g, _ in grads:
        local = local_tensor(g, 'a gradient')
        by_dtype.setdefault(local.dtype, []).append(local)
    for dtype, ts in by_dtype.items():
        torch._foreach_mul_(ts, coef.to(dtype).reshape(()))
    return total.reshape(())


@contextlib.contextmanager
def no_sync_for_backward(sharding: Optional[Sharding], sync: bool) -> Iterator[None]:
    """Around a backward: skip FSDP's gradient reduce-scatter while accumulating (``sync`` False).

    FSDP reads its sync flag when the gradients arrive, i.e. during backward (DDP reads it in the
    forward, which is why mmengine's ``optim_context`` suffices there). FSDP1 uses its public
    ``no_sync()`` context; FSDP2 ``set_requires_gradient_sync``.
    """
    if sharding is None or sync:
        yield
        return
    if sharding.kind == 'fsdp1':
        with sharding.model.no_sync():
            yield
        return
    sharding.model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        sharding.model.set_requires_gradient_sync(True)


# Optimizers whose update reads norms of whole tensors (trust ratios, per-layer second moments): on
# a shard those would be per-shard norms, a silently different optimizer.
_PER_TENSOR_NORM_OPTIMIZERS = ('FusedLAMB', 'FusedNovoGrad', 'LAMB', 'Lamb', 'NovoGrad', 'LARS')


def check_elementwise_optimizer(optimizer: torch.optim.Optimizer, sharding: Sharding) -> None:
    """Refuse optimizers whose update needs whole-tensor norms when the params are sharded."""
    name = type(optimizer).__name__
    if name in _PER_TENSOR_NORM_OPTIMIZERS:
        raise NotImplementedError(
            f'{name} computes per-tensor norms (trust ratio / layer-wise moments), which on '
            f'{sharding.kind.upper()} shards would be norms of shards: a different optimizer. '
            'Use an elementwise optimizer under FSDP (FusedAdam, FusedSGD, FusedAdagrad or '
            "torch's Adam/AdamW/SGD), or DDP for LAMB/NovoGrad")


def split_by_sharding(tensors: Sequence[Tensor], sharding: Optional[Sharding]
                      ) -> Tuple[List[Tensor], List[Tensor]]:
    """``(sharded, replicated)`` local tensors; without sharding everything is 'replicated'."""
    sharded, replicated = [], []
    for t in tensors:
        (sharded if sharding is not None and sharding.slot_is_sharded(t) else replicated).append(
            local_tensor(t))
    return sharded, replicated


def local_slot(optimizer: torch.optim.Optimizer, param: Tensor, grad: Tensor,
               model: Optional[Tensor], state: Dict[str, object], keys: Sequence[str]
               ) -> Tuple[Tensor, Tensor, Optional[Tensor], Dict[str, object]]:
    """The local shards of one fused-optimizer slot whose param is a DTensor (FSDP2).

    Returns ``(param, grad, model, state)`` with the DTensors replaced by their local tensors
    (views of the same storage, so the op's in-place update lands in the DTensors); ``state`` is a
    shallow copy, the optimizer's own state keeps its DTensors for checkpoints.

    Raises:
        ValueError: the gradient, model copy or a state tensor is laid out differently.
        NotImplementedError: an unsupported placement (Note [DTensor to local]), or an optimizer
            with per-tensor norms over sharded params.
    """
    name = type(optimizer).__name__
    if is_sharded(param) and name in _PER_TENSOR_NORM_OPTIMIZERS:
        check_elementwise_optimizer(optimizer, Sharding('fsdp2', nn.Module(), None))
    local_state = dict(state)
    for what, t in (('gradient', grad), ('model param', model),
                    *((f"state '{k}'", state.get(k)) for k in keys)):
        if is_dtensor(t) and (t.placements != param.placements
                              or t.device_mesh != param.device_mesh):
            raise ValueError(f'{name}: the {what} of a DTensor param has placements '
                             f'{t.placements} but the param has {param.placements}; a fused '
                             'update needs them laid out alike')
    for k in keys:
        local_state[k] = local_tensor(state.get(k), f"{name} state '{k}'")
    return (local_tensor(param, f'a {name} param'), local_tensor(grad, f'a {name} gradient'),
            local_tensor(model, f'a {name} model param'), local_state)


def check_fsdp_precision(opt_level: str, cast: torch.dtype, master_weights: bool,
                         sharding: Sharding, params: Sequence[Tensor]) -> None:
    """Check that an opt level which casts the model (O2/O3) is met by FSDP (Note [sharded masters]).

    Under FSDP our wrapper never casts the model itself (a flat or DTensor parameter cannot change
    dtype after sharding). Either FSDP's mixed precision makes the half copies from fp32 shards
    (``param_dtype == cast``: O2, the fp32 shards are the masters), or the model was cast to half
    before sharding (the wrapper then keeps fp32 masters of the local half shards).

    Raises:
        RuntimeError: neither holds, or O3 (no masters) over fp32 shards.
    """
    dtype = str(cast).replace('torch.', '')
    if any(p.dtype == cast for p in params):
        return  # cast before sharding: masters of the local half shards (O2) or none (O3)
    if sharding.param_dtype == cast and master_weights:
        return  # FSDP's half copies, our masters are its fp32 shards
    if sharding.param_dtype == cast:
        raise RuntimeError(
            f"ApexOptimWrapper(opt_level={opt_level!r}) keeps no fp32 masters, but under "
            f"{sharding.kind.upper()} with param_dtype={dtype} the optimizer would step FSDP's fp32 "
            "shards (that is O2). Use opt_level='O2', or cast the model to half before sharding "
            "(e.g. model.dtype in the config) for pure half training")
    hint = ("the strategy's model_wrapper=dict(mixed_precision=dict(param_dtype="
            f"'{dtype}', reduce_dtype='float32')) (mp_wrappers.MixedPrecisionFSDPStrategy fills it "
            'in from the optim_wrapper)' if sharding.kind == 'fsdp1' else
            f'fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.{dtype}, '
            'reduce_dtype=torch.float32)) (mp_wrappers.FullyShardedModel does it from its dtype)')
    raise RuntimeError(
        f'ApexOptimWrapper(opt_level={opt_level!r}) runs the model in {dtype}, but the model is '
        f'sharded by {sharding.kind.upper()} with fp32 parameters and FSDP param_dtype='
        f'{sharding.param_dtype}; a sharded parameter cannot be cast afterwards. Let FSDP make '
        f'the half copies: {hint}')
