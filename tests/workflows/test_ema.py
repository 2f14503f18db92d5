"""EMA with mixed precision through mmengine's Runner (issue 10, item 2).

mmengine's ``EMAHook`` copies the model before ``ApexOptimWrapper`` casts it (O2/O3: ``lerp_`` then fails
on the half weights) and, over a half model, keeps a half average whose small updates round away.
``mp_wrappers.MixedPrecisionEMAHook`` keeps mmengine's hook and averaged-model classes and averages the
full-precision weights (the fp32 masters where they exist) into an fp32 copy (Note [EMA and masters]).
"""
import math

import pytest
import torch
from mmengine.hooks import EMAHook, Hook
from mmengine.model import ExponentialMovingAverage

from mp_wrappers import MixedPrecisionEMAHook
from mp_wrappers.registry import HOOKS, MODELS

from _workflow import RecordHook, load, make_runner, masters_by_name, train

# Note [two launchers] (tests/_workflow.py): every test runs through both.
pytestmark = pytest.mark.usefixtures('launcher')

MOMENTUM = 0.25


def _ema_hook(runner):
    (hook,) = [h for h in runner.hooks if isinstance(h, EMAHook)]
    return hook


def _oracle(sequence, momentum=MOMENTUM):
    """ExponentialMovingAverage's arithmetic in fp32: copy at the first update, then lerp_."""
    ema = {k: v.float().clone() for k, v in sequence[0].items()}
    for weights in sequence[1:]:
        for k, v in ema.items():
            v.lerp_(weights[k].float(), momentum)
    return ema


def _full_precision_sequence(record, wrapper):
    """Per iteration, the weights the EMA must average: masters where the level keeps them."""
    out = []
    for weights, masters in zip(record.weights, record.masters):
        out.append({k: masters.get(k, w) for k, w in weights.items()})
    return out


# mmengine's own EMAHook is adopted by the wrappers (mp_wrappers.ema.adopt_ema_hooks): a toolbox
# config that lists it gets exactly what MixedPrecisionEMAHook does.
EMA_HOOKS = ('mp_wrappers.MixedPrecisionEMAHook', 'EMAHook')


@pytest.mark.parametrize('ema_type', EMA_HOOKS)
@pytest.mark.parametrize('wrapper', ['FP16', 'O1', 'O2', 'O3'])
def test_ema_averages_the_full_precision_weights_at_every_level(tmp_path, wrapper, ema_type):
    record = RecordHook()
    runner = make_runner(tmp_path, wrapper, 'bfloat16', iters=5, ckpt_interval=5,
                         custom_hooks=[dict(type=ema_type, momentum=MOMENTUM)])
    runner.register_hook(record)
    train(runner)
    ema = dict(_ema_hook(runner).ema_model.module.named_parameters())
    expected = _oracle(_full_precision_sequence(record, wrapper))
    if wrapper in ('FP16', 'O2'):
        assert set(record.masters[0]) >= {'fc1.weight', 'fc2.weight'}
    for name, value in expected.items():
        assert ema[name].dtype == torch.float32, name
        assert torch.equal(ema[name], value), name
    # The checkpoint's EMA is full precision too (EMAHook swaps it into state_dict).
    ckpt = load(tmp_path / 'iter_5.pth')
    for name, value in expected.items():
        assert ckpt['ema_state_dict'][f'module.{name}'].dtype == torch.float32
        assert torch.equal(ckpt['state_dict'][name], value), name


