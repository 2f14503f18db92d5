"""MixedPrecisionHook in real (short) mmengine Runner runs with planted overflows.

A digits CNN in fp16 with a dynamic loss scale (2**16) trains 12 iterations (6 per epoch on a 180-image
training split); the loss is made inf at iterations 3, 4 and 8, so each of those steps is skipped and
halves the scale. The LoggerHook prints every 2 iterations.
"""
import copy
import json
import math
import os
import re

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

from mp_wrappers import MixedPrecisionHook
from mp_wrappers.hooks import PRECISION_INFO_KEY, SKIPPED_INFO_KEY, SKIPPED_ITERS_KEY
from mp_wrappers.registry import MODELS
from mp_wrappers.optim_config import uses_our_optim_wrapper
from mp_wrappers.train_config import add_mixed_precision_hook
from projects.digits import DigitsCNN

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANTED = (3, 4, 8)  # 0-based runner.iter values whose loss is inf
ITERS = 12


@MODELS.register_module(force=True)
class _PlantedOverflowCNN(DigitsCNN):
    """DigitsCNN whose training loss is inf at the chosen iterations (test only)."""

    def __init__(self, inf_iters=(), **kwargs):
        super().__init__(**kwargs)
        self.inf_iters = tuple(inf_iters)

    def forward(self, inputs, labels=None, mode='tensor'):
        out = super().forward(inputs, labels, mode)
        if mode == 'loss' and self.training:
            from mmengine.logging import MessageHub
            if MessageHub.get_current_instance().get_info('iter') in self.inf_iters:
                out = {'loss': out['loss'] * float('inf')}
        return out


_RUNS = [0]


def _cfg(tmp_path, skip_aware=True, planted=PLANTED, add_hook_explicitly=True):
    cfg = Config.fromfile(os.path.join(REPO, 'configs', 'digits', 'cnn_fp16_dynamic.py'))
    # A narrow fp16 CNN: fp16 convolutions are slow on CPU (docs/semantics.md section 8).
    cfg.model = dict(type='mp_wrappers._PlantedOverflowCNN', width=4, dtype='float16',
                     inf_iters=list(planted))
    cfg.train_dataloader.dataset.val_fraction = 0.9
    cfg.train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=2, val_interval=100)
    cfg.val_dataloader = cfg.val_cfg = cfg.val_evaluator = None
    cfg.default_hooks.logger.interval = 2
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=100, save_last=False)
    # An iteration-based scheduler that changes lr every step: lr = 0.01 + 0.99 * last_step / 99.
    cfg.param_scheduler = [dict(type='LinearLR', start_factor=0.01, end_factor=1.0, by_epoch=False,
                                begin=0, end=100)]
    cfg.optim_wrapper.optimizer.lr = 1.0
    cfg.optim_wrapper.optimizer.momentum = 0.0
    cfg.optim_wrapper.optimizer.nesterov = False
    cfg.custom_hooks = [dict(type='mp_wrappers.MixedPrecisionHook',
                             skip_aware_schedules=skip_aware)] if add_hook_explicitly else []
    cfg.work_dir = str(tmp_path)
    _RUNS[0] += 1
    cfg.experiment_name = f'test_hooks_{_RUNS[0]}'
    return cfg


def _train(cfg):
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        runner = Runner.from_cfg(cfg)
        runner.train()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    return runner


def _log_and_scalars(tmp_path):
    (log,) = tmp_path.glob('*/*.log')
    (scalars,) = tmp_path.glob('*/vis_data/scalars.json')
    rows = [json.loads(line) for line in scalars.read_text().splitlines() if line.strip()]
    return log.read_text(), rows


@pytest.fixture(scope='module', params=['MixedPrecisionHook', 'no_hook'])
def planted_run(tmp_path_factory, request):
    """The same run with our hook in the config and without it (a toolbox's train script): the
    amp_* log values come from the wrapper's own lifecycle hook either way."""
    tmp_path = tmp_path_factory.mktemp('planted')
    runner = _train(_cfg(tmp_path, add_hook_explicitly=request.param == 'MixedPrecisionHook'))
    return runner, tmp_path


def _expected(iter_count):
    """(scale, skipped total, skipped since the previous log line) after `iter_count` iterations."""
    skipped = sum(1 for i in PLANTED if i < iter_count)
    recent = sum(1 for i in PLANTED if iter_count - 2 <= i < iter_count)
    return 2.0 ** 16 / 2 ** skipped, skipped, recent


