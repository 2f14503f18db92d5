"""The optimizer wrappers' checkpoint format, and the foreign formats they load.

A wrapper's ``state_dict()`` is the inner optimizer's state (``state``, ``param_groups``, and
mmengine's ``base_param_settings``) plus, in this order:

* ``'mp_wrappers'`` (:data:`STATE_KEY`): ``version`` (:data:`STATE_VERSION`), ``wrapper`` (the class
  name), ``loss_scalers`` (one :meth:`~mp_wrappers.scaler.LossScaler.state_dict` per loss),
  ``fp32_master_params`` (the masters per param group, apex's ``fp32_from_fp16``), then the
  wrapper's own entries (``ApexOptimWrapper``: its precision policy; ``FP16OptimWrapper``: apex
  ``FP16_Optimizer``'s ``dynamic_loss_scale``/``overflow``/``first_closure_call_this_step``);
* ``'apex_amp'`` (``ApexOptimWrapper`` only): ``{'loss_scaler<k>': {loss_scale, unskipped}}`` as
  apex's ``amp.state_dict()`` writes it, so code written for apex checkpoints reads ours.

Everything is tensors and plain Python numbers (``torch.load(weights_only=True)`` reads it), and the
key order is part of the format: checkpoints are compared byte for byte (tests/golden_traces.py).
Loading also adopts mmengine ``AmpOptimWrapper``'s ``loss_scaler`` and apex's ``apex_amp``.
A version above :data:`STATE_VERSION` is refused; a checkpoint written by another wrapper or
precision policy loads with a :class:`CheckpointMismatchWarning`.

:class:`WrapperCheckpoint` is the wrappers' ``state_dict``/``load_state_dict`` in this format; the
functions below it read and write the parts.
"""
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from mmengine.logging import print_log
from torch import Tensor
from torch.optim import Optimizer

from ..master import MasterParams
from ..ops.quantized_states import num_blocks
from ..scaler import LossScaler

__all__ = ['WrapperCheckpoint', 'STATE_KEY', 'STATE_VERSION', 'APEX_KEY', 'FOREIGN_KEYS', 'CheckpointMismatchWarning',
           'LoadedState', 'wrapper_state', 'apex_amp_state', 'split_state_dict',
           'check_optimizer_state', 'load_masters_and_scalers', 'load_scaler_states',
           'warn_if_foreign']

# Our top-level key in the wrapper's state_dict (beside the optimizer's 'state' and 'param_groups').
STATE_KEY = 'mp_wrappers'
STATE_VERSION = 1
APEX_KEY = 'apex_amp'
# The keys a plain OptimWrapper (ApexOptimWrapper with enabled=False) drops before loading.
FOREIGN_KEYS = (STATE_KEY, APEX_KEY, 'loss_scaler')


class CheckpointMismatchWarning(UserWarning):
    """A checkpoint written by another wrapper or precision policy was loaded (what carried over)."""


