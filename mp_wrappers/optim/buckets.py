"""The lists one fused-optimizer op call takes (a bucket), and how one param's tensors join them.

:meth:`FusedOptimizer._collect <mp_wrappers.optim.FusedOptimizer>` collects a group in one pass
when it can (:func:`collect_in_one_pass`, Note [collect in one pass]), else one param at a time,
deciding which bucket a param goes to; this module adds the param's tensors: as they are when all
of them are contiguous, shaped alike and of the state dtypes the optimizer keeps
(:func:`add_contiguous`, the case of nearly every param), else as flat views in the param's memory
order, re-laying out state once (:func:`add_strided`, e.g. channels_last params).

Note [collect fast path]
    ``_collect`` runs for every param at every step, so its per-param Python is the host time of a
    fused step, which bounds the step of a model of many small tensors on a GPU as on the CPU
    (``benchmarks/bench_host_overhead.py``). So per param it reads each tensor's attributes about
    once, and what it can settle once per bucket or per dtype it settles there:

    * What depends only on the group and the dtype of the updated tensor (the state keys of a slot
      and their dtypes, :class:`SlotSpec`) is worked out once per group, dtype and step, with the
      dtypes a slot's own state may hold besides (8-bit codes or float32 moments, ``SlotSpec.own``)
      so that no slot's state is looked up again to confirm them. Nothing is carried across steps:
      hyperparameters, storage options (``set_bf16_storage``), the state and the params themselves
      (``param.data = ...``) may all change between steps.
    * The bucket key holds the devices and dtypes ``_check_slot`` checks, so it runs once per
      bucket, and again only for a slot whose sizes or layouts differ (the same errors, naming the
      same param, as checking every slot).
    * Consecutive params mostly share their step counter: its position is looked up on a change.

Note [collect in one pass]
    Even so, the per-param checks above read about sixteen tensor attributes per Adam param (device,
    dtype, shape, contiguity of four tensors), at 50-90 ns each from Python: on an H100's host our
    step's Python took 1.42x torch's. So when every param is its own update target (no internal
    master, FSDP2 shard, or lean bf16 storage given model copies to write, which it refuses:
    ``FusedOptimizer._targets_are_params``) and
    torch.compile is not tracing (it cannot trace the C++ call; :func:`one_pass_applies`),
    :func:`collect_in_one_pass` first appends each param's tensors unchecked, to buckets keyed by
    the param's dtype, step cohort and whether it has a model copy, and then asks
    :func:`mp_wrappers.ops.slots.slots_dense`, in C++, once per bucket, whether the lists are what
    the one-by-one collection would have built from them: dense tensors of the key's devices and
    dtypes, each of its param's shape, with state of the spec's dtypes. When every
    bucket passes, the buckets are those of the one-by-one collection, in the same order (its key
    adds devices and dtypes the check found uniform), and the op gets the same lists. Otherwise the
    group is collected again one by one, which adds the strided slots, asks about other state
    dtypes exactly and raises the errors that name a param. The first pass changes nothing: a param
    without state (its first step) or an FSDP2 shard sends its group one by one at once, so state
    is made, and new params share their step counter (Note [step cohorts] in :mod:`.base`),
    exactly as before.
"""
import functools
from typing import (Any, Callable, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Sequence,
                    Tuple)

import torch
from torch import Tensor

from .. import compat
from ..ops.slots import slots_dense
from . import layout

__all__ = ['SlotSpec', 'identity', 'add_contiguous', 'add_strided', 'collect_in_one_pass',
           'new_step', 'one_pass_applies', 'with_grads']

#: ``state_dtype(key, target)``: the dtype state ``key`` of the tensor ``target`` is kept in.
StateDtype = Callable[[str, Tensor], torch.dtype]


class _Bucket:
    """The lists of one op call: one group, device, set of dtypes and step counter."""

    __slots__ = ('group', 'device', 'step', 'params', 'grads', 'model_params', 'states',
                 'slot_states')

    def __init__(self, group: Dict[str, Any], device: torch.device, step: Tensor,
                 state_keys: Sequence[str]) -> None:
        self.group = group
        self.device = device
        self.step = step
        self.params: List[Tensor] = []
        self.grads: List[Tensor] = []
        self.model_params: List[Tensor] = []
        self.states: Dict[str, List[Tensor]] = {k: [] for k in state_keys}
        #: Each slot's whole state dict, for what the op takes beyond the slot keys' lists (the
        #: 8-bit absmaxes): found here, not looked up again by a param that may be a view.
        self.slot_states: List[Dict[str, Any]] = []


