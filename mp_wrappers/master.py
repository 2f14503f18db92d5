"""fp32 master weights for the fp16/bf16 parameters of one optimizer.

Every optimizer slot falls in one of three groups (as in Megatron's Float16Optimizer): a half model
parameter whose fp32 master takes its place in ``optimizer.param_groups``; an fp32 parameter that is
stepped as it is; and nothing else. The group dicts themselves are never replaced, so LR schedulers that
write ``group['lr']`` keep working.

Note [masters lifecycle]
    Masters stand for the model's weights, so they must start from the weights the model has when
    training starts. mmengine builds the optimizer wrapper before ``init_weights()``, ``load_from``
    and ``resume`` write the model (and ``ApexOptimWrapper`` casts the model lazily), so masters made
    at construction can be stale. The wrappers therefore *bind* the masters to the model once, when
    training starts (``initialize_count_status``, which the Runner calls after loading, or the first
    ``optim_context``), with :meth:`MasterParams.sync_with_model`: a master whose rounded value is not
    the model's weight bit for bit is re-derived from the model. A fresh master (made before the model
    was written) is re-derived quietly; one loaded from a checkpoint that disagrees with the loaded
    weights is re-derived with a warning naming the parameters. After that, masters and model only
    change together (the step writes the rounded masters into the model). Where full-precision
    values exist when masters are made (ApexOptimWrapper O2 casting an fp32 model), the masters
    take them exactly (``initial_values``) instead of the rounded half weights.

Gradients reach the masters through :class:`GradStash`: model gradients, scaled by a loss scale, are
unscaled into fp32 buffers (accumulating when several losses with different scales contribute to one
step), with a non-finite check, and handed to the optimizer as ``master.grad``.
"""
import logging
import warnings
import weakref
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from mmengine.logging import print_log
from torch import Tensor, nn
from torch.optim import Optimizer

from .casting import HALF_DTYPES, forget_loaded_full_precision, loaded_full_precision
from .sharding import local_tensors
from .ops import multi_tensor_axpby, multi_tensor_scale

__all__ = ['MasterParams', 'GradStash', 'grouped_scale', 'MastersInStateDict', 'bind_masters',
           'zero_grads', 'MasterMismatchWarning']


class MasterMismatchWarning(UserWarning):
    """fp32 masters loaded from a checkpoint disagreed with the model's weights at training start."""


def _buckets(pairs: Sequence[Tuple[Tensor, Tensor]]) -> Dict[tuple, Tuple[List[Tensor], List[Tensor]]]:
    buckets: Dict[tuple, Tuple[List[Tensor], List[Tensor]]] = {}
    for a, b in pairs:
        key = (a.device, a.dtype, b.dtype)
        xs, ys = buckets.setdefault(key, ([], []))
        xs.append(a)
        ys.append(b)
    return buckets


def grouped_scale(inputs: Sequence[Tensor], outputs: Sequence[Tensor], scale: Tensor,
                  found_inf: Tensor) -> None:
    """``multi_tensor_scale`` over lists that may mix dtypes: one call per (device, dtypes) bucket."""
    for xs, ys in _buckets(list(zip(inputs, outputs))).values():
        # FSDP2 DTensors: the op runs on the local shards (mp_wrappers.sharding).
        multi_tensor_scale(local_tensors(xs), local_tensors(ys), scale, found_inf)


