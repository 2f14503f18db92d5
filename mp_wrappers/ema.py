"""``MixedPrecisionEMAHook``: mmengine's ``EMAHook``, averaging the full-precision weights.

mmengine's ``EMAHook`` deep-copies the model in ``before_run`` and averages
``model.named_parameters()`` into the copy with ``lerp_``. Under mixed precision that goes wrong two
ways: at ``ApexOptimWrapper`` O2/O3 the copy is taken from the fp32 model before the wrapper casts it
(the first forward), so ``lerp_`` meets bf16/fp16 parameters and fails; and over a half model
(``FP16OptimWrapper``) the copy is half too, so with a small momentum each update is below half a
unit in the last place and rounds away: the EMA silently stops moving.

Note [EMA and masters]
    This hook keeps mmengine's ``EMAHook`` and its averaged-model machinery (any ``ema_type``:
    ``ExponentialMovingAverage``, ``StochasticWeightAverage``, a toolbox's own) and changes only
    the precision:

    * the averaged copy is full precision: its half floating tensors are cast to fp32 once, in
      ``before_run``;
    * it is averaged from the full-precision weights the optimizer steps: the fp32 master of every
      half parameter that has one (``ApexOptimWrapper`` O2, ``FP16OptimWrapper``), the parameter
      itself otherwise (O0/O1 fp32 weights; O3's half weights, widened);
    * validation and test swap the EMA into the model by copying (the model's own weights are kept
      aside and restored), so the fp32 EMA never passes through the half parameters;
    * checkpoints hold the fp32 EMA under ``ema_state_dict`` and, as with ``EMAHook``, swapped into
      ``state_dict`` (where the wrappers' checkpoint hook already puts the fp32 masters), so both
      are full precision and resume is exact.
"""
import itertools
import logging
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from mmengine.hooks import EMAHook
from mmengine.logging import print_log
from torch import Tensor, nn

from .casting import HALF_DTYPES
from .registry import HOOKS
from .runner_adapter import replace_hook
from .wrappers.apex import ApexOptimWrapper
from .wrappers.base import MixedPrecisionOptimWrapper, mixed_precision_wrappers

__all__ = ['MixedPrecisionEMAHook', 'FullPrecisionSource', 'adopt_ema_hooks']


def _our_wrappers(runner) -> List[MixedPrecisionOptimWrapper]:
    return [w for _, w in mixed_precision_wrappers(getattr(runner, 'optim_wrapper', None))]


class FullPrecisionSource:
    """What an mmengine averaged model reads from its source model, in full precision.

    ``BaseAveragedModel.update_parameters(model)`` reads ``model.named_parameters()`` (or
    ``model.state_dict()`` with ``update_buffers=True``) and ``model.buffers()``. This object answers
    the same calls for ``module``, with each half parameter replaced by its fp32 master where one
    exists, and by an fp32 copy otherwise.

    Args:
        module (nn.Module): The (unwrapped) model being averaged.
        masters (dict): ``id(param) -> fp32 master`` (see
            :meth:`MixedPrecisionOptimWrapper.full_precision_weights`).
    """

    def __init__(self, module: nn.Module, masters: Dict[int, Tensor]) -> None:
        self.module = module
        self.masters = masters

    def _full(self, p: Tensor) -> Tensor:
        master = self.masters.get(id(p))
        if master is not None:
            return master.detach()
        return p.detach().float() if p.dtype in HALF_DTYPES else p.detach()

    def named_parameters(self) -> Iterator[Tuple[str, Tensor]]:
        for name, p in self.module.named_parameters():
            yield name, self._full(p)

    def state_dict(self) -> Dict[str, Tensor]:
        # The wrappers' checkpoint hook already puts the masters there; widen what is left half.
        return {k: (v.float() if isinstance(v, Tensor) and v.dtype in HALF_DTYPES else v)
                for k, v in self.module.state_dict().items()}

    def buffers(self) -> Iterator[Tensor]:
        return self.module.buffers()


