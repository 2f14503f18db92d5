"""Validation and test loops that evaluate in the training precision: mmengine's ``fp16`` done right.

mmengine 0.10.7's ``ValLoop``/``TestLoop(fp16=True)`` wrap ``val_step``/``test_step`` in
``mmengine.runner.amp.autocast()``, which picks the dtype from the device alone: bf16 on CPU (and it
refuses anything else there), ``torch.get_autocast_gpu_dtype()`` (fp16) on CUDA. A model trained with
``dtype='float16'`` on CPU or ``dtype='bfloat16'`` on CUDA is then evaluated in the other half type.
:class:`MixedPrecisionValLoop` and :class:`MixedPrecisionTestLoop` are the same loops with the
autocast dtype taken from the training wrapper.

The precision evaluation runs in (the documented default):

* ``fp16=False`` (default): the model as it is. O2/O3 models (half weights; their inputs are cast by
  the wrapper's forward hooks) evaluate in their half dtype, fp32 models (O0, O1, ``FP16OptimWrapper``
  over fp32 weights, or a model loaded for ``runner.test()`` only) in fp32. No autocast.
* ``fp16=True``: the forward runs under ``torch.autocast`` on the model's device (CPU or CUDA) with
  ``dtype`` if given, else the training wrapper's half dtype (``ApexOptimWrapper``'s ``dtype``, or
  the dtype of the model's half parameters), else bf16 on CPU and fp16 on CUDA (mmengine's choice).

``tools/train.py`` switches a config's ``val_cfg``/``test_cfg`` to these loops when it trains with our
wrappers and names no loop type itself (:func:`use_mixed_precision_loops`), so
``val_cfg=dict(fp16=True)`` means the wrapper's dtype. With another train script, name the loop:
``val_cfg=dict(type='mp_wrappers.MixedPrecisionValLoop', fp16=True)``.
"""
import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import torch
from mmengine.evaluator import Evaluator
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapperDict
from mmengine.runner import TestLoop, ValLoop
try:  # mmengine >= 0.10.5 records the losses a val/test step returns; 0.10.4 has no such step
    from mmengine.runner.loops import _update_losses
except ImportError:
    _update_losses = None
from torch import nn
from torch.utils.data import DataLoader

from . import compat
from .casting import HALF_DTYPES, parse_dtype
from .registry import LOOPS

__all__ = ['MixedPrecisionValLoop', 'MixedPrecisionTestLoop', 'evaluation_dtype',
           'use_mixed_precision_loops']


def _model_device(model: nn.Module) -> torch.device:
    module = model.module if is_model_wrapper(model) else model
    for p in module.parameters():
        return p.device
    return torch.device('cpu')


def _wrapper_dtype(runner) -> Optional[torch.dtype]:
    """The half dtype of the first of our training wrappers, if the runner has one built."""
    from .wrappers.base import MixedPrecisionOptimWrapper
    optim_wrapper = getattr(runner, 'optim_wrapper', None)
    wrappers = list(optim_wrapper.values()) if isinstance(optim_wrapper, OptimWrapperDict) \
        else [optim_wrapper]
    for wrapper in wrappers:
        if not isinstance(wrapper, MixedPrecisionOptimWrapper):
            continue
        props = getattr(wrapper, 'properties', None)
        if props is not None and props.enabled and props.opt_level != 'O0':
            return props.dtype
        for group in wrapper.param_groups:
            for p in group['params']:
                if p.dtype in HALF_DTYPES:
                    return p.dtype
        masters = wrapper._masters
        if masters is not None:
            for _, model_p in masters.slots():
                if model_p is not None:
                    return model_p.dtype
    return None


