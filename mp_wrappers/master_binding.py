"""A wrapper's masters over their lifetime: made lazily, rebuilt with the optimizer, bound to the model.

:class:`MasterBinding` is the wrappers' side of Note [masters lifecycle] (in :mod:`mp_wrappers.master`):

* the masters are made from the wrapper's *current* optimizer on first use, and made again if the
  optimizer is replaced (mmengine's FSDP strategy does that), so nothing caches parameter lists
  beyond their optimizer; each set of masters comes with its own fp32 gradient stash;
* they are bound to the model's weights when training starts (:meth:`MasterBinding.prepare`, from
  ``initialize_count_status`` or the first ``optim_context``), once per set of masters, and once
  more at the first forward after ``initialize_count_status`` (hooks may write the weights in
  between); loading optimizer state unbinds them, so loaded masters are checked at the next bind;
* every module the wrapper sees (the model, or parts of it, as GANs pass them) gets a state-dict
  hook (:class:`~mp_wrappers.master.MastersInStateDict`) that saves the masters in place of the
  rounded half weights.

:class:`WrapperMasters` is the masters' side of the wrappers' API (a base class of
:class:`~mp_wrappers.wrappers.base.MixedPrecisionOptimWrapper`) over a :class:`MasterBinding`.
"""
import weakref
from typing import Any, Callable, Dict, List, Optional

from mmengine.model import is_model_wrapper
from torch import Tensor, nn
from torch.optim import Optimizer

from .master import GradStash, MasterParams, MastersInStateDict, bind_masters

__all__ = ['MasterBinding', 'WrapperMasters']

NewMasters = Callable[[Optional[Dict[int, Tensor]]], MasterParams]


class MasterBinding:
    """The masters of one wrapper, their gradient stash, and whether they are bound to the model.

    Attributes:
        masters (MasterParams, optional): The current masters (None until first needed).
        stash (GradStash): The fp32 unscaled gradients of the masters' slots.
        precast_weights (dict): ``id(half param) -> fp32 weight`` a cast by the wrapper rounded
            (ApexOptimWrapper O2), taken as the masters' values at the next bind.
        check_at_first_forward (bool): Bind (compare with the model) once more at the next
            ``optim_context``.
    """

    def __init__(self) -> None:
        self.masters: Optional[MasterParams] = None
        self.stash = GradStash()
        self.precast_weights: Dict[int, Tensor] = {}
        self.check_at_first_forward = False
        self._bound: Optional[MasterParams] = None  # the masters last bound to the model
        self._hooked: 'weakref.WeakKeyDictionary[nn.Module, Any]' = weakref.WeakKeyDictionary()

    def current(self, optimizer: Optimizer, new_masters: NewMasters) -> MasterParams:
        """The masters of ``optimizer``, made (unbound) when it is not the one they were made for."""
        if self.masters is None or self.masters.optimizer is not optimizer:
            self.rebuild(new_masters)
        else:
            self.masters.check_groups()
        return self.masters

    def rebuild(self, new_masters: NewMasters,
                initial_values: Optional[Dict[int, Tensor]] = None) -> None:
        """New masters (from ``initial_values`` where given), with a new stash, unbound."""
        self.masters = new_masters(initial_values)
        self.stash = GradStash()
        self._bound = None

    def unbind(self) -> None:
        """Check the masters against the model at the next :meth:`prepare` (after a load)."""
        self._bound = None

    def prepare(self, module: nn.Module, owner: object, masters: Callable[[], MasterParams]) -> None:
        """Bind the masters to ``module``'s weights when due, and hook its ``state_dict`` to save
        them (once per module). ``masters``: the wrapper's current masters, made on demand."""
        if self._bound is not self.masters or self.check_at_first_forward:
            current = masters()
            precast, self.precast_weights = self.precast_weights, {}
            bind_masters(current, module, precast)
            self._bound = current
            self.check_at_first_forward = False
        if module not in self._hooked:  # the per-iteration cost: a dict lookup
            self._hooked[module] = module._register_state_dict_hook(MastersInStateDict(owner))


class WrapperMasters:
    """The masters of a mixed-precision optimizer wrapper, as the wrapper and its users see them.

    Uses the wrapper's ``optimizer``, ``master_weights`` and ``_binding`` (a :class:`MasterBinding`);
    subclasses choose the master-weight mode with :meth:`_new_masters`.
    """

    def _new_masters(self, initial_values: Optional[Dict[int, Tensor]] = None) -> MasterParams:
        """Subclass hook: the master-weight mode (ApexOptimWrapper's lean bf16 storages)."""
        return MasterParams(self.optimizer, create_masters=self.master_weights,
                            initial_values=initial_values)

    def _master_params(self) -> MasterParams:
        return self._binding.current(self.optimizer, self._new_masters)

    def _rebuild_masters(self, initial_values: Optional[Dict[int, Tensor]] = None) -> None:
        self._binding.rebuild(self._new_masters, initial_values)

    @property
    def _masters(self) -> Optional[MasterParams]:
        return self._binding.masters

    @property
    def _stash(self) -> GradStash:
        return self._binding.stash

    def full_precision_weights(self) -> Dict[int, Tensor]:
        """``id(model param) -> fp32 master`` for every half param this wrapper keeps a master of.

        What checkpoints save and what ``mp_wrappers.MixedPrecisionEMAHook`` averages: the full-
        precision weights the optimizer steps. Params without a master (fp32 params, or half
        params at levels without masters) are not listed.
        """
        return self._master_params().full_precision_of()

    def _prepare_model(self, model: nn.Module) -> None:
        """Bind the masters to ``model``'s weights and hook its ``state_dict`` to save them.

        Subclasses that prepare the model further (casting) do it before calling this.
        """
        module = model.module if is_model_wrapper(model) else model
        self._binding.prepare(module, self, self._master_params)

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group; its fp16/bf16 params get fp32 masters (apex's add_param_group)."""
        self._master_params().add_param_group(param_group)

    def trains_half_weights(self) -> bool:
        """Whether the weights the model computes with are (or will be, once cast) fp16/bf16."""
        return self._master_params().has_half

    def master_params(self) -> List[Tensor]:
        """The params the inner optimizer steps (fp32 masters, and fp32 params as they are)."""
        return [slot for slot, _ in self._master_params().slots()]
