"""What a fused optimizer saves in ``state_dict()`` and how ``load_state_dict`` reads it back.

:class:`~mp_wrappers.optim.FusedOptimizer` keeps the two methods (they call these functions in
order): the saved dict is torch's plus a layout version key, with ``step`` as torch.optim writes it;
loading re-reads the saved state tensors in the dtypes the optimizer keeps (torch's loader would cast
fp32 moments to a half param's dtype), completes and checks the param groups, and shares the step
counters of equal value again (Note [step cohorts] in :mod:`mp_wrappers.optim.base`).

Note [optimizer state under FSDP1]
    FSDP1's optimizer state dicts (``FSDP.optim_state_dict``, 'full' and 'local'/sharded, as
    mmengine's ``FSDPStrategy`` and ours call them) gather every non-scalar state tensor of a param
    as per-element state shaped like the param piece, through one buffer per param and key whose
    dtype must be the same for all of the param's states on every rank. So when any param is
    flattened by FSDP1 (or ``save_float32_state`` is set), ``state_dict()`` writes every state tensor
    but ``step`` as float32: a lean storage's uint16 low half or bf16 compensation and bf16 moments
    exactly (float32 holds their values), 8-bit moments by ``dequantize_invertibly`` (Note [8-bit
    states under FSDP1] in :mod:`mp_wrappers.optim.quantized_state`). Loading turns each back into
    the dtype the optimizer keeps (:func:`reload_saved_tensors`, and the 8-bit conversion).
"""
from collections import defaultdict
from itertools import chain
from typing import Any, Callable, Dict, Iterable, List, Mapping, Sequence

import torch
from torch import Tensor

from ..sharding import is_fsdp1_flattened

__all__ = ['VERSION_KEY', 'VERSION', 'versioned', 'check_version', 'holds_fsdp1_params',
           'with_float32_state', 'float32_slot', 'reload_saved_tensors', 'complete_group',
           'check_loaded_state', 'merge_step_cohorts']

#: Top-level key of ``state_dict()``: the layout version of the per-parameter state written here.
VERSION_KEY = 'mp_wrappers_fused_optimizer_version'
VERSION = 1


def versioned(state: Dict[str, Any]) -> Dict[str, Any]:
    """torch's optimizer state dict ``state`` as we save it: 0-dim steps and the version key."""
    # 'step' as torch.optim writes it, a 0-dim tensor: FSDP's optimizer state dicts treat 1-D
    # state as sharded per-element state (mp_wrappers.distributed). Loading reshapes it back.
    state['state'] = {k: dict(v, step=v['step'].reshape(()))
                      if isinstance(v.get('step'), Tensor) and v['step'].numel() == 1 else v
                      for k, v in state['state'].items()}
    state[VERSION_KEY] = VERSION
    return state


def holds_fsdp1_params(param_groups: Sequence[Dict[str, Any]]) -> bool:
    """Whether any param of ``param_groups`` is managed by FSDP1 (Note [optimizer state under
    FSDP1])."""
    return any(is_fsdp1_flattened(p) for g in param_groups for p in g['params'])


def float32_slot(slot: Dict[str, Any]) -> Dict[str, Any]:
    """A saved param state with every tensor but ``step`` as float32 (a new dict)."""
    return {k: v.to(torch.float32) if isinstance(v, Tensor) and k != 'step' else v
            for k, v in slot.items()}


def with_float32_state(state: Dict[str, Any],
                       to_float32: Callable[[Dict[str, Any]], Dict[str, Any]]) -> Dict[str, Any]:
    """``state`` (a state dict) with each param's state replaced by ``to_float32(it)``: new dicts,
    since torch's may be the optimizer's live ones."""
    state['state'] = {k: to_float32(slot) for k, slot in state['state'].items()}
    return state


def check_version(state_dict: Mapping[str, Any], name: str) -> None:
    """Raise ValueError when ``state_dict`` was written in a layout this version cannot read."""
    version = state_dict.get(VERSION_KEY, VERSION)
    if version != VERSION:
        raise ValueError(f'{name}.load_state_dict: state layout version {version!r} is not '
                         f'supported (this version of mp_wrappers writes {VERSION})')


