"""``tools/train.py`` flags that OpenMMLab train scripts have: ``--auto-scale-lr`` and ``--help``.

``--auto-scale-lr`` turns on mmengine's ``auto_scale_lr`` (as mmpretrain's and mmdet's train scripts
do): the Runner multiplies every learning rate by (world size x batch size) / base_batch_size before
the schedulers are built. Checked through the Runner with our wrapper's live param groups.
"""
import os
import sys

import pytest
import torch
from mmengine.runner import Runner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, 'tools'))
import train as train_tool  # noqa: E402

BASE = os.path.join(REPO, 'configs', 'digits', 'cnn_apex_O2_bf16.py')  # SGD lr=0.05, batch 32


def _config(tmp_path, name, extra=''):
    path = tmp_path / f'{name}.py'
    path.write_text(
        f'_base_ = [{BASE!r}]\n'
        'model = dict(width=4)\n'
        "train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=2, val_interval=100)\n"
        'param_scheduler = None\n'
        'val_dataloader = val_cfg = val_evaluator = None\n'
        "default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=100, "
        'save_last=False))\n'
        f"log_level = 'WARNING'\nexperiment_name = {name!r}\n{extra}")
    return str(path)


def _lr_after_training(tmp_path, name, extra, *flags):
    args = train_tool.parse_args([_config(tmp_path, name, extra), '--work-dir',
                                  str(tmp_path / name), *flags])
    cfg = train_tool.build_config(args)
    runner = Runner.from_cfg(cfg)
    threads = torch.get_num_threads()
    try:
        runner.train()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)
    return [g['lr'] for g in runner.optim_wrapper.optimizer.param_groups]


def test_auto_scale_lr_scales_by_batch_over_base_batch(tmp_path):
    extra = 'auto_scale_lr = dict(base_batch_size=128)\n'  # mmpretrain style: no `enable` key
    assert _lr_after_training(tmp_path, 'scaled', extra, '--auto-scale-lr') == [0.05 * 32 / 128]
    # Without the flag the config's auto_scale_lr is inert, as in OpenMMLab's scripts.
    assert _lr_after_training(tmp_path, 'unscaled', extra) == [0.05]


def test_auto_scale_lr_without_a_base_batch_size_is_refused(tmp_path):
    args = train_tool.parse_args([_config(tmp_path, 'nobase'), '--auto-scale-lr'])
    with pytest.raises(ValueError, match=r'--auto-scale-lr needs auto_scale_lr=dict\('
                                         r'base_batch_size=N\)'):
        train_tool.build_config(args)


def test_help_lists_the_openmmlab_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_tool.parse_args(['--help'])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ('--work-dir', '--resume', '--cfg-options', '--launcher', '--auto-scale-lr',
                 '--local-rank'):
        assert flag in out, flag
