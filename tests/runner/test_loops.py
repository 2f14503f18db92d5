"""Evaluation precision through mmengine's Runner: ``val_cfg``/``test_cfg`` ``fp16`` and O2/O3 models.

The digits CNN (narrow, one short epoch) trains through ``tools/train.py``'s config preparation and
mmengine's Runner; a forward hook on its first convolution records the dtype each evaluation batch
actually ran in. The documented default (``mp_wrappers.loops``): ``fp16=False`` evaluates the model
as it is (O2/O3 in their half dtype, fp32 weights in fp32); ``fp16=True`` autocasts to the training
wrapper's dtype on the model's device, where mmengine's own ``ValLoop`` would pick bf16 on any CPU
and fp16 on any GPU. Metrics stay within the accuracy bar of docs/precision_comparison.md (1 point
on digits) of the fp32 evaluation of the same weights.
"""
import os
import sys

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

from mp_wrappers.loops import (MixedPrecisionTestLoop, MixedPrecisionValLoop,
                               use_mixed_precision_loops)
from projects.digits import DigitsCNN

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, 'tools'))
import train as train_tool  # noqa: E402

ACCURACY_BAR = 1.0  # points, docs/precision_comparison.md
_RUNS = [0]


def _cfg(tmp_path, level, dtype, val_cfg, test=False, launcher='tools_train'):
    """A config file extending the digits O2 config, prepared by tools/train.py's build_config,
    or read as it is, as a toolbox's train script does (``launcher='toolbox'``)."""
    _RUNS[0] += 1
    name = f'test_eval_precision_{_RUNS[0]}'
    lines = [
        f"_base_ = [{os.path.join(REPO, 'configs', 'digits', 'cnn_apex_O2_bf16.py')!r}]",
        'model = dict(width=4)',
        f"optim_wrapper = dict(opt_level={level!r}, dtype={dtype!r}, verbosity=0)",
        # 20 iterations reach ~90% on the 360 validation images: enough to compare precisions.
        "train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=20, val_interval=20)",
        'param_scheduler = None',
        'val_dataloader = dict(batch_size=360)',
        f'val_cfg = {val_cfg!r}',
        "default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=100, "
        "save_last=False), logger=dict(interval=100))",
        "log_processor = dict(by_epoch=False)",
        "log_level = 'WARNING'",
        f'experiment_name = {name!r}',
    ]
    if test:
        lines += ["test_dataloader = dict(batch_size=360, num_workers=0, dataset=dict("
                  "type='mp_wrappers.DigitsDataset', split='val'), sampler=dict("
                  "type='DefaultSampler', shuffle=False), collate_fn=dict(type='default_collate'))",
                  "test_evaluator = dict(type='mp_wrappers.DigitsAccuracy')",
                  f'test_cfg = {val_cfg!r}']
    path = tmp_path / f'{name}.py'
    path.write_text('\n'.join(lines) + '\n')
    if launcher == 'toolbox':
        cfg = Config.fromfile(str(path))
        cfg.work_dir = str(tmp_path / name)
        return cfg
    args = train_tool.parse_args([str(path), '--work-dir', str(tmp_path / name)])
    return train_tool.build_config(args)


def _runner(cfg):
    runner = Runner.from_cfg(cfg)
    runner.eval_dtypes = []
    model = runner.model

    def record(module, args, output):
        if not module.training:
            runner.eval_dtypes.append(output.dtype)
    model.features[0].register_forward_hook(record)
    return runner