def test_log_lines_carry_amp_fields(planted_run):
    _, tmp_path = planted_run
    log, _ = _log_and_scalars(tmp_path)
    lines = [line for line in log.splitlines() if 'Epoch(train)' in line]
    assert len(lines) == ITERS // 2
    for n, line in enumerate(lines):
        it = 2 * (n + 1)
        scale, skipped, recent = _expected(it)
        fields = dict(re.findall(r'(amp_\w+): (\S+)', line))
        assert float(fields['amp_scale']) == scale, (it, line)
        assert float(fields['amp_skipped']) == skipped, (it, line)
        assert float(fields['amp_skipped_recent']) == recent, (it, line)
        assert math.isfinite(float(fields['amp_gnorm'])) and float(fields['amp_gnorm']) > 0
    # The wrapper's own skip messages are in the log, and with our hook the precision summary.
    assert log.count('Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale') == 3
    runner, _ = planted_run
    if any(isinstance(h, MixedPrecisionHook) for h in runner.hooks):
        assert 'mp_wrappers precision (optim_wrapper): wrapper=FP16OptimWrapper' in log
        assert 'loss_scaler=DynamicLossScaler' in log and 'fused_master_step=False' in log
    else:
        assert 'mp_wrappers precision' not in log


def test_scalars_json_holds_amp_fields(planted_run):
    _, tmp_path = planted_run
    _, rows = _log_and_scalars(tmp_path)
    train = [r for r in rows if 'amp_scale' in r]
    assert [r['iter'] for r in train] == list(range(2, ITERS + 1, 2))
    for row in train:
        scale, skipped, recent = _expected(row['iter'])
        assert (row['amp_scale'], row['amp_skipped'], row['amp_skipped_recent']) == \
            (scale, skipped, recent)
        assert row['amp_gnorm'] > 0


def test_runtime_info_and_log_interval(planted_run):
    runner, _ = planted_run
    assert runner.optim_wrapper.log_interval == 2
    assert runner.optim_wrapper.publish_now is None  # handed back after training
    if not any(isinstance(h, MixedPrecisionHook) for h in runner.hooks):
        return  # the runtime info below is the hook's
    hub = runner.message_hub
    info = hub.get_info(PRECISION_INFO_KEY)['optim_wrapper']
    assert info['wrapper'] == 'FP16OptimWrapper' and info['param_dtypes'] == 'float16/float32'
    assert info['master_weights'] is True and info['loss_scale'] == 2.0 ** 16
    assert hub.get_info(SKIPPED_ITERS_KEY) == len(PLANTED)
    assert hub.get_info(SKIPPED_INFO_KEY) is False  # the last iteration stepped
    assert runner.optim_wrapper.log_interval == 2
    assert runner.optim_wrapper.publish_now is None  # handed back after training


def test_schedule_does_not_advance_on_skipped_steps(planted_run, tmp_path):
    runner, _ = planted_run
    sched = runner.param_schedulers[0]
    if not any(isinstance(h, MixedPrecisionHook) for h in runner.hooks):
        # Skip-aware schedules are the hook's optional extra: without it every iteration counts.
        assert sched.last_step == ITERS
        return
    assert sched.last_step == ITERS - len(PLANTED)
    lr = runner.optim_wrapper.param_groups[0]['lr']
    assert lr == pytest.approx(0.01 + 0.99 * (ITERS - len(PLANTED)) / 99)

    plain = _train(_cfg(tmp_path, skip_aware=False))
    assert plain.param_schedulers[0].last_step == ITERS
    assert plain.optim_wrapper.param_groups[0]['lr'] == pytest.approx(0.01 + 0.99 * ITERS / 99)
    # The counters that other hooks can read are kept either way.
    assert plain.message_hub.get_info(SKIPPED_ITERS_KEY) == len(PLANTED)


def test_a_skipped_step_restores_every_scheduler_state_and_group_value():
    """The undo goes through the schedulers' public state_dict()/load_state_dict(): after a skipped
    step the chained schedulers (warm-up, then cosine) are in their state from before the iteration,
    every field of it, and so is the learning rate they write; the schedule then goes on as if the
    skipped iteration had not been there."""
    from types import SimpleNamespace

    from mmengine.optim.scheduler import CosineAnnealingLR, LinearLR

    def schedule():
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
        schedulers = [LinearLR(optimizer, start_factor=0.1, by_epoch=False, begin=0, end=4),
                      CosineAnnealingLR(optimizer, T_max=8, by_epoch=False, begin=2, end=10)]

        def step(n=1):
            for _ in range(n):
                optimizer.step()
                for sched in schedulers:
                    sched.step()
        return optimizer, schedulers, step

    def state(optimizer, schedulers):
        return [s.state_dict() for s in schedulers], optimizer.param_groups[0]['lr']

    optimizer, schedulers, step = schedule()
    step(3)
    before = copy.deepcopy(state(optimizer, schedulers))
    hook = MixedPrecisionHook()
    hook._take_snapshot(SimpleNamespace(param_schedulers=schedulers))
    step()  # what ParamSchedulerHook does after the iteration whose optimizer step was skipped
    assert state(optimizer, schedulers) != before
    hook._restore_snapshot({id(optimizer)})
    assert state(optimizer, schedulers) == before
    step(3)
    ref_optimizer, ref_schedulers, ref_step = schedule()
    ref_step(6)
    assert state(optimizer, schedulers) == state(ref_optimizer, ref_schedulers)


