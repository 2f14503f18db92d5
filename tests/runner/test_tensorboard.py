"""TensorBoard shows the loss scale, skipped steps and grad norm (a real TensorBoard, read back).

The digits CNN in fp16 under ``FP16OptimWrapper`` starts with a dynamic loss scale of 2**21, too high
for its fp16 gradients: the first steps overflow and are skipped, halving the scale each time. The
run goes through ``tools/train.py``'s config preparation (which adds ``MixedPrecisionHook``) and
mmengine's Runner with ``TensorboardVisBackend``; the event files are then read back with
TensorBoard's own ``EventAccumulator``.
"""
import glob
import os
import sys

import pytest
import torch
from mmengine.runner import Runner

pytest.importorskip('tensorboard', reason="install the test extras: pip install -e '.[test]'")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, 'tools'))
import train as train_tool  # noqa: E402

ITERS = 8


def test_tensorboard_event_files_hold_amp_scalars(tmp_path):
    config = tmp_path / 'tb.py'
    config.write_text(
        f"_base_ = [{os.path.join(REPO, 'configs', 'digits', 'cnn_fp16_dynamic.py')!r}]\n"
        'model = dict(width=4)\n'
        'optim_wrapper = dict(dynamic_loss_args=dict(init_scale=2.**21))\n'
        f"train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters={ITERS}, "
        'val_interval=100)\n'
        'param_scheduler = None\n'
        'val_dataloader = val_cfg = val_evaluator = None\n'
        "default_hooks = dict(logger=dict(interval=1), checkpoint=dict(type='CheckpointHook', "
        'interval=100, save_last=False))\n'
        'log_processor = dict(by_epoch=False)\n'
        "visualizer = dict(type='Visualizer', vis_backends=[dict(type='LocalVisBackend'), "
        "dict(type='TensorboardVisBackend')])\n"
        "log_level = 'WARNING'\nexperiment_name = 'test_tensorboard'\n")
    cfg = train_tool.build_config(train_tool.parse_args([str(config), '--work-dir',
                                                         str(tmp_path / 'work')]))
    runner = Runner.from_cfg(cfg)
    threads = torch.get_num_threads()
    try:
        runner.train()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)
    runner.visualizer.close()  # flush the event file
    events = glob.glob(str(tmp_path / 'work' / '**' / 'events.out.tfevents.*'), recursive=True)
    assert events, 'TensorboardVisBackend wrote no event file'
    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    tags = set(acc.Tags()['scalars'])
    assert {'amp_scale', 'amp_skipped', 'amp_gnorm', 'loss'} <= tags, tags
    scale = [e.value for e in acc.Scalars('amp_scale')]
    skipped = [e.value for e in acc.Scalars('amp_skipped')]
    gnorm = [e.value for e in acc.Scalars('amp_gnorm')]
    assert [e.step for e in acc.Scalars('amp_scale')] == list(range(1, ITERS + 1))
    # Overflows at 2**21 skip steps and halve the scale; the count and the scale agree.
    assert skipped[-1] >= 1 and skipped == sorted(skipped)
    for s, k in zip(scale, skipped):
        assert s == 2.0 ** 21 / 2 ** k
    assert all(g > 0 and g == g for g in gnorm)
