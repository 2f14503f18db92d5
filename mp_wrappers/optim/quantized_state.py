"""Block-wise 8-bit optimizer states: ``state_dtype='int8'`` of FusedAdam (both moments) and FusedSGD
(the momentum buffer) (Note [8-bit optimizer states] in :mod:`mp_wrappers.ops.reference.quant`).

:class:`QuantizedStateMixin` keeps the optimizer's moments (FusedAdam ``exp_avg`` /
``exp_avg_sq``, FusedSGD ``momentum_buffer``: the subclass's ``_quantized_codes``) of every param
with at least ``min_8bit_size`` elements (default 4096) as uint8 codes laid out like the param,
plus ``<moment>_absmax`` (``exp_avg_absmax``, ...): float32, one per block of 256 elements in
memory order (about 1 byte per parameter and moment instead of 4). Smaller params (biases, norms)
keep float32 moments: their bytes do not matter and they are often the most sensitive. A param
group may override the optimizer's choice with ``state_dtype='float32'`` or ``'int8'`` (e.g.
embeddings in 32-bit; mmengine's
``paramwise_cfg=dict(custom_keys={'embed': dict(state_dtype='float32')})`` sets it).

The codes and absmax are what ``state_dict()`` saves. ``load_state_dict`` converts: a float32-state
checkpoint loaded into an int8-state optimizer is quantized, an int8 one loaded into a float32-state
optimizer (or a param that now wants float32 moments) is dequantized.

With a ``bf16_storage`` (the lean bf16 masters, a wrapper's ``master_weights='split'|'kahan'|
'stochastic'``) the bf16 params' 8-bit moments are stepped by the lean form of the optimizer's
8-bit op, the storage's aux state in the same pass: FusedAdam's ``multi_tensor_adam8bit_lean_``,
FusedSGD's ``multi_tensor_sgd8bit_lean_``, on the CPU, and on CUDA with a build that has CUDA
kernels. Lean bf16 params with 8-bit moments on a device without the kernel are refused when the
storage is set or the group added, before any step.

FSDP2 params (DTensors) keep 8-bit moments where their blocks never straddle shards, as DTensors
placed like the param (:mod:`.quantized_shards`, Note [8-bit blocks on FSDP2 shards]); the others
keep float32 moments. Under FSDP1 every param is this rank's flat piece of it, quantized in blocks
of its own, and ``state_dict()`` writes 8-bit moments as float32 (Note [8-bit states under FSDP1]).

``capturable=True`` (a tensor lr, read by the 8-bit kernel where it runs, Note [capturable] in
:mod:`.base`) works as with float32 moments, but for lean bf16 params (``bf16_storage``), whose
kernels take lr as a number. Refused with ``state_dtype='int8'`` (the optimizer's or a param
group's): ``master_weights=True``, params on a device without the 8-bit kernel (CUDA params with a
build that has no CUDA kernels, :func:`~mp_wrappers.ops.quantized_states.check_quantized_device`)
and non-dense params.

Note [8-bit states under FSDP1]
    FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True`` as the shipped configs and
    mmengine use it) flattens a unit's params into one flat parameter and hands each rank an equal
    1-D slice: the optimizer's param is this rank's piece of the original param, starting at any
    element offset. The piece is quantized in blocks of 256 from its own first element, so no block
    straddles two ranks, and ``min_8bit_size`` applies to the piece (a param may keep 8-bit moments
    on one rank and float32 on another). Codes and absmax therefore depend on the rank count:
    results match one process closely, not bit for bit (FSDP2's row blocks do, Note [8-bit blocks
    on FSDP2 shards]).

    FSDP1's optimizer state dicts gather per-element state only (Note [optimizer state under
    FSDP1] in :mod:`.saved_state`); a per-block absmax has no such shape. So under FSDP1
    ``state_dict()`` writes each 8-bit moment as float32 values and no absmax:
    :func:`~mp_wrappers.ops.reference.quant.dequantize_invertibly`, which loading quantizes back
    to the same codes and absmax when the pieces are the same (the same rank count) and the block's
    smallest nonzero code decodes to a normal float32 (absmax >= 2**-92 for ``exp_avg_sq``,
    2**-116 for ``exp_avg``; below that, moments under ~1e-28 that no update can tell from 0, a
    value may come back a code lower): resume is bit for bit. On another rank count the moments are
    requantized in the new pieces' blocks. The price is the checkpoint's size (float32 moments, 8
    bytes per param); memory while training is the 8-bit state's.
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..casting import parse_dtype
from ..sharding import dtensor_type, is_dtensor
from ..ops.quantized_states import check_quantized_device
from ..ops.reference.lean import LEAN_STORAGES
from ..ops.reference.quant import (EXP_AVG_CODE, EXP_AVG_SQ_CODE, Minifloat,
                                   dequantize_invertibly, quantize_blockwise)
from . import layout
from . import quantized_shards as shards
from .buckets import SlotSpec, _Bucket

__all__ = ['QuantizedStateMixin', 'STATE_DTYPES', 'DEFAULT_MIN_8BIT_SIZE', 'ADAM_CODES',
           'SGD_CODES', 'absmax_key', 'ABSMAX_KEYS']

#: The values of ``state_dtype`` (the optimizers' argument and a param group's override).
STATE_DTYPES = ('float32', 'bfloat16', 'int8')
#: Params with fewer elements keep float32 moments.
DEFAULT_MIN_8BIT_SIZE = 4096
#: FusedAdam's 8-bit moments and their codes.
ADAM_CODES = {'exp_avg': EXP_AVG_CODE, 'exp_avg_sq': EXP_AVG_SQ_CODE}
#: FusedSGD's 8-bit momentum buffer: signed, as Adam's first moment.
SGD_CODES = {'momentum_buffer': EXP_AVG_CODE}
_GROUP_STATE_DTYPES = ('float32', 'int8')


def absmax_key(key: str) -> str:
    """Optimizer-state key of moment ``key``'s per-block absmax."""
    return key + '_absmax'