class WrapperCheckpoint:
    """``state_dict``/``load_state_dict`` of :class:`~mp_wrappers.wrappers.base.MixedPrecisionOptimWrapper`.

    A base class of the wrapper (before mmengine's ``OptimWrapper``, whose methods ``super()`` calls
    reach), kept with the format it writes. It uses the wrapper's masters (``_master_params()``),
    ``loss_scalers``, step ledger (``_outcomes``, ``_take_outcomes``) and master binding
    (``_binding``); subclasses add entries with the three hooks below.
    """

    def _extra_state(self) -> Dict[str, Any]:
        """Subclass hook: more entries for our state key."""
        return {}

    def _load_extra_state(self, ours: Dict[str, Any]) -> None:
        """Subclass hook: read the entries added by :meth:`_extra_state`."""

    def _policy(self) -> Dict[str, Any]:
        """Subclass hook: the precision settings a checkpoint records and is compared on."""
        return {}

    def state_dict(self) -> dict:
        """Optimizer state + ``base_param_settings`` + ``'mp_wrappers'`` (scalers, fp32 masters).

        Everything is tensors and plain Python numbers: ``torch.load(weights_only=True)`` reads it.
        """
        masters = self._master_params()  # (re)made before the optimizer's state is read
        state = super().state_dict()
        state[STATE_KEY] = wrapper_state(type(self).__name__, self.loss_scalers, masters,
                                         self._extra_state())
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load optimizer, scaler and master state; validate it against the model first.

        Accepts dicts written by this wrapper, by mmengine's ``OptimWrapper``/``AmpOptimWrapper``
        (``loss_scaler``) and by apex-based wrappers (``apex_amp``). Without saved masters, the
        masters are re-derived from the model's (already loaded) weights.
        """
        loaded = split_state_dict(state_dict)
        self._take_outcomes(wait=True)  # account for the steps taken before the load first
        if loaded.ours is not None:
            self._warn_if_foreign(loaded.ours)
        masters = self._master_params()
        check_optimizer_state(self.optimizer, loaded.optimizer)
        super().load_state_dict(loaded.optimizer)  # pops base_param_settings, loads the optimizer
        load_masters_and_scalers(masters, self.loss_scalers, loaded)
        if loaded.ours is not None:
            self._load_extra_state(loaded.ours)
        self._outcomes.seq = self.loss_scalers[0].steps  # numbering continues from the checkpoint
        self._binding.unbind()  # check the loaded masters against the model at the next bind

    def _load_scalers(self, states: List[Dict[str, Any]], source: str) -> None:
        """Load scaler states (also for mp_wrappers.distributed.checkpoint's sharded resume)."""
        _load_scalers(self.loss_scalers, states, source)

    def _warn_if_foreign(self, ours: Dict[str, Any]) -> None:
        """Warn when the checkpoint came from another wrapper or policy (once per checkpoint)."""
        if getattr(self, '_foreign_checked', None) == id(ours):
            return  # ApexOptimWrapper checks at load time and loads at its first forward
        self._foreign_checked = id(ours)
        warn_if_foreign(ours, type(self).__name__, self._policy())


def wrapper_state(wrapper: str, scalers: Sequence[LossScaler], masters: MasterParams,
                  extra: Dict[str, Any]) -> Dict[str, Any]:
    """The entries under :data:`STATE_KEY`, in the format's order."""
    return dict(version=STATE_VERSION, wrapper=wrapper,
                loss_scalers=[s.state_dict() for s in scalers],
                fp32_master_params=masters.state_dict(), **extra)


def apex_amp_state(scalers: Sequence[LossScaler]) -> Dict[str, Dict[str, Any]]:
    """apex ``amp.state_dict()``'s layout of the scalers (the ``'apex_amp'`` entry)."""
    return {f'loss_scaler{k}': dict(loss_scale=s.loss_scale, unskipped=s.unskipped)
            for k, s in enumerate(scalers)}


@dataclass
class LoadedState:
    """A wrapper state_dict taken apart: the optimizer's part and the scaler/master entries."""
    optimizer: dict  # what mmengine's OptimWrapper.load_state_dict takes
    ours: Optional[Dict[str, Any]]  # STATE_KEY
    amp_scaler: Optional[Dict[str, Any]]  # mmengine AmpOptimWrapper's 'loss_scaler'
    apex_amp: Optional[Dict[str, Any]]  # apex's 'apex_amp'


def split_state_dict(state_dict: dict) -> LoadedState:
    """Take a checkpoint apart (never mutating it) and refuse versions newer than ours."""
    if not isinstance(state_dict, dict):
        raise TypeError(f'state_dict must be a dict, got {type(state_dict).__name__}')
    state = dict(state_dict)
    ours = state.pop(STATE_KEY, None)
    loaded = LoadedState(state, ours, state.pop('loss_scaler', None), state.pop(APEX_KEY, None))
    if ours is not None:
        version = ours.get('version', STATE_VERSION)
        if version > STATE_VERSION:
            raise ValueError(f"state_dict['{STATE_KEY}'] has version {version}; this "
                             f'mp_wrappers reads versions <= {STATE_VERSION}')
    return loaded


def load_masters_and_scalers(masters: MasterParams, scalers: Sequence[LossScaler],
                             loaded: LoadedState) -> None:
    """Load the saved masters (without any, re-derive them from the loaded model) and scalers."""
    ours = loaded.ours
    if ours is not None and 'fp32_master_params' in ours and masters.has_half:
        masters.load_state_dict(ours['fp32_master_params'])
    else:
        masters.copy_model_to_masters()
    load_scaler_states(scalers, loaded)


def load_scaler_states(scalers: Sequence[LossScaler], loaded: LoadedState) -> None:
    """Load the scalers from our entry, else apex's, else mmengine AmpOptimWrapper's."""
    ours, apex_amp = loaded.ours, loaded.apex_amp
    if ours is not None and 'loss_scalers' in ours:
        _load_scalers(scalers, ours['loss_scalers'], source='mp_wrappers')
    elif apex_amp is not None:
        if not isinstance(apex_amp, dict):
            raise TypeError(f"state_dict['apex_amp'] must be a dict, got {type(apex_amp).__name__}")
        keys = sorted((k for k in apex_amp if k.startswith('loss_scaler')),
                      key=lambda k: int(k[len('loss_scaler'):] or 0))
        _load_scalers(scalers, [apex_amp[k] for k in keys], source="apex's apex_amp")
    elif loaded.amp_scaler is not None:
        _load_scalers(scalers, [loaded.amp_scaler],
                      source="mmengine AmpOptimWrapper's loss_scaler")


def _load_scalers(scalers: Sequence[LossScaler], states: List[Dict[str, Any]],
                  source: str) -> None:
    n = len(scalers)
    if len(states) != n:
        # apex warns and loads what matches; so do we.
        warnings.warn(f'the checkpoint ({source}) holds {len(states)} loss scaler states but '
                      f'this wrapper has num_losses={n}; loading the first {min(n, len(states))}',
                      UserWarning, stacklevel=5)
    for scaler, st in zip(scalers, states):
        scaler.load_state_dict(st)


def warn_if_foreign(ours: Dict[str, Any], wrapper: str, policy: Dict[str, Any],
                    stacklevel: int = 4) -> None:
    """Warn (never silently accept) when the checkpoint came from another wrapper or policy.

    Switching wrappers or opt levels mid-training is allowed (optimizer state, masters and
    scaler state carry over where the parameters match, as with mmengine/apex checkpoints),
    but it changes the numerics, so it must be visible in the log.
    """
    mine = dict(wrapper=wrapper, **policy)
    diffs = [f'{k}={ours[k]!r} (now {k}={v!r})' for k, v in mine.items()
             if k in ours and ours[k] != v]
    if diffs:
        saved = ', '.join(f'{k}={ours[k]!r}' for k in mine if k in ours)
        msg = (f'loading a checkpoint written by {ours.get("wrapper", "?")} with {saved} '
               f'into {wrapper} with {", ".join(f"{k}={v!r}" for k, v in mine.items())}: '
               f'differs in {"; ".join(diffs)}. Optimizer state, fp32 masters and loss-scaler '
               'state carry over where the parameters match; the precision policy is the new one.')
        warnings.warn(msg, CheckpointMismatchWarning, stacklevel=stacklevel)
        print_log(f'mp_wrappers: {msg}', logger='current', level=logging.WARNING)


def check_optimizer_state(optimizer: Optimizer, state: dict) -> None:
    """Refuse optimizer state whose groups, counts or tensor shapes do not fit the model."""
    saved_groups = state.get('param_groups')
    if saved_groups is None or 'state' not in state:
        raise KeyError("optimizer state_dict needs 'state' and 'param_groups'; got keys "
                       f'{sorted(state)}')
    groups = optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise ValueError(f'the checkpoint has {len(saved_groups)} optimizer param groups but the'
                         f' optimizer has {len(groups)}')
    index_to_param = {}
    for g, (saved, group) in enumerate(zip(saved_groups, groups)):
        if len(saved['params']) != len(group['params']):
            raise ValueError(f'param group {g}: the checkpoint has {len(saved["params"])} '
                             f'parameters but the optimizer has {len(group["params"])}')
        index_to_param.update(zip(saved['params'], group['params']))
    for idx, param_state in state['state'].items():
        p = index_to_param.get(idx)
        if p is None:
            continue
        for name, value in param_state.items():
            # 1-element tensors are counters and scalars, not per-element state: the fused
            # optimizers' `step` and NovoGrad's norm have shape (1,) whatever the param's.
            # 8-bit moments carry one absmax per block (mp_wrappers.optim.quantized_state).
            if (isinstance(value, Tensor) and value.dim() > 0 and value.numel() != 1
                    and value.shape != p.shape
                    and not (name.endswith('_absmax') and value.numel() == num_blocks(p.numel()))):
                raise ValueError(f"optimizer state '{name}' of parameter {idx} has shape "
                                 f'{tuple(value.shape)} but the parameter has shape '
                                 f'{tuple(p.shape)}')
