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
"""
import contextlib
import dataclasses
from collections import deque
from typing import Any, Deque, Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ['defers_host_reads', 'simulate_accelerator', 'StepOutcome', 'OutcomeQueue',
           'HOST_COPY_ATTR']

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