class SlotSpec(NamedTuple):
    """The tensor state of the slots of one group and target dtype, for one step."""

    #: The state keys whose lists the op gets (``FusedOptimizer._slot_state_keys``).
    keys: Tuple[str, ...]
    #: ``(key, dtype)`` for each key: the dtype ``_state_dtype`` gives a target of this dtype.
    dtypes: Tuple[Tuple[str, torch.dtype], ...]
    #: ``(key, dtype)`` pairs a slot's own state may hold that ``_state_dtype`` would confirm for
    #: every slot holding them (8-bit codes stay uint8): accepted without asking it.
    own: FrozenSet[Tuple[str, torch.dtype]] = frozenset()


def identity(seen: List[Tensor], t: Tensor) -> int:
    """The position of ``t`` in ``seen`` by identity, appending it the first time.

    Buckets are keyed by which step counter their params share. ``id(tensor)`` would say it, but
    dynamo before torch 2.13 cannot trace id() of a tensor made in the graph (a first step's
    counter): 2.6 and 2.11 break the graph there. ``is`` traces on every torch we support.
    """
    for i, s in enumerate(seen):
        if s is t:
            return i
    seen.append(t)
    return len(seen) - 1


def with_grads(params: Sequence[Tensor], grads: Optional[Sequence[Any]]
               ) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """``(index, param, grad)`` of the params a step updates: the grad given for it (a fused master
    step's), else its ``.grad``; params with neither are left alone."""
    for pi, param in enumerate(params):
        grad = None if grads is None else grads[pi]
        if grad is None:
            grad = param.grad
            if grad is None:
                continue
        yield pi, param, grad


def one_pass_applies(opt: Any, with_models: bool) -> bool:
    """Whether the step of the :class:`~mp_wrappers.optim.FusedOptimizer` ``opt`` (writing model
    copies when ``with_models``) may collect in one pass (Note [collect in one pass]): not while
    torch.compile traces, and when ``opt`` says its params are their own update targets, in a class
    at or below the one defining ``_update_target`` (a subclass mapping them anew without saying
    when collects one by one)."""
    return (not compat.is_compiling() and _says_when(type(opt))
            and opt._targets_are_params(with_models))


@functools.lru_cache(maxsize=None)
def _says_when(cls: type) -> bool:
    mro = cls.__mro__
    maps = next(i for i, k in enumerate(mro) if '_update_target' in vars(k))
    return next(i for i, k in enumerate(mro) if '_targets_are_params' in vars(k)) <= maps


def collect_in_one_pass(opt: Any, group: Dict[str, Any], grads: Optional[Sequence[Any]],
                        models: Optional[Sequence[Any]], steps: List[Tensor],
                        dtensor: Optional[type]) -> Optional[List[_Bucket]]:
    """The buckets of ``group`` of the :class:`~mp_wrappers.optim.FusedOptimizer` ``opt``, whose
    params are their own update targets, checked once per bucket (Note [collect in one pass]);
    None when a slot needs the one-by-one collection (``opt._collect_group``)."""
    all_state, scalar_keys = opt.state, opt._scalar_state
    buckets: Dict[Tuple[torch.dtype, int, bool], _Bucket] = {}
    specs: Dict[torch.dtype, SlotSpec] = {}
    last_step, cohort = None, 0
    for pi, param, grad in with_grads(group['params'], grads):
        if dtensor is not None and isinstance(param, dtensor):
            return None  # FSDP2 steps the local shards: one by one
        state = all_state.get(param)
        if state is None or 'step' not in state:
            return None  # a first step makes state: one by one, before this pass changed anything
        dtype = param.dtype
        spec = specs.get(dtype)
        if spec is None:
            spec = specs[dtype] = opt._slot_spec(group, param)
        step = state['step']
        if step is not last_step:
            last_step, cohort = step, identity(steps, step)
        model = None if models is None else models[pi]
        key = (dtype, cohort, model is None)
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = _Bucket(group, param.device, step, spec.keys + scalar_keys)
        bucket.params.append(param)
        bucket.grads.append(grad)
        if model is not None:
            bucket.model_params.append(model)
        lists = bucket.states
        for k in spec.keys:
            lists[k].append(state.get(k))
        for k in scalar_keys:
            lists[k].append(state[k])
        bucket.slot_states.append(state)
    for (dtype, _, _), bucket in buckets.items():
        spec = specs[dtype]
        allowed = tuple((d,) + tuple(o for k, o in spec.own if k == key and o != d)
                        for key, d in spec.dtypes)
        if not slots_dense(bucket.params, bucket.grads, bucket.model_params,
                           [bucket.states[k] for k in spec.keys], allowed):
            return None
    return list(buckets.values())


