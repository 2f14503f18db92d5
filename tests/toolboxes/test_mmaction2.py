"""mmaction2 1.2.0's TSN, trained by mmaction2's own ``tools/train.py`` with our wrappers (issue 23).

The config inherits mmaction2's shipped
``configs/recognition/tsn/tsn_imagenet-pretrained-r50_8xb32-1x1x3-100e_kinetics400-rgb.py`` through
a tiny, offline base: generated 32x32 raw frames (3 segments of 1 frame per video), the ResNet
backbone at depth 18 cut to its first two stages and without the ImageNet download, the head
without dropout (see the config), 2 epochs of 8 iterations. Each variant adds only the wrapper lines.

TSN's head computes its training accuracy inside the forward with numpy
(``BaseHead.loss_by_feat``: ``top_k_accuracy(cls_scores.detach().cpu().numpy(), ...)``), and numpy
has no bf16: at O1/O2 bf16 the head must stay fp32, ``fp32_modules=['cls_head']``.
"""
import os

import pytest
import torch

from _toolbox_runs import (CUSTOM_IMPORTS, REPO, float_state, load_checkpoint, log_text,
                           resume_from_epoch_1,
                           make_rawframes, require_toolbox, run_script, train_records, val_records,
                           write_config)

SHIPPED = ('configs', 'recognition', 'tsn',
           'tsn_imagenet-pretrained-r50_8xb32-1x1x3-100e_kinetics400-rgb.py')


def _apex(level, extra=''):
    return (CUSTOM_IMPORTS + f"optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', "
            f"opt_level='{level}', dtype='bfloat16', fp32_modules=['cls_head']{extra})\n")


VARIANTS = {
    'fp32': '',
    'O1': _apex('O1'),
    'O2': _apex('O2'),
    'O2_ema': _apex('O2') + "custom_hooks = [dict(type='EMAHook', momentum=0.1, "
                            "priority='ABOVE_NORMAL')]\n",
    'O2_no_fp32_head': CUSTOM_IMPORTS + (
        "optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', "
        "dtype='bfloat16')\n"),
}

TINY = """_base_ = ['{shipped}']
model = dict(
    backbone=dict(pretrained=None, depth=18, num_stages=2, out_indices=(1, ), strides=(1, 2),
                  dilations=(1, 1)),
    # No dropout: mmengine's resume restores no random number generator, so with dropout a resumed
    # run draws other masks than an uninterrupted one (in fp32 too) and cannot be compared bitwise.
    cls_head=dict(num_classes=4, in_channels=128, dropout_ratio=0))
train_pipeline = [
    dict(type='SampleFrames', clip_len=1, frame_interval=1, num_clips=3),
    dict(type='RawFrameDecode'),
    dict(type='FormatShape', input_format='NCHW'),
    dict(type='PackActionInputs')]
val_pipeline = [
    dict(type='SampleFrames', clip_len=1, frame_interval=1, num_clips=3, test_mode=True),
    dict(type='RawFrameDecode'),
    dict(type='FormatShape', input_format='NCHW'),
    dict(type='PackActionInputs')]
train_dataloader = dict(
    batch_size=8, num_workers=0, persistent_workers=False,
    dataset=dict(type='RawframeDataset', ann_file='{data}/train.txt',
                 data_prefix=dict(img='{data}/train'), pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=16, num_workers=0, persistent_workers=False,
    dataset=dict(type='RawframeDataset', ann_file='{data}/val.txt',
                 data_prefix=dict(img='{data}/val'), pipeline=val_pipeline, test_mode=True))
test_dataloader = val_dataloader
train_cfg = dict(max_epochs=2)
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=1, save_best=None))
log_processor = dict(window_size=1)  # each iteration's own loss in the log, not a running mean
randomness = dict(seed=0)
"""


@pytest.fixture(scope='module')
def mmaction2(tmp_path_factory):
    """Runs variants on demand, once per module: ``mmaction2(name)`` -> its work dir."""
    mim = require_toolbox('mmaction', 'mmaction2', '1.2.0')
    root = tmp_path_factory.mktemp('mmaction2')
    data = make_rawframes(root / 'data', {'train': 16, 'val': 8})
    write_config(root / 'tiny_tsn.py', TINY.format(shipped=os.path.join(mim, *SHIPPED), data=data))
    script = os.path.join(mim, 'tools', 'train.py')
    done = {}

    class Runs:
        def __init__(self):
            self.root, self.script = root, script

        def config(self, name, text):
            return write_config(root / f'{name}.py', f"_base_ = ['./tiny_tsn.py']\n{text}")

        def __call__(self, name, *args, script=None, check=True):
            if name not in done:
                work_dir = root / name
                done[name] = (work_dir, run_script(script or self.script,
                                                   self.config(name, VARIANTS[name]), work_dir,
                                                   *args, check=check))
            return done[name]

    return Runs()


def _losses(work_dir):
    return [r['loss'] for r in train_records(work_dir)]


def _accuracy(work_dir):
    return [r['acc/top1'] for r in val_records(work_dir)]


