"""The options every mixed-precision wrapper shares, and the checks of its options and optimizer.

``ApexOptimWrapper`` and ``FP16OptimWrapper`` take these as keyword arguments beside their own
(:class:`~mp_wrappers.wrappers.base.MixedPrecisionOptimWrapper` reads them):

    overflow_report (bool): On every skipped step, log the first parameters whose gradients
        hold inf/nan and whether the loss itself was non-finite. Defaults to False.
    on_scale_collapse (str): What to do when ``collapse_patience`` consecutive steps overflow
        while the scale cannot go lower (a static scale, or a dynamic one at its floor:
        ``min_loss_scale``, or 1.0 without one): ``'warn'`` (default), ``'raise'``
        (``FloatingPointError``) or ``'ignore'``.
    collapse_patience (int): See ``on_scale_collapse``. Defaults to 10.
    sync_found_inf (bool, optional): All-reduce (MAX) the overflow flag across ranks before
        deciding to skip. None (default) does it when a process group of several ranks exists
        and the model is not DDP-wrapped (DDP already all-reduces the gradients, so every rank
        sees the same inf); sharded setups need it.
    log_interval (int, optional): Iterations between publications of the ``amp_*`` scalars
        to the MessageHub during training (each costs a host sync on GPU, and, at a static
        scale of 1.0, one read of the gradients for ``amp_gnorm``). None: every 10, the
        LoggerHook's default; the wrappers' lifecycle hook sets it to the LoggerHook's
        interval. ``publish_now`` (True/False, set per iteration by that hook) overrides it;
        None (the default) uses ``log_interval``. Outside a training loop (no ``iter`` in the
        MessageHub) every step publishes.
    grad_check (str): Which steps read every gradient for inf/nan. ``'auto'`` (default): every
        step whose loss is scaled (dynamic, or a static scale other than 1.0: the unscaling
        pass checks for free) or whose gradients pass through fp32 master copies anyway (O2,
        ``FP16OptimWrapper`` over a half model); at a static scale of 1.0 with the gradients in
        place (O1/O3 in bf16, O0, ``FP16OptimWrapper`` over fp32 weights) only the loss is
        checked, a step whose loss is not finite being skipped, as apex does nothing there and
        mmengine's ``AmpOptimWrapper`` checks nothing on CPU: one read of every gradient per
        step would cost 1-2% of a ResNet-18 step (Note [unit-scale check] in overflow.py). ``'always'``:
        read every gradient on every step, so a finite loss with non-finite gradients is
        skipped too.
    compile_step (bool or dict): Run the device stages of the fused step (an optimizer with
        the fused master step such as ``mp_wrappers.FusedAdam``, the gradients of one scaler:
        the inf/nan check, the norm, norm clipping, the update and the loss scale's update)
        through ``torch.compile(fullgraph=True)``, as one graph; a dict gives ``torch.compile``'s
        other keywords (``backend``, ``mode``, ``dynamic``, ``options``). The bookkeeping after
        it stays eager, and steps that cannot fuse run eagerly. Needs torch >= 2.4
        (``compat`` feature ``fake_kernels``). Defaults to False. Note [compiled step] in
        :mod:`mp_wrappers.wrappers.compiled_step`.

Every refusal says what was given and what is allowed, at construction, before anything is changed.
"""
import math
from typing import Any

import torch
from torch.optim import Optimizer

from ..ops._checks import is_flag

__all__ = ['COLLAPSE_POLICIES', 'GRAD_CHECKS', 'check_options', 'check_optimizer', 'check_loss_id',
           'flag']

COLLAPSE_POLICIES = ('warn', 'raise', 'ignore')
GRAD_CHECKS = ('auto', 'always')


def _positive_int(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f'{name} must be an integer >= 1, got {value!r}')


def flag(name: str, value: Any) -> bool:
    """``bool(value)`` of True or False (``is_flag``): a string such as 'False' is refused, as
    ``bool()`` would take it as true."""
    if not is_flag(value):
        raise ValueError(f'{name}={value!r} must be True or False')
    return bool(value)


