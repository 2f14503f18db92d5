"""Unscaling and checking a step's gradients, on the wrappers' three step paths.

* **fused** (:func:`fused_unscale_norm`): with an optimizer that implements the fused master step
  and gradients from a single scaler, the half model gradients are read once here, for the
  inf/nan check and the norm (nothing is written), and once by the fused update, which unscales
  them itself (docs/semantics.md section 7).
* **in place** (:func:`unscale_in_place`, Note [in-place unscale]).
* **stash**: model gradients are unscaled into fp32 buffers of the optimizer's slots
  (:class:`~mp_wrappers.master.GradStash`); :class:`StashedGrads` is what the later stages see of
  them.

Note [in-place unscale]: when every optimizer slot is the model parameter itself (O0, O1, O3,
FP16OptimWrapper over fp32 weights) and one scaler produced the step's gradients, there is no fp32
stash to fill: the gradients are checked and unscaled where they are, as torch's GradScaler does
(at a static 1.0 possibly not read at all, Note [unit-scale check] in
:mod:`mp_wrappers.wrappers.overflow`).

Under FSDP the kernels run on local shards and norms are combined across ranks
(:mod:`mp_wrappers.sharding`).
"""
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import sharding as _sharding
from ..master import GradStash, MasterParams
from ..ops import multi_tensor_l2norm, multi_tensor_scale, multi_tensor_unscale_l2norm
from ..scaler import LossScaler
from .overflow import StepFlags

__all__ = ['norm_of', 'fusable', 'fused_step', 'InPlaceGrads', 'unscale_in_place', 'StashedGrads',
           'nonfinite_param_names']

Sharding = Optional['_sharding.Sharding']


def _refuse_sparse(g: Optional[Tensor], slot: Tensor) -> None:
    if g is not None and g.is_sparse:
        raise RuntimeError('mixed-precision wrappers do not support sparse gradients '
                           f'(parameter of shape {tuple(slot.shape)})')


def norm_of(grads: List[Tensor], sharding: Sharding) -> Tensor:
    """L2 norm of unscaled gradients; under FSDP the norm of the whole model's."""
    if sharding is None:
        return multi_tensor_l2norm(grads)[0]
    sharded, replicated = _sharding.split_by_sharding(grads, sharding)
    return _sharding.global_norm({True: [multi_tensor_l2norm(sharded)[0]] if sharded else [],
                                  False: [multi_tensor_l2norm(replicated)[0]]
                                  if replicated else []}, group=sharding.group)


# ---- the fused path ------------------------------------------------------------------------------
# Note [fused step and clipping]: clip_grad_norm_ multiplies the unscaled grads by
# coef = min(1, max_norm / (norm + 1e-6)). Dividing by grad_scale / coef does the same inside the
# fused kernel, so norm clipping costs no extra pass. Other clip settings take the unfused path.
_FUSABLE_CLIP_KEYS = {'max_norm', 'norm_type', 'error_if_nonfinite', 'foreach'}


def fusable(optimizer: Optimizer, flags: StepFlags, stash: GradStash, clip: Optional[dict],
            grad_name: str) -> bool:
    """Whether the step can take the fused path: an optimizer with the fused master step, the
    gradients of one scaler still in the model, and no clipping beyond Note [fused step and
    clipping]."""
    if not getattr(optimizer, 'supports_fused_master_step', False):
        return False
    if flags.pending is None or stash.holds_grads or len(flags.used) != 1:
        return False
    if clip:
        if grad_name != 'grad_norm':
            return False
        if not set(clip) <= _FUSABLE_CLIP_KEYS or float(clip.get('norm_type', 2.0)) != 2.0:
            return False
        if clip.get('error_if_nonfinite', False):
            return False
    return True


