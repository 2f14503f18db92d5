"""mmpretrain 1.2.0, trained by mmpretrain's own ``tools/train.py`` with our wrappers (issue 23).

A user changes one line of a shipped config (``optim_wrapper``, plus ``custom_imports``) and runs
the toolbox's script. Each variant here is that: a config that inherits mmpretrain's shipped
``configs/resnet/resnet18_8xb32_in1k.py`` through a tiny, offline base (generated 32x32 images in a
``CustomDataset`` folder, ResNet-18 at a quarter of its width, 2 epochs of 8 iterations) and adds
only the wrapper lines; the script runs in a subprocess. No hook or loop of ours is listed.
"""
import os

import pytest
import torch

from _toolbox_runs import (CUSTOM_IMPORTS, REPO, float_state, load_checkpoint, log_text,
                           resume_from_epoch_1,
                           make_image_folder, require_toolbox, run_script, train_records,
                           val_records, write_config)

BN_BUFFERS = ('running_mean', 'running_var', 'num_batches_tracked')
O2 = "optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16')\n"

VARIANTS = {
    # name: what the user adds to the (tiny) config
    'fp32': '',
    'O1': CUSTOM_IMPORTS + "optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', "
                           "opt_level='O1', dtype='bfloat16')\n",
    'O2': CUSTOM_IMPORTS + O2,
    'O2_accum_clip_ema': CUSTOM_IMPORTS + (
        "optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16',"
        " accumulative_counts=2, clip_grad=dict(max_norm=1.0))\n"
        "custom_hooks = [dict(type='mmengine.EMAHook', momentum=0.1, priority='ABOVE_NORMAL')]\n"),
    'O2_accum_clip_mmpretrain_ema': CUSTOM_IMPORTS + (
        "optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16',"
        " accumulative_counts=2, clip_grad=dict(max_norm=1.0))\n"
        "custom_hooks = [dict(type='EMAHook', momentum=0.1, priority='ABOVE_NORMAL')]\n"),
    'O2_accum_clip_mp_ema': CUSTOM_IMPORTS + (
        "optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16',"
        " accumulative_counts=2, clip_grad=dict(max_norm=1.0))\n"
        "custom_hooks = [dict(type='mp_wrappers.MixedPrecisionEMAHook', momentum=0.1, "
        "priority='ABOVE_NORMAL')]\n"),
    'O2_fp32_head': CUSTOM_IMPORTS + (
        "optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16',"
        " fp32_modules=['head'])\n"),
    'FP16OptimWrapper': CUSTOM_IMPORTS + (
        "optim_wrapper = dict(type='mp_wrappers.FP16OptimWrapper', dtype='bfloat16')\n"),
}


@pytest.fixture(scope='module')
def mmpretrain(tmp_path_factory):
    """Runs variants on demand, once per module: ``mmpretrain(name)`` -> its work dir."""
    mim = require_toolbox('mmpretrain', 'mmpretrain', '1.2.0')
    root = tmp_path_factory.mktemp('mmpretrain')
    data = make_image_folder(root / 'data', {'train': 16, 'val': 8})
    shipped = os.path.join(mim, 'configs', 'resnet', 'resnet18_8xb32_in1k.py')
    tiny = write_config(root / 'tiny_resnet18.py', TINY.format(shipped=shipped, data=data))
    script = os.path.join(mim, 'tools', 'train.py')
    done = {}

    class Runs:
        def __init__(self):
            self.root, self.script, self.tiny = root, script, tiny

        def config(self, name, text):
            return write_config(root / f'{name}.py', f"_base_ = ['./tiny_resnet18.py']\n{text}")

        def __call__(self, name, text=None, *args, script=None):
            if name not in done:
                config = self.config(name, VARIANTS[name] if text is None else text)
                work_dir = root / name
                done[name] = (work_dir, run_script(script or self.script, config, work_dir, *args))
            return done[name][0]

    return Runs()


