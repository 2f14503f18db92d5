"""Public lean bf16 optimizer ops: Adam/AdamW and SGD on bf16 params without a separate fp32 master.

See Note [lean bf16 storage] in :mod:`mp_wrappers.ops.reference.lean` for what ``storage`` means
(``'split'``, ``'kahan'``, ``'stochastic'``) and what ``aux`` holds. Each function validates its
arguments the way :mod:`mp_wrappers.ops.optimizers` does and calls the implementation chosen by
:func:`~mp_wrappers.ops._dispatch.implementation` (kernel or reference). The argument order follows
the op schemas in ``csrc/bindings.cpp``.

:class:`mp_wrappers.optim.FusedAdam` / :class:`~mp_wrappers.optim.FusedSGD` with
``master_weights='split'|'kahan'|'stochastic'`` build these lists for you.
"""
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from .. import compat
from ._checks import (_check_adam_scalars, _check_lr, _check_scalar, _check_seed,
                      _check_sgd_hyper, _check_step, check_tensor_lists)
from ._dispatch import run
from .reference.lean import LEAN_STORAGES

__all__ = ['multi_tensor_adam_lean', 'multi_tensor_sgd_lean', 'LEAN_STORAGES']

_STATE_DTYPES = (torch.float32, torch.bfloat16)


def _check_lean(op: str, storage: str, params: List[Tensor], aux: List[Tensor],
                grads: List[Tensor], state: Sequence[tuple], allow_empty: Sequence[str] = ()
                ) -> torch.device:
    if storage not in LEAN_STORAGES:
        raise ValueError(f'{op}: storage={storage!r} is not allowed; expected one of '
                         f'{sorted(LEAN_STORAGES)}')
    if storage == 'split':
        compat.require('uint16')
    names = ('params', 'grads') + tuple(n for n, _ in state)
    device = check_tensor_lists(op, names, [params, grads] + [list(t) for _, t in state],
                                allow_empty=allow_empty)
    for i, p in enumerate(params):
        if p.dtype != torch.bfloat16:
            raise TypeError(f'{op}: params[{i}] has dtype {p.dtype}; storage={storage!r} holds '
                            'bfloat16 params')
    want = LEAN_STORAGES[storage]
    if want is None:
        if aux:
            raise ValueError(f"{op}: storage='stochastic' keeps no aux state; pass aux=[] "
                             f'(got {len(aux)} tensors)')
    else:
        if len(aux) != len(params):
            raise ValueError(f'{op}: aux has {len(aux)} tensors but params has {len(params)}; '
                             f'storage={storage!r} needs one {want} tensor per param')
        for i, (a, p) in enumerate(zip(aux, params)):
            if not isinstance(a, Tensor) or a.dtype != want:
                got = a.dtype if isinstance(a, Tensor) else type(a).__name__
                raise TypeError(f'{op}: aux[{i}] has dtype {got}; storage={storage!r} needs {want}')
            if a.device != device or not a.is_contiguous() or a.numel() != p.numel():
                raise ValueError(f'{op}: aux[{i}] must be a contiguous tensor on {device} with '
                                 f'{p.numel()} elements, got {tuple(a.shape)} on {a.device}')
    dtypes = {t.dtype for _, ts in state for t in ts}
    if not dtypes <= set(_STATE_DTYPES) or len(dtypes) > 1:
        raise TypeError(f'{op}: optimizer state has dtypes {sorted(map(str, dtypes))}; expected '
                        'one of float32 or bfloat16 for all state tensors')
    gdtypes = {g.dtype for g in grads}
    if len(gdtypes) > 1:
        raise TypeError(f'{op}: grads mixes dtypes {sorted(map(str, gdtypes))}; each list must '
                        'hold one dtype (call once per dtype)')
    return device