def test_o1_ema_matches_mmengine_ema_hook(tmp_path):
    """At O1 the weights are fp32: the result is mmengine's EMAHook's, bit for bit."""
    ours = train(make_runner(tmp_path / 'ours', 'O1', 'bfloat16', iters=4, custom_hooks=[
        dict(type='mp_wrappers.MixedPrecisionEMAHook', momentum=MOMENTUM)]))
    stock = train(make_runner(tmp_path / 'stock', 'O1', 'bfloat16', iters=4, custom_hooks=[
        dict(type='EMAHook', momentum=MOMENTUM)]))
    a = dict(_ema_hook(ours).ema_model.module.named_parameters())
    b = dict(_ema_hook(stock).ema_model.module.named_parameters())
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize('ema_type', EMA_HOOKS)
def test_bf16_ema_keeps_moving(tmp_path, ema_type):
    """A small momentum over a bf16 model: a bf16 average would round every update away."""
    record = RecordHook()
    runner = make_runner(tmp_path, 'FP16', 'bfloat16', iters=6,
                         optimizer=dict(type='SGD', lr=0.02),
                         custom_hooks=[dict(type=ema_type, momentum=1e-3)])
    runner.register_hook(record)
    train(runner)
    ema = _ema_hook(runner).ema_model.module.fc1.weight
    sequence = _full_precision_sequence(record, 'FP16')
    expected = _oracle(sequence, momentum=1e-3)['fc1.weight']
    start = sequence[0]['fc1.weight']
    assert torch.equal(ema, expected)
    assert not torch.equal(ema, start)  # it moved
    # what a bf16 average of the same weights does: nothing
    stalled = start.bfloat16()
    for weights in sequence[1:]:
        stalled.lerp_(weights['fc1.weight'].bfloat16(), 1e-3)
    assert torch.equal(stalled.float(), start.bfloat16().float())


