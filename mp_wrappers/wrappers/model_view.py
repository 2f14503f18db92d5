"""What a wrapper knows of the model it trains, learnt only in ``optim_context``.

The wrappers are built from an optimizer, before any model wrapper (DDP, FSDP) exists; the model
shows up at each forward. Whether DDP all-reduces the gradients (the overflow flags then need no
sync), how FSDP shards them (norms and clipping combine shards) and the parameters' names (for the
overflow report) are therefore looked up there, once per model object.
"""
import weakref
from typing import Any, Dict, Optional, Tuple

import torch
from mmengine.model import is_model_wrapper
from torch import Tensor, nn
from torch.optim import Optimizer

from .. import sharding as _sharding

__all__ = ['ModelView']


class ModelView:
    """The model last passed to ``optim_context``, as the step needs it.

    Attributes:
        is_ddp (bool): The model is wrapped in DistributedDataParallel.
        sharding (Sharding, optional): FSDP1/FSDP2's sharding of the model, None without FSDP.
    """

    def __init__(self) -> None:
        self.is_ddp = False
        self.sharding: Optional[_sharding.Sharding] = None
        # (weakref to the model last passed to optim_context, its unwrapped module)
        self._seen: Optional[Tuple[Any, nn.Module]] = None
        self._names: Dict[int, str] = {}
        self._names_for: Optional[int] = None

    def see(self, model: nn.Module, optimizer: Optimizer) -> Tuple[nn.Module, bool]:
        """``(the unwrapped module, whether this model object is new)``."""
        seen = self._seen
        new = seen is None or seen[0]() is not model
        if not new:
            # The same model object as last time: its wrapping cannot have changed (a fresh
            # DDP/FSDP wrapper is a new object), and these checks cost tiny models ~10% per step.
            module = seen[1]
        else:
            self.is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
            self.sharding = _sharding.sharding_of(model)
            if self.sharding is not None:
                _sharding.check_elementwise_optimizer(optimizer, self.sharding)
            module = model.module if is_model_wrapper(model) else model
            self._seen = (weakref.ref(model), module)
        if self._names_for != id(module):
            self._names = {id(p): n for n, p in module.named_parameters()}
            self._names_for = id(module)
        return module, new

    def name_of(self, param: Tensor) -> str:
        """The parameter's name (its shape when the model was never seen)."""
        return self._names.get(id(param), f'<param {tuple(param.shape)}>')
