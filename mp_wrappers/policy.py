"""apex amp's opt levels as data, and the one function that applies and validates overrides.

The table (docs/semantics.md section 1):

===== ================= ===================== =================== ============== ==========
level cast_model_type   patch_torch_functions keep_batchnorm_fp32 master_weights loss_scale
===== ================= ===================== =================== ============== ==========
O0    float32           False                 None                False          1.0
O1    None              True                  None                None           "dynamic"
O2    half              False                 True                True           "dynamic"
O3    half              False                 False               False          1.0
===== ================= ===================== =================== ============== ==========

"half" is float16 as in apex, or bfloat16 with ``dtype='bfloat16'``; ``dtype='auto'`` picks the
format the training device computes natively (:func:`mp_wrappers.hardware.auto_dtype`), which is fp32
on a CPU without native half instructions: O1 then runs without autocast, O2/O3 keep an fp32 model,
and the wrapper's skipping, scaling and checkpoint behaviour stay. O1's "patched functions" are
``torch.autocast``: the dispatcher applies the cast policy, nothing in torch is patched.

Beyond apex, ``master_weights`` also accepts ``'split'``, ``'kahan'`` and ``'stochastic'`` for a bf16
model (O2/O3 with ``dtype='bfloat16'``): the lean storages of :mod:`mp_wrappers.master_modes`.
"""
import dataclasses
import math
from typing import Any, Optional, Union

import torch

from .casting import parse_dtype
from . import compat
from .master_modes import LEAN_MODES

__all__ = ['Properties', 'OPT_LEVELS', 'resolve_properties', 'DEFAULT']


class _Default:
    """Sentinel for "not given": an explicit value (even the default's) must always win."""

    def __repr__(self) -> str:
        return 'DEFAULT'


DEFAULT: Any = _Default()


@dataclasses.dataclass(frozen=True)
class Properties:
    """The resolved precision policy of one :class:`~mp_wrappers.ApexOptimWrapper`."""

    opt_level: str
    enabled: bool
    dtype: torch.dtype  # the compute type of O1-O3: a half type, or fp32 where 'auto' chose it
    cast_model_type: Optional[torch.dtype]
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: Optional[Union[bool, str]]  # True/False/None, or a lean mode (LEAN_MODES)
    loss_scale: Union[float, str]
    cast_model_outputs: Optional[torch.dtype]

    @property
    def lean_storage(self) -> Optional[str]:
        """``'split'``, ``'kahan'`` or ``'stochastic'`` when master_weights names one, else None."""
        return self.master_weights if isinstance(self.master_weights, str) else None

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 'dynamic'

    def describe(self) -> str:
        rows = [f'{f.name:<22}: {getattr(self, f.name)}' for f in dataclasses.fields(self)]
        return 'mp_wrappers ApexOptimWrapper properties:\n  ' + '\n  '.join(rows)


# Per level: cast_model_type ('half' = the chosen dtype), patch_torch_functions,
# keep_batchnorm_fp32, master_weights, loss_scale.
OPT_LEVELS = {
    'O0': (torch.float32, False, None, False, 1.0),
    'O1': (None, True, None, None, 'dynamic'),
    'O2': ('half', False, True, True, 'dynamic'),
    'O3': ('half', False, False, False, 1.0),
}


def _parse_bool_or_none(option: str, value: Any) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    if value in ('True', 'False'):  # apex accepts the strings (command-line friendly)
        return value == 'True'
    raise ValueError(f'{option}={value!r} is not allowed; expected True, False, "True", "False" '
                     'or None')


def _parse_loss_scale(value: Any) -> Union[float, str]:
    if value == 'dynamic':
        return 'dynamic'
    if isinstance(value, bool):
        raise ValueError(f'loss_scale={value!r} is not allowed; expected "dynamic" or a positive '
                         'number (a float or a numeric string such as "128.0")')
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(f'loss_scale={value!r} is not allowed; expected "dynamic" or a positive '
                         'number (a float or a numeric string such as "128.0")') from None
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f'loss_scale={value!r} must be "dynamic" or a positive finite number')
    return scale


