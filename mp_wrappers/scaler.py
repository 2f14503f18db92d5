"""Loss scalers: a static scale and a dynamic one with apex amp's defaults, hysteresis and min/max.

State lives on the scaler as small tensors on the gradients' device (moved there lazily), so scaling a
loss, unscaling grads and updating the scale need no host synchronisation; ``loss_scale`` and the
counters are read on the host only when asked for (logging, checkpoints).

Both scalers are told of every optimizer step through :meth:`LossScaler.update` with the step's
``found_inf`` flag; a step whose gradients are not finite is always skipped by the wrappers, static
scales included (apex's static scaler applied such steps, and a NaN reached the weights). A static
scale itself never changes.

``state_dict()`` holds plain numbers only (loadable with ``torch.load(weights_only=True)``);
``load_state_dict()`` also adopts the state of torch's ``GradScaler`` (what mmengine's
``AmpOptimWrapper`` saves as ``loss_scaler``) and of an apex amp scaler (``apex_amp['loss_scaler0']``),
so users can switch wrappers mid-training.
"""
import math
from typing import Any, Dict, List, Optional, Union

import torch
from torch import Tensor

from . import compat
from .ops import update_scale_hysteresis_

__all__ = ['LossScaler', 'StaticLossScaler', 'DynamicLossScaler', 'build_loss_scaler',
           'DYNAMIC_LOSS_ARGS']

_STATE_VERSION = 1

# Accepted keys of ``dynamic_loss_args`` (apex's names plus scale_factor and hysteresis), with the
# defaults of apex amp's dynamic scaler.
DYNAMIC_LOSS_ARGS = dict(init_scale=2.0**16, scale_factor=2.0, scale_window=2000,
                         min_loss_scale=None, max_loss_scale=2.0**24, hysteresis=1)


def _positive_finite(option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f'{option} must be a positive finite number, got {value!r}')
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f'{option} must be a positive finite number, got {value!r}')
    return value