@HOOKS.register_module()
class MixedPrecisionEMAHook(EMAHook):
    """mmengine's ``EMAHook`` with a full-precision average of the full-precision weights.

    Takes exactly ``EMAHook``'s arguments (``ema_type``, ``momentum``, ``update_buffers``,
    ``begin_iter``, ``begin_epoch``, ``strict_load``, ``priority``...); see Note [EMA and masters].
    At O0/O1 it behaves as ``EMAHook``. A configured ``EMAHook`` becomes this hook by itself when
    one of our wrappers trains half weights (``ApexOptimWrapper`` O2/O3, ``FP16OptimWrapper``; see
    :func:`adopt_ema_hooks`); naming it in the config says so explicitly, and is needed in place of
    a subclass of ``EMAHook``.

    Examples:
        >>> custom_hooks = [dict(type='mp_wrappers.MixedPrecisionEMAHook', momentum=2e-4,
        ...                      priority='ABOVE_NORMAL')]
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kept_src: Optional[List[Tensor]] = None

    @classmethod
    def adopt(cls, hook: EMAHook) -> 'MixedPrecisionEMAHook':
        """This hook with everything a configured mmengine ``EMAHook`` holds (arguments, priority,
        and the averaged copy if ``before_run`` already built it); see :func:`adopt_ema_hooks`."""
        new = cls.__new__(cls)
        new.__dict__.update(hook.__dict__)
        new._kept_src = None
        if getattr(new, 'ema_model', None) is not None:
            new._widen_average()
        return new

    def before_run(self, runner) -> None:
        """Build the averaged copy (``EMAHook``), then make it full precision."""
        super().before_run(runner)
        self._widen_average()

    def _widen_average(self) -> None:
        ema = self.ema_model
        if any(t.dtype in HALF_DTYPES for t in itertools.chain(ema.module.parameters(),
                                                                ema.module.buffers())):
            ema.module.float()
            # BaseAveragedModel keeps its own dict of the tensors it averages into: re-read it
            # from the widened copy, as its constructor does.
            ema.avg_parameters = (ema.module.state_dict() if ema.update_buffers
                                  else dict(ema.module.named_parameters()))

    def _source(self, runner) -> FullPrecisionSource:
        masters: Dict[int, Tensor] = {}
        for wrapper in _our_wrappers(runner):
            masters.update(wrapper.full_precision_weights())
        return FullPrecisionSource(self.src_model, masters)

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        """Average the full-precision weights (or copy them, before ``begin_iter``/``epoch``)."""
        source = self._source(runner)
        if self._ema_started(runner):
            self.ema_model.update_parameters(source)
        else:
            src = source.state_dict()
            for k, p in self.ema_model.module.state_dict().items():
                p.data.copy_(src[k].data)

    def _swap_ema_parameters(self) -> None:
        """Put the EMA into the model (first call), or restore the model's weights (second call).

        ``EMAHook`` swaps data both ways, which would round the fp32 EMA through half parameters
        at every validation; here the EMA is only read.
        """
        avg = (itertools.chain(self.ema_model.module.parameters(), self.ema_model.module.buffers())
               if self.ema_model.update_buffers else self.ema_model.module.parameters())
        src = (itertools.chain(self.src_model.parameters(), self.src_model.buffers())
               if self.ema_model.update_buffers else self.src_model.parameters())
        src = list(src)
        with torch.no_grad():
            if self._kept_src is None:
                self._kept_src = [p.data.clone() for p in src]
                for p_avg, p_src in zip(avg, src):
                    p_src.data.copy_(p_avg.data)
            else:
                for kept, p_src in zip(self._kept_src, src):
                    p_src.data.copy_(kept)
                self._kept_src = None


def _half_trainers(runner) -> List[str]:
    """Our wrappers in the runner that train half weights, as the messages name them."""
    return [type(w).__name__ + (f'(opt_level={w.opt_level!r})' if isinstance(w, ApexOptimWrapper)
                                else '')
            for w in _our_wrappers(runner) if w.trains_half_weights()]


def _ema_hook_config(hook: EMAHook) -> str:
    """The ``MixedPrecisionEMAHook`` config line that carries over ``hook``'s arguments."""
    cfg = dict(getattr(hook, 'ema_cfg', {}))
    args = dict(ema_type=cfg.pop('type', 'ExponentialMovingAverage'), **cfg)
    for name in ('begin_iter', 'begin_epoch', 'strict_load', 'priority'):
        if hasattr(hook, name):
            args[name] = getattr(hook, name)
    text = ', '.join(f'{k}={v!r}' for k, v in args.items())
    return f"custom_hooks=[dict(type='mp_wrappers.MixedPrecisionEMAHook', {text})]"


# The EMAHook methods MixedPrecisionEMAHook replaces: a subclass that keeps mmengine's versions of
# these (mmpretrain's EMAHook only adds evaluate_on_ema/evaluate_on_origin) is combined with it.
_REPLACED = ('before_run', 'after_train_iter', '_swap_ema_parameters')
_COMBINED: Dict[type, type] = {}