def reload_saved_tensors(state_dict: Mapping[str, Any], param_groups: Sequence[Dict[str, Any]],
                         state: Dict[Tensor, Dict[str, Any]],
                         state_dtype: Callable[[str, Tensor], torch.dtype]) -> None:
    """Replace the state torch's loader made with copies of the saved tensors on each param's
    device, floating ones in ``state_dtype(key, param)``, and ``step`` as a 1-element tensor."""
    # torch's loader casts every floating state tensor to its param's dtype, which would round
    # the fp32 moments of half params; and it returns the caller's own tensors when no cast is
    # needed. Re-read the saved values: fp32 copies on the param's device.
    saved_ids = chain.from_iterable(g['params'] for g in state_dict['param_groups'])
    params = chain.from_iterable(g['params'] for g in param_groups)
    for saved_id, param in zip(saved_ids, params):
        saved = state_dict['state'].get(saved_id)
        if saved is None:
            continue
        param_state = state[param]
        for key, value in saved.items():
            if isinstance(value, Tensor):
                # Integer state (a 'split' param's uint16 low half) keeps its dtype: torch's
                # loader would have converted it to the param's dtype by value.
                dtype = state_dtype(key, param) if value.is_floating_point() else value.dtype
                param_state[key] = value.to(device=param.device, copy=True, dtype=dtype)
        if 'step' in param_state and isinstance(param_state['step'], Tensor):
            param_state['step'] = param_state['step'].reshape(1)
        elif 'step' in param_state:  # a plain number from an older optimizer
            param_state['step'] = torch.full((1,), float(param_state['step']),
                                             device=param.device)


def complete_group(group: Dict[str, Any], hyperparameter_keys: Iterable[str],
                   defaults: Mapping[str, Any]) -> None:
    """Give a loaded param group the hyperparameters it lacks and its tensor lr on its device."""
    for key in hyperparameter_keys:
        # e.g. a torch.optim.Adam dict lacks adam_w_mode
        group.setdefault(key, defaults[key])
    lr = group['lr']
    if isinstance(lr, Tensor) and group['params']:
        # A tensor lr (Note [capturable]) saved from another device (mmengine resumes with
        # map_location='cpu'): the kernels read it where the params are.
        device = group['params'][0].device
        group['lr'] = lr.detach().to(device, torch.float32).reshape(1).clone()


def check_loaded_state(group: Dict[str, Any], state: Mapping[Tensor, Dict[str, Any]],
                       keys: Sequence[str], scalar_keys: Sequence[str], name: str,
                       set_up_keys: Sequence[str] = ()) -> None:
    """Raise ValueError when a param of ``group`` has state but lacks one of the tensors ``keys``
    (plus ``step``), or one has the wrong number of elements (1 for ``scalar_keys`` and ``step``).
    A state holding only ``set_up_keys`` is that of a param never stepped (a lean param's aux state,
    made when the storage is set up, e.g. for a head that gets no gradient) and passes."""
    for i, param in enumerate(group['params']):
        param_state = state.get(param)
        if not param_state or set(param_state) <= set(set_up_keys):
            continue
        for key in tuple(keys) + ('step',):
            value = param_state.get(key)
            if not isinstance(value, Tensor):
                raise ValueError(f'{name}.load_state_dict: the state of param {i} of its group '
                                 f'lacks the tensor {key!r} (has {sorted(param_state)}); was it '
                                 'saved by another optimizer?')
            want = 1 if key in scalar_keys or key == 'step' else param.numel()
            if value.numel() != want:
                raise ValueError(f'{name}.load_state_dict: state {key!r} of param {i} has '
                                 f'{value.numel()} elements, expected {want}')


def merge_step_cohorts(param_groups: Sequence[Dict[str, Any]],
                       state: Mapping[Tensor, Dict[str, Any]]) -> None:
    """Share one step tensor among the params of a group (and device) whose counts are equal.

    Runs at load time only, where reading the counts to the host is fine.
    """
    for group in param_groups:
        by_device: Dict[torch.device, List[Dict[str, Any]]] = defaultdict(list)
        for param in group['params']:
            param_state = state.get(param)
            if param_state and isinstance(param_state.get('step'), Tensor):
                by_device[param.device].append(param_state)
        for states in by_device.values():
            counts = torch.cat([s['step'].reshape(1) for s in states]).tolist()
            shared: Dict[float, Tensor] = {}
            for param_state, count in zip(states, counts):
                param_state['step'] = shared.setdefault(count, param_state['step'])
