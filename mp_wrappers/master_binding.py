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
"""
import weakref
from typing import Any, Callable, Dict, Optional

from torch import Tensor, nn
from torch.optim import Optimizer

from .master import GradStash, MasterParams, MastersInStateDict, bind_masters

__all__ = ['MasterBinding']

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