class MasterParams:
    """Creates fp32 masters for the half params of ``optimizer`` and swaps them into its groups.

    Optimizer state already held for a half param is re-keyed to its master and cast to fp32.

    Args:
        optimizer (Optimizer): The optimizer whose ``param_groups`` hold the model's parameters.
        create_masters (bool): Whether half params get fp32 masters. When False (apex O3, or a
            level without master weights) every slot is stepped directly in its own dtype.
        initial_values (dict, optional): ``id(half param) -> full-precision tensor`` to start
            masters from instead of the half weights (the fp32 weights a cast just rounded).

    Attributes:
        model_params: Per group, per slot: the half model parameter the slot's master stands for,
            or None when the slot holds an fp32 parameter that is stepped directly.
    """

    def __init__(self, optimizer: Optimizer, create_masters: bool = True,
                 initial_values: Optional[Dict[int, Tensor]] = None) -> None:
        self.optimizer = optimizer
        self.create_masters = create_masters
        self.model_params: List[List[Optional[Tensor]]] = []
        # Whether the masters hold values loaded from a checkpoint (not derived from the model):
        # a disagreement with the model is then worth a warning (Note [masters lifecycle]).
        self.loaded_from_checkpoint = False
        initial_values = initial_values or {}
        for group in optimizer.param_groups:
            row: List[Optional[Tensor]] = []
            for i, p in enumerate(group['params']):
                if create_masters and p.dtype in HALF_DTYPES:
                    master = _new_master(p, initial_values.get(id(p)))
                    if p in optimizer.state:
                        optimizer.state[master] = {
                            k: (v.float() if isinstance(v, Tensor) and v.dtype in HALF_DTYPES
                                else v) for k, v in optimizer.state.pop(p).items()}
                    group['params'][i] = master
                    row.append(p)
                else:
                    row.append(None)
            self.model_params.append(row)

    # ---- iteration helpers ---------------------------------------------------------------------
    def slots(self) -> Iterator[Tuple[Tensor, Optional[Tensor]]]:
        """Yield ``(optimizer param, half model param or None)`` for every slot."""
        for group, row in zip(self.optimizer.param_groups, self.model_params):
            yield from zip(group['params'], row)

    def half_pairs(self) -> List[Tuple[Tensor, Tensor]]:
        """``(master, model param)`` for every half slot."""
        return [(m, p) for m, p in self.slots() if p is not None]

    @property
    def has_half(self) -> bool:
        return any(p is not None for row in self.model_params for p in row)

    def check_groups(self) -> None:
        """Fail loudly if the optimizer's groups changed shape behind our back."""
        counts = [len(g['params']) for g in self.optimizer.param_groups]
        if counts != [len(r) for r in self.model_params]:
            raise RuntimeError(
                'the optimizer param_groups changed after fp32 master weights were created '
                f'(slots per group {counts}, masters made for {[len(r) for r in self.model_params]});'
                ' use the wrapper\'s add_param_group() instead of the optimizer\'s')

    def add_param_group(self, group: dict) -> None:
        """Add a group to the optimizer, with masters for its half params (apex's add_param_group)."""
        self.optimizer.add_param_group(group)
        new = self.optimizer.param_groups[-1]
        row: List[Optional[Tensor]] = []
        for i, p in enumerate(new['params']):
            if self.create_masters and p.dtype in HALF_DTYPES:
                new['params'][i] = _new_master(p, None)
                row.append(p)
            else:
                row.append(None)
        self.model_params.append(row)

    # ---- weights -------------------------------------------------------------------------------
    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        """Round the fp32 masters into the half model params (after an optimizer step)."""
        pairs = self.half_pairs()
        if pairs:
            torch._foreach_copy_(local_tensors([p for _, p in pairs]), local_tensors([m for m, _ in pairs]))

    @torch.no_grad()
    def copy_model_to_masters(self) -> None:
        """Re-derive the masters from the model (after loading model weights without masters)."""
        pairs = self.half_pairs()
        if pairs:
            torch._foreach_copy_(local_tensors([m for m, _ in pairs]), local_tensors([p for _, p in pairs]))

    @torch.no_grad()
    def sync_with_model(self, loaded: Optional[Dict[int, Tensor]] = None) -> List[Tensor]:
        """Start every master from its model param's weight (Note [masters lifecycle]).

        A master that rounds to the model's weight is kept when it came from a checkpoint (the
        optimizer state is authoritative on resume). Otherwise it takes the full-precision value
        loaded into the half param (``loaded``, see Note [full-precision values loaded into a half
        model] in casting.py) when that value rounds to the weight, else the weight itself.

        Args:
            loaded (dict, optional): ``id(half param) -> full-precision tensor`` loaded into it.

        Returns:
            The model params whose masters did not round to their weights (empty when all agreed
            bit for bit).
        """
        loaded = loaded or {}
        stale, dst, src = [], [], []
        for m, p in self.half_pairs():
            agrees = torch.equal(m.to(p.dtype), p)
            if not agrees:
                stale.append(p)
            value = loaded.get(id(p))
            if value is not None and not (agrees and self.loaded_from_checkpoint) and \
                    torch.equal(value.to(device=p.device, dtype=p.dtype), p):
                dst.append(m)
                src.append(value.to(device=m.device, dtype=torch.float32))
            elif not agrees:
                dst.append(m)
                src.append(p)
        if dst:
            torch._foreach_copy_(dst, src)
        self.loaded_from_checkpoint = False
        return stale

    def full_precision_of(self) -> Dict[int, Tensor]:
        """``id(half model param) -> its fp32 master``, for checkpoints and EMA."""
        return {id(p): m for m, p in self.half_pairs()}

    def state_dict(self) -> List[List[Tensor]]:
        """The fp32 masters, per group, in slot order of the half slots (apex's fp32_from_fp16)."""
        return [[m.detach().clone() for m, p in zip(g['params'], row) if p is not None]
                for g, row in zip(self.optimizer.param_groups, self.model_params)]

    @torch.no_grad()
    def load_state_dict(self, saved: List[List[Tensor]]) -> None:
        """Copy saved masters in, after checking groups, counts and shapes against the model."""
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.model_params):
            got = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
            raise ValueError(f'saved fp32 master weights have {got} param groups but the optimizer '
                             f'has {len(self.model_params)}: the checkpoint is for another model '
                             'or optimizer configuration')
        for g, (group, row, masters) in enumerate(
                zip(self.optimizer.param_groups, self.model_params, saved)):
            current = [m for m, p in zip(group['params'], row) if p is not None]
            if len(masters) != len(current):
                raise ValueError(f'param group {g}: the checkpoint has {len(masters)} fp32 master '
                                 f'weights but the model has {len(current)} fp16/bf16 parameters '
                                 'in this group')
            for i, (dst, src) in enumerate(zip(current, masters)):
                if not isinstance(src, Tensor) or src.shape != dst.shape:
                    shape = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
                    raise ValueError(f'param group {g}, master {i}: checkpoint shape {shape} does '
                                     f'not match the parameter shape {tuple(dst.shape)}')
            for dst, src in zip(current, masters):
                dst.copy_(src)
        self.loaded_from_checkpoint = True


