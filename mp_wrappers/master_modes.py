"""The storage modes of ``master_weights='split'|'kahan'|'stochastic'``: bf16 models without a
separate fp32 master copy (Note [lean bf16 storage] in :mod:`mp_wrappers.ops.reference.lean`).

:class:`~mp_wrappers.master.MasterParams` is ``master_weights=True`` (an fp32 master per bf16 param,
swapped into the optimizer). :class:`LeanMasterParams` has the same interface for the three lean
modes: the optimizer steps the bf16 model params themselves, and the optimizer (``FusedAdam`` /
``FusedSGD`` with ``bf16_storage``) keeps the per-element extra state:

=============== ===================== ===================================================================
mode            extra state            checkpoint
=============== ===================== ===================================================================
``'split'``     uint16 low half        model weights: the exact fp32 master (high + low half); wrapper
                                       state: the same fp32 masters as O2 writes them (interchangeable)
``'kahan'``     bf16 compensation      model weights: ``p + comp`` in fp32 (the best full-precision
                                       estimate); wrapper state: the bf16 params bit for bit, the
                                       compensation is optimizer state
``'stochastic'`` none                  model weights: the bf16 values in fp32 (exact)
=============== ===================== ===================================================================

A plain fp32 model therefore loads any of these checkpoints as full-precision weights, and
``--resume`` restores the bf16 params, their extra state and the optimizer bit for bit.
"""
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .master import MasterParams
from .ops.reference.lean import LEAN_STORAGES, bf16_join, bf16_split

__all__ = ['LEAN_MODES', 'LeanMasterParams', 'lean_mode']

#: The values of ``master_weights`` that select a lean storage.
LEAN_MODES = tuple(LEAN_STORAGES)