# Everything here makes the shipped config tiny and offline; nothing concerns precision.
TINY = """_base_ = ['{shipped}']
model = dict(backbone=dict(base_channels=16, stem_channels=16),
             head=dict(num_classes=4, in_channels=128, topk=(1, )))
data_preprocessor = dict(num_classes=4)
pipeline = [dict(type='LoadImageFromFile'), dict(type='PackInputs')]
train_dataloader = dict(
    batch_size=8, num_workers=0, persistent_workers=False, pin_memory=False,
    dataset=dict(_delete_=True, type='CustomDataset', data_root='{data}', data_prefix='train',
                 pipeline=pipeline))
val_dataloader = dict(
    batch_size=16, num_workers=0, persistent_workers=False, pin_memory=False,
    dataset=dict(_delete_=True, type='CustomDataset', data_root='{data}', data_prefix='val',
                 pipeline=pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_evaluator = val_evaluator
optim_wrapper = dict(optimizer=dict(lr=0.01))
param_scheduler = []
train_cfg = dict(max_epochs=2, val_interval=1)
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=1))
log_processor = dict(window_size=1)  # each iteration's own loss in the log, not a running mean
randomness = dict(seed=0)
"""


def _losses(work_dir):
    return [r['loss'] for r in train_records(work_dir)]


def _accuracy(work_dir):
    return [r['accuracy/top1'] for r in val_records(work_dir)]


def _params(state):
    return {k: v for k, v in state.items() if not k.endswith(BN_BUFFERS)}


def _assert_trains(work_dir, fp32_dir=None, min_accuracy=90.0, loss_ratio=0.7):
    """Finite, decreasing loss, a validation accuracy well above chance (25%) and, given an fp32
    run of the same config, close to its accuracy; the checkpoint is fp32 and finite."""
    losses = _losses(work_dir)
    assert len(losses) == 16 and all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-4:]) < loss_ratio * sum(losses[:4]), losses
    accuracy = _accuracy(work_dir)
    assert len(accuracy) == 2 and accuracy[-1] >= min_accuracy, accuracy
    if fp32_dir is not None:
        fp32_accuracy = _accuracy(fp32_dir)
        assert abs(accuracy[-1] - fp32_accuracy[-1]) <= 10.0, (accuracy, fp32_accuracy)
    ckpt = load_checkpoint(work_dir / 'epoch_2.pth')
    for name, value in float_state(ckpt).items():
        assert value.dtype == torch.float32 and torch.isfinite(value).all(), name
    return ckpt


def _assert_amp_fields(work_dir, gnorm_from=None):
    """amp_scale and amp_skipped in every training log line, and amp_gnorm (clipping) in every
    line from iteration ``gnorm_from`` on (the first optimizer step)."""
    lines = [line for line in log_text(work_dir).splitlines() if 'Epoch(train)' in line]
    assert len(lines) == 16, len(lines)
    for i, line in enumerate(lines, 1):
        assert 'amp_scale: ' in line and 'amp_skipped: ' in line, line
        if gnorm_from is not None and i >= gnorm_from:
            assert 'amp_gnorm: ' in line, line
    records = train_records(work_dir)
    assert all(r['amp_skipped'] == 0 and r['amp_scale'] == 1.0 for r in records)


@pytest.mark.parametrize('level', ['O1', 'O2'])
def test_apex_levels_train_like_fp32(mmpretrain, level):
    work_dir = mmpretrain(level)
    _assert_trains(work_dir, mmpretrain('fp32'))
    _assert_amp_fields(work_dir)
    # bf16 arithmetic: not the fp32 run's numbers.
    assert _losses(work_dir)[1:] != _losses(mmpretrain('fp32'))[1:]


def test_o2_masters_are_the_checkpointed_weights(mmpretrain):
    """O2 keeps fp32 masters: the checkpoint holds weights that bf16 cannot represent."""
    state = _params(float_state(load_checkpoint(mmpretrain('O2') / 'epoch_2.pth')))
    conv = state['backbone.layer1.0.conv1.weight']
    assert not torch.equal(conv, conv.bfloat16().float())


def _bf16_exact(x: float) -> bool:
    return torch.tensor(x, dtype=torch.float64).bfloat16().double().item() == x


def test_o2_computes_the_loss_in_bf16_unless_the_head_is_fp32(mmpretrain):
    """mmpretrain computes the loss inside the model (``ClsHead.loss``), so at O2 it is a bf16
    number (as apex's O2 computed it in fp16); ``fp32_modules=['head']`` keeps the head, and the
    loss, in fp32."""
    assert all(_bf16_exact(x) for x in _losses(mmpretrain('O2')))
    work_dir = mmpretrain('O2_fp32_head')
    _assert_trains(work_dir, mmpretrain('fp32'))
    assert sum(_bf16_exact(x) for x in _losses(work_dir)) <= 2, _losses(work_dir)
    # The backbone still trains in bf16, with fp32 masters holding what bf16 cannot.
    state = float_state(load_checkpoint(work_dir / 'epoch_2.pth'))
    conv = state['backbone.layer1.0.conv1.weight']
    assert not torch.equal(conv, conv.bfloat16().float())