@pytest.mark.parametrize('level', ['O1', 'O2'])
def test_bf16_with_an_fp32_head_trains_like_fp32(mmaction2, level):
    work_dir, _ = mmaction2(level)
    fp32_dir, _ = mmaction2('fp32')
    losses = _losses(work_dir)
    assert len(losses) == 16 and all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses
    assert losses[1:] != _losses(fp32_dir)[1:]  # bf16 arithmetic, not an fp32 run
    # The head's own training accuracy (numpy, inside the forward) is logged.
    assert all('top1_acc' in r for r in train_records(work_dir))
    accuracy, fp32_accuracy = _accuracy(work_dir), _accuracy(fp32_dir)
    assert len(accuracy) == 2 and accuracy[-1] >= 0.6, accuracy
    assert abs(accuracy[-1] - fp32_accuracy[-1]) <= 0.3, (accuracy, fp32_accuracy)
    lines = [line for line in log_text(work_dir).splitlines() if 'Epoch(train)' in line]
    # The shipped schedule clips (max_norm=40): amp_gnorm too.
    assert len(lines) == 16
    for line in lines:
        assert 'amp_scale: ' in line and 'amp_skipped: ' in line and 'amp_gnorm: ' in line, line
    ckpt = load_checkpoint(work_dir / 'epoch_2.pth')
    for name, value in float_state(ckpt).items():
        assert value.dtype == torch.float32 and torch.isfinite(value).all(), name
    if level == 'O2':  # fp32 masters: weights that bf16 cannot represent
        conv = ckpt['state_dict']['backbone.layer1.0.conv1.conv.weight']
        assert not torch.equal(conv, conv.bfloat16().float())


def test_bf16_head_fails_in_numpy_without_fp32_modules_naming_the_key(mmaction2):
    """Why the key is needed: without it the head's numpy accuracy meets bf16 scores at the first
    iteration, and the error names the module and the line to add."""
    work_dir, proc = mmaction2('O2_no_fp32_head', check=False)
    assert proc.returncode != 0
    assert 'Epoch(train)' not in proc.stdout + proc.stderr
    assert 'top_k_accuracy(cls_scores.detach().cpu().numpy()' in proc.stderr
    assert 'TypeError: Got unsupported ScalarType BFloat16' in proc.stderr
    assert ("inside TSNHead 'cls_head'" in proc.stderr
            and "adding fp32_modules=['cls_head'] to the optim_wrapper config" in proc.stderr), \
        proc.stderr[-2000:]


def test_resume_continues_bit_for_bit(mmaction2):
    full, _ = mmaction2('O2')
    resumed = resume_from_epoch_1(mmaction2, full, 'O2_resumed', VARIANTS['O2'])
    assert _losses(resumed) == _losses(full)[8:]
    a, b = load_checkpoint(full / 'epoch_2.pth'), load_checkpoint(resumed / 'epoch_2.pth')
    for name, value in a['state_dict'].items():
        assert torch.equal(b['state_dict'][name], value), name
    for key, value in a['optimizer']['state'].items():
        for k, v in value.items():
            assert torch.equal(b['optimizer']['state'][key][k], v), (key, k)
    assert _accuracy(resumed) == _accuracy(full)[1:]


def test_stock_ema_hook_at_o2(mmaction2):
    work_dir, _ = mmaction2('O2_ema')
    losses = _losses(work_dir)
    assert losses == _losses(mmaction2('O2')[0])  # the EMA does not touch training
    ckpt = load_checkpoint(work_dir / 'epoch_2.pth')
    ema = float_state(ckpt)  # EMAHook swaps the average into state_dict
    model = {k[len('module.'):]: v for k, v in float_state(ckpt, 'ema_state_dict').items()
             if k.startswith('module.')}
    plain = float_state(load_checkpoint(mmaction2('O2')[0] / 'epoch_2.pth'))
    for name, value in model.items():
        assert torch.equal(value, plain[name]), name  # the model's weights, as without EMA
        assert ema[name].dtype == torch.float32 and torch.isfinite(ema[name]).all(), name
    assert any(not torch.equal(ema[k], model[k]) for k in model if 'running' not in k)


def test_our_train_script_gives_the_same_run(mmaction2):
    ours = mmaction2.root / 'O2_our_script'
    run_script(os.path.join(REPO, 'tools', 'train.py'), mmaction2.config('O2_ours', VARIANTS['O2']),
               ours)
    theirs, _ = mmaction2('O2')
    assert _losses(ours) == _losses(theirs)
    assert _accuracy(ours) == _accuracy(theirs)
    a, b = load_checkpoint(theirs / 'epoch_2.pth'), load_checkpoint(ours / 'epoch_2.pth')
    for name, value in float_state(a).items():
        assert torch.equal(b['state_dict'][name], value), name


def test_amp_flag_refuses_our_wrapper(mmaction2):
    """mmaction2's ``--amp`` accepts only OptimWrapper/AmpOptimWrapper configs."""
    proc = run_script(mmaction2.script, mmaction2.config('O2_amp', VARIANTS['O2']),
                      mmaction2.root / 'O2_amp', '--amp', check=False)
    assert proc.returncode != 0
    assert ('AssertionError: `--amp` is not supported custom optimizer wrapper type '
            '`mp_wrappers.ApexOptimWrapper.') in proc.stderr, proc.stderr[-3000:]
