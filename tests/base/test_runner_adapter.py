"""The runner adapter and the wrappers' lifecycle hook (Notes [runner adapter], [wrapper lifecycle]).

The wrappers find the mmengine runner that builds them and register one lifecycle hook in it, so a
config that only names our wrapper trains through a toolbox's own train script (a plain
``Runner.from_cfg(cfg).train()``) as it does through ours.
"""
import mmengine
import pytest
import torch
from mmengine.hooks import EMAHook, Hook
from mmengine.runner import Runner
from torch import nn

from mp_wrappers import ApexOptimWrapper, MixedPrecisionEMAHook, WrapperLifecycleHook
from mp_wrappers import runner_adapter
from mp_wrappers.lifecycle import STAGES

from _workflow import WorkflowMLP, make_runner, masters_by_name, train


def test_installed_mmengine_was_checked():
    """The adapter reads private parts of mmengine: a version nobody checked fails here first."""
    assert mmengine.__version__ in runner_adapter.CHECKED_MMENGINE_VERSIONS, (
        f'mmengine {mmengine.__version__} was not checked against mp_wrappers.runner_adapter: read '
        'Runner.train, FlexibleRunner.train, EMAHook and OptimWrapperDict.initialize_count_status '
        'of that version (Note [runner adapter]), then add it to CHECKED_MMENGINE_VERSIONS')


def test_find_runner_outside_and_inside_a_runner(tmp_path):
    assert runner_adapter.find_runner() is None
    found = []

    class Probe(Hook):
        def before_run(self, runner):
            found.append(runner_adapter.find_runner())

    runner = make_runner(tmp_path, 'O1', iters=1)
    runner.register_hook(Probe())
    train(runner)
    assert found == [runner]
    assert runner_adapter.is_runner(runner) and not runner_adapter.is_runner(object())


def test_replace_hook_refuses_a_hook_that_is_not_registered(tmp_path):
    runner = make_runner(tmp_path, 'O1', iters=1)
    with pytest.raises(ValueError, match='EMAHook is not registered in this runner'):
        runner_adapter.replace_hook(runner, EMAHook(), EMAHook())


def test_one_lifecycle_hook_per_runner_built_by_the_runner(tmp_path, launcher):
    runner = train(make_runner(tmp_path, 'O2', iters=2))
    hooks = [h for h in runner.hooks if isinstance(h, WrapperLifecycleHook)]
    assert len(hooks) == 1 and runner.hooks[0] is hooks[0]  # HIGHEST: before every other hook
    assert runner.optim_wrapper._runner.ref() is runner


def test_catch_up_rejects_an_unknown_stage(tmp_path):
    with pytest.raises(ValueError, match=r"stage='later' is not one of \('build'"):
        WrapperLifecycleHook().catch_up(None, 'later')
    assert STAGES == ('build', 'count_status', 'forward')


def test_a_wrapper_without_a_runner_looks_once_per_stage(monkeypatch):
    calls = []
    find = runner_adapter.find_runner
    monkeypatch.setattr(runner_adapter, 'find_runner', lambda: (calls.append(1), find())[1])
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    wrapper = ApexOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               opt_level='O2', dtype='bfloat16', verbosity=0)
    for _ in range(5):
        with wrapper.optim_context(model):
            loss = model(torch.randn(8, 4)).float().sum()
        wrapper.update_params(loss)
    assert len(calls) == 2  # at construction and at the first forward, never per iteration
    assert wrapper._runner.ref is None


def _prebuilt_runner(work_dir, hooks):
    """A Runner handed a wrapper object built outside it (it meets the runner later)."""
    model = WorkflowMLP()
    wrapper = ApexOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                               opt_level='O2', dtype='bfloat16', verbosity=0)
    return Runner(
        model=model, work_dir=str(work_dir), experiment_name=f'prebuilt_{work_dir.name}',
        train_dataloader=dict(dataset=dict(type='mp_wrappers.WorkflowData'), batch_size=16,
                              num_workers=0, sampler=dict(type='DefaultSampler', shuffle=True),
                              collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=4), optim_wrapper=wrapper,
        default_hooks=dict(logger=dict(type='LoggerHook', interval=1)), custom_hooks=hooks,
        randomness=dict(seed=0), log_level='WARNING')


def test_a_wrapper_handed_to_the_runner_adopts_the_ema_hook_late(tmp_path):
    """Built outside, the wrapper meets the runner at initialize_count_status, after EMAHook's
    before_run: the lifecycle hook catches up before the first step, and the average is the same
    as with a wrapper the runner built."""
    ema = [dict(type='EMAHook', momentum=0.25)]
    late = train(_prebuilt_runner(tmp_path / 'late', ema))
    (hook,) = [h for h in late.hooks if isinstance(h, EMAHook)]
    assert type(hook) is MixedPrecisionEMAHook
    built = train(make_runner(tmp_path / 'built', 'O2', iters=4, custom_hooks=ema,
                              launcher='toolbox'))
    (expected,) = [h for h in built.hooks if isinstance(h, EMAHook)]
    a = dict(hook.ema_model.module.named_parameters())
    b = dict(expected.ema_model.module.named_parameters())
    for name in b:
        assert a[name].dtype == torch.float32 and torch.equal(a[name], b[name]), name
    assert masters_by_name(late).keys() == masters_by_name(built).keys()


def test_flexible_runner_gets_the_same_lifecycle(tmp_path):
    """mmengine's FlexibleRunner (strategies) builds the wrapper inside its own train() too."""
    from mmengine.runner import FlexibleRunner
    runner = FlexibleRunner(
        model=dict(type='mp_wrappers.WorkflowMLP'), work_dir=str(tmp_path),
        experiment_name='flexible_lifecycle',
        train_dataloader=dict(dataset=dict(type='mp_wrappers.WorkflowData'), batch_size=16,
                              num_workers=0, sampler=dict(type='DefaultSampler', shuffle=True),
                              collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=3),
        optim_wrapper=dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16',
                           verbosity=0, optimizer=dict(type='SGD', lr=0.2, momentum=0.9)),
        default_hooks=dict(logger=dict(type='LoggerHook', interval=1)),
        custom_hooks=[dict(type='EMAHook', momentum=0.25)], randomness=dict(seed=0),
        log_level='WARNING')
    train(runner)
    assert sum(isinstance(h, WrapperLifecycleHook) for h in runner.hooks) == 1
    (ema,) = [h for h in runner.hooks if isinstance(h, EMAHook)]
    assert type(ema) is MixedPrecisionEMAHook
    assert all(p.dtype == torch.float32 for p in ema.ema_model.module.parameters())
    assert runner.model.fc1.weight.dtype == torch.bfloat16
    assert list(runner.message_hub.get_scalar('train/amp_scale').data[0]) == [1.0] * 3