@HOOKS.register_module(force=True)
class ToolboxEMAHook(EMAHook):
    """A toolbox's EMAHook subclass as mmpretrain's: options of its own, mmengine's averaging."""

    def __init__(self, *args, count_train_starts: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.count_train_starts = count_train_starts
        self.train_starts = 0

    def before_train(self, runner) -> None:
        super().before_train(runner)
        self.train_starts += int(self.count_train_starts)


@HOOKS.register_module(force=True)
class OwnAveragingEMAHook(EMAHook):
    """A subclass that averages its own way: precision cannot be changed under it."""

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.ema_model.update_parameters(self.src_model)


@pytest.mark.parametrize('wrapper', ['FP16', 'O2', 'O3'])
def test_a_toolbox_ema_hook_subclass_runs_in_full_precision_keeping_its_own_behaviour(
        tmp_path, wrapper):
    emas = {}
    for hook_type in ('mp_wrappers.ToolboxEMAHook', 'mp_wrappers.MixedPrecisionEMAHook'):
        runner = train(make_runner(tmp_path / hook_type, wrapper, 'bfloat16', iters=4,
                                   custom_hooks=[dict(type=hook_type, momentum=MOMENTUM)]))
        hook = _ema_hook(runner)
        emas[hook_type] = dict(hook.ema_model.module.named_parameters())
    assert isinstance(hook, MixedPrecisionEMAHook)
    runner = train(make_runner(tmp_path / 'again', wrapper, 'bfloat16', iters=2,
                               custom_hooks=[dict(type='mp_wrappers.ToolboxEMAHook',
                                                  momentum=MOMENTUM)]))
    (toolbox,) = [h for h in runner.hooks if isinstance(h, ToolboxEMAHook)]
    assert isinstance(toolbox, MixedPrecisionEMAHook)
    assert type(toolbox).__name__ == 'MixedPrecisionToolboxEMAHook'
    assert toolbox.train_starts == 1 and toolbox.count_train_starts is True  # its own behaviour
    a, b = emas.values()
    for name in a:
        assert a[name].dtype == torch.float32 and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize('wrapper', ['FP16', 'O2', 'O3'])
def test_ema_hook_subclass_with_its_own_averaging_is_refused_with_the_config_line(
        tmp_path, wrapper):
    record = RecordHook()
    runner = make_runner(tmp_path, wrapper, 'bfloat16', iters=3, custom_hooks=[
        dict(type='mp_wrappers.OwnAveragingEMAHook', momentum=MOMENTUM, begin_iter=2)])
    runner.register_hook(record)
    with pytest.raises(RuntimeError,
                       match=r"OwnAveragingEMAHook \(an EMAHook subclass\).*it overrides "
                             r'after_train_iter') as info:
        train(runner)
    message = str(info.value)
    assert ("custom_hooks=[dict(type='mp_wrappers.MixedPrecisionEMAHook', "
            "ema_type='ExponentialMovingAverage', momentum=0.25") in message
    assert 'begin_iter=2' in message
    assert record.weights == []  # stopped before the first iteration


def test_ema_hook_subclass_at_o1_is_left_alone(tmp_path):
    runner = train(make_runner(tmp_path, 'O1', 'bfloat16', iters=2, custom_hooks=[
        dict(type='mp_wrappers.OwnAveragingEMAHook', momentum=MOMENTUM)]))
    assert any(type(h) is OwnAveragingEMAHook for h in runner.hooks)


def test_validation_uses_the_ema_and_leaves_training_untouched(tmp_path):
    """The EMA is swapped in for validation by copying: neither it nor the model is rounded."""
    hooks = [dict(type='mp_wrappers.MixedPrecisionEMAHook', momentum=MOMENTUM)]

    class SeenInValidation(Hook):
        priority = 'LOWEST'  # after the EMA hook swapped the EMA in
        seen = []

        def before_val_epoch(self, runner):
            ema = _ema_hook(runner).ema_model.module.fc1.weight
            self.seen.append(torch.equal(runner.model.fc1.weight, ema.bfloat16()))

    runner = make_runner(tmp_path / 'val', 'O2', 'bfloat16', iters=6, val=True, val_interval=2,
                         custom_hooks=hooks)
    runner.register_hook(SeenInValidation())
    with_val = train(runner)
    assert SeenInValidation.seen == [True, True, True]
    without = train(make_runner(tmp_path / 'noval', 'O2', 'bfloat16', iters=6,
                                custom_hooks=hooks))
    for (name, a), b in zip(with_val.model.named_parameters(), without.model.parameters()):
        assert torch.equal(a, b), name
    for name, m in masters_by_name(with_val).items():
        assert torch.equal(m, masters_by_name(without)[name]), name
    a = dict(_ema_hook(with_val).ema_model.module.named_parameters())
    b = dict(_ema_hook(without).ema_model.module.named_parameters())
    for name in a:
        assert a[name].dtype == torch.float32
        assert torch.equal(a[name], b[name]), name
    assert isinstance(_ema_hook(with_val), MixedPrecisionEMAHook)
    assert 'acc' in str(with_val.message_hub.log_scalars.keys())


@MODELS.register_module(force=True)
class MomentumWarmupEMA(ExponentialMovingAverage):
    """mmdet's ExpMomentumEMA in kind: an averaged model of a toolbox with its own momentum rule."""

    def avg_func(self, averaged_param, source_param, steps):
        momentum = (1 - self.momentum) * math.exp(-float(1 + steps) / 2000) + self.momentum
        averaged_param.lerp_(source_param, momentum)


@pytest.mark.parametrize('ema_type', ['ExponentialMovingAverage', 'StochasticWeightAverage',
                                      'mp_wrappers.MomentumWarmupEMA'])
@pytest.mark.parametrize('wrapper', ['FP16', 'O2', 'O3'])
def test_mmengine_ema_hook_with_any_ema_type_is_the_full_precision_one(tmp_path, wrapper, ema_type):
    """mmengine's EMAHook with any averaged model trains exactly as MixedPrecisionEMAHook."""
    emas = {}
    for hook_type in EMA_HOOKS:
        # StochasticWeightAverage takes no momentum.
        args = {} if ema_type == 'StochasticWeightAverage' else dict(momentum=MOMENTUM)
        runner = train(make_runner(tmp_path / hook_type, wrapper, 'bfloat16', iters=4,
                                   custom_hooks=[dict(type=hook_type, ema_type=ema_type, **args)]))
        hook = _ema_hook(runner)
        assert type(hook) is MixedPrecisionEMAHook
        emas[hook_type] = dict(hook.ema_model.module.named_parameters())
    a, b = emas.values()
    for name in a:
        assert a[name].dtype == torch.float32 and torch.equal(a[name], b[name]), name