def test_o2_accumulation_clip_and_stock_ema_hook(mmpretrain):
    """mmengine's EMAHook at O2 with accumulation and clipping (it crashed at iteration 2). In
    mmpretrain's scope ``type='EMAHook'`` is mmpretrain's own subclass (the next test): mmengine's
    is ``type='mmengine.EMAHook'``."""
    work_dir = mmpretrain('O2_accum_clip_ema')
    # Half as many steps as the other runs, clipped, validated on the average: slower to learn.
    ckpt = _assert_trains(work_dir, min_accuracy=75.0, loss_ratio=0.9)
    # No gradient norm before the first step (iteration 2 with accumulative_counts=2).
    _assert_amp_fields(work_dir, gnorm_from=2)
    # EMAHook swaps the average into state_dict and keeps the model's weights in ema_state_dict.
    ema = _params(float_state(ckpt))
    model = {k[len('module.'):]: v for k, v in float_state(ckpt, 'ema_state_dict').items()
             if k.startswith('module.') and not k.endswith(BN_BUFFERS)}
    assert set(ema) == set(model)
    for name, value in ema.items():
        assert value.dtype == torch.float32, name
    assert any(not torch.equal(ema[k], model[k]) for k in ema)  # an average, not the last weights


@pytest.mark.parametrize('stock', ['O2_accum_clip_ema', 'O2_accum_clip_mmpretrain_ema'])
def test_stock_ema_hooks_equal_mixed_precision_ema_hook(mmpretrain, stock):
    """mmengine's EMAHook, and mmpretrain's own ``EMAHook`` (a subclass adding
    ``evaluate_on_ema``/``evaluate_on_origin``; what ``type='EMAHook'`` builds in mmpretrain's configs),
    average the fp32 masters exactly as MixedPrecisionEMAHook does: the same checkpoint, bit for
    bit."""
    stock_dir = mmpretrain(stock)
    ours_dir = mmpretrain('O2_accum_clip_mp_ema')
    assert _losses(ours_dir) == _losses(stock_dir)
    a = load_checkpoint(stock_dir / 'epoch_2.pth')
    b = load_checkpoint(ours_dir / 'epoch_2.pth')
    for key in ('state_dict', 'ema_state_dict'):
        x, y = float_state(a, key), float_state(b, key)
        assert set(x) == set(y)
        for name in x:
            assert torch.equal(x[name], y[name]), (key, name)
    assert _accuracy(ours_dir) == _accuracy(stock_dir)


def test_fp16_optim_wrapper_bf16_casts_the_toolbox_model(mmpretrain):
    """FP16OptimWrapper(dtype='bfloat16') over mmpretrain's fp32 model trains in bf16 (it trained
    entirely in fp32: the losses were the fp32 run's, bit for bit)."""
    work_dir = mmpretrain('FP16OptimWrapper')
    _assert_trains(work_dir, mmpretrain('fp32'))
    _assert_amp_fields(work_dir)
    assert _losses(work_dir)[1:] != _losses(mmpretrain('fp32'))[1:]


def test_load_from_with_zero_lr_keeps_the_loaded_weights_and_accuracy(mmpretrain):
    """``load_from`` a trained fp32 checkpoint and fine-tune it at lr=0 with frozen BatchNorm
    statistics (``norm_eval=True``): the O2 masters are the loaded fp32 weights (not their bf16
    rounding), the checkpoint written after an epoch is the loaded one, bit for bit, and
    validation finds the loaded accuracy."""
    source = mmpretrain('fp32') / 'epoch_2.pth'
    loaded_accuracy = _accuracy(mmpretrain('fp32'))[-1]
    assert loaded_accuracy >= 90.0
    text = (CUSTOM_IMPORTS + "optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', "
            "opt_level='O2', dtype='bfloat16', optimizer=dict(lr=0.0))\n"
            "model = dict(backbone=dict(norm_eval=True))\n"
            f"load_from = {str(source)!r}\ntrain_cfg = dict(max_epochs=1)\n")
    work_dir = mmpretrain('load_from_lr0', text)
    assert 'Load checkpoint from' in log_text(work_dir)
    before = float_state(load_checkpoint(source))
    after = float_state(load_checkpoint(work_dir / 'epoch_1.pth'))
    assert set(before) == set(after)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    # Evaluated in bf16 (the O2 model): a borderline image may change class.
    (accuracy,) = _accuracy(work_dir)
    assert abs(accuracy - loaded_accuracy) <= 100.0 / 32, (accuracy, loaded_accuracy)