def _positive_int(option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{option} must be an integer >= 1, got {value!r}')
    return value


class LossScaler:
    """Common machinery of the static and dynamic scalers.

    Args:
        init_scale (float): The initial loss scale.
    """

    dynamic = False

    def __init__(self, init_scale: float) -> None:
        self._init_scale = init_scale
        self._host_scale = float(init_scale)  # mirror of the scale, kept only for is_unit
        self._device = torch.device('cpu')
        self._scale = torch.full((1,), init_scale, dtype=torch.float32)
        # Consecutive clean steps since the scale last changed (apex's ``unskipped``).
        self._growth_tracker = torch.zeros(1, dtype=torch.int32)
        self._hysteresis_tracker = torch.full((1,), self._hysteresis(), dtype=torch.int32)
        self._skipped_steps = torch.zeros(1, dtype=torch.int64)
        self._steps = torch.zeros(1, dtype=torch.int64)

    def _hysteresis(self) -> int:
        return 1

    # ---- device placement --------------------------------------------------------------------
    _STATE = ('_scale', '_growth_tracker', '_hysteresis_tracker', '_skipped_steps', '_steps')

    def to(self, device: Union[str, torch.device]) -> 'LossScaler':
        """Move the state tensors to ``device`` (done lazily by the wrappers on first use)."""
        device = torch.device(device)
        if device != self._device:
            for name in self._STATE:
                setattr(self, name, getattr(self, name).to(device))
            self._device = device
        return self

    def state_tensors(self) -> List[Tensor]:
        """The tensors the device-side update writes in place (scale, trackers, counters)."""
        return [getattr(self, name) for name in self._STATE]

    @property
    def device(self) -> torch.device:
        return self._device

    # ---- hot path ----------------------------------------------------------------------------
    @property
    def scale(self) -> Tensor:
        """The current scale as a 1-element float32 tensor on the scaler's device."""
        return self._scale

    def inv_scale(self) -> Tensor:
        """``1 / scale`` as a 1-element float32 tensor.

        Computed in float64 and rounded once: the scales are powers of two in practice, so this is
        exact, and for other static scales it is the correctly rounded reciprocal.
        """
        return self._scale.double().reciprocal().float()

    def scale_loss(self, loss: Tensor) -> Tensor:
        """Multiply ``loss`` by the current scale (in the loss's dtype, on the loss's device)."""
        if loss.device != self._device:
            self.to(loss.device)
        if self.is_unit:
            return loss  # x * 1.0 is x, inf and nan included: save the ops (tiny models feel them)
        return loss * self._scale.to(loss.dtype).reshape(())

    def update(self, found_inf: Tensor) -> None:
        """Record one optimizer step whose gradients had ``found_inf`` (nonzero: skipped)."""
        flag = found_inf.to(self._device).reshape(1)
        self._steps += 1
        if self._device.type == 'cpu' and not self.dynamic and not compat.is_compiling():
            # On the CPU reading the flag costs nothing and every tensor op a few microseconds,
            # which tiny models feel: the same counters, updated from the host. A compiled step
            # reads nothing on the host (Note [compiled step] in mp_wrappers.wrappers.compiled_step).
            if flag.item() > 0:
                self._skipped_steps.add_(1)
                self._growth_tracker.zero_()
            else:
                self._growth_tracker.add_(1)
            return
        self._skipped_steps += (flag > 0).to(torch.int64)
        self._update_scale(flag)

    def _update_scale(self, found_inf: Tensor) -> None:
        # A static scale never changes; count clean steps like apex's `unskipped` for checkpoints.
        self._growth_tracker.copy_(torch.where(found_inf > 0, torch.zeros_like(
            self._growth_tracker), self._growth_tracker + 1))

    def at_floor(self, scale: float) -> bool:
        """Whether an overflow at ``scale`` leaves no room to lower the scale (collapse watch)."""
        return True  # a static scale never goes down

    # ---- host-side views (synchronise; use at log intervals) -----------------------------------
    @property
    def loss_scale(self) -> float:
        return float(self._scale.item())

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        value = _positive_finite('loss_scale', value)
        self._scale.fill_(value)
        self._host_scale = value

    @property
    def is_unit(self) -> bool:
        """Whether this is a static scale of exactly 1.0: gradients need no unscaling (no host sync)."""
        return not self.dynamic and self._host_scale == 1.0

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because their gradients were not finite, since training began."""
        return int(self._skipped_steps.item())

    @property
    def steps(self) -> int:
        return int(self._steps.item())

    @property
    def unskipped(self) -> int:
        return int(self._growth_tracker.item())

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return dict(version=_STATE_VERSION, dynamic=self.dynamic, loss_scale=self.loss_scale,
                    unskipped=self.unskipped,
                    hysteresis_tracker=int(self._hysteresis_tracker.item()),
                    skipped_steps=self.skipped_steps, steps=self.steps)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load our own state, an apex amp scaler's, or a torch ``GradScaler``'s.

        Options (window, factor, bounds) come from the configuration, not the checkpoint; only the
        evolving state is restored. A static scaler keeps its configured scale.
        """
        if not isinstance(state, dict):
            raise TypeError(f'loss scaler state must be a dict, got {type(state).__name__}')
        if 'scale' in state and '_growth_tracker' in state:  # torch GradScaler
            scale, unskipped = state['scale'], state['_growth_tracker']
            hysteresis_left, skipped, steps = self._hysteresis(), None, None
        elif 'loss_scale' in state:  # ours, or apex amp's {'loss_scale', 'unskipped'}
            version = state.get('version', _STATE_VERSION)
            if version > _STATE_VERSION:
                raise ValueError(f'loss scaler state has version {version}; this mp_wrappers '
                                 f'reads versions <= {_STATE_VERSION}: upgrade mp_wrappers')
            scale, unskipped = state['loss_scale'], state.get('unskipped', 0)
            hysteresis_left = state.get('hysteresis_tracker', self._hysteresis())
            skipped, steps = state.get('skipped_steps'), state.get('steps')
        else:
            raise KeyError('loss scaler state has none of the known layouts (mp_wrappers/apex: '
                           "'loss_scale'; torch GradScaler: 'scale' and '_growth_tracker'); got "
                           f'keys {sorted(state)}')
        scale = _positive_finite('loss_scale in the loaded state', float(scale))
        if self.dynamic:
            self._scale.fill_(scale)
        self._growth_tracker.fill_(int(unskipped))
        self._hysteresis_tracker.fill_(int(hysteresis_left))
        if skipped is not None:
            self._skipped_steps.fill_(int(skipped))
        if steps is not None:
            self._steps.fill_(int(steps))

    def __repr__(self) -> str:
        return f'{type(self).__name__}(loss_scale={self.loss_scale})'


class StaticLossScaler(LossScaler):
    """A fixed loss scale. Steps with non-finite gradients are still detected and skipped.

    Args:
        loss_scale (float): The scale, a positive finite number (1.0 means no scaling).
    """

    def __init__(self, loss_scale: float = 1.0) -> None:
        super().__init__(_positive_finite('static_loss_scale', loss_scale))


class DynamicLossScaler(LossScaler):
    """apex amp's dynamic loss scaler, plus hysteresis (DeepSpeed/Megatron) and a configurable factor.

    The scale starts at ``init_scale``; a step with non-finite gradients is skipped and, after
    ``hysteresis`` consecutive such steps, the scale is divided by ``scale_factor`` (never below
    ``min_loss_scale``); after ``scale_window`` consecutive clean steps it is multiplied by
    ``scale_factor`` (never above ``max_loss_scale``).

    Args:
        init_scale (float): Initial scale. Defaults to 2**16 (apex amp).
        scale_factor (float): Growth and back-off factor, > 1. Defaults to 2.
        scale_window (int): Clean steps before growing. Defaults to 2000.
        min_loss_scale (float, optional): Floor of the scale. Defaults to None (no floor).
        max_loss_scale (float): Ceiling of the scale. Defaults to 2**24.
        hysteresis (int): Consecutive overflows needed to back off. Defaults to 1 (apex).

    Examples:
        >>> scaler = DynamicLossScaler(init_scale=2.**16, scale_window=1000, hysteresis=2)
    """

    dynamic = True

    def __init__(self, init_scale: float = DYNAMIC_LOSS_ARGS['init_scale'],
                 scale_factor: float = DYNAMIC_LOSS_ARGS['scale_factor'],
                 scale_window: int = DYNAMIC_LOSS_ARGS['scale_window'],
                 min_loss_scale: Optional[float] = DYNAMIC_LOSS_ARGS['min_loss_scale'],
                 max_loss_scale: Optional[float] = DYNAMIC_LOSS_ARGS['max_loss_scale'],
                 hysteresis: int = DYNAMIC_LOSS_ARGS['hysteresis']) -> None:
        init_scale = _positive_finite('init_scale', init_scale)
        self.scale_factor = _positive_finite('scale_factor', scale_factor)
        if self.scale_factor <= 1:
            raise ValueError(f'scale_factor must be > 1, got {scale_factor!r}')
        self.scale_window = _positive_int('scale_window', scale_window)
        self.hysteresis = _positive_int('hysteresis', hysteresis)
        self.min_loss_scale = (None if min_loss_scale is None else
                               _positive_finite('min_loss_scale', min_loss_scale))
        self.max_loss_scale = (None if max_loss_scale is None else
                               _positive_finite('max_loss_scale', max_loss_scale))
        if (self.min_loss_scale is not None and self.max_loss_scale is not None
                and self.min_loss_scale > self.max_loss_scale):
            raise ValueError(f'min_loss_scale={min_loss_scale!r} is greater than '
                             f'max_loss_scale={max_loss_scale!r}')
        if self.max_loss_scale is not None:
            init_scale = min(init_scale, self.max_loss_scale)
        if self.min_loss_scale is not None:
            init_scale = max(init_scale, self.min_loss_scale)
        super().__init__(init_scale)

    def _hysteresis(self) -> int:
        return self.hysteresis

    def _update_scale(self, found_inf: Tensor) -> None:
        update_scale_hysteresis_(
            self._scale, self._growth_tracker, self._hysteresis_tracker, found_inf,
            growth_factor=self.scale_factor, backoff_factor=1.0 / self.scale_factor,
            growth_interval=self.scale_window, hysteresis=self.hysteresis,
            min_scale=0.0 if self.min_loss_scale is None else self.min_loss_scale,
            max_scale=math.inf if self.max_loss_scale is None else self.max_loss_scale)

    def at_floor(self, scale: float) -> bool:
        # Without min_loss_scale the scale could keep halving, but below 1.0 fp16 gradients no
        # longer fit even unscaled: treat 1.0 as the floor for the collapse watch.
        floor = self.min_loss_scale if self.min_loss_scale is not None else 1.0
        return scale <= floor

    def __repr__(self) -> str:
        return (f'DynamicLossScaler(loss_scale={self.loss_scale}, scale_factor={self.scale_factor}, '
                f'scale_window={self.scale_window}, min_loss_scale={self.min_loss_scale}, '
                f'max_loss_scale={self.max_loss_scale}, hysteresis={self.hysteresis})')


def build_loss_scaler(dynamic: bool, static_loss_scale: float = 1.0,
                      dynamic_loss_args: Optional[Dict[str, Any]] = None) -> LossScaler:
    """Build a scaler from FP16_Optimizer-style arguments, validating ``dynamic_loss_args`` keys."""
    if dynamic_loss_args is not None and not isinstance(dynamic_loss_args, dict):
        raise TypeError(f'dynamic_loss_args must be a dict or None, got {dynamic_loss_args!r}')
    if not dynamic:
        if dynamic_loss_args:
            raise ValueError('dynamic_loss_args is only used with dynamic_loss_scale=True; got '
                             f'dynamic_loss_args={dynamic_loss_args!r} with a static scale')
        return StaticLossScaler(static_loss_scale)
    args = dict(dynamic_loss_args or {})
    unknown = sorted(set(args) - set(DYNAMIC_LOSS_ARGS))
    if unknown:
        raise ValueError(f'dynamic_loss_args has unknown keys {unknown}; allowed: '
                         f'{sorted(DYNAMIC_LOSS_ARGS)}')
    return DynamicLossScaler(**args)