def _parse_cast_type(option: str, value: Any) -> Union[torch.dtype, None, bool]:
    if value is None or value is False:
        return value
    try:
        return parse_dtype(value, option, allowed=('float16', 'bfloat16', 'float32'))
    except ValueError:
        raise ValueError(f"{option}={value!r} is not supported; allowed: 'float16', 'bfloat16', "
                         "'float32', None (the level's default) or False (no cast)") from None


def _check_opt_level(opt_level: Any) -> None:
    if not isinstance(opt_level, str) or opt_level not in OPT_LEVELS:
        hint = ''
        if isinstance(opt_level, str) and opt_level[:1] == '0':
            hint = (' The first character of the opt level is the letter "O" (as in "optimization"'
                    '), not the digit zero.')
        raise RuntimeError(f'Unexpected optimization level {opt_level!r}. Options are "O0", "O1", '
                           f'"O2", "O3".{hint}')


def _resolve_compute_dtype(dtype: Any, device: Union[str, torch.device, None]) -> torch.dtype:
    """The "half" of the level table: ``dtype``, with ``'auto'`` resolved for ``device``."""
    if isinstance(dtype, str) and dtype == 'auto':
        from .hardware import auto_dtype
        return auto_dtype(device).dtype
    try:  # None would mean no cast at all (resolve_properties lets it through where none is made)
        return parse_dtype(dtype, 'dtype', allowed=('float16', 'bfloat16', 'float32'),
                           allow_none=False)
    except ValueError:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: 'float16', 'bfloat16', "
                         "'float32', 'auto'") from None


def _parse_master_weights(master_weights: Any) -> Optional[Union[bool, str]]:
    """apex's True/False/None, or the name of a lean bf16 storage."""
    if isinstance(master_weights, str) and master_weights in LEAN_MODES:
        if master_weights == 'split':
            compat.require('uint16')  # its low halves are torch.uint16 (torch >= 2.3)
        return master_weights
    try:
        return _parse_bool_or_none('master_weights', master_weights)
    except ValueError:
        raise ValueError(f'master_weights={master_weights!r} is not allowed; expected True, '
                         'False, None (apex), or for a bf16 model one of '
                         f'{", ".join(repr(m) for m in LEAN_MODES)}') from None


def _check_level_overrides(opt_level: str, cast: Any, keep_bn: Optional[bool], master: Any,
                           patch: Optional[bool], cast_model_type: Any,
                           keep_batchnorm_fp32: Any, master_weights: Any) -> None:
    """apex's refusals of overrides the opt level forbids (its wording)."""
    if opt_level == 'O1':
        if cast not in (None, False, torch.float32):
            raise RuntimeError(
                'O1 inserts casts around Torch functions rather than model weights, so with O1 the '
                'model weights themselves should remain FP32. If you wish to cast the model to a '
                f"different type, use opt_level='O2' or 'O3'. cast_model_type was {cast_model_type}")
        if keep_bn is not None:
            raise RuntimeError(
                'With opt_level O1, batchnorm functions are automatically run in FP32, so '
                f'keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {keep_batchnorm_fp32}')
        if isinstance(master, str):
            raise RuntimeError(
                f'master_weights={master!r} stores a bf16 model without a separate fp32 master, but '
                'O1 keeps fp32 model weights (and, as in apex, master_weights must be None with '
                f"O1). Use opt_level='O2' (or 'O3') with dtype='bfloat16' for master_weights="
                f'{master!r}')
        if master is not None:
            raise RuntimeError(
                "It doesn't make sense to use master_weights with O1. With O1, your model weights "
                f'themselves should be FP32. master_weights was {master_weights}')
    elif patch:
        raise RuntimeError("patch_torch_functions=True should only be set by selecting "
                           f"opt_level='O1' (got opt_level={opt_level!r})")