def check_options(optimizer: Any, accumulative_counts: Any, clip_grad: Any,
                  on_scale_collapse: Any, collapse_patience: Any, log_interval: Any,
                  grad_check: Any, sync_found_inf: Any) -> None:
    """Refuse wrapper options of the wrong type or value (see MixedPrecisionOptimWrapper)."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f'optimizer must be a torch.optim.Optimizer, got '
                        f'{type(optimizer).__name__}')
    if (isinstance(accumulative_counts, bool) or not isinstance(accumulative_counts, int)
            or accumulative_counts < 1):
        raise ValueError(f'accumulative_counts must be an integer >= 1, got '
                         f'{accumulative_counts!r}')
    _check_clip_grad(clip_grad)
    if on_scale_collapse not in COLLAPSE_POLICIES:
        raise ValueError(f'on_scale_collapse={on_scale_collapse!r} is not allowed; expected '
                         f'one of {COLLAPSE_POLICIES}')
    if collapse_patience is None:  # _positive_int lets None through (log_interval's default)
        raise ValueError('collapse_patience must be an integer >= 1, got None')
    _positive_int('collapse_patience', collapse_patience)
    _positive_int('log_interval', log_interval)
    if grad_check not in GRAD_CHECKS:
        raise ValueError(f'grad_check={grad_check!r} is not allowed; expected one of '
                         f'{GRAD_CHECKS}')
    if sync_found_inf is not None and not isinstance(sync_found_inf, bool):
        raise ValueError(f'sync_found_inf must be True, False or None, got {sync_found_inf!r}')


# The keywords of torch.nn.utils.clip_grad_norm_ / clip_grad_value_, which mmengine calls with the
# rest of clip_grad once it has popped 'type'.
CLIP_KEYS = {'norm': ('max_norm', 'norm_type', 'error_if_nonfinite', 'foreach'),
             'value': ('clip_value', 'foreach')}


def _positive_number(value: Any, strings: bool = False) -> bool:
    """Whether ``float(value)`` is > 0 (inf included, NaN not): numpy scalars and 0-d tensors
    are taken as torch takes them; strings only where torch documents them (norm_type='inf')."""
    if isinstance(value, (bool, bytes)) or (isinstance(value, str) and not strings):
        return False
    try:
        return float(value) > 0
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
        return False


def _check_clip_grad(clip_grad: Any) -> None:
    """Refuse a clip_grad that torch would take wrongly or only reject at the first step: a
    negative max_norm flips every gradient (the clip coefficient is negative), a misspelt key
    or a string limit fails inside the first step. An unknown 'type' is mmengine's to refuse.
    Whatever torch takes stays allowed: inf (log the norm, clip nothing), numpy scalars, 0-d
    tensors, norm_type='inf'."""
    if clip_grad is None:
        return
    if not isinstance(clip_grad, dict):
        raise TypeError(f'clip_grad must be a dict such as dict(max_norm=1.0) or None, got '
                        f'{clip_grad!r}')
    kind = clip_grad.get('type', 'norm')
    if kind not in CLIP_KEYS:
        return
    allowed = CLIP_KEYS[kind]
    unknown = sorted(k for k in clip_grad if k != 'type' and k not in allowed)
    if unknown:
        raise ValueError(f"clip_grad has unknown keys {unknown} for type={kind!r}; allowed: "
                         f'{list(allowed)}')
    limit = allowed[0]
    if limit not in clip_grad:
        raise ValueError(f'clip_grad needs {limit} (a positive number) for type={kind!r}, got '
                         f'{clip_grad!r}')
    if not _positive_number(clip_grad[limit]):
        raise ValueError(f"clip_grad {limit} must be a number > 0 (float('inf') clips nothing), "
                         f'got {clip_grad[limit]!r}')
    if 'norm_type' in clip_grad and not _positive_number(clip_grad['norm_type'], strings=True):
        raise ValueError(f"clip_grad norm_type must be a number > 0 (float('inf') or 'inf' for the "
                         f"max norm), got {clip_grad['norm_type']!r}")


def check_optimizer(optimizer: Optimizer, master_weights: bool, wrapper: str) -> None:
    """Refuse optimizers that cannot be trained in mixed precision, with a reason."""
    params = [p for g in optimizer.param_groups for p in g['params']]
    if not params:
        raise ValueError('the optimizer has no parameters to train')
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f'the optimizer holds parameters on several devices ({sorted(map(str, devices))}); '
                         'mixed-precision wrappers need them on one device')
    for i, p in enumerate(params):
        if not p.is_floating_point():
            raise TypeError(f'parameter {i} has dtype {p.dtype}; only floating-point parameters '
                            'can be optimized')
    if master_weights:
        _refuse_sharded_inner_optimizer(optimizer, wrapper)
        _refuse_unused_bf16_storage(optimizer, wrapper)


def _refuse_unused_bf16_storage(optimizer: Optimizer, wrapper: str) -> None:
    """Under fp32 master weights the optimizer steps fp32 masters, never a bf16 param: its own
    bf16 storage would be ignored silently, and bf16 moments (which need one) would fail at the
    first step. The wrapper's lean masters (ApexOptimWrapper master_weights='split' & co.) are the
    way to store bf16 params without fp32 masters."""
    name = type(optimizer).__name__
    lean = ("ApexOptimWrapper(opt_level='O2', dtype='bfloat16', master_weights='split', 'kahan' "
            "or 'stochastic')")
    storage = getattr(optimizer, 'bf16_storage', None)
    if storage is not None:
        raise ValueError(f'{wrapper} keeps fp32 master weights, so {name} never steps a bf16 '
                         f'param and its bf16_storage={storage!r} would be ignored. Drop '
                         f'bf16_storage, or let the wrapper store the bf16 params: {lean}')
    if getattr(optimizer, 'state_dtype', None) == torch.bfloat16:
        raise ValueError(f"{name}(state_dtype='bfloat16') needs a bf16 storage, which {wrapper}'s "
                         f'fp32 master weights leave unused: use state_dtype=\'float32\' (or '
                         f"'int8' with FusedAdam), or {lean}")


def _refuse_sharded_inner_optimizer(optimizer: Optimizer, wrapper: str) -> None:
    """Refuse fp32 masters over an optimizer that steps its own inner optimizer (ZeRO).

    ``ZeroRedundancyOptimizer`` builds a local optimizer over its shard of the parameters it was
    given and steps that one; masters swapped into its outer ``param_groups`` would receive the
    gradients and never be updated, while the inner optimizer steps half parameters whose
    gradients the wrapper consumed: the model would not train, silently.
    """
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # torch built without distributed support
        return
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        level = "opt_level='O2'" if wrapper == 'ApexOptimWrapper' else 'its fp32 master weights'
        raise ValueError(
            f'{wrapper} with {level} cannot step a {type(optimizer).__name__}: ZeRO steps its '
            'own inner optimizer over the model\'s parameters, so fp32 master weights would never '
            'be updated and the model would not train. Use ApexOptimWrapper with '
            "opt_level='O1' (fp32 weights, autocast) or opt_level='O3' (half weights, no masters) "
            "with ZeroRedundancyOptimizer, or keep opt_level='O2' with a plain optimizer, e.g. "
            "optimizer=dict(type='AdamW', lr=...).")


def check_loss_id(loss_id: Any, num_losses: int) -> None:
    """Refuse a ``loss_id`` that names no loss scaler."""
    n = num_losses
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < n:
        raise ValueError(f'loss_id={loss_id!r} is out of range: this wrapper has num_losses={n},'
                         f' so loss_id must be an integer in [0, {n - 1}]')