#: FusedAdam's moment -> its absmax key (the name of earlier releases; :func:`absmax_key`).
ABSMAX_KEYS = {key: absmax_key(key) for key in ADAM_CODES}


def _float32_moment(codes: Tensor, absmax: Tensor, code: Minifloat, like: Tensor) -> Tensor:
    """A moment's codes as float32 values (``dequantize_invertibly``), laid out like ``like``."""
    values = dequantize_invertibly(layout.flat(codes), absmax.reshape(-1), code)
    out = layout.like(like, torch.float32)
    layout.flat(out).copy_(values)
    return out


class QuantizedStateMixin:
    """``state_dtype='int8'`` for :class:`~mp_wrappers.optim.FusedAdam` and
    :class:`~mp_wrappers.optim.FusedSGD` (see the module docstring).

    The subclass names its 8-bit moments (``_quantized_codes``) and op (``_quantized_op``), calls
    :meth:`_init_quantized` before ``FusedOptimizer.__init__`` and :meth:`_launch_quantized` at
    the start of ``_launch``, and implements :meth:`_call_8bit_op`.
    """

    #: moment key -> its code, in the op's order
    _quantized_codes: Dict[str, Minifloat] = ADAM_CODES
    #: the 8-bit update (has_quantized_kernel says where it runs)
    _quantized_op: str = 'multi_tensor_adam8bit_'
    int8_states: bool = False
    min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE
    #: local-shard address -> FSDP2 param (:meth:`_shard_state`)
    _shard_owners: Dict[int, Tensor] = {}

    def _init_quantized(self, state_dtype: Any, min_8bit_size: int) -> Any:
        """Record the int8 choice; return the ``state_dtype`` for the lean storages."""
        name = type(self).__name__
        if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) \
                or min_8bit_size < 0:
            raise ValueError(f'{name}: min_8bit_size={min_8bit_size!r} is not allowed; expected '
                             'an int >= 0')
        self.min_8bit_size = min_8bit_size
        self.int8_states = isinstance(state_dtype, str) and state_dtype == 'int8'
        if not self.int8_states:
            try:  # the lean mixin knows only its own two values: name all three here
                parse_dtype(state_dtype, f'{name}: state_dtype', allowed=('float32', 'bfloat16'),
                            allow_none=False)
            except ValueError:
                raise ValueError(f'{name}: state_dtype={state_dtype!r} is not supported; allowed: '
                                 f'{", ".join(repr(s) for s in STATE_DTYPES)}') from None
            return state_dtype
        # capturable=True (a tensor lr, Note [capturable]) is allowed: the 8-bit kernel reads it
        # where it runs, like the fp32 kernels; the lean storages refuse it themselves.
        if getattr(self, 'master_weights', False):
            raise ValueError(f"{name}: master_weights=True is not supported with "
                             "state_dtype='int8'; use a wrapper's fp32 masters (e.g. "
                             "ApexOptimWrapper opt_level='O2') or state_dtype='float32'")
        return 'float32'

    def set_bf16_storage(self, bf16_storage: Optional[str]) -> None:
        # Refused before anything changes: the storage and the params' aux state stay as they were.
        if bf16_storage in LEAN_STORAGES:
            for group in getattr(self, 'param_groups', ()):
                self._check_lean_devices(group, bf16_storage)
        super().set_bf16_storage(bf16_storage)  # type: ignore[misc]

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        value = param_group.get('state_dtype')
        if value is not None and value not in _GROUP_STATE_DTYPES:
            raise ValueError(f'{type(self).__name__}: param group state_dtype={value!r} is not '
                             f'allowed; expected one of {list(_GROUP_STATE_DTYPES)}')
        # What the optimizer-wide state_dtype='int8' refuses, a group's may not bring in.
        if value == 'int8' and getattr(self, 'master_weights', False):
            raise ValueError(f"{type(self).__name__}: a param group's state_dtype='int8' is not "
                             "supported with master_weights=True; set the group's "
                             "state_dtype='float32', or master_weights=False")
        # Checked before the group is added: a refused group leaves the optimizer as it was. The
        # params are made a list first, as torch would (one Tensor, or an iterator the check must
        # not consume); a set is left for torch to refuse.
        params = param_group.get('params')
        if isinstance(params, Tensor):
            param_group['params'] = [params]
        elif not isinstance(params, set) and params is not None:
            param_group['params'] = list(params)
        merged = dict(getattr(self, 'defaults', {}), **param_group)  # the group as it will be
        self._check_lean_devices(merged, getattr(self, 'bf16_storage', None))
        super().add_param_group(param_group)  # type: ignore[misc]

    def _check_lean_devices(self, group: Dict[str, Any], storage: Optional[str]) -> None:
        """Refuse, before any step, lean bf16 params stored the ``storage`` way with 8-bit moments
        where no kernel runs them (CUDA with a build that has no CUDA kernels, any other
        device)."""
        if storage is None:
            return
        params = group.get('params')
        if not isinstance(params, list):
            return  # torch refuses it (a set) when the group is added
        for param in params:
            if param.dtype == torch.bfloat16 and self._wants_8bit(param, group):
                check_quantized_device(type(self).__name__, param.device, storage,
                                       op=self._quantized_op)

    # ---- which params, and their state -----------------------------------------------------------
    def _wants_8bit(self, param: Tensor, group: Dict[str, Any]) -> bool:
        default = 'int8' if self.int8_states else 'float32'
        if group.get('state_dtype', default) != 'int8' or param.numel() < self.min_8bit_size:
            return False
        # A DTensor's numel and shape are global: every rank and rank count decides alike.
        if is_dtensor(param) and not shards.blocks_follow_shards(param):
            shards.log_ineligible(self, param)
            return False
        return True

    def _slot_spec(self, group: Dict[str, Any], target: Tensor) -> SlotSpec:
        # The spec's dtypes are the first such target's (codes or not): a slot holding the other
        # kind of moments is one _state_dtype would confirm too, without its lookup of the state.
        spec = super()._slot_spec(group, target)  # type: ignore[misc]
        # A moment held as codes is uint8 for _state_dtype too: add_contiguous need not ask it.
        codes = frozenset((key, torch.uint8) for key in self._quantized_codes)
        unquantized = frozenset(
            (key, super(QuantizedStateMixin, self)._state_dtype(key, target))  # type: ignore
            for key in self._quantized_codes if key in spec.keys)
        return spec._replace(own=spec.own | codes | unquantized)

    def _check_8bit_param(self, param: Tensor) -> None:
        name = type(self).__name__
        storage = self.bf16_storage if self._lean_8bit(param) else None
        check_quantized_device(name, param.device, storage, op=self._quantized_op)
        # FSDP2 shards are contiguous (Note [8-bit blocks on FSDP2 shards]); say so if one is not.
        dense = shards.local(param).is_contiguous() if is_dtensor(param) else layout.is_dense(param)
        if not dense:
            raise ValueError(f"{name}: state_dtype='int8' needs dense params (got a "
                             f'{type(param).__name__} of shape {tuple(param.shape)} and strides '
                             f"{param.stride()}); keep its group at state_dtype='float32'")

    def _lean_8bit(self, param: Tensor) -> bool:
        """Whether ``param`` is a bf16 param stepped with its lean storage (LeanStorageMixin)."""
        is_lean = getattr(self, '_is_lean', None)
        return bool(is_lean is not None and is_lean(param))

    def _init_state(self, param: Tensor, group: Dict[str, Any], step: Tensor) -> Dict[str, Any]:
        # Refused before any state exists: a float32 state left behind would step the next time.
        eight_bit = self._wants_8bit(param, group)
        if eight_bit:
            self._check_8bit_param(param)
        state = super()._init_state(param, group, step)  # type: ignore[misc]
        if eight_bit:
            self._quantize_moments(param, state)
        return state

    def _state_dtype(self, key: str, param: Tensor) -> torch.dtype:
        if key in self._quantized_codes:
            state = self.state.get(param)  # type: ignore[attr-defined]
            if state is None and self._holds_dtensors():
                # an FSDP2 param's local shard (a slot's target) is no key: its owner's state.
                # Asked only under FSDP2: other targets (fp32 masters) need no address lookup,
                # which torch.compile cannot trace (dynamo 2.11 cannot hash a data_ptr).
                state = self._shard_state(param)
            codes = state.get(key) if state else None
            if codes is not None and codes.dtype == torch.uint8:
                return torch.uint8
        return super()._state_dtype(key, param)  # type: ignore[misc]

    def _quantize_moments(self, param: Tensor, state: Dict[str, Any]) -> None:
        # a DTensor's on its local shards (Note [8-bit blocks on FSDP2 shards])
        sharded = is_dtensor(param)
        target = shards.local(param) if sharded else param
        for key, code in self._quantized_codes.items():
            absmax_key_ = absmax_key(key)
            value = self._local_state(param, state[key], key) if sharded else state[key]
            flat = layout.flat(value) if layout.is_dense(value) else value.reshape(-1)
            codes, absmax = quantize_blockwise(flat.to(torch.float32), code, signed_zeros=True)
            state[key] = layout.like(target, torch.uint8)
            layout.flat(state[key]).copy_(codes)
            state[absmax_key_] = absmax.to(param.device)
            if sharded:
                state[key] = shards.like_param(param, state[key])
                state[absmax_key_] = shards.absmax_like(param, state[absmax_key_])

    def _dequantize_moments(self, param: Tensor, state: Dict[str, Any]) -> None:
        sharded = is_dtensor(param)
        target = shards.local(param) if sharded else param
        for key, code in self._quantized_codes.items():
            codes, absmax = state[key], state.pop(absmax_key(key))
            if sharded:
                codes = self._local_state(param, codes, key)
                absmax = self._local_state(param, absmax, absmax_key(key))
            state[key] = _float32_moment(codes, absmax, code, target)
            if sharded:
                state[key] = shards.like_param(param, state[key])

    def _local_state(self, param: Tensor, value: Tensor, key: str) -> Tensor:
        """This rank's part of state ``key`` of DTensor ``param``: a DTensor too, or a whole
        absmax (a consolidated checkpoint converted to float32 moments)."""
        if not is_dtensor(value):
            rows = (shards.local_rows_of_full_absmax(param, value) if key.endswith('_absmax')
                    else None)
            if rows is not None:
                return rows
            raise ValueError(f'{type(self).__name__}: state {key!r} of a DTensor (FSDP2) param of '
                             f'shape {tuple(param.shape)} is a plain tensor of shape '
                             f'{tuple(value.shape)}; load sharded optimizer state with '
                             'torch.distributed.checkpoint.state_dict.set_optimizer_state_dict '
                             '(mp_wrappers.distributed.checkpoint), which keeps it sharded')
        return shards.local(value)

    def _float32_slot(self, slot: Dict[str, Any]) -> Dict[str, Any]:
        """A saved param state as float32: 8-bit moments by ``dequantize_invertibly`` (Note [8-bit
        states under FSDP1]), their absmax dropped."""
        if self._holds_codes(slot):
            absmaxes = {absmax_key(key) for key in self._quantized_codes}
            slot = {k: v for k, v in dict(slot, **self._float32_moments(slot)).items()
                    if k not in absmaxes}
        return super()._float32_slot(slot)  # type: ignore[misc]

    @property
    def _first_moment(self) -> str:
        """The state key whose dtype says whether a param's moments are codes (a param's moments
        are quantized together)."""
        return next(iter(self._quantized_codes))

    def _holds_codes(self, state: Dict[str, Any]) -> bool:
        """Whether a param's state holds its moments as 8-bit codes."""
        first = state.get(self._first_moment)
        return isinstance(first, Tensor) and first.dtype == torch.uint8

    def _float32_moments(self, slot: Dict[str, Any]) -> Dict[str, Tensor]:
        """The 8-bit moments of a saved ``slot`` (plain tensors) as float32 values shaped alike."""
        return {key: _float32_moment(slot[key], slot[absmax_key(key)], code, slot[key])
                for key, code in self._quantized_codes.items()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load, then quantize or dequantize each param's moments to what it wants now.

        Params that want 8-bit moments on a device without the 8-bit kernel are refused first,
        before anything is loaded (a saved 8-bit state would otherwise step without the check
        that a new param's first step makes)."""
        for group in self.param_groups:  # type: ignore[attr-defined]
            for param in group['params']:
                if self._wants_8bit(param, group):
                    self._check_8bit_param(param)
        super().load_state_dict(state_dict)  # type: ignore[misc]
        name = type(self).__name__
        for group in self.param_groups:  # type: ignore[attr-defined]
            for i, param in enumerate(group['params']):
                state = self.state.get(param)  # type: ignore[attr-defined]
                if not state or not isinstance(state.get(self._first_moment), Tensor):
                    continue
                has = self._holds_codes(state)
                if has:
                    for key in self._quantized_codes:
                        absmax = state.get(absmax_key(key))
                        if not isinstance(absmax, Tensor) or state[key].dtype != torch.uint8:
                            raise ValueError(f'{name}.load_state_dict: the 8-bit state of param '
                                             f'{i} of its group lacks {absmax_key(key)!r} or has '
                                             f'{key!r} of another dtype')
                        absmax = absmax.to(device=param.device, dtype=torch.float32)
                        # one per block: a consolidated FSDP2 checkpoint's are one row per param row
                        state[absmax_key(key)] = (absmax if is_dtensor(absmax)
                                                  else absmax.reshape(-1))
                want = self._wants_8bit(param, group)
                if want and not has:
                    self._quantize_moments(param, state)
                elif has and not want:
                    self._dequantize_moments(param, state)

    # ---- the update ----------------------------------------------------------------------------------
    def _launch_quantized(self, bucket: _Bucket, grad_scale: Optional[Tensor],
                          found_inf: Optional[Tensor], lr: float, lr_tensor: Optional[Tensor]
                          ) -> Optional[_Bucket]:
        """Step the bucket's 8-bit slots; return the bucket of the others (None when none).
        ``lr, lr_tensor``: the group's lr as ``_lr_args`` gives it."""
        eight: List[int] = []
        rest: List[int] = []
        for i, t in enumerate(bucket.states.get(self._first_moment, ())):
            (eight if t.dtype == torch.uint8 else rest).append(i)
        if not eight:
            return bucket
        g = bucket.group
        # One step counter serves both calls: the 8-bit one advances a copy when another follows.
        step = bucket.step.clone() if rest else bucket.step
        self._call_8bit(bucket, eight, step, grad_scale, found_inf, lr, lr_tensor)
        if not rest:
            return None
        others = _Bucket(g, bucket.device, bucket.step, tuple(bucket.states))
        for i in rest:
            others.params.append(bucket.params[i])
            others.grads.append(bucket.grads[i])
            if bucket.model_params:
                others.model_params.append(bucket.model_params[i])
            for key, values in bucket.states.items():
                others.states[key].append(values[i])
            others.slot_states.append(bucket.slot_states[i])
        return others

    def _call_8bit(self, bucket: _Bucket, eight: List[int], step: Tensor,
                   grad_scale: Optional[Tensor], found_inf: Optional[Tensor], lr: float,
                   lr_tensor: Optional[Tensor]) -> None:
        """The 8-bit op on the bucket's slots ``eight`` (:meth:`_call_8bit_op` with their lists)."""
        absmax = [self._absmax_of(bucket, i) for i in eight]
        whole = len(eight) == len(bucket.params)  # no float32-moment slot: the lists as they are

        def pick(values: List[Tensor]) -> List[Tensor]:
            return values if whole else [values[i] for i in eight]
        # moment codes and absmaxes interleaved, in _quantized_codes' order (the ops' order)
        states = []
        for j, key in enumerate(self._quantized_codes):
            states += [pick(bucket.states[key]), [a[j] for a in absmax]]
        self._call_8bit_op(bucket, pick, states, step, grad_scale, found_inf, lr, lr_tensor)

    def _call_8bit_op(self, bucket: _Bucket, pick: Callable[[List[Tensor]], List[Tensor]],
                      states: List[List[Tensor]], step: Tensor, grad_scale: Optional[Tensor],
                      found_inf: Optional[Tensor], lr: float, lr_tensor: Optional[Tensor]) -> None:
        """Call the subclass's 8-bit op: ``pick`` selects the 8-bit slots of a bucket list,
        ``states`` are their codes and absmaxes (the op's state lists)."""
        raise NotImplementedError

    def _absmax_of(self, bucket: _Bucket, i: int) -> Tuple[Tensor, ...]:
        """The absmax of every moment of slot ``i`` (local shards of an FSDP2 param's)."""
        param = bucket.params[i]
        if not param.numel():  # a rank holding no rows of an FSDP2 param: no block to update
            empty = torch.empty(0, dtype=torch.float32, device=param.device)
            return (empty,) * len(self._quantized_codes)
        state = bucket.slot_states[i]
        absmax = tuple(state[absmax_key(key)] for key in self._quantized_codes)
        if type(absmax[0]) is Tensor:  # noqa: E721 - plain tensors, the common case: no DTensor
            return absmax
        return tuple(shards.local(a).view(-1) for a in absmax)

    def _holds_dtensors(self) -> bool:
        dtensor = dtensor_type()
        return dtensor is not None and any(
            isinstance(p, dtensor) for group in self.param_groups  # type: ignore[attr-defined]
            for p in group['params'])

    def _shard_state(self, local_param: Tensor) -> Optional[Dict[str, Any]]:
        """The state of the FSDP2 param whose local shard ``local_param`` is, or None.

        The local shard of a parameter DTensor is a new view at each ``to_local()``: found by its
        storage address, and the DTensor remembered by that address, so the params are scanned
        once (again when a param's shard moved), not at every step. An empty shard (a rank
        holding no rows) has no address of its own: None, and with nothing to update the slot may
        go with the float32 ones.
        """
        if not local_param.numel():
            return None
        ptr = local_param.data_ptr()
        owner = self._shard_owners.get(ptr)
        if owner is None or shards.local(owner).data_ptr() != ptr:
            locals_ = ((shards.local(p), p) for group in self.param_groups  # type: ignore
                       for p in group['params'] if is_dtensor(p))
            self._shard_owners = {t.data_ptr(): p for t, p in locals_ if t.numel()}
            owner = self._shard_owners.get(ptr)
        return self.state.get(owner) if owner is not None else None  # type: ignore[attr-defined]