def _full_precision_class(cls: type) -> Optional[type]:
    """The hook class that runs ``cls`` in full precision, or None when ``cls`` changes what
    :class:`MixedPrecisionEMAHook` changes (then its behaviour cannot be kept)."""
    if cls is EMAHook:
        return MixedPrecisionEMAHook
    if any(getattr(cls, name) is not getattr(EMAHook, name) for name in _REPLACED):
        return None
    if cls not in _COMBINED:
        # MixedPrecisionEMAHook's methods first, then the subclass's own, then EMAHook's.
        _COMBINED[cls] = type(f'MixedPrecision{cls.__name__}', (MixedPrecisionEMAHook, cls),
                              {'__module__': __name__})
    return _COMBINED[cls]


def adopt_ema_hooks(runner) -> None:
    """Make mmengine's ``EMAHook`` average in full precision when our wrappers train half weights.

    Called by the wrappers' lifecycle hook (:mod:`mp_wrappers.lifecycle`) before the first
    optimizer step, and before ``EMAHook.before_run`` when the wrapper was built by the runner.
    A plain ``EMAHook`` would crash (O2/O3: ``lerp_`` of its fp32 copy with the half weights) or
    average in half precision, where small updates round away and the average silently stops
    moving (a half ``FP16OptimWrapper`` model). So each ``EMAHook`` is replaced in the runner by a
    :class:`MixedPrecisionEMAHook` holding the same arguments, state and priority (Note [EMA and
    masters]). A toolbox's subclass is combined with it when it keeps mmengine's versions of the
    methods that precision changes (:data:`_REPLACED`; mmpretrain's ``EMAHook`` does); one that
    overrides them stops training with the config line to use instead.

    Raises:
        RuntimeError: an ``EMAHook`` subclass that overrides those methods would average half
            weights.
    """
    plain = [h for h in runner.hooks
             if isinstance(h, EMAHook) and not isinstance(h, MixedPrecisionEMAHook)]
    if not plain:
        return
    half = _half_trainers(runner)
    if not half:
        return
    for hook in plain:
        cls = _full_precision_class(type(hook))
        if cls is None:
            raise RuntimeError(
                f'{type(hook).__name__} (an EMAHook subclass) cannot average a model trained with '
                f'{", ".join(half)}: its copy would be taken before the model is cast (lerp_ then '
                'fails on the half weights) or be half itself (small EMA updates round away and '
                'the average silently stops moving), and it overrides '
                f'{", ".join(n for n in _REPLACED if getattr(type(hook), n) is not getattr(EMAHook, n))}'
                ', which full-precision averaging must replace. Use '
                f'{_ema_hook_config(hook)} in place of {type(hook).__name__}, or train at '
                'opt_level O0/O1 (fp32 weights).')
        new = cls.adopt(hook)
        replace_hook(runner, hook, new)
        print_log(f'mp_wrappers: {type(hook).__name__} averages the full-precision weights of '
                  f'{", ".join(half)} (it runs as {cls.__name__}, with the same arguments)',
                  logger='current', level=logging.INFO)


# Note [EMA loaded before before_run]
#     mmengine's ``FlexibleRunner`` (FSDP1, DeepSpeed, ... strategies) runs ``load_from``/``resume``
#     before ``before_run``, where ``EMAHook`` builds its averaged model: the hook's
#     ``after_load_checkpoint`` then finds none (``AttributeError``, mmengine 0.10.7), and an average
#     built afterwards would be a fresh copy of the model, the loaded one lost. The wrappers'
#     lifecycle hook runs first at every event: at ``after_load_checkpoint`` it builds the averaged
#     model of each such hook (``EMAHook.before_run``) so that the hook loads into it
#     (:func:`build_averages_before_load`), and after ``before_run`` replaced it, puts the loaded one
#     back (:func:`keep_loaded_averages`). ``mmengine``'s ``Runner`` builds before loading: nothing
#     to do there.
_LOADED = '_mp_wrappers_loaded_average'


def build_averages_before_load(runner) -> None:
    """Build the averaged model of every ``EMAHook`` that has none yet (Note [EMA loaded before
    before_run])."""
    for hook in runner.hooks:
        if isinstance(hook, EMAHook) and getattr(hook, 'ema_model', None) is None:
            hook.before_run(runner)
            setattr(hook, _LOADED, hook.ema_model)


def keep_loaded_averages(runner) -> None:
    """Give back to each ``EMAHook`` the averaged model it loaded before ``before_run`` (Note [EMA
    loaded before before_run])."""
    for hook in runner.hooks:
        loaded = hook.__dict__.pop(_LOADED, None)
        if loaded is not None:
            hook.ema_model = loaded