def _new_master(param: Tensor, initial: Optional[Tensor]) -> Tensor:
    """An fp32 master for ``param``: from ``initial`` (exactly) when given, else from the param."""
    source = param if initial is None else initial
    if initial is not None and (initial.shape != param.shape or initial.device != param.device):
        raise ValueError(f'initial master value of shape {tuple(initial.shape)} on {initial.device} '
                         f'does not match the parameter ({tuple(param.shape)} on {param.device})')
    return source.detach().to(torch.float32, copy=True).requires_grad_(param.requires_grad)


def bind_masters(masters: MasterParams, module: nn.Module,
                 precast_weights: Dict[int, Tensor]) -> None:
    """Note [masters lifecycle]: start the masters from ``module``'s weights, saying which were stale.

    ``precast_weights``: ``id(half param) -> fp32 weight`` a cast by the wrapper rounded, taken
    like full-precision values loaded into the model.
    """
    loaded = masters.loaded_from_checkpoint
    full_precision = loaded_full_precision(module)
    full_precision.update(precast_weights)
    stale = masters.sync_with_model(full_precision)
    forget_loaded_full_precision(module)
    if not stale:
        return
    names = {id(p): n for n, p in module.named_parameters()}
    listed = ', '.join(names.get(id(p), f'<param {tuple(p.shape)}>') for p in stale[:5])
    more = f' and {len(stale) - 5} more' if len(stale) > 5 else ''
    if loaded:
        msg = (f'mp_wrappers: {len(stale)} fp32 master weights loaded from the checkpoint '
               f'do not round to the model\'s weights ({listed}{more}): the model was '
               'written after the optimizer state was loaded, or the checkpoint\'s '
               'state_dict and optimizer state disagree. Training starts from the model\'s '
               'weights; their masters were re-derived from them.')
        warnings.warn(msg, MasterMismatchWarning, stacklevel=5)
        print_log(msg, logger='current', level=logging.WARNING)
    else:
        print_log(f'mp_wrappers: re-derived {len(stale)} fp32 master weights from the '
                  f'model, written after the optimizer wrapper was built ({listed}{more};'
                  ' init_weights or load_from)', logger='current', level=logging.INFO)


def zero_grads(masters: MasterParams, set_to_none: bool) -> None:
    """Clear the gradients of the optimizer's slots and of the half model params behind them."""
    for slot, model_p in masters.slots():
        for p in (slot, model_p):
            if p is None or p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                # As torch's Optimizer.zero_grad: grads that are views (FSDP's use_orig_params,
                # DDP's gradient_as_bucket_view) cannot be detached in place.
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()


class MastersInStateDict:
    """A ``Module._register_state_dict_hook`` callback that saves fp32 masters for half params.

    Checkpoints then hold the full-precision weights the optimizer steps, not their bf16/fp16
    rounding: an fp32 model loading them for inference or export gets the masters, and a resumed
    half model rounds them back to exactly the weights it had.

    Args:
        owner: The optimizer wrapper, held weakly; its ``_masters`` (:class:`MasterParams` or None)
            are read at every ``state_dict()`` call, so rebuilt masters are followed. Copies of the
            hook (``copy.deepcopy(model)`` by EMAHook, ``torch.save(model)``) do not follow the
            wrapper: they save the model's own weights.
    """

    def __init__(self, owner: object) -> None:
        self._owner = weakref.ref(owner)

    def __call__(self, module, state_dict, prefix, local_metadata):
        owner = self._owner() if self._owner is not None else None
        masters: Optional[MasterParams] = getattr(owner, '_masters', None)
        full = masters.full_precision_of() if masters is not None else {}
        if not full:
            return state_dict
        for name, p in module.named_parameters():
            master = full.get(id(p))
            key = prefix + name
            if master is not None and key in state_dict:
                state_dict[key] = master.detach()
        return state_dict

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._owner = None