class LeanMasterParams(MasterParams):
    """bf16 params that are their own master (``'split'``), or go without one (``'kahan'``,
    ``'stochastic'``), with :class:`~mp_wrappers.master.MasterParams`'s interface.

    Args:
        optimizer (Optimizer): An mp_wrappers ``FusedAdam`` or ``FusedSGD`` (the optimizers with
            ``bf16_storage``) over the model's parameters.
        mode (str): ``'split'``, ``'kahan'`` or ``'stochastic'``.
        initial_values (dict, optional): ``id(bf16 param) -> fp32 weight`` it was cast from
            ('split' starts from them exactly, see :meth:`_start_from`).

    Raises:
        TypeError: the optimizer has no lean bf16 update.
        ValueError: an unknown mode, or the optimizer was built with another ``bf16_storage``.
    """

    def __init__(self, optimizer: Optimizer, mode: str,
                 initial_values: Optional[Dict[int, Tensor]] = None) -> None:
        if mode not in LEAN_MODES:
            raise ValueError(f'master_weights={mode!r} is not a lean storage; expected one of '
                             f'{LEAN_MODES}')
        if not hasattr(optimizer, 'set_bf16_storage'):
            raise TypeError(f'master_weights={mode!r} needs an optimizer with a fused lean bf16 '
                            f'update: mp_wrappers.FusedAdam or mp_wrappers.FusedSGD, got '
                            f'{type(optimizer).__name__}. Use one of them, or master_weights=True')
        current = getattr(optimizer, 'bf16_storage', None)
        if current not in (None, mode):
            raise ValueError(f'master_weights={mode!r} but the optimizer was built with '
                             f'bf16_storage={current!r}; set one of them only')
        super().__init__(optimizer, create_masters=False)
        optimizer.set_bf16_storage(mode)
        self.mode = mode
        if mode == 'split' and initial_values:
            self._start_from(initial_values)

    @torch.no_grad()
    def _start_from(self, values: Dict[int, Tensor]) -> None:
        """'split': make each bf16 param and its low half the exact fp32 weight it was cast from.

        O2's masters start from the fp32 weights the cast rounded (Note [masters lifecycle]);
        splitting the same values keeps 'split' bit-identical to O2 from the first step. The bf16
        param becomes the high half (rounded toward zero, the storage's forward weights).
        'kahan' and 'stochastic' keep no full-precision state: they start from the bf16 weights.
        """
        for row in self.lean_params():
            for p in row:
                value = values.get(id(p))
                if value is None or value.shape != p.shape or not value.is_floating_point():
                    continue
                hi, lo = bf16_split(value.to(device=p.device, dtype=torch.float32))
                p.copy_(hi)
                self.optimizer.lean_aux(p).copy_(lo)

    def lean_params(self) -> List[List[Tensor]]:
        """The bf16 params per group, in slot order (what the storage applies to)."""
        return [[p for p in g['params'] if p.dtype == torch.bfloat16]
                for g in self.optimizer.param_groups]

    @property
    def has_half(self) -> bool:
        return any(self.lean_params())

    def full_precision(self, param: Tensor) -> Tensor:
        """The fp32 weight ``param`` stands for: the exact master ('split'), ``p + comp``
        ('kahan'), or the bf16 value ('stochastic')."""
        aux = self.optimizer.lean_aux(param, create=False)
        if aux is None:  # before the first update: the bf16 value is the whole weight
            return param.detach().float()
        if self.mode == 'split':
            return bf16_join(param.detach(), aux)
        if self.mode == 'kahan':
            return param.detach().float() + aux.float()
        return param.detach().float()

    # ---- weights: the model params ARE the optimizer's params --------------------------------
    def copy_masters_to_model(self) -> None:
        """Nothing to copy: the update wrote the model params."""

    @torch.no_grad()
    def copy_model_to_masters(self) -> None:
        """Re-derive the extra state from the (just loaded) model weights: a zero low half / zero
        compensation, i.e. the master is the bf16 value, as O2 derives its masters from the model."""
        for row in self.lean_params():
            for p in row:
                aux = self.optimizer.lean_aux(p, create=False)
                if aux is not None:
                    aux.zero_()

    def state_dict(self) -> List[List[Tensor]]:
        """'split': the fp32 masters (O2's format); 'kahan': the bf16 params; 'stochastic': none."""
        if self.mode == 'split':
            return [[self.full_precision(p) for p in row] for row in self.lean_params()]
        if self.mode == 'kahan':
            return [[p.detach().clone() for p in row] for row in self.lean_params()]
        return [[] for _ in self.lean_params()]

    @torch.no_grad()
    def load_state_dict(self, saved: List[List[Tensor]]) -> None:
        """Restore the params (and low halves) from :meth:`state_dict` output, or from O2's fp32
        masters (a 'split' run resumes an O2 checkpoint exactly; 'kahan' rounds them to bf16)."""
        rows = self.lean_params()
        if not isinstance(saved, (list, tuple)) or len(saved) != len(rows):
            got = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
            raise ValueError(f'saved master weights have {got} param groups but the optimizer has '
                             f'{len(rows)}: the checkpoint is for another model or optimizer')
        if self.mode == 'stochastic' or all(len(s) == 0 for s in saved):
            return  # the model weights loaded with the checkpoint are exact bf16 values
        for g, (row, masters) in enumerate(zip(rows, saved)):
            if len(masters) != len(row):
                raise ValueError(f'param group {g}: the checkpoint has {len(masters)} master '
                                 f'weights but the model has {len(row)} bf16 parameters')
            for i, (p, m) in enumerate(zip(row, masters)):
                if not isinstance(m, Tensor) or m.shape != p.shape:
                    shape = tuple(m.shape) if isinstance(m, Tensor) else type(m).__name__
                    raise ValueError(f'param group {g}, master {i}: checkpoint shape {shape} does '
                                     f'not match the parameter shape {tuple(p.shape)}')
        for row, masters in zip(rows, saved):
            for p, m in zip(row, masters):
                m = m.to(p.device)
                if self.mode == 'split':
                    hi, lo = bf16_split(m.float())
                    p.copy_(hi)
                    self.optimizer.lean_aux(p).copy_(lo)
                else:
                    p.copy_(m)  # bf16 saved by 'kahan' is exact; fp32 from O2 is rounded

    # ---- checkpoints of the model ------------------------------------------------------------
    def register_state_dict_hook(self, module: nn.Module):
        """Make ``module.state_dict()`` hold :meth:`full_precision` weights (after the fp32 hook).

        Returns the removable handle.
        """
        def hook(mod: nn.Module, state_dict: Dict[str, Tensor], prefix: str,
                 local_metadata) -> Dict[str, Tensor]:
            lean = {id(p) for row in self.lean_params() for p in row}
            for name, param in mod.named_parameters():
                key = prefix + name
                if id(param) in lean and key in state_dict:
                    state_dict[key] = self.full_precision(param)
            return state_dict

        return module._register_state_dict_hook(hook)


def lean_mode(master_weights: object) -> Optional[str]:
    """``master_weights`` when it names a lean storage, else None."""
    return master_weights if isinstance(master_weights, str) and master_weights in LEAN_MODES \
        else None
