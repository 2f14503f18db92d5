"""The overflow flags of one optimizer step: which loss scalers took part and whether each saw inf/nan.

One flag per loss scaler, a 1-element fp32 tensor on the scaler's device that the unscaling kernels
set (``found_inf``), so nothing is read on the host until the step must decide. The flags are
cleared once the step is finished (applied or skipped) and its scalers updated.

Note [unit-scale check]: at a static scale of 1.0 nothing needs unscaling, so checking the
gradients would be a read pass of its own: 45 MB for ResNet-18, ~5 ms of a 0.69 s step on one core
of a Xeon VM, 1% (2% on two threads), the whole gap to mmengine's AmpOptimWrapper, which checks
nothing on CPU (its GradScaler disables itself there). apex does no check at a static 1.0 either.
By default (``grad_check='auto'``) the step then only checks the loss, in backward
(:meth:`StepFlags.check_loss`, a scalar, on the device): a non-finite loss is the usual way
non-finite gradients arise, and bf16 autocast's gradients are fp32 gradients of fp32 weights, which
overflow only where fp32 training would. amp_gnorm is computed at publications only.
``grad_check='always'`` restores the pass (it also yields the norm).
benchmarks/bench_o1_overhead.py measures both.

Note [non-finite norm]: finite gradients can have an infinite total norm: squares summed in fp32
overflow once elements pass ~1.8e19 (torch's fp32 norm does this on CPU), and a true norm above
fp32's max is inf in any accumulation. Clipping then computes coef = max_norm / inf = 0 and silently
zeroes every gradient (an Adam step still moves the weights through its moments). The wrappers treat
such a norm as an overflow instead, on every device and every step path: the flags are set
(:meth:`StepFlags.flag_nonfinite_norm`), the update is skipped and the scalers back off.
"""
import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops import new_found_inf
from ..scaler import LossScaler

__all__ = ['StepFlags']


class StepFlags:
    """This step's overflow flags, the scalers used in it and the one whose grads are pending.

    Args:
        scalers (Sequence[LossScaler]): The wrapper's loss scalers (the list itself, not a copy).

    Attributes:
        pending (int, optional): The scaler of the still scaled gradients in the model's ``.grad``.
        used (list[int]): The scalers that took part in the current step, in order of first use.
        loss_nonfinite (Tensor, optional): Whether a loss since the last step was not finite
            (kept with ``overflow_report`` only).
    """

    def __init__(self, scalers: Sequence[LossScaler]) -> None:
        self._scalers = scalers
        self._found_inf: Dict[int, Tensor] = {}
        self.pending: Optional[int] = None
        self.used: List[int] = []
        self.loss_nonfinite: Optional[Tensor] = None

    def flag(self, k: int) -> Tensor:
        """Scaler ``k``'s flag (made on its device at first use)."""
        flag = self._found_inf.get(k)
        if flag is None:
            flag = self._found_inf[k] = new_found_inf(self._scalers[k].device)
        return flag

    def used_flags(self) -> List[Tensor]:
        return [self.flag(k) for k in self.used]

    def backward_done(self, k: int) -> None:
        """Scaler ``k``'s scaled gradients are now in the model's ``.grad``."""
        self.pending = k
        if k not in self.used:
            self.used.append(k)

    def check_loss(self, loss: Tensor, k: int, report: bool) -> None:
        """Flag a non-finite loss at a unit scale (Note [unit-scale check]); with ``report``
        (``overflow_report``) also remember it for the report."""
        scaler = self._scalers[k]
        if report or (scaler.is_unit and loss.device.type != 'cpu'):
            bad = ~torch.isfinite(loss.detach()).all()
            if report:
                self.loss_nonfinite = bad if self.loss_nonfinite is None else \
                    self.loss_nonfinite | bad
            if scaler.is_unit:
                # A non-finite loss skips the step at a static 1.0 whether or not the gradients
                # are read; on the device, so no host sync here.
                flag = self.flag(k)
                torch.maximum(flag, bad.to(flag.dtype).reshape(1), out=flag)
        elif scaler.is_unit and loss.numel() == 1:  # the same check, from the host (free on CPU)
            if not math.isfinite(loss.item()):
                self.flag(k).fill_(1.0)

    def sync(self, want: Optional[bool], model_is_ddp: bool, loss_only: bool = False) -> None:
        """All-reduce (MAX) this step's flags across ranks when gradients are not.

        ``want``: the wrapper's ``sync_found_inf`` (None: when several ranks exist and DDP does
        not all-reduce the gradients). ``loss_only``: the flags come from each rank's own loss
        (Note [unit-scale check]), which DDP does not all-reduce, so they are synchronised under
        DDP too.
        """
        if want is None:
            want = (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
                    and (loss_only or not model_is_ddp))
        if want and self.used:
            flags = torch.cat(self.used_flags())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            for i, k in enumerate(self.used):
                self.flag(k).copy_(flags[i:i + 1])

    def found_inf(self) -> Optional[Tensor]:
        """Whether any scaler of the step saw inf/nan, on the device (None before any backward)."""
        flags = self.used_flags()
        if not flags:
            return None
        return flags[0] if len(flags) == 1 else torch.stack(flags).amax(0)

    def overflowed(self) -> bool:
        """:meth:`found_inf`, read on the host."""
        found_inf = self.found_inf()
        return bool(found_inf is not None and found_inf.item() > 0)

    def flag_nonfinite_norm(self, norm: Tensor) -> None:
        """Set this step's flags if ``norm`` is inf/nan (Note [non-finite norm]), on the device."""
        bad = (~torch.isfinite(norm)).reshape(1).to(torch.float32)
        for k in self.used:
            flag = self.flag(k)
            torch.maximum(flag, bad.to(flag.device), out=flag)

    def reset(self) -> None:
        """The step is finished: clear the flags and forget its scalers."""
        for flag in self._found_inf.values():
            flag.zero_()
        self.used = []
        self.pending = None
        self.loss_nonfinite = None
