"""bf16 params without a separate fp32 master, for FusedAdam and FusedSGD (Note [lean bf16 storage]
in :mod:`mp_wrappers.ops.reference.lean`).

:class:`LeanStorageMixin` adds three optimizer options:

* ``bf16_storage``: ``None`` (bf16 params are stepped as plain bf16, or have fp32 masters given by a
  wrapper), ``'split'`` (a uint16 low half per element makes param + low half the exact fp32
  master), ``'kahan'`` (a bf16 compensation buffer) or ``'stochastic'`` (stochastic rounding, no
  extra state). Only bfloat16 params use it; fp32 params in the same optimizer are stepped as usual.
* ``state_dtype``: ``'float32'`` (default) or ``'bfloat16'``: the dtype of the moments / momentum
  buffers of those bf16 params (2 B instead of 4 per element each).
* ``seed``: the key of the stochastic-rounding hash (with the update number, so a resumed run draws
  the same bits).

The wrappers' ``master_weights='split'|'kahan'|'stochastic'`` set ``bf16_storage`` through
:meth:`LeanStorageMixin.set_bf16_storage`.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import compat
from ..casting import parse_dtype
from ..ops.reference.lean import LEAN_STORAGES

__all__ = ['LeanStorageMixin', 'AUX_STATE_KEYS']

#: Optimizer-state key of each storage's aux tensor.
AUX_STATE_KEYS = {'split': 'master_low', 'kahan': 'kahan_comp'}


_CAPTURABLE_LEAN = ('{name}: a tensor lr (capturable=True) is not supported with '
                    "bf16_storage={storage!r}: the lean kernels take lr as a number; use a float lr "
                    'and capturable=False, or bf16_storage=None')

class LeanStorageMixin:
    """The lean bf16 storages for a :class:`~mp_wrappers.optim.FusedOptimizer` subclass.

    The subclass declares ``_moment_keys`` (the state that ``state_dtype`` applies to) and
    ``_lean_op``, calls :meth:`_init_lean` in its constructor and :meth:`_launch_lean` from
    ``_launch`` when :meth:`_is_lean` holds for the bucket.
    """

    _moment_keys: Tuple[str, ...] = ()
    _lean_op: str = ''
    bf16_storage: Optional[str] = None
    state_dtype: torch.dtype = torch.float32
    seed: int = 0

    def _init_lean(self, bf16_storage: Optional[str], state_dtype: Any, seed: int) -> None:
        name = type(self).__name__
        self.state_dtype = parse_dtype(state_dtype, f'{name}: state_dtype',
                                       allowed=('float32', 'bfloat16'), allow_none=False)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f'{name}: seed must be an int, got {seed!r}')
        if not -2**63 <= seed < 2**63:  # the kernels take it as an int64
            raise ValueError(f'{name}: seed={seed!r} is out of range; expected an int in '
                             '[-2**63, 2**63)')
        self.seed = seed
        self.set_bf16_storage(bf16_storage)

    def set_bf16_storage(self, bf16_storage: Optional[str]) -> None:
        """Choose how bfloat16 params are stored and stepped (see the module docstring).

        Raises:
            ValueError: an unknown storage, or ``state_dtype='bfloat16'`` without one.
        """
        name = type(self).__name__
        if bf16_storage is not None and bf16_storage not in LEAN_STORAGES:
            raise ValueError(f'{name}: bf16_storage={bf16_storage!r} is not allowed; expected None'
                             f' or one of {sorted(LEAN_STORAGES)}')
        if bf16_storage == 'split':
            compat.require('uint16')
        if bf16_storage is not None and getattr(self, 'master_weights', False):
            raise ValueError(f'{name}: bf16_storage={bf16_storage!r} cannot be combined with '
                             'master_weights=True (an internal fp32 master); choose one')
        if bf16_storage is not None and getattr(self, 'capturable', False):
            raise ValueError(_CAPTURABLE_LEAN.format(name=name, storage=bf16_storage))
        changed = bf16_storage != self.bf16_storage
        self.bf16_storage = bf16_storage
        if changed:
            self._drop_stale_aux()

    def _drop_stale_aux(self) -> None:
        """Remove from every param's state the aux tensors of the storages other than the current
        one. A param stepped another way since (another storage, or plain bf16) has moved away
        from an old aux tensor: reused on a switch back, its low halves or its compensation would
        be joined to a param they no longer belong to (an error up to about one bf16 ulp); kept
        otherwise, it is dead weight (4 B/param once loaded as float32) saved in every checkpoint.
        A storage switched to starts its aux state anew (``lean_aux``)."""
        keep = AUX_STATE_KEYS.get(self.bf16_storage)
        stale = [key for key in AUX_STATE_KEYS.values() if key != keep]
        # The constructor sets the storage before Optimizer.__init__ makes the state: nothing then.
        for state in getattr(self, 'state', {}).values():
            for key in stale:
                state.pop(key, None)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load, then drop the aux state of another storage than the one set (a checkpoint saved
        with another ``bf16_storage``). With none set yet, the aux state stays: a wrapper's
        ``master_weights`` may set its storage after the load."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        if self.bf16_storage is not None:
            self._drop_stale_aux()

    # ---- FusedOptimizer hooks ------------------------------------------------------------------
    def _set_up_state_keys(self) -> Tuple[str, ...]:
        key = AUX_STATE_KEYS.get(self.bf16_storage)  # made by lean_aux before the first step
        return (key,) if key else ()

    def _is_lean(self, t: Tensor) -> bool:
        return self.bf16_storage is not None and t.dtype == torch.bfloat16

    def _state_dtype(self, key: str, param: Tensor) -> torch.dtype:
        if self._is_lean(param):
            if key in self._moment_keys:
                return self.state_dtype
            if key == AUX_STATE_KEYS.get(self.bf16_storage):
                return LEAN_STORAGES[self.bf16_storage]
        return torch.float32

    def _slot_state_keys(self, group: Dict[str, Any], target: Tensor) -> Tuple[str, ...]:
        keys = self._tensor_state_keys(group)
        aux = AUX_STATE_KEYS.get(self.bf16_storage) if self._is_lean(target) else None
        return keys + (aux,) if aux else keys

    def _targets_are_params(self, with_models: bool) -> bool:
        # _update_target below returns every param as it is, but raises for bf16 state without a
        # storage and for a lean param given a model copy: those steps collect one by one, which
        # raises. The aux state it makes when missing is a slot the one pass sends one by one too.
        if self.bf16_storage is None:
            return self.state_dtype == torch.float32
        return not with_models

    def _update_target(self, param: Tensor, state: Dict[str, Any],
                       model: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        if self.bf16_storage is None and self.state_dtype != torch.float32:
            # Checked at the step, not at construction: a wrapper's master_weights='split'|...
            # sets the storage after the optimizer is built from the config.
            raise ValueError(f"{type(self).__name__}: state_dtype='bfloat16' needs "
                             "bf16_storage='split', 'kahan' or 'stochastic' (or a wrapper's "
                             "master_weights with one of them); the fp32-master update keeps "
                             'float32 state')
        if self._is_lean(param):
            if model is not None:
                raise ValueError(f'{type(self).__name__}(bf16_storage={self.bf16_storage!r}) steps '
                                 'bf16 params in place; fused_master_step cannot also write a '
                                 'model copy for them (a wrapper with fp32 masters must not set '
                                 'bf16_storage)')
            self.lean_aux(param)
            return param, None
        return super()._update_target(param, state, model)

    def lean_aux(self, param: Tensor, create: bool = True) -> Optional[Tensor]:
        """The aux tensor of a bf16 ``param``, or None. A missing one is created as zeros (a 'split'
        param then represents exactly its bf16 value, a 'kahan' param has nothing to compensate)
        unless ``create`` is False."""
        key = AUX_STATE_KEYS.get(self.bf16_storage)
        if key is None or not self._is_lean(param):
            return None
        if not create and key not in self.state.get(param, {}):
            return None
        state = self.state[param]
        aux = state.get(key)
        want = LEAN_STORAGES[self.bf16_storage]
        if aux is None or aux.dtype != want or aux.shape != param.shape:
            state[key] = aux = torch.zeros_like(param, dtype=want)
        return aux

    def _prepare(self, buckets: List[Any], grad_scale: Optional[Tensor]) -> Any:
        """Refuse a tensor lr for lean bf16 params before any bucket launches: in a group that also
        holds fp32 params, their bucket would otherwise have stepped already (its params and state
        moved, the group's step counter not)."""
        for bucket in buckets:
            if self._is_lean(bucket.params[0]) and isinstance(bucket.group['lr'], Tensor):
                raise ValueError(_CAPTURABLE_LEAN.format(name=type(self).__name__,
                                                         storage=self.bf16_storage))
        return super()._prepare(buckets, grad_scale)  # type: ignore[misc]

    def _lean_lr(self, lr: float, lr_tensor: Optional[Tensor]) -> float:
        """The lean kernels take lr as a number: a tensor lr (Note [capturable]) is refused."""
        if lr_tensor is not None:
            raise ValueError(_CAPTURABLE_LEAN.format(name=type(self).__name__,
                                                     storage=self.bf16_storage))
        return lr

    def _launch_lean(self, bucket: Any, state_lists: Tuple[list, ...], *hyper: Any) -> None:
        key = AUX_STATE_KEYS.get(self.bf16_storage)
        aux = bucket.states[key] if key else []
        grad_scale, found_inf = hyper[-2:]
        self._call_op(bucket, bucket.params, aux, bucket.grads, *state_lists, bucket.step,
                      *hyper[:-2], self.bf16_storage, int(self.seed), grad_scale, found_inf,
                      op=self._lean_op)