def multi_tensor_adam_lean(params: Sequence[Tensor], aux: Sequence[Tensor],
                           grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                           exp_avg_sqs: Sequence[Tensor], step: Tensor, lr: float, beta1: float,
                           beta2: float, eps: float, weight_decay: float, adam_w_mode: bool,
                           bias_correction: bool, storage: str, seed: int = 0,
                           grad_scale: Optional[Tensor] = None,
                           found_inf: Optional[Tensor] = None) -> None:
    """One Adam/AdamW update of bf16 ``params`` stored the ``storage`` way.

    Args:
        params: bfloat16 params, updated in place.
        aux: Per param: uint16 low halves (``'split'``), bf16 compensation (``'kahan'``), or an
            empty list (``'stochastic'``); updated in place.
        grads: Their gradients (any float dtype), scaled by ``grad_scale`` when given.
        exp_avgs, exp_avg_sqs: Moments, all float32 or all bfloat16, updated in place.
        step: 1-element float32 count of applied updates, incremented in place.
        lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction: As in
            :func:`~mp_wrappers.ops.multi_tensor_adam`.
        storage: ``'split'``, ``'kahan'`` or ``'stochastic'``.
        seed: Key of the stochastic-rounding hash (unused by the other storages).
        grad_scale: Optional 1-element float32 tensor the grads are divided by.
        found_inf: Optional 1-element float32 flag; nonzero skips everything.

    Examples:
        >>> hi, lo = bf16_split(fp32_master)            # the exact master, as two halves
        >>> multi_tensor_adam_lean([hi], [lo], [g], [m], [v], torch.zeros(1), 1e-3, 0.9, 0.999,
        ...                        1e-8, 0.01, True, True, 'split')
    """
    op = 'multi_tensor_adam_lean'
    params, aux, grads = list(params), list(aux), list(grads)
    exp_avgs, exp_avg_sqs = list(exp_avgs), list(exp_avg_sqs)
    device = _check_lean(op, storage, params, aux, grads,
                         [('exp_avgs', exp_avgs), ('exp_avg_sqs', exp_avg_sqs)])
    _check_adam_scalars(op, lr, beta1, beta2, eps, weight_decay, step, grad_scale, found_inf,
                        device, seed=seed)
    if params:
        run('multi_tensor_adam_lean_', device, params, aux, grads, exp_avgs, exp_avg_sqs, step,
             float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
             bool(adam_w_mode), bool(bias_correction), storage, int(seed), grad_scale, found_inf)


def multi_tensor_sgd_lean(params: Sequence[Tensor], aux: Sequence[Tensor], grads: Sequence[Tensor],
                          momentum_buffers: Sequence[Tensor], step: Tensor, lr: float,
                          momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                          wd_after_momentum: bool, storage: str, seed: int = 0,
                          grad_scale: Optional[Tensor] = None,
                          found_inf: Optional[Tensor] = None) -> None:
    """One SGD update of bf16 ``params`` stored the ``storage`` way (see
    :func:`multi_tensor_adam_lean` for ``aux``, ``storage`` and ``seed``; the math is
    :func:`~mp_wrappers.ops.multi_tensor_sgd`'s). ``momentum_buffers`` (all float32 or all
    bfloat16) may be empty when ``momentum == 0``.

    Examples:
        >>> multi_tensor_sgd_lean(params, comps, grads, bufs, torch.zeros(1), 0.1, 0.9, 0.0, 1e-4,
        ...                       True, False, 'kahan')
    """
    op = 'multi_tensor_sgd_lean'
    params, aux, grads, bufs = list(params), list(aux), list(grads), list(momentum_buffers)
    _check_lr(op, lr)
    _check_sgd_hyper(op, momentum, dampening, weight_decay, nesterov)
    allow_empty = ('momentum_buffers',) if momentum == 0 else ()
    device = _check_lean(op, storage, params, aux, grads, [('momentum_buffers', bufs)],
                         allow_empty=allow_empty)
    _check_seed(op, seed)
    _check_step(op, step, device)
    _check_scalar(op, 'grad_scale', grad_scale, device)
    _check_scalar(op, 'found_inf', found_inf, device)
    if params:
        run('multi_tensor_sgd_lean_', device, params, aux, grads, bufs, step, float(lr),
             float(momentum), float(dampening), float(weight_decay), bool(nesterov),
             bool(wd_after_momentum), storage, int(seed), grad_scale, found_inf)
