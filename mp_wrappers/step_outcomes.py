"""What the host learns of optimizer steps decided on the device, without waiting for it.

Note [deferred outcomes]: the fused master step needs no decision from the host. The optimizer
kernels skip their update where ``found_inf`` is set and the loss scaler grows or backs off on the
device, exactly as torch's ``GradScaler`` with a fused optimizer. What the host still wants from a
step is bookkeeping: whether it was skipped (``last_step_skipped``, apex's "Gradient overflow"
message), the scales before and after (that message, the scale-collapse watch) and whether the
norm to publish belongs to an applied step. On the CPU reading those flags costs nothing. On an
accelerator a read (``.item()``) waits until the device has run every kernel queued so far: the
host stops queuing the next iteration's work, and a CUDA-graph capture of the step breaks.

So on a CUDA device the wrapper packs the step's flags and scales into one small tensor, copies it
to pinned host memory without blocking, and records an event on that device's stream
(:class:`OutcomeQueue`). Later steps take the outcomes whose copies have landed (an event query, not
a sync); the host views (``last_step_skipped``/``overflow``, ``publish_scalars``, a direct step,
``load_state_dict``) wait for the rest, where a host read is expected anyway. The host therefore
learns of an overflow a step or so late, never wrongly: the outcomes are accounted in step order,
with the values the device computed. (This makes the eager step sync-free; it does not make the
wrapper's step capturable in a CUDA graph: the pinned copy, the event and the Python bookkeeping
run when the step is called.)

:func:`defers_host_reads` is the one place that decides which devices defer (CUDA; other device
types read the flags directly), and :func:`simulate_accelerator` lets the CPU test-suite run the
deferred path (with copies that land late) so that it is tested where CI runs, not only on a GPU.

:class:`OutcomeLedger` is the host's side of both paths: it numbers the steps, updates the loss
scalers with each step's flags (reading them on the host, or queuing them), and accounts for every
outcome in step order: ``last_step_skipped``, the "Gradient overflow" messages, the overflow report
and the scale-collapse watch (``on_scale_collapse``).
"""
import contextlib
import dataclasses
import logging
import warnings
from collections import deque
from typing import Any, Callable, Deque, Iterator, List, Optional, Sequence, Tuple

import torch
from mmengine.logging import print_log
from torch import Tensor

__all__ = ['defers_host_reads', 'simulate_accelerator', 'StepOutcome', 'OutcomeQueue',
           'OutcomeLedger', 'HOST_COPY_ATTR']

# (lag in polls) while simulate_accelerator() is active, else None.
_simulated_lag: Optional[int] = None


def defers_host_reads(device: torch.device) -> bool:
    """Whether a step on ``device`` hands its outcome to the host through :class:`OutcomeQueue`.

    CUDA, where a host read waits for the device; not the CPU, where it is free; not other device
    types, whose pinned memory and events this has not been tested with (they read directly).
    """
    if device.type == 'cpu':
        return _simulated_lag is not None
    return device.type == 'cuda'


@contextlib.contextmanager
def simulate_accelerator(lag: int = 1) -> Iterator[None]:
    """Treat CPU tensors as an accelerator's: steps take the deferred path (for tests).

    Args:
        lag (int): How many polls a step's outcome stays in flight before its copy "lands"; a
            blocking read always gets it. 0 lands at the first poll.
    """
    global _simulated_lag
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise ValueError(f'simulate_accelerator: lag must be an integer >= 0, got {lag!r}')
    previous, _simulated_lag = _simulated_lag, lag
    try:
        yield
    finally:
        _simulated_lag = previous


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """One optimizer step, as the device decided it.

    Attributes:
        seq (int): The wrapper's step number (0-based), to tell the latest step from older ones.
        iteration (int, optional): The training loop's iteration of the step (MessageHub
            ``iter``), None outside a loop.
        scalers (tuple): The loss scalers used in the step.
        flags (tuple): Per scaler: whether its gradients had inf/nan.
        scales_before / scales_after (tuple): Per scaler: the loss scale around the update.
        norm (float, optional): The gradient norm the step clipped with, if it clipped.
    """

    seq: int
    iteration: Optional[int]
    scalers: Tuple[int, ...]
    flags: Tuple[bool, ...]
    scales_before: Tuple[float, ...]
    scales_after: Tuple[float, ...]
    norm: Optional[float] = None

    @property
    def skipped(self) -> bool:
        return any(self.flags)


# Marks the host copies (an attribute of the tensor): reading one is no device synchronisation.
# The CPU test-suite's guard against host reads (tests/_sync_guard.py) lets these through.
HOST_COPY_ATTR = '_mp_wrappers_host_copy'