class GradStash:
    """fp32 unscaled gradients accumulated for the optimizer's slots, before the optimizer step.

    One persistent fp32 buffer per slot (allocated on first use and reused, so large buffers are not
    page-faulted in again every step). The model's own gradients are unscaled into it and dropped, so
    the next backward starts a fresh scaled sum: several losses with different scales can therefore
    contribute to one step. :meth:`hand_to_optimizer` exposes the buffers as ``.grad`` of the
    optimizer's slots (masters, or fp32 params stepped directly).
    """

    def __init__(self) -> None:
        self._buffers: Dict[int, Tensor] = {}
        self._valid: set = set()

    @property
    def holds_grads(self) -> bool:
        return bool(self._valid)

    def withdraw(self, masters: MasterParams) -> None:
        """Take the buffers back from the slots' ``.grad``, keeping their contents.

        Needed before a backward: an fp32 parameter is both a model and an optimizer slot, and
        autograd would otherwise add fresh scaled gradients into the unscaled stash.
        """
        if not self._buffers:  # nothing was ever handed out (e.g. steps that unscale in place)
            return
        for slot, _ in masters.slots():
            if slot.grad is not None and slot.grad is self._buffers.get(id(slot)):
                slot.grad = None

    def clear(self, masters: MasterParams) -> None:
        """Forget this step's gradients and detach the buffers from the optimizer's slots."""
        self.withdraw(masters)
        self._valid.clear()

    @torch.no_grad()
    def absorb(self, masters: MasterParams, inv_scale: Tensor, found_inf: Tensor) -> None:
        """Add ``model grad * inv_scale`` to the stash of every slot that has a gradient.

        ``found_inf`` is set when any model gradient holds inf or nan.
        """
        fresh_in, fresh_out, add_in, add_out = [], [], [], []
        for slot, model_p in masters.slots():
            src = model_p if model_p is not None else slot
            g = src.grad
            key = id(slot)
            buf = self._buffers.get(key)
            if g is None or g is buf:  # no gradient, or our own buffer handed out earlier
                continue
            if g.is_sparse:
                raise RuntimeError('mixed-precision wrappers do not support sparse gradients '
                                   f'(parameter of shape {tuple(slot.shape)})')
            if buf is None:
                # The slot's own dtype: fp32 for masters and fp32 params, half for params stepped
                # directly in half precision (apex O3).
                buf = self._buffers[key] = torch.empty_like(slot)
            if key in self._valid:
                add_in.append(g)
                add_out.append(buf)
            else:
                fresh_in.append(g)
                fresh_out.append(buf)
                self._valid.add(key)
            src.grad = None
        if fresh_in:
            grouped_scale(fresh_in, fresh_out, inv_scale, found_inf)
        if add_in:
            # Only steps with several losses (or an explicit update_master_grads between backwards)
            # get here: unscale into temporaries, then add. Only the incoming gradients are checked
            # (arg_to_check=0, as apex's unscale_with_stashed): the stash was checked by the scaler
            # that put it there, and re-checking it would charge another loss's overflow to this
            # loss's scaler, backing off a scale that did not overflow.
            tmp = [torch.empty_like(b) for b in add_out]
            grouped_scale(add_in, tmp, inv_scale, found_inf)
            for xs, ys in _buckets(list(zip(tmp, add_out))).values():
                xs, ys = local_tensors(xs), local_tensors(ys)
                multi_tensor_axpby(xs, ys, ys, 1.0, 1.0, arg_to_check=0, found_inf=found_inf)

    def hand_to_optimizer(self, masters: MasterParams) -> None:
        """Set every optimizer slot's ``.grad`` to its stash (None when it got no gradient)."""
        for slot, _ in masters.slots():
            key = id(slot)
            slot.grad = self._buffers[key] if key in self._valid else None

    def grad_of(self, slot: Tensor) -> Optional[Tensor]:
        """This step's unscaled gradient of ``slot``, or None."""
        key = id(slot)
        return self._buffers[key] if key in self._valid else None

    def grads(self, masters: MasterParams) -> List[Tensor]:
        """This step's unscaled gradients, in slot order."""
        return [self._buffers[id(s)] for s, _ in masters.slots() if id(s) in self._valid]
