"""The base class of the fused optimizers: bucketing, state, skipped steps and the master-step protocol.

Note [fused master step]
    A mixed-precision wrapper keeps fp32 master params in ``optimizer.param_groups`` while the model
    holds fp16/bf16 params whose ``.grad`` is scaled by the loss scale. The classic way (apex O2,
    FP16_Optimizer) unscales every half grad into an fp32 master grad, steps the masters and copies
    them back into the model: about 44 bytes of memory traffic per parameter. ``fused_master_step``
    hands the half grads and the half model params straight to the update op, which unscales, updates
    the master and its state and writes the rounded value into the model in one pass (about 30 bytes,
    see docs/semantics.md section 7), with the overflow skip decided on the device.

Note [step cohorts]
    Each parameter's state holds ``step``, a 1-element float32 tensor counting the updates applied to
    it (incremented by the op on the device, not when a step is skipped for an overflow). Params that
    received their first gradient at the same step share one tensor object, so normally a whole group
    shares one counter, as apex's per-group step, and a bucket needs one op call. A param that starts
    later gets its own counter, which is torch.optim's per-parameter semantics (SGD initialises its
    momentum buffer, Adam starts its bias correction, on that param's own first update). Loading a
    state dict merges counters of equal value again. A shared counter advances whenever any of its
    params is updated, as apex's per-group step does: a param without a gradient at that step
    advances too. So the counter stays shared even where its params take two op calls (8-bit and
    float32 moments, Note [8-bit optimizer states]): one per group keeps every rank and state dtype
    counting alike.
"""
from typing import (Any, Callable, ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple,
                    Union)

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import compat
from ..sharding import dtensor_type, local_slot
from ..ops._checks import _check_flag
from ..ops._dispatch import implementation
from ..ops._extension import extension
from . import layout, saved_state
from .buckets import (SlotSpec, _Bucket, add_contiguous, add_strided, collect_in_one_pass,
                      identity, new_step, one_pass_applies, with_grads)

__all__ = ['FusedOptimizer']

ParamsT = Union[Iterable[Tensor], Iterable[Dict[str, Any]]]