def evaluation_dtype(runner, dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The autocast dtype of an ``fp16=True`` evaluation (see the module docstring)."""
    if dtype is not None:
        return dtype
    found = _wrapper_dtype(runner)
    if found is not None:
        return found
    module = runner.model.module if is_model_wrapper(runner.model) else runner.model
    for p in module.parameters():
        if p.dtype in HALF_DTYPES:
            return p.dtype
    return torch.bfloat16 if _model_device(runner.model).type == 'cpu' else torch.float16


class _EvaluationPrecision:
    """What the two loops share: the ``fp16``/``dtype`` options and the autocast context."""

    def _setup_precision(self, fp16: bool, dtype: Union[str, torch.dtype, None]) -> None:
        if not isinstance(fp16, bool):
            raise ValueError(f'{type(self).__name__}: fp16 must be True or False, got {fp16!r}')
        self.fp16 = fp16
        self.dtype = parse_dtype(dtype, f'{type(self).__name__}(dtype)')

    def __init__(self, runner, dataloader: Union[DataLoader, Dict],
                 evaluator: Union[Evaluator, Dict, List], fp16: bool = False,
                 dtype: Optional[str] = None) -> None:
        # mmengine's loop (next in the MRO) with its own autocast off: ours replaces it.
        super().__init__(runner, dataloader, evaluator, fp16=False)
        self._setup_precision(fp16, dtype)

    def _run_eval_iter(self, idx: int, data_batch: Sequence[dict], stage: str) -> None:
        """mmengine's ``ValLoop``/``TestLoop.run_iter`` (``stage`` 'val'/'test') with our precision
        context instead of its autocast."""
        self.runner.call_hook(f'before_{stage}_iter', batch_idx=idx, data_batch=data_batch)
        with self.precision_context():
            outputs = getattr(self.runner.model, f'{stage}_step')(data_batch)
        if _update_losses is not None:  # what mmengine's own run_iter does on this version
            outputs, losses = _update_losses(outputs, getattr(self, f'{stage}_loss'))
            setattr(self, f'{stage}_loss', losses)
        self.evaluator.process(data_samples=outputs, data_batch=data_batch)
        self.runner.call_hook(f'after_{stage}_iter', batch_idx=idx, data_batch=data_batch,
                              outputs=outputs)

    @contextlib.contextmanager
    def precision_context(self) -> Iterator[None]:
        """``torch.autocast`` with the evaluation dtype when ``fp16``, else nothing."""
        if not self.fp16:
            yield
            return
        device = _model_device(self.runner.model)
        dtype = evaluation_dtype(self.runner, self.dtype)
        if device.type == 'cpu' and dtype == torch.float16:
            compat.require('cpu_fp16')
        with torch.autocast(device_type=device.type, dtype=dtype):
            yield


@LOOPS.register_module()
class MixedPrecisionValLoop(_EvaluationPrecision, ValLoop):
    """mmengine's ``ValLoop`` whose ``fp16=True`` autocasts to the training wrapper's dtype.

    Args:
        runner (Runner): The runner.
        dataloader (DataLoader | dict): The validation dataloader or its config.
        evaluator (Evaluator | dict | list): The evaluator or its config.
        fp16 (bool): Evaluate under ``torch.autocast`` (see :mod:`mp_wrappers.loops`). Defaults to
            False: the model as it is (O2/O3 in their half dtype, fp32 models in fp32).
        dtype (str, optional): The autocast dtype (``'float16'``/``'bfloat16'``); default: the
            training wrapper's.

    Examples:
        >>> val_cfg = dict(type='mp_wrappers.MixedPrecisionValLoop', fp16=True)
    """

    @torch.no_grad()
    def run_iter(self, idx: int, data_batch: Sequence[dict]) -> None:
        self._run_eval_iter(idx, data_batch, 'val')


@LOOPS.register_module()
class MixedPrecisionTestLoop(_EvaluationPrecision, TestLoop):
    """mmengine's ``TestLoop`` whose ``fp16=True`` autocasts to the training wrapper's dtype.

    Args: as :class:`MixedPrecisionValLoop`.

    Examples:
        >>> test_cfg = dict(type='mp_wrappers.MixedPrecisionTestLoop', fp16=True)
    """

    @torch.no_grad()
    def run_iter(self, idx: int, data_batch: Sequence[dict]) -> None:
        self._run_eval_iter(idx, data_batch, 'test')


_OURS = {'val_cfg': 'mp_wrappers.MixedPrecisionValLoop',
         'test_cfg': 'mp_wrappers.MixedPrecisionTestLoop'}
_MMENGINE_DEFAULT = {'val_cfg': 'ValLoop', 'test_cfg': 'TestLoop'}


def use_mixed_precision_loops(cfg: Any) -> List[str]:
    """Point ``val_cfg``/``test_cfg`` at our loops when the config trains with our wrappers.

    Only entries that name no loop type, or mmengine's default ``ValLoop``/``TestLoop``, are
    changed; a config that picks its own loop keeps it.

    Args:
        cfg: The mmengine ``Config`` (modified in place).

    Returns:
        The keys changed (``'val_cfg'``, ``'test_cfg'``).
    """
    from .optim_config import uses_our_optim_wrapper
    if not uses_our_optim_wrapper(cfg):
        return []
    changed = []
    for key, ours in _OURS.items():
        loop = cfg.get(key, None)
        if not isinstance(loop, dict) or loop.get('type', _MMENGINE_DEFAULT[key]) not in (
                _MMENGINE_DEFAULT[key], f'mmengine.{_MMENGINE_DEFAULT[key]}'):
            continue
        loop = dict(loop)
        loop['type'] = ours
        cfg[key] = loop
        changed.append(key)
    return changed