def _run(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what the digits configs ask for (torch_num_threads = 1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)


def _fp32_accuracy(runner):
    """The same weights evaluated in fp32 (the model's fp32 state dict in a fresh DigitsCNN)."""
    ref = DigitsCNN(width=4)
    ref.load_state_dict({k: v.float() for k, v in runner.model.state_dict().items()})
    model, runner.model = runner.model, ref
    loop, fp16 = runner.val_loop, runner.val_loop.fp16
    loop.fp16 = False
    try:
        return _run(loop.run)['accuracy']
    finally:
        runner.model, loop.fp16 = model, fp16


def _train(runner):
    _run(runner.train)
    return runner.message_hub.get_scalar('val/accuracy').current()


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_val_fp16_autocasts_to_the_wrappers_dtype(tmp_path, dtype):
    """``val_cfg=dict(fp16=True)`` with an O1 wrapper: autocast in the wrapper's dtype, on CPU."""
    cfg = _cfg(tmp_path, 'O1', dtype, dict(fp16=True))
    assert cfg.val_cfg['type'] == 'mp_wrappers.MixedPrecisionValLoop'
    runner = _runner(cfg)
    accuracy = _train(runner)
    half = getattr(torch, dtype)
    assert isinstance(runner.val_loop, MixedPrecisionValLoop)
    assert runner.eval_dtypes and set(runner.eval_dtypes) == {half}
    assert abs(accuracy - _fp32_accuracy(runner)) <= ACCURACY_BAR


@pytest.mark.parametrize('launcher', ['tools_train', 'toolbox'])
@pytest.mark.parametrize('level', ['O2', 'O3'])
def test_o2_o3_models_evaluate_in_their_own_dtype_by_default(tmp_path, level, launcher):
    runner = _runner(_cfg(tmp_path, level, 'bfloat16', dict(), launcher=launcher))
    accuracy = _train(runner)
    assert set(runner.eval_dtypes) == {torch.bfloat16}
    assert abs(accuracy - _fp32_accuracy(runner)) <= ACCURACY_BAR


def test_o1_model_evaluates_in_fp32_by_default(tmp_path):
    runner = _runner(_cfg(tmp_path, 'O1', 'bfloat16', dict()))
    _train(runner)
    assert set(runner.eval_dtypes) == {torch.float32}


def test_test_cfg_fp16_path(tmp_path):
    cfg = _cfg(tmp_path, 'O1', 'float16', dict(fp16=True), test=True)
    assert cfg.test_cfg['type'] == 'mp_wrappers.MixedPrecisionTestLoop'
    runner = _runner(cfg)
    _train(runner)
    runner.eval_dtypes.clear()
    metrics = _run(runner.test)
    assert isinstance(runner.test_loop, MixedPrecisionTestLoop)
    assert set(runner.eval_dtypes) == {torch.float16}
    assert abs(metrics['accuracy'] - _fp32_accuracy(runner)) <= ACCURACY_BAR


def test_a_config_that_names_its_own_loop_keeps_it(tmp_path):
    cfg = _cfg(tmp_path, 'O1', 'bfloat16', dict(type='ValLoop', fp16=True))
    assert cfg.val_cfg['type'] == 'mp_wrappers.MixedPrecisionValLoop'  # mmengine's default: ours
    cfg.val_cfg = dict(type='MyLoop', fp16=True)
    assert use_mixed_precision_loops(cfg) == []
    assert cfg.val_cfg['type'] == 'MyLoop'


def test_loop_options_are_checked(tmp_path):
    cfg = _cfg(tmp_path, 'O1', 'bfloat16', dict(type='mp_wrappers.MixedPrecisionValLoop',
                                                 fp16=True, dtype='float64'))
    with pytest.raises(ValueError, match=r"MixedPrecisionValLoop\(dtype\)='float64'"):
        _run(Runner.from_cfg(cfg).train)


def test_a_toolbox_script_evaluates_in_the_wrappers_dtype_with_the_loop_named(tmp_path):
    """A toolbox's train script keeps mmengine's ValLoop, whose fp16=True picks bf16 on any CPU and
    fp16 on any GPU; naming our loop in the config gives what tools/train.py picks by itself."""
    cfg = _cfg(tmp_path, 'O1', 'float16',
               dict(type='mp_wrappers.MixedPrecisionValLoop', fp16=True), launcher='toolbox')
    runner = _runner(cfg)
    accuracy = _train(runner)
    assert isinstance(runner.val_loop, MixedPrecisionValLoop)
    assert set(runner.eval_dtypes) == {torch.float16}
    assert abs(accuracy - _fp32_accuracy(runner)) <= ACCURACY_BAR