class FusedOptimizer(Optimizer):
    """Base class of the fused optimizers: one multi-tensor op call per (group, device, dtype) bucket.

    Subclasses declare their per-parameter state and launch their op on a bucket; this class does the
    rest the same way for all of them:

    * **Buckets.** Params with a gradient are grouped by param group, device, the dtypes of param,
      grad and model copy, and step counter (Note [step cohorts]); every bucket is one op call, which
      reads the group's hyperparameters then, so LR schedulers take effect at the next step.
    * **State.** float32 tensors (moments even for half params), shaped and laid out like the param;
      ``step`` a 1-element float32 tensor. ``state_dict()`` holds tensors and numbers only (loadable
      with ``torch.load(weights_only=True)``) plus a version key; ``load_state_dict`` keeps the state
      float32 where torch's loader would cast it to the param's dtype.
    * **Loss scaling in the kernel.** ``step(grad_scale=..., found_inf=...)`` divides the grads by
      ``grad_scale`` and, when ``found_inf`` is nonzero, leaves params, state and step counters
      bit-identical, decided on the device (no host sync). ``_step_supports_amp_scaling = True`` makes
      ``torch.amp.GradScaler.step`` pass its scale and flag this way (as the ``grad_scale`` /
      ``found_inf`` attributes it sets on the optimizer) instead of unscaling the grads itself.
    * **Fused mixed-precision step** (Note [fused master step]). With ``supports_fused_master_step``
      every fused optimizer implements::

          fused_master_step(grads, model_params, grad_scale=None, found_inf=None) -> None

      ``grads[g][i]`` is the gradient for ``self.param_groups[g]['params'][i]`` (an fp32 master), of
      any float dtype and scaled by ``grad_scale``, or None to use that param's own ``.grad`` (the
      slot is skipped when that is None too). ``model_params[g][i]`` is the fp16/bf16 model tensor
      that receives the updated value rounded to its dtype, or None (an fp32 param stepped as it is).
      Either argument may be None as a whole (all None). The update is one op call per bucket; no
      fp32 master-grad buffers are made, and ``found_inf`` skips the model copies too.

    ``zero_grad(set_to_none=None)`` uses the constructor's ``set_grad_none`` by default (apex), and
    accepts torch's keyword.

    Examples:
        >>> # In an mmengine config (any default_scope):
        >>> optim_wrapper = dict(type='OptimWrapper',
        ...                      optimizer=dict(type='mp_wrappers.FusedAdam', lr=1e-3))
        >>> # With torch's GradScaler the scale and the overflow flag go into the kernel:
        >>> scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        >>> # A mixed-precision wrapper holding fp32 masters in opt.param_groups:
        >>> half = list(model.parameters())  # single group; masters in opt.param_groups[0]
        >>> opt.fused_master_step([[p.grad for p in half]], [half],
        ...                       grad_scale=loss_scale, found_inf=found_inf)
    """

    _step_supports_amp_scaling: ClassVar[bool] = True
    supports_fused_master_step: ClassVar[bool] = True
    #: The op of ``mp_wrappers.ops.reference`` / ``torch.ops.mp_wrappers`` this optimizer calls.
    _op: ClassVar[str] = ''
    #: Per-parameter float32 state tensors shaped like the param (besides ``step``).
    _tensor_state: ClassVar[Tuple[str, ...]] = ()
    #: The group options that are True/False (checked as such: 'False' would be true).
    _flag_options: ClassVar[Tuple[str, ...]] = ()
    #: Per-parameter 1-element float32 state (NovoGrad's running grad norm).
    _scalar_state: ClassVar[Tuple[str, ...]] = ()
    #: ``state_dict()`` writes every state tensor as float32, as it does by itself when a param is
    #: flattened by FSDP1 (Note [optimizer state under FSDP1] in :mod:`.saved_state`).
    save_float32_state: bool = False

    def __init__(self, params: ParamsT, defaults: Dict[str, Any], set_grad_none: bool,
                 capturable: bool = False) -> None:
        _check_flag(type(self).__name__, 'set_grad_none', set_grad_none)
        _check_flag(type(self).__name__, 'capturable', capturable)
        self._check_group(defaults)
        self.set_grad_none = bool(set_grad_none)
        self.capturable = bool(capturable)
        if self.capturable and getattr(self, 'bf16_storage', None) is not None:
            # The lean kernels take lr as a number: set_bf16_storage refuses the combination.
            self.set_bf16_storage(self.bf16_storage)
        # Our own hyperparameters: torch's Optimizer.__setstate__ (run by load_state_dict) adds
        # 'differentiable' to self.defaults, which must not leak into resumed param groups.
        self._hyperparameter_keys = tuple(defaults)
        super().__init__(params, defaults)
        # Loaded here, eagerly, not at the first step: a step traced by torch.compile must find
        # the ops' implementations settled (Note [dispatch decided at registration]).
        extension()

    # ---- hooks for subclasses ----------------------------------------------------------------------

    def _check_hyperparameters(self, group: Dict[str, Any]) -> None:
        """Raise ValueError naming the option when a group's hyperparameter is invalid."""
        raise NotImplementedError

    def _check_group(self, group: Dict[str, Any]) -> None:
        """The group's True/False options (``_flag_options``), then its other hyperparameters."""
        for option in self._flag_options:
            if option in group:
                _check_flag(type(self).__name__, option, group[option])
        self._check_hyperparameters(group)

    def _tensor_state_keys(self, group: Dict[str, Any]) -> Tuple[str, ...]:
        """The tensor-state keys a param of ``group`` needs (SGD needs none without momentum)."""
        return self._tensor_state

    def _update_target(self, param: Tensor, state: Dict[str, Any],
                       model: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        """The tensor the op updates for ``param`` and the model copy it writes (FusedAdam's
        ``master_weights`` substitutes an internal fp32 master here)."""
        return param, model

    def _targets_are_params(self, with_models: bool) -> bool:
        """Whether ``_update_target`` returns every param and model copy as they are, and raises
        nothing, this step (Note [collect in one pass]); ``with_models``: the step writes
        model copies (a fused master step given at least one). A class overriding
        ``_update_target`` says when, here (else its steps collect one by one:
        buckets.one_pass_applies)."""
        return True

    def _init_extra_state(self, param: Tensor, state: Dict[str, Any]) -> None:
        """Create state beyond the declared tensors (FusedAdam's internal master)."""

    def _state_dtype(self, key: str, param: Tensor) -> torch.dtype:
        """The dtype of tensor state ``key`` of ``param`` (float32; the lean bf16 storages of
        :mod:`mp_wrappers.optim.lean` keep some in bf16 or uint16). It may depend on the param's
        dtype and its own state (8-bit codes stay uint8), not on anything else of the tensor: a
        step asks once per group and dtype (Note [collect fast path] in :mod:`.buckets`)."""
        return torch.float32

    def _slot_state_keys(self, group: Dict[str, Any], target: Tensor) -> Tuple[str, ...]:
        """The tensor-state keys whose lists the op gets for ``target`` (``_tensor_state_keys``
        plus per-param extras such as a lean storage's aux state). It may depend on the group and
        ``target``'s dtype only: a step asks once per group and dtype."""
        return self._tensor_state_keys(group)

    def _prepare(self, buckets: List[_Bucket], grad_scale: Optional[Tensor]) -> Any:
        """Work over all buckets before any update (LAMB's global grad norm); passed to _launch."""
        return None

    def _launch(self, bucket: _Bucket, grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
                prepared: Any) -> None:
        """Call the op once on ``bucket`` with its group's hyperparameters."""
        raise NotImplementedError

    # ---- torch.optim.Optimizer API -----------------------------------------------------------------

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a group after checking its hyperparameters (those it sets and the defaults)."""
        merged = dict(self.defaults)
        merged.update({k: v for k, v in param_group.items() if k != 'params'})
        self._check_group(merged)
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Reset the grads; ``set_to_none`` defaults to the constructor's ``set_grad_none``."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *,
             grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> Any:
        """Update every param that has a ``.grad``.

        Args:
            closure: Re-evaluates the model and returns the loss (run with grad enabled).
            grad_scale: 1-element float32 tensor the grads are divided by, e.g. a loss scale. When
                omitted, the ``grad_scale`` attribute ``torch.amp.GradScaler.step`` sets is used.
            found_inf: 1-element float32 flag; nonzero skips the whole update on the device. When
                omitted, the ``found_inf`` attribute set by GradScaler is used.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, 'grad_scale', None)
        if found_inf is None:
            found_inf = getattr(self, 'found_inf', None)
        self._update(None, None, grad_scale, found_inf)
        return loss

    @torch.no_grad()
    def fused_master_step(self, grads: Optional[Sequence[Sequence[Optional[Tensor]]]],
                          model_params: Optional[Sequence[Sequence[Optional[Tensor]]]],
                          grad_scale: Optional[Tensor] = None,
                          found_inf: Optional[Tensor] = None) -> None:
        """Update the fp32 masters in ``param_groups`` from half grads and write the half model.

        See the class docstring and Note [fused master step] for the protocol.

        Args:
            grads: Per group, per param: the (scaled) gradient to use, or None for ``param.grad``.
            model_params: Per group, per param: the model tensor receiving the rounded new value,
                or None.
            grad_scale: 1-element float32 tensor the grads are divided by.
            found_inf: 1-element float32 flag; nonzero skips params, state, step counters and
                model copies alike.
        """
        for name, nested in (('grads', grads), ('model_params', model_params)):
            if nested is None:
                continue
            if len(nested) != len(self.param_groups):
                raise ValueError(f'{type(self).__name__}.fused_master_step: {name} has '
                                 f'{len(nested)} groups but the optimizer has '
                                 f'{len(self.param_groups)}')
            for gi, (entries, group) in enumerate(zip(nested, self.param_groups)):
                if len(entries) != len(group['params']):
                    raise ValueError(f'{type(self).__name__}.fused_master_step: {name}[{gi}] has '
                                     f'{len(entries)} entries but param group {gi} has '
                                     f'{len(group["params"])} params')
        self._update(grads, model_params, grad_scale, found_inf)

    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state dict plus a layout version key (:mod:`.saved_state`); under FSDP1
        every state tensor as float32 (Note [optimizer state under FSDP1] there)."""
        saved = saved_state.versioned(super().state_dict())
        if self.save_float32_state or saved_state.holds_fsdp1_params(self.param_groups):
            saved = saved_state.with_float32_state(saved, self._float32_slot)
        return saved

    def _float32_slot(self, slot: Dict[str, Any]) -> Dict[str, Any]:
        """A saved param state as float32 tensors (subclasses convert what a cast cannot)."""
        return saved_state.float32_slot(slot)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict of this optimizer (or of the matching torch.optim one).

        The state stays in the dtypes this optimizer keeps (float32 moments for half params), and
        step counters of equal value are shared again (:mod:`.saved_state`).

        Raises:
            ValueError: When the layout version is unknown, the groups do not match, or a param's
                state lacks a tensor this optimizer needs.
        """
        name = type(self).__name__
        saved_state.check_version(state_dict, name)
        super().load_state_dict(state_dict)
        saved_state.reload_saved_tensors(state_dict, self.param_groups, self.state,
                                         self._state_dtype)
        for group in self.param_groups:
            saved_state.complete_group(group, self._hyperparameter_keys, self.defaults)
            self._check_group(group)
            saved_state.check_loaded_state(group, self.state,
                                           self._tensor_state_keys(group) + self._scalar_state,
                                           self._scalar_state, name, self._set_up_state_keys())
        saved_state.merge_step_cohorts(self.param_groups, self.state)
        self.mark_static_addresses()  # loaded tensors are new ones (a no-op off CUDA)

    def mark_static_addresses(self) -> None:
        """Mark the params and their state static for inductor's CUDA graphs
        (``compat.mark_static_addresses``): a replayed step updates them in place. Not the lr: a
        scheduler may replace it every step, and a graph only reads it."""
        compat.mark_static_addresses(
            [p for group in self.param_groups for p in group['params']]
            + [t for state in self.state.values() for t in state.values()])

    # ---- internals ---------------------------------------------------------------------------------

    def _set_up_state_keys(self) -> Tuple[str, ...]:
        """State a param may hold before its first step (saved_state.check_loaded_state)."""
        return ()

    def _init_state(self, param: Tensor, group: Dict[str, Any], step: Tensor) -> Dict[str, Any]:
        state = self.state[param]
        for key in self._tensor_state_keys(group):
            state[key] = layout.like(param, self._state_dtype(key, param)).zero_()
        for key in self._scalar_state:
            state[key] = torch.zeros(1, dtype=torch.float32, device=param.device)
        state['step'] = step
        self._init_extra_state(param, state)
        if self.capturable:  # replayed as CUDA graphs: updated in place, at one address
            compat.mark_static_addresses([param, *state.values()])
        return state

    def _collect(self, grads: Optional[Sequence[Sequence[Optional[Tensor]]]],
                 model_params: Optional[Sequence[Sequence[Optional[Tensor]]]],
                 writebacks: List[Tuple[Tensor, Tensor]]) -> List[_Bucket]:
        buckets: List[_Bucket] = []
        steps: List[Tensor] = []  # the step counters seen, keyed by position (buckets.identity)
        dtensor = dtensor_type()  # looked up once a step: the import costs more than isinstance
        # A wrapper's fused master step gives a row per group, None where a param has no copy
        # (every param stepped in place, as the lean masters are): only a real copy counts.
        one_pass = one_pass_applies(self, model_params is not None and any(
            m is not None for row in model_params for m in row))
        for gi, group in enumerate(self.param_groups):
            g = None if grads is None else grads[gi]
            m = None if model_params is None else model_params[gi]
            # Note [collect in one pass]: None when the group needs the one-by-one collection
            found = collect_in_one_pass(self, group, g, m, steps, dtensor) if one_pass else None
            buckets += self._collect_group(gi, group, g, m, steps, dtensor,
                                           writebacks) if found is None else found
        return buckets

    def _collect_group(self, gi: int, group: Dict[str, Any], grads: Optional[Sequence[Any]],
                       models: Optional[Sequence[Any]], steps: List[Tensor],
                       dtensor: Optional[type], writebacks: List[Tuple[Tensor, Tensor]]
                       ) -> List[_Bucket]:
        """The buckets of param group ``gi``, one param at a time (Note [collect fast path] in
        :mod:`.buckets`)."""
        buckets: Dict[tuple, _Bucket] = {}
        specs: Dict[torch.dtype, SlotSpec] = {}  # by target dtype, for this step only
        new_steps: Dict[torch.device, Tensor] = {}
        all_state, state_dtype, scalar_keys = self.state, self._state_dtype, self._scalar_state
        last_step, cohort = None, 0
        for pi, param, grad in with_grads(group['params'], grads):
            if grad.is_sparse:
                raise RuntimeError(f'{type(self).__name__} does not support sparse gradients '
                                   f'(param {pi} of group {gi}); use torch.optim.SparseAdam for '
                                   'sparse ones')
            model = None if models is None else models[pi]
            state = all_state[param]
            if 'step' not in state:
                state = self._init_state(param, group, new_step(new_steps, param.device))
            target, model = self._update_target(param, state, model)
            dtype = target.dtype  # a DTensor's is its local tensor's
            spec = specs.get(dtype)
            if spec is None:
                spec = specs[dtype] = self._slot_spec(group, target)
            if dtensor is not None and isinstance(target, dtensor):
                # FSDP2: update the local shards (mp_wrappers.distributed); every slot key: a lean
                # storage's extra state is a DTensor too.
                target, grad, model, state = local_slot(self, target, grad, model, state,
                                                        spec.keys)
            step = state['step']
            if step is not last_step:  # a group's params mostly share one (Note [step cohorts])
                last_step, cohort = step, identity(steps, step)
            # The key holds every device and dtype _check_slot looks at: checked once per bucket.
            key = (target.device, dtype, grad.device, grad.dtype,
                   None if model is None else (model.device, model.dtype), cohort)
            bucket = buckets.get(key)
            if bucket is None:
                self._check_slot(gi, pi, target, grad, model)
                bucket = buckets[key] = _Bucket(group, target.device, step,
                                                spec.keys + scalar_keys)
            if not add_contiguous(bucket, spec, target, grad, model, state, state_dtype):
                self._check_slot(gi, pi, target, grad, model)  # the key vouched for all but sizes
                add_strided(bucket, spec.keys, target, grad, model, state, state_dtype,
                            writebacks)
            for k in scalar_keys:
                bucket.states[k].append(state[k])
            bucket.slot_states.append(state)
        return list(buckets.values())

    def _slot_spec(self, group: Dict[str, Any], target: Tensor) -> SlotSpec:
        """The state keys and dtypes of the slots of ``group`` whose updated tensor has
        ``target``'s dtype, for this step (the hooks' contract: see their docstrings)."""
        keys = self._slot_state_keys(group, target)
        return SlotSpec(keys, tuple((k, self._state_dtype(k, target)) for k in keys))

    def _check_slot(self, gi: int, pi: int, target: Tensor, grad: Tensor,
                    model: Optional[Tensor]) -> None:
        """Raise naming param ``pi`` of group ``gi`` when its grad or model copy cannot pair with
        the tensor the op updates (not floating point, another device or size)."""
        name = type(self).__name__
        for what, t in (('gradient', grad), ('model param', model)):
            if t is None:
                continue
            if not t.is_floating_point():
                raise TypeError(f'{name}: the {what} of param {pi} of group {gi} has '
                                f'dtype {t.dtype}; expected a floating-point tensor')
            if t.device != target.device or t.numel() != target.numel():
                raise ValueError(f'{name}: the {what} of param {pi} of group {gi} is '
                                 f'{tuple(t.shape)} on {t.device}, but the param is '
                                 f'{tuple(target.shape)} on {target.device}')

    def _update(self, grads: Optional[Sequence[Sequence[Optional[Tensor]]]],
                model_params: Optional[Sequence[Sequence[Optional[Tensor]]]],
                grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        writebacks: List[Tuple[Tensor, Tensor]] = []
        buckets = self._collect(grads, model_params, writebacks)
        if not buckets:
            return
        # A step counter shared by several buckets (a group mixing dtypes) must advance once: each
        # of those buckets advances a copy, and one copy is written back (they all agree).
        steps: List[Tensor] = []  # lists, not dicts keyed by id(): they trace (buckets.identity)
        users: List[int] = []
        for bucket in buckets:
            i = identity(steps, bucket.step)
            users += [0] * (len(steps) - len(users))
            users[i] += 1
        for bucket in buckets:
            if users[identity(steps, bucket.step)] > 1:
                shared = bucket.step
                bucket.step = shared.clone()
                writebacks.append((shared, bucket.step))
        prepared = self._prepare(buckets, grad_scale)
        for bucket in buckets:
            self._launch(bucket, _scalar_on(grad_scale, bucket.device),
                         _scalar_on(found_inf, bucket.device), prepared)
        for dst, src in writebacks:
            dst.copy_(src.reshape(dst.shape))

    # Note [capturable]: a CUDA graph records kernel launches with their arguments, so a float lr
    # would be replayed forever with the value it had at capture, silently ignoring the schedule.
    # A group's lr may therefore be a 1-element float32 tensor on the params' device, which the
    # kernels read on the device when they run (the ops' lr_tensor). capturable=True makes every
    # group's lr such a tensor at its first step; LR schedulers that update tensor lrs in place
    # (torch.optim.lr_scheduler does) then drive the replays. mmengine's schedulers instead assign
    # a new tensor (group['lr'] * factor, in fp32): right in eager mode, unseen by a captured graph.
    # The other hyperparameters (betas, eps, weight decay, momentum) are fixed in a graph. The step
    # counters, grad_scale and found_inf already live on the device, and a step reads nothing back
    # to the host. A float lr met while a CUDA graph is being captured is an error, never a
    # baked-in constant.
    def _lr_args(self, group: Dict[str, Any], device: torch.device) -> Tuple[float, Optional[Tensor]]:
        """(lr, lr_tensor) for the op: the float, or the group's tensor lr (read on the device)."""
        lr = group['lr']
        if isinstance(lr, Tensor):
            if lr.device != device or lr.numel() != 1 or lr.dtype != torch.float32:
                raise ValueError(
                    f"{type(self).__name__}: param_groups[{_index_of(group, self.param_groups)}]"
                    "['lr'] "
                    f'is a tensor of dtype {lr.dtype} and shape {tuple(lr.shape)} on {lr.device}; '
                    f'a tensor lr must be a 1-element float32 tensor on the params\' device '
                    f'({device}): torch.tensor([lr], device={str(device)!r})')
            return 0.0, lr
        if _capturing(device):
            raise RuntimeError(
                f'{type(self).__name__}.step() is being captured in a CUDA graph with a float lr '
                f'({lr!r}): the graph would replay that value forever, ignoring any LR schedule. '
                'Build the optimizer with capturable=True and take one step before capturing (the '
                'lr becomes a device tensor that schedulers update in place), or set '
                "param_group['lr'] to a 1-element float32 tensor on the params' device")
        if self.capturable:
            group['lr'] = torch.full((1,), float(lr), dtype=torch.float32, device=device)
            return 0.0, group['lr']
        return float(lr), None

    def _call_op(self, bucket: _Bucket, *args: Any, op: Optional[str] = None) -> None:
        implementation(op or self._op, bucket.device)(*args)


def _index_of(group: Dict[str, Any], groups: List[Dict[str, Any]]) -> int:
    # By identity: list.index would compare other groups' dicts, tensors included, by value.
    return next(i for i, g in enumerate(groups) if g is group)


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (never while torch.compile
    traces: the query returns a bool dynamo cannot put in a graph, a break found on an H100, and
    inductor's CUDA graphs record the compiled code later, where this Python no longer runs; a
    float lr is a constant of a compiled graph, Note [compiled step])."""
    if device.type != 'cuda' or compat.is_compiling():
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _scalar_on(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    """A scale or flag as the ops take it: 1-element float32 on ``device`` (GradScaler's are 0-dim,
    and its summed flag lives on the scaler's device)."""
    if t is None:
        return None
    if not isinstance(t, Tensor) or t.numel() != 1:
        raise ValueError(f'grad_scale and found_inf must be 1-element tensors, got {t!r}')
    return t.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)