def new_step(new_steps: Dict[torch.device, Tensor], device: torch.device) -> Tensor:
    """The step counter of the params of one group starting on ``device`` at this step, shared by
    all of them (Note [step cohorts] in :mod:`.base`)."""
    step = new_steps.get(device)
    if step is None:
        step = new_steps[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return step


def add_contiguous(bucket: _Bucket, spec: SlotSpec, target: Tensor, grad: Tensor,
                   model: Optional[Tensor], state: Dict[str, Any], state_dtype: StateDtype) -> bool:
    """Add one param's tensors to ``bucket`` as they are, when all are contiguous, shaped alike
    and every state tensor has the dtype the optimizer keeps; else add nothing and return False.

    Shapes, not just sizes: the kernels pair contiguous tensors element by element, but the
    pure-PyTorch references (ops/reference) broadcast, so tensors of other shapes go as flat views.
    """
    shape = target.shape
    if not (target.is_contiguous() and grad.is_contiguous() and grad.shape == shape):
        return False
    if model is not None and not (model.is_contiguous() and model.shape == shape):
        return False
    states = []
    for key, dtype in spec.dtypes:
        t = state.get(key)
        # spec's dtype holds for every target of this dtype; _state_dtype may also look at the
        # param's own state (8-bit codes stay uint8), so another dtype is asked about exactly.
        if (t is None or not t.is_contiguous() or t.shape != shape
                or (t.dtype != dtype and (key, t.dtype) not in spec.own
                    and t.dtype != state_dtype(key, target))):
            return False
        states.append(t)
    bucket.params.append(target)
    bucket.grads.append(grad)
    if model is not None:
        bucket.model_params.append(model)
    for key, t in zip(spec.keys, states):
        bucket.states[key].append(t)
    return True


def add_strided(bucket: _Bucket, keys: Sequence[str], target: Tensor, grad: Tensor,
                model: Optional[Tensor], state: Dict[str, Any], state_dtype: StateDtype,
                writebacks: List[Tuple[Tensor, Tensor]]) -> None:
    """Add a slot some of whose tensors are not contiguous (e.g. channels_last params).

    Every tensor of the slot is passed as a flat view in the target's memory order; tensors in
    another order are copied, and the written ones copied back after the op (a skipped step
    copies back the same bits). State is re-laid out once, in place in the state dict.
    """
    if layout.is_dense(target):
        order = target
    else:  # e.g. a strided view: update a contiguous copy of the same shape
        order = target.clone(memory_format=torch.contiguous_format)
        writebacks.append((target, order))
    bucket.params.append(layout.flat(order))
    if not layout.same_order(grad, order):
        grad = layout.like(order, grad.dtype).copy_(grad.reshape(order.shape))
    bucket.grads.append(layout.flat(grad))
    if model is not None:
        if not layout.same_order(model, order):
            staged = layout.like(order, model.dtype).copy_(model.reshape(order.shape))
            writebacks.append((model, staged))  # the shaped copy: its flat view is permuted
            model = staged
        bucket.model_params.append(layout.flat(model))
    for k in keys:
        bucket.states[k].append(layout.flat(_ensure_layout(state, k, order, state_dtype)))


def _ensure_layout(state: Dict[str, Any], key: str, ref: Tensor, state_dtype: StateDtype) -> Tensor:
    """The state tensor ``key`` in ``ref``'s memory order, re-laid out once if needed."""
    value = state.get(key)
    dtype = state_dtype(key, ref)
    if value is None:  # e.g. SGD momentum switched on after the first steps
        value = state[key] = layout.like(ref, dtype).zero_()
    elif not layout.same_order(value, ref) or value.dtype != dtype:
        value = state[key] = layout.like(ref, dtype).copy_(value.reshape(ref.shape))
    return value
