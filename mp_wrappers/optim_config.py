"""What an ``optim_wrapper`` config asks for, read from the config before anything is built.

The launcher needs to know whether the wrapper will cast the model (to cast it before DDP wraps
it), FSDP whether to let its own mixed precision make the half copies, the train script and the
loops whether the wrapper is one of ours: each reads it here, from the same resolved opt-level
properties the wrapper itself will use (:func:`mp_wrappers.policy.resolve_properties`).
"""
from typing import Any, Optional, Tuple

import torch
from mmengine.registry import OPTIM_WRAPPERS as ROOT_OPTIM_WRAPPERS

from .casting import parse_dtype
from .policy import Properties, resolve_properties
from .registry import OPTIM_WRAPPERS
from .wrappers import ApexOptimWrapper, FP16OptimWrapper, MixedPrecisionOptimWrapper

__all__ = ['optim_cfg_properties', 'model_cast_of', 'uses_our_optim_wrapper']

_APEX_TYPES = ('mp_wrappers.ApexOptimWrapper',)
_FP16_TYPES = ('mp_wrappers.FP16OptimWrapper',)
_PROPERTY_KEYS = ('enabled', 'loss_scale', 'cast_model_type', 'patch_torch_functions',
                  'keep_batchnorm_fp32', 'master_weights', 'cast_model_outputs', 'dtype')


def optim_cfg_properties(optim: Any) -> Optional[Properties]:
    """The resolved opt-level properties of an ``mp_wrappers.ApexOptimWrapper`` config.

    Args:
        optim: The ``optim_wrapper`` config (a dict), or anything else.

    Returns:
        :func:`~mp_wrappers.policy.resolve_properties` of its ``opt_level`` and overrides, or None
        when ``optim`` is not an ``ApexOptimWrapper`` config.
    """
    if not hasattr(optim, 'get'):
        return None
    type_ = optim.get('type', None)
    if not (type_ in _APEX_TYPES or type_ is ApexOptimWrapper):
        return None
    # An override set to None means the level's default, except dtype, where None is refused
    # (resolve_properties): the wrapper would refuse it too.
    kwargs = {k: optim[k] for k in _PROPERTY_KEYS
              if optim.get(k, None) is not None or (k == 'dtype' and k in optim)}
    return resolve_properties(optim.get('opt_level', 'O1'), **kwargs)


def model_cast_of(optim: Any) -> Tuple[Optional[torch.dtype], bool]:
    """(the dtype the configured wrapper casts the model to, keep norm layers fp32), or (None, _).

    ApexOptimWrapper casts at O2/O3 (or with a half ``cast_model_type`` override); FP16OptimWrapper
    with a half ``dtype`` (over an fp32 model; a half model is left as it is).
    """
    wrapper_type = optim.get('type', None)
    if wrapper_type in _FP16_TYPES or wrapper_type is FP16OptimWrapper:
        dtype = optim.get('dtype', None)
        if dtype is None or (isinstance(dtype, str) and dtype == 'auto'):
            return None, True  # no cast, or 'auto' (resolved per device by the wrapper)
        try:  # every spelling the wrapper takes: 'bf16', 'half', torch.bfloat16...
            cast = parse_dtype(dtype, 'dtype', allowed=('float16', 'bfloat16', 'float32'))
        except ValueError:
            return None, True  # the wrapper refuses it, naming what is allowed
        return (cast if cast in (torch.float16, torch.bfloat16) else None), True
    props = optim_cfg_properties(optim)
    if props is None:
        return None, True
    cast = props.cast_model_type
    if not props.enabled or cast is None or cast == torch.float32:
        return None, True
    return cast, bool(props.keep_batchnorm_fp32)


def _resolve_optim_wrapper_type(type_: Any, default_scope: Optional[str]) -> Any:
    """The class a config's ``optim_wrapper.type`` names, resolved as the Runner would."""
    if not isinstance(type_, str):
        return type_
    if '.' in type_:
        return ROOT_OPTIM_WRAPPERS.get(type_)  # 'mp_wrappers.X' finds our child registry from the root
    # Unprefixed: the default scope decides (mmengine has an ApexOptimWrapper of its own).
    if default_scope == OPTIM_WRAPPERS.scope:
        return OPTIM_WRAPPERS.get(type_)
    return ROOT_OPTIM_WRAPPERS.get(type_)


def uses_our_optim_wrapper(cfg: Any) -> bool:
    """Whether ``cfg.optim_wrapper`` builds an mp_wrappers optimizer wrapper.

    Looks at ``optim_wrapper.type`` and, for multi-optimizer configs (an ``OptimWrapperDict`` built
    by a constructor), at the ``type`` of every sub-dict.

    Args:
        cfg: The mmengine ``Config``.

    Returns:
        True when at least one wrapper is a :class:`~mp_wrappers.MixedPrecisionOptimWrapper`.
    """
    optim = cfg.get('optim_wrapper', None)
    if not isinstance(optim, dict):
        return False
    scope = cfg.get('default_scope', None)
    candidates = [optim] + [v for v in optim.values() if isinstance(v, dict) and 'type' in v]
    for entry in candidates:
        if 'type' not in entry:
            continue
        cls = _resolve_optim_wrapper_type(entry['type'], scope)
        if isinstance(cls, type) and issubclass(cls, MixedPrecisionOptimWrapper):
            return True
    return False