@torch.no_grad()
def fused_step(optimizer: Optimizer, masters: MasterParams, scaler: LossScaler,
               flags: StepFlags, clip: Optional[dict], sharding: Sharding,
               sync_flags: Callable[[], None]) -> Optional[Tensor]:
    """Check, clip and step in the fused kernels (the update skips itself on the device where
    the flag is set); returns the norm of the unscaled gradients (None without gradients)."""
    flag = flags.flag(flags.pending)
    grads, models, by_dtype = _fused_grads(optimizer, masters, sharding)
    total = _fused_unscale_norm(by_dtype, scaler, flag, sharding)
    clipping = bool(clip) and total is not None
    if clipping:
        flags.flag_nonfinite_norm(total)  # before the sync, so every rank skips together
    sync_flags()
    grad_scale = scaler.scale
    if clipping:  # Note [fused step and clipping]
        coef = torch.clamp(clip['max_norm'] / (total + 1e-6), max=1.0)
        grad_scale = grad_scale / coef
    optimizer.fused_master_step(grads, models, grad_scale=grad_scale, found_inf=flag)
    _release_fused_grads(grads, optimizer, masters)
    flags.pending = None
    return total


def _fused_grads(optimizer: Optimizer, masters: MasterParams, sharding: Sharding
                ) -> Tuple[List[List[Optional[Tensor]]], List[List[Optional[Tensor]]],
                           Dict[tuple, List[Tensor]]]:
    """The model gradients per group and slot, the model params beside them, and the gradients'
    local tensors by ``(dtype, sharded)`` for the multi-tensor kernels."""
    grads, models, by_dtype = [], [], {}
    for group, row in zip(optimizer.param_groups, masters.model_params):
        g_row = []
        for slot, model_p in zip(group['params'], row):
            g = (model_p if model_p is not None else slot).grad
            _refuse_sparse(g, slot)
            g_row.append(g)
            if g is not None:
                # Under FSDP: local shards, and the norm is combined across ranks.
                sharded = sharding is not None and sharding.slot_is_sharded(g)
                by_dtype.setdefault((g.dtype, sharded), []).append(
                    _sharding.local_tensor(g, 'a gradient'))
        grads.append(g_row)
        models.append(list(row))
    return grads, models, by_dtype


def _fused_unscale_norm(by_dtype: Dict[tuple, List[Tensor]], scaler: LossScaler, flag: Tensor,
                       sharding: Sharding) -> Optional[Tensor]:
    """Check the gradients for inf/nan into ``flag`` and return the norm of the unscaled
    gradients (None without gradients); nothing is written."""
    inv_scale = scaler.inv_scale()
    norms = [multi_tensor_unscale_l2norm(gs, inv_scale, found_inf=flag)[0]
             for gs in by_dtype.values()]
    if sharding is not None:
        # Under FSDP: the norm of the whole model's gradients, equal on every rank.
        return _sharding.global_norm({True: [n for (_, sh), n in zip(by_dtype, norms) if sh],
                                      False: [n for (_, sh), n in zip(by_dtype, norms)
                                              if not sh]}, group=sharding.group)
    # Combined in double: the per-dtype norms are exact up to fp32's max, their fp32 squares are
    # not (a norm of 1e30 would square to inf).
    return torch.linalg.vector_norm(torch.stack(norms).double()).float() if norms else None


def _release_fused_grads(grads: List[List[Optional[Tensor]]], optimizer: Optimizer,
                        masters: MasterParams) -> None:
    """Drop the model gradients the fused step consumed.

    As the unfused path's unscale does: a gradient left here would be zeroed (not freed) by
    zero_grad(set_to_none=False) and step a parameter that gets no gradient later (an unused
    branch) with zeros: weight decay and moments would move it, where torch.optim leaves a
    parameter without a gradient alone.
    """
    for g_row, row, group in zip(grads, masters.model_params, optimizer.param_groups):
        for g, slot, model_p in zip(g_row, group['params'], row):
            if g is not None:
                (model_p if model_p is not None else slot).grad = None