def _check_lean_storage(master: str, half: torch.dtype, final_cast: Any, dtype: Any,
                        opt_level: str, cast_model_type: Any) -> None:
    """A lean storage needs a bf16 model."""
    if half != torch.bfloat16:
        why = ('an fp16 model has no such master' if half == torch.float16 else
               'an fp32 model needs no lean storage')
        raise ValueError(
            f"master_weights={master!r} needs dtype='bfloat16', got dtype={dtype!r}: the lean "
            'storages rely on a bf16 being the top half of an fp32 (same exponent range); '
            f"{why}. Use dtype='bfloat16', or master_weights=True")
    if final_cast != torch.bfloat16:
        raise ValueError(
            f'master_weights={master!r} needs a bf16 model, but opt_level={opt_level!r} with '
            f'cast_model_type={cast_model_type!r} keeps the model in {final_cast}. Use '
            "opt_level='O2' or 'O3' with dtype='bfloat16'")


def resolve_properties(opt_level: str = 'O1', *, dtype: Union[str, torch.dtype] = 'float16',
                       enabled: bool = True, loss_scale: Any = DEFAULT,
                       cast_model_type: Any = None, patch_torch_functions: Any = None,
                       keep_batchnorm_fp32: Any = None, master_weights: Any = None,
                       cast_model_outputs: Any = None,
                       device: Union[str, torch.device, None] = None) -> Properties:
    """Apply user overrides to an opt level's defaults, with apex's rules and errors.

    Any override that is not None replaces the level's default. ``loss_scale`` left at its default
    means ``'dynamic'`` for fp16 (mmengine passes ``'dynamic'``, overriding O0/O3's 1.0) and no
    scaling (1.0) for bf16 and fp32; an explicit value always wins. ``dtype='auto'`` is resolved
    for ``device`` (default: CUDA when available, else the CPU) by
    :func:`mp_wrappers.hardware.auto_dtype`; ``'float32'`` (explicit, or what ``'auto'`` chose)
    makes O1-O3 compute in fp32.

    Raises:
        RuntimeError: unknown opt level, or an override the level forbids (apex's wording).
        ValueError: a value of the wrong form (dtype, loss_scale, keep_batchnorm_fp32...).
    """
    _check_opt_level(opt_level)
    if not isinstance(enabled, bool):
        raise ValueError(f'enabled={enabled!r} must be True or False')
    if dtype is None and (opt_level == 'O0' or not enabled):
        half = None  # nothing is cast or autocast: the compute dtype does not matter (as ever)
    else:
        half = _resolve_compute_dtype(dtype, device)
    level_cast, level_patch, level_keep_bn, level_master, level_scale = OPT_LEVELS[opt_level]
    level_cast = half if level_cast == 'half' else level_cast

    cast = _parse_cast_type('cast_model_type', cast_model_type)
    keep_bn = _parse_bool_or_none('keep_batchnorm_fp32', keep_batchnorm_fp32)
    master = _parse_master_weights(master_weights)
    patch = _parse_bool_or_none('patch_torch_functions', patch_torch_functions)
    outputs = _parse_cast_type('cast_model_outputs', cast_model_outputs)
    _check_level_overrides(opt_level, cast, keep_bn, master, patch, cast_model_type,
                           keep_batchnorm_fp32, master_weights)

    if loss_scale is DEFAULT:
        scale: Union[float, str] = 'dynamic' if half == torch.float16 else 1.0
    else:
        scale = _parse_loss_scale(loss_scale)

    final_cast = level_cast if cast is None else (None if cast is False else cast)
    if isinstance(master, str):
        _check_lean_storage(master, half, final_cast, dtype, opt_level, cast_model_type)

    return Properties(
        opt_level=opt_level,
        enabled=enabled,
        dtype=half,
        cast_model_type=final_cast,
        patch_torch_functions=level_patch if patch is None else patch,
        keep_batchnorm_fp32=level_keep_bn if keep_bn is None else keep_bn,
        master_weights=level_master if master is None else master,
        loss_scale=scale,
        cast_model_outputs=outputs or None,
    )