class _Landing:
    """A pinned host copy in flight and the event that says it has landed."""

    def __init__(self, packed: Tensor) -> None:
        self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        setattr(self.host, HOST_COPY_ATTR, True)
        # The copy and the event on the stream of the tensor's device (not the current device's:
        # a model on cuda:1 while cuda:0 is current).
        stream = torch.cuda.current_stream(packed.device)
        with torch.cuda.stream(stream):
            self.host.copy_(packed, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def landed(self) -> bool:
        return self.event.query()

    def wait(self) -> Tensor:
        self.event.synchronize()
        return self.host


class _SimulatedLanding:
    """:func:`simulate_accelerator`'s stand-in: a CPU copy that lands after ``lag`` polls."""

    def __init__(self, packed: Tensor, lag: int) -> None:
        self.host = packed.clone()
        setattr(self.host, HOST_COPY_ATTR, True)
        self.polls_left = lag

    def landed(self) -> bool:
        if self.polls_left == 0:
            return True
        self.polls_left -= 1
        return False

    def wait(self) -> Tensor:
        return self.host


class OutcomeQueue:
    """Steps whose outcomes are still on their way to the host, oldest first."""

    def __init__(self) -> None:
        # (seq, iteration, scalers, carries a norm, landing)
        self._pending: Deque[Tuple[int, Optional[int], Tuple[int, ...], bool, Any]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, seq: int, iteration: Optional[int], scalers: Sequence[int],
             flags: Sequence[Tensor], scales_before: Sequence[Tensor],
             scales_after: Sequence[Tensor], norm: Optional[Tensor] = None) -> None:
        """Start the host copy of one step's flags, scales and norm (1-element tensors)."""
        extra = [] if norm is None else [norm]
        packed = torch.cat([t.reshape(1).to(torch.float32)
                            for t in (*flags, *scales_before, *scales_after, *extra)])
        landing = (_SimulatedLanding(packed, _simulated_lag) if packed.device.type == 'cpu'
                   else _Landing(packed))
        self._pending.append((seq, iteration, tuple(scalers), norm is not None, landing))

    def take(self, wait: bool = False) -> Iterator[StepOutcome]:
        """The outcomes that have landed, in step order; all of them with ``wait=True``.

        Stops at the first copy still in flight, so an outcome is never taken before an older one.
        A generator that removes each outcome as it yields it: if accounting for one raises (the
        collapse policy's 'raise'), the later ones stay queued.
        """
        while self._pending:
            seq, iteration, scalers, has_norm, landing = self._pending[0]
            if not wait and not landing.landed():
                return
            self._pending.popleft()
            # A landed copy is read as it is: no event synchronisation outside a blocking take.
            values = (landing.wait() if wait else landing.host).tolist()
            n = len(scalers)
            yield StepOutcome(seq, iteration, scalers, tuple(v > 0 for v in values[:n]),
                              tuple(values[n:2 * n]), tuple(values[2 * n:3 * n]),
                              values[3 * n] if has_norm else None)

    def clear(self) -> None:
        self._pending.clear()


class OutcomeLedger:
    """The host's record of finished steps, in step order (see the module doc).

    The wrapper is read at each call (``owner``: its ``verbose``, ``overflow_report``,
    ``on_scale_collapse``, ``collapse_patience``, ``loss_scalers``, ``message_hub`` and
    ``grad_name``), as users and hooks may change its settings between steps.

    Attributes:
        seq (int): Steps finished (applied or skipped), numbering the outcomes.
        last_skipped (bool): Whether the latest accounted step was skipped.
        stuck_steps (int): Consecutive overflowing steps with no room to lower the scale.
        grad_norm (Tensor, optional): The norm of the unscaled gradients of the latest step
            (``amp_gnorm``), forgotten once that step turns out skipped.
    """

    def __init__(self) -> None:
        self.seq = 0
        self.last_skipped = False
        self.stuck_steps = 0
        self.grad_norm: Optional[Tensor] = None
        self._queue = OutcomeQueue()  # of fused steps on an accelerator, on their way to the host

    def __len__(self) -> int:
        """How many outcomes are still in flight."""
        return len(self._queue)

    def settle(self, scalers: Sequence[Any], used: Sequence[int], flags: Sequence[Tensor],
               skipped: bool, updated: Optional[Sequence[Tensor]] = None) -> StepOutcome:
        """Update the scalers used in a step with its flags and number it (host reads).

        ``updated``: the scales before the step, when the step has updated the scalers itself
        (a compiled step, Note [compiled step] in mp_wrappers.wrappers.compiled_step).
        """
        if updated is not None:
            before = [float(t.item()) for t in updated] if skipped else []
        else:
            before = [scalers[k].loss_scale for k in used] if skipped else []
            for k, flag in zip(used, flags):
                scalers[k].update(flag)
        if skipped:
            outcome = StepOutcome(self.seq, None, tuple(used),
                                  tuple(bool(flag.item() > 0) for flag in flags), tuple(before),
                                  tuple(scalers[k].loss_scale for k in used))
        else:
            outcome = StepOutcome(self.seq, None, tuple(used), (False,) * len(used), (), ())
        self.seq += 1
        return outcome

    def settle_deferred(self, scalers: Sequence[Any], used: Sequence[int],
                        flags: Sequence[Tensor], iteration: Optional[int],
                        norm: Optional[Tensor], updated: Optional[Sequence[Tensor]] = None
                        ) -> None:
        """:meth:`settle` without host reads: the outcome is queued (Note [deferred outcomes]).

        ``norm``: with ``clip_grad``, the norm mmengine logs as ``grad_norm`` at every applied
        step; it travels with the outcome and is logged when that arrives. ``updated``: as in
        :meth:`settle`.
        """
        if updated is not None:
            before = list(updated)
        else:
            before = [scalers[k].scale.clone() for k in used]
            for k, flag in zip(used, flags):
                scalers[k].update(flag)
        # push() packs the values now (in stream order), so the caller may clear the flags.
        self._queue.push(self.seq, iteration, used, flags, before,
                         [scalers[k].scale for k in used], norm=norm)
        self.seq += 1

    def arrived(self, wait: bool) -> Iterator[StepOutcome]:
        """The queued outcomes that have reached the host (all of them with ``wait``)."""
        if not self._queue:  # the common case (always on the CPU): nothing in flight
            return iter(())
        return self._queue.take(wait=wait)

    def catch_up(self, owner: Any, wait: bool) -> None:
        """Account for the queued outcomes that have arrived (all of them with ``wait``); a
        clipped step's norm goes to the MessageHub as mmengine's ``grad_norm`` then."""
        for outcome in self.arrived(wait):
            if outcome.norm is not None and not outcome.skipped:
                owner.message_hub.update_scalar(f'train/{owner.grad_name}', outcome.norm)
            self.account(outcome, owner, where_deferred(outcome, owner.message_hub.get_info('iter')))

    def account(self, outcome: StepOutcome, owner: Any, where: str,
                names: Optional[Callable[[], List[str]]] = None,
                loss_nonfinite: Optional[Tensor] = None) -> None:
        """One step's bookkeeping: overflow messages, the collapse watch, ``last_skipped``.

        ``names``: lists the parameters with non-finite gradients; None once the gradients are
        gone (a deferred outcome). ``loss_nonfinite``: whether a loss of the step was not finite.
        """
        self.last_skipped = outcome.skipped
        if not outcome.skipped:
            self.stuck_steps = 0
            return
        if outcome.seq == self.seq - 1:
            self.grad_norm = None  # the norm of a step that did not happen is not published
        self._react_to_overflow(outcome, owner, where, names, loss_nonfinite)
        if owner.verbose:
            for k, flagged, before, after in zip(outcome.scalers, outcome.flags,
                                                 outcome.scales_before, outcome.scales_after):
                if flagged:
                    verb = f'reducing loss scale to {after}' if after != before else \
                        f'keeps loss scale {after}'
                    print_log(f'Gradient overflow.  Skipping step, loss scaler {k} {verb}',
                              logger='current', level=logging.INFO)

    def _react_to_overflow(self, outcome: StepOutcome, owner: Any, where: str,
                           names: Optional[Callable[[], List[str]]],
                           loss_nonfinite: Optional[Tensor]) -> None:
        """Overflow report and the scale-collapse policy."""
        stuck = any(flagged and owner.loss_scalers[k].at_floor(before) for k, flagged, before
                    in zip(outcome.scalers, outcome.flags, outcome.scales_before))
        self.stuck_steps = self.stuck_steps + 1 if stuck else 0
        collapsed = (owner.on_scale_collapse != 'ignore'
                     and self.stuck_steps == owner.collapse_patience)
        if not (owner.overflow_report or collapsed):
            return
        if names is None:
            detail = ('parameters: not read (the step ran without host reads on the device; '
                      'overflow_report=True names them)')
        else:
            found = names()
            loss_bad = loss_nonfinite is not None and bool(loss_nonfinite.item())
            detail = (f'first parameters with non-finite gradients: {found or "none found"}; the '
                      f'loss itself was {"non-finite" if loss_bad else "finite"}'
                      if owner.overflow_report or found else f'parameters: {found or "none found"}')
        if owner.overflow_report:
            print_log(f'mp_wrappers overflow at {where}: {detail}', logger='current',
                      level=logging.WARNING)
        if collapsed:
            scales = ', '.join(f'{before}' for before in outcome.scales_before)
            msg = (f'mp_wrappers: the loss scale collapsed at {where}: {self.stuck_steps} '
                   f'consecutive steps had non-finite gradients while the scale ({scales}) could '
                   f'not go lower; {detail}. Training on is likely wasted: check the learning rate '
                   'and the data, try bfloat16, or set min_loss_scale lower.')
            if owner.on_scale_collapse == 'raise':
                raise FloatingPointError(msg)
            print_log(msg, logger='current', level=logging.WARNING)
            warnings.warn(msg, RuntimeWarning, stacklevel=5)


def where_direct(iteration: Optional[int], steps: int) -> str:
    """How messages name the step being finished: its iteration, or the optimizer step."""
    return f'iteration {iteration}' if iteration is not None else f'optimizer step {steps}'


def where_deferred(outcome: StepOutcome, now: Optional[int]) -> str:
    """:func:`where_direct` of a deferred outcome's own step, and when the host learned of it."""
    if outcome.iteration is None:
        return f'optimizer step {outcome.seq}'
    where = f'iteration {outcome.iteration}'
    if now is not None and now != outcome.iteration:
        where += f' (reported at iteration {now})'
    return where