def test_resume_continues_bit_for_bit(mmpretrain):
    """``--resume`` (the last checkpoint of the work dir) from epoch 1 of the O2 run: epoch 2's
    losses, weights, optimizer state and loss scaler equal the uninterrupted run's."""
    full = mmpretrain('O2')
    resumed = resume_from_epoch_1(mmpretrain, full, 'O2_resumed', VARIANTS['O2'])
    assert _losses(resumed) == _losses(full)[8:]
    a, b = load_checkpoint(full / 'epoch_2.pth'), load_checkpoint(resumed / 'epoch_2.pth')
    assert set(a['state_dict']) == set(b['state_dict'])
    for name, value in a['state_dict'].items():
        assert torch.equal(b['state_dict'][name], value), name
    assert _states_equal(a['optimizer'], b['optimizer'])
    assert _accuracy(resumed) == _accuracy(full)[1:]


def _states_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_states_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_our_train_script_gives_the_same_run(mmpretrain):
    """The same O2 config through our tools/train.py: the same losses, weights and accuracy."""
    ours = mmpretrain('O2_our_script', VARIANTS['O2'],
                      script=os.path.join(REPO, 'tools', 'train.py'))
    theirs = mmpretrain('O2')
    assert _losses(ours) == _losses(theirs)
    assert _accuracy(ours) == _accuracy(theirs)
    a, b = load_checkpoint(theirs / 'epoch_2.pth'), load_checkpoint(ours / 'epoch_2.pth')
    for name, value in float_state(a).items():
        assert torch.equal(b['state_dict'][name], value), name


def test_a_shipped_config_and_its_demo_project_through_mmpretrains_script(tmp_path):
    """One of our configs (configs/digits: its model, data and metric are the demo project
    projects/digits, imported by the config's custom_imports) through mmpretrain's script, run from
    another working directory: the repository root on PYTHONPATH (run_script puts it there) is all
    it needs (projects/README.md)."""
    mim = require_toolbox('mmpretrain', 'mmpretrain', '1.2.0')
    work_dir = tmp_path / 'digits'
    # --no-persistent-workers: mmpretrain's script turns them on, and the config loads its data in
    # the main process (num_workers=0).
    run_script(os.path.join(mim, 'tools', 'train.py'),
               os.path.join(REPO, 'configs', 'digits', 'cnn_fp32.py'), work_dir,
               '--no-persistent-workers', '--cfg-options', 'train_cfg.max_epochs=1',
               'train_cfg.val_interval=1', cwd=tmp_path)
    accuracy = [r['accuracy'] for r in val_records(work_dir)]
    assert len(accuracy) == 1 and accuracy[0] > 50, accuracy


def test_amp_flag_replaces_our_wrapper_with_mmengines_amp_wrapper(mmpretrain):
    """mmpretrain's ``--amp`` sets ``optim_wrapper.type = 'AmpOptimWrapper'`` (mmengine's, on
    ``torch.amp``) over whatever the config names, keeping the other keys: our wrapper is dropped.
    mmengine's AmpOptimWrapper refuses to run without a GPU; on a GPU it rejects our keys
    (``opt_level``). The config line is the switch: do not pass ``--amp`` with it."""
    config = mmpretrain.config('O2_amp', VARIANTS['O2'])
    proc = run_script(mmpretrain.script, config, mmpretrain.root / 'O2_amp', '--amp', check=False)
    assert proc.returncode != 0
    assert ('AssertionError: ``AmpOptimizerWrapper`` is only available training on gpu, npu, '
            'mlu or musa') in proc.stderr, proc.stderr[-3000:]
    assert 'Epoch(train)' not in proc.stdout


def test_amp_flag_on_a_gpu_would_reject_our_keys(monkeypatch):
    """What the same ``--amp`` does where a GPU is present: mmengine's AmpOptimWrapper gets our
    wrapper's keys and refuses them (checked in-process with the GPU check answered yes)."""
    require_toolbox('mmpretrain', 'mmpretrain', '1.2.0')
    from mmengine.optim.optimizer import amp_optimizer_wrapper
    monkeypatch.setattr(amp_optimizer_wrapper, 'is_cuda_available', lambda: True)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'opt_level'"):
        amp_optimizer_wrapper.AmpOptimWrapper(optimizer=optimizer, opt_level='O2',
                                              dtype='bfloat16', loss_scale='dynamic')