def test_hook_options_are_validated():
    with pytest.raises(ValueError, match='skip_aware_schedules=1 is not allowed'):
        MixedPrecisionHook(skip_aware_schedules=1)
    with pytest.raises(ValueError, match="overflow_report='yes'"):
        MixedPrecisionHook(overflow_report='yes')


def test_overflow_report_option(tmp_path):
    cfg = _cfg(tmp_path, planted=(1,))
    cfg.train_cfg.max_epochs = 1
    cfg.custom_hooks = [dict(type='mp_wrappers.MixedPrecisionHook', overflow_report=True)]
    runner = _train(cfg)
    assert runner.optim_wrapper.overflow_report is True
    log, _ = _log_and_scalars(tmp_path)
    assert 'mp_wrappers overflow at iteration 1' in log and 'the loss itself was non-finite' in log


def test_add_mixed_precision_hook():
    ours = Config(dict(optim_wrapper=dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2')))
    assert uses_our_optim_wrapper(ours)
    assert add_mixed_precision_hook(ours)
    assert ours.custom_hooks == [dict(type='mp_wrappers.MixedPrecisionHook')]
    assert not add_mixed_precision_hook(ours)  # already there: not twice

    # mmengine's own ApexOptimWrapper (unprefixed name in scope mmengine) is not ours.
    theirs = Config(dict(default_scope='mmengine', optim_wrapper=dict(type='ApexOptimWrapper')))
    assert not uses_our_optim_wrapper(theirs) and not add_mixed_precision_hook(theirs)
    scoped = Config(dict(default_scope='mp_wrappers', optim_wrapper=dict(type='ApexOptimWrapper')))
    assert uses_our_optim_wrapper(scoped)
    fp32 = Config(dict(optim_wrapper=dict(type='OptimWrapper')))
    assert not add_mixed_precision_hook(fp32)

    multi = Config(dict(optim_wrapper=dict(
        constructor='MultiOptimWrapperConstructor',
        gen=dict(type='mp_wrappers.FP16OptimWrapper'), disc=dict(type='OptimWrapper'))))
    assert uses_our_optim_wrapper(multi)

    off = Config(dict(mixed_precision_hook=False,
                      optim_wrapper=dict(type='mp_wrappers.FP16OptimWrapper')))
    assert not add_mixed_precision_hook(off) and 'custom_hooks' not in off
    opts = Config(dict(mixed_precision_hook=dict(overflow_report=True),
                       optim_wrapper=dict(type='mp_wrappers.FP16OptimWrapper')))
    assert add_mixed_precision_hook(opts)
    assert opts.custom_hooks == [dict(type='mp_wrappers.MixedPrecisionHook', overflow_report=True)]
    with pytest.raises(ValueError, match="mixed_precision_hook='on' is not allowed"):
        add_mixed_precision_hook(Config(dict(mixed_precision_hook='on')))


def _analyze_logs():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        'analyze_logs', os.path.join(REPO, 'tools', 'analyze_logs.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_analyze_logs_plot(planted_run, tmp_path, capsys):
    _, run_dir = planted_run
    (scalars,) = run_dir.glob('*/vis_data/scalars.json')
    tool = _analyze_logs()
    skips = tool._skipped_at(tool.load_scalars(str(scalars)))
    assert skips == [4.0, 6.0, 10.0]  # the log lines right after iterations 3, 4 and 8 (0-based)
    out = tmp_path / 'curve.png'
    assert tool.main(['plot', str(scalars), str(scalars), '--keys', 'loss', 'amp_scale', 'lr',
                      '--out', str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 10_000

    assert tool.main(['plot', str(scalars), '--keys', 'accuracy', '--out', str(out)]) == 2
    err = capsys.readouterr().err
    assert "no values for key(s) 'accuracy'" in err and 'available keys: amp_gnorm, amp_scale' in err
    assert tool.main(['plot', str(tmp_path / 'missing.json'), '--out', str(out)]) == 2
    assert 'missing.json: no such file' in capsys.readouterr().err