# ---- the unfused paths: what the clip stage and amp_gnorm see of the gradients -------------------
class InPlaceGrads:
    """The gradients of a step unscaled in place (Note [in-place unscale])."""

    def __init__(self, slots: List[Tensor], by_dtype: Dict[torch.dtype, List[Tensor]],
                 norm: Optional[Tensor], loss_only: bool) -> None:
        self.slots = slots
        self._by_dtype = by_dtype  # empty when only the loss was checked
        self._norm = norm  # taken while checking (unit scale, not under FSDP)
        self._loss_only = loss_only

    def hand_to_optimizer(self) -> None:
        """Nothing to do: the gradients are the optimizer's slots' own."""

    def norm_to_publish(self, publish_due: bool, sharding: Sharding,
                        previous: Optional[Tensor]) -> Optional[Tensor]:
        """amp_gnorm of an unclipped step: the norm taken while checking, else (when a
        publication is due) one read of the gradients, else None."""
        if self._norm is not None or not publish_due:
            return self._norm
        grads = ([g for gs in self._by_dtype.values() for g in gs] if not self._loss_only else
                 [_sharding.local_tensor(s.grad, 'a gradient') for s in self.slots
                  if s.grad is not None])
        return norm_of(grads, sharding) if grads else None

    def release(self) -> None:
        """Consumed, as on the stash path: the next backward starts afresh."""
        for slot in self.slots:
            slot.grad = None


@torch.no_grad()
def unscale_in_place(masters: MasterParams, scaler: LossScaler, flag: Tensor, grad_check: str,
                     sharding: Sharding) -> InPlaceGrads:
    """Check (into ``flag``) and unscale the slots' gradients where they are."""
    slots = [slot for slot, _ in masters.slots()]
    loss_only = scaler.is_unit and grad_check == 'auto'
    by_dtype: Dict[torch.dtype, List[Tensor]] = {}
    for slot in slots:
        g = slot.grad
        if g is None:
            continue
        _refuse_sparse(g, slot)
        if not loss_only:  # else gathered only if the norm is published
            by_dtype.setdefault(g.dtype, []).append(_sharding.local_tensor(g, 'a gradient'))
    norm = None
    if loss_only:
        pass  # the loss was checked in backward (Note [unit-scale check])
    elif scaler.is_unit:
        norms = [multi_tensor_unscale_l2norm(gs, 1.0, found_inf=flag)[0]
                 for gs in by_dtype.values()]
        # Local norms under FSDP: the whole model's norm is taken later when it is needed.
        norm = (torch.linalg.vector_norm(torch.stack(norms).double()).float()
                if norms and sharding is None else None)
    else:
        inv_scale = scaler.inv_scale()
        for gs in by_dtype.values():
            multi_tensor_scale(gs, gs, inv_scale, flag)
    return InPlaceGrads(slots, by_dtype, norm, loss_only)


class StashedGrads:
    """The gradients of a step unscaled into the fp32 stash (:class:`GradStash`)."""

    def __init__(self, stash: GradStash, masters: MasterParams) -> None:
        self._stash = stash
        self._masters = masters

    def hand_to_optimizer(self) -> None:
        """Expose the stash as the ``.grad`` of the optimizer's slots."""
        self._stash.hand_to_optimizer(self._masters)

    def norm_to_publish(self, publish_due: bool, sharding: Sharding,
                        previous: Optional[Tensor]) -> Optional[Tensor]:
        """amp_gnorm of an unclipped step: one read of the stash when a publication is due."""
        if not publish_due:
            return previous
        grads = self._stash.grads(self._masters)
        return norm_of(grads, sharding) if grads else None

    def release(self) -> None:
        """Nothing to do: finishing the step clears the stash."""


def nonfinite_param_names(masters: MasterParams, stash: GradStash, name_of: Callable[[Tensor], str],
                          limit: int = 5) -> List[str]:
    """The first ``limit`` parameters with inf/nan in this step's unscaled stash or in the model
    gradients still present (host reads)."""
    found = []
    for slot, model_p in masters.slots():
        param = model_p if model_p is not None else slot
        grads = [stash.grad_of(slot), param.grad]
        if any(g is not None and not bool(torch.isfinite(g).all()) for g in grads):
            found.append(name_of(param))
            if len(found) == limit:
                break
    return found
