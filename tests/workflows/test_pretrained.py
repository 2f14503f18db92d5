"""Pretrained weights, init_cfg, load_from and resume through mmengine's Runner (issue 10, items 1, 6, 7, 11).

mmengine builds the optimizer wrapper before ``init_weights()``, ``load_from`` and ``resume`` write the
model; the fp32 masters must nevertheless start from the weights the model has when training starts
(Note [masters lifecycle] in mp_wrappers/master.py), checkpoints must hold the masters, and a mismatch
between loaded masters and loaded weights must be reported.
"""
import warnings

import pytest
import torch
from mmengine.hooks import Hook

from mp_wrappers.master import MasterMismatchWarning
from mp_wrappers.wrappers.fp16 import FP32ModelWarning

from _workflow import (RecordHook, latest_checkpoint, load, make_runner, masters_by_name,
                       save_pretrained, train)

# Note [two launchers] (tests/_workflow.py): every test runs through both.
pytestmark = pytest.mark.usefixtures('launcher')

DTYPES = ('bfloat16', 'float16')
LR0 = dict(type='SGD', lr=0.0)  # a fine-tune that must not change the weights at all


def _half(state, dtype):
    return {k: v.to(getattr(torch, dtype)) for k, v in state.items()}


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('wrapper', ['FP16', 'O2'])
def test_lr0_finetune_from_load_from_keeps_the_pretrained_weights(tmp_path, wrapper, dtype):
    """Item 1: a fine-tune at lr=0 must end with the loaded weights, not the stale init's masters."""
    pretrained = save_pretrained(tmp_path / 'pretrained.pth')
    ref = train(make_runner(tmp_path / 'fp32', 'fp32', optimizer=LR0, iters=2,
                            load_from=str(tmp_path / 'pretrained.pth')))
    runner = train(make_runner(tmp_path / 'run', wrapper, dtype, optimizer=LR0, iters=2,
                               load_from=str(tmp_path / 'pretrained.pth')))
    half = _half(pretrained, dtype)
    for name, p in runner.model.named_parameters():
        assert torch.equal(ref.model.state_dict()[name], pretrained[name])  # the fp32 reference
        if p.dtype != torch.float32:
            assert torch.equal(p.detach(), half[name]), name
        else:  # BatchNorm kept fp32
            assert torch.equal(p.detach(), pretrained[name]), name


@pytest.mark.parametrize('wrapper', ['FP16', 'O2'])
def test_masters_start_from_init_cfg(tmp_path, wrapper):
    """Item 1: init_cfg runs after the wrapper is built; the masters must start from its weights."""
    init = dict(type='Constant', layer='Linear', val=0.375, bias=0.125)
    runner = train(make_runner(tmp_path, wrapper, 'bfloat16', optimizer=LR0, iters=2,
                               model=dict(init_cfg=init)))
    masters = masters_by_name(runner)
    assert masters, 'the level keeps masters'
    for name, master in masters.items():
        assert torch.all(master == (0.375 if name.endswith('weight') else 0.125)), name


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('wrapper', ['O2', 'O2-cast-before-loading', 'FP16'])
def test_masters_equal_the_fp32_checkpoint_bit_for_bit(tmp_path, wrapper, dtype):
    """Item 7: loading fp32 weights into an O2 run must not round them through the half dtype.

    O2 casts after loading. FP16OptimWrapper's model, and an O2 model cast before loading (what
    MixedPrecisionDistributedDataParallel does before DDP wraps it), were cast with cast_model, whose
    load pre-hook kept the fp32 values for the masters.
    """
    pretrained = save_pretrained(tmp_path / 'pretrained.pth')
    record = RecordHook()
    model = dict(dtype=dtype) if wrapper == 'O2-cast-before-loading' else None
    runner = make_runner(tmp_path / 'run', wrapper.split('-')[0], dtype, optimizer=LR0, iters=2,
                         model=model,
                         load_from=str(tmp_path / 'pretrained.pth'))
    runner.register_hook(record)
    train(runner)
    masters = record.masters[0]  # after one step at lr=0
    assert set(masters) == {'fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias', 'late.weight',
                            'late.bias', 'unused.weight', 'unused.bias'}
    for name, master in masters.items():
        assert master.dtype == torch.float32
        assert torch.equal(master, pretrained[name]), name
        # and the pretrained values really are not representable in the half dtype
        assert not torch.equal(master, pretrained[name].to(getattr(torch, dtype)).float())


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('wrapper', ['FP16', 'O2'])
def test_checkpoints_hold_the_masters_and_resume_is_bitwise(tmp_path, wrapper, dtype):
    """Item 6: state_dict holds the fp32 masters (an fp32 model loads them), resume is bitwise."""
    full = train(make_runner(tmp_path / 'full', wrapper, dtype, iters=6, ckpt_interval=3))
    ckpt = load(tmp_path / 'full' / 'iter_3.pth')
    saved_masters = [m for group in ckpt['optimizer']['mp_wrappers']['fp32_master_params']
                     for m in group]
    state = ckpt['state_dict']
    half_names = [n for n, p in full.model.named_parameters() if p.dtype != torch.float32]
    assert len(half_names) == len(saved_masters)
    for name, master in zip(half_names, saved_masters):
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], master), name
    assert any(not torch.equal(state[n], state[n].to(getattr(torch, dtype)).float())
               for n in half_names), 'the checkpoint holds rounded weights, not the masters'
    # An fp32 model (inference, export) gets the masters.
    from _workflow import WorkflowMLP
    fp32_model = WorkflowMLP()
    fp32_model.load_state_dict(state)
    for name, master in zip(half_names, saved_masters):
        assert torch.equal(fp32_model.state_dict()[name], master)
    # Resume from iteration 3 ends bit for bit where the uninterrupted run ended.
    resumed = train(make_runner(tmp_path / 'resumed', wrapper, dtype, iters=6, ckpt_interval=3,
                                resume=True, load_from=str(tmp_path / 'full' / 'iter_3.pth')))
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    for name, m in masters_by_name(full).items():
        assert torch.equal(m, masters_by_name(resumed)[name]), name
    last_full, last_resumed = load(latest_checkpoint(tmp_path / 'full')), \
        load(latest_checkpoint(tmp_path / 'resumed'))
    for k, v in last_full['state_dict'].items():
        assert torch.equal(v, last_resumed['state_dict'][k]), k


@pytest.mark.parametrize('wrapper', ['FP16', 'O2'])
def test_loaded_masters_that_disagree_with_the_weights_are_reported(tmp_path, wrapper):
    """Item 1: a mismatch never passes silently; training starts from the model's weights."""
    train(make_runner(tmp_path / 'full', wrapper, 'bfloat16', iters=2, ckpt_interval=2))
    ckpt = load(tmp_path / 'full' / 'iter_2.pth')
    ckpt['state_dict']['fc1.weight'] = ckpt['state_dict']['fc1.weight'] + 0.5
    for group in ckpt['optimizer']['param_groups']:
        group['lr'] = 0.0  # so that the recorded masters after one step are the starting ones
    torch.save(ckpt, tmp_path / 'tampered.pth')
    record = RecordHook()
    runner = make_runner(tmp_path / 'resumed', wrapper, 'bfloat16', iters=3, resume=True,
                         load_from=str(tmp_path / 'tampered.pth'))
    runner.register_hook(record)
    with pytest.warns(MasterMismatchWarning, match='fc1.weight'):
        train(runner)
    # the loaded fp32 weight itself (not its bf16 rounding), for both wrappers
    assert torch.equal(record.masters[0]['fc1.weight'], ckpt['state_dict']['fc1.weight'])
    assert torch.equal(record.masters[0]['fc2.weight'], ckpt['state_dict']['fc2.weight'])


def test_a_consistent_resume_warns_nothing(tmp_path):
    train(make_runner(tmp_path / 'full', 'FP16', 'bfloat16', iters=2, ckpt_interval=2))
    with warnings.catch_warnings():
        warnings.simplefilter('error', MasterMismatchWarning)
        train(make_runner(tmp_path / 'resumed', 'FP16', 'bfloat16', iters=3, resume=True,
                          load_from=str(tmp_path / 'full' / 'iter_2.pth')))


def test_fp16_wrapper_over_an_fp32_model_says_so_with_the_fix(tmp_path):
    """Item 11: FP16OptimWrapper over an fp32 model trains in fp32; it must say so, once."""
    runner = make_runner(tmp_path, 'FP16', 'bfloat16', iters=2, model=dict(dtype=None))
    with pytest.warns(FP32ModelWarning) as caught:
        train(runner)
    messages = [str(w.message) for w in caught if issubclass(w.category, FP32ModelWarning)]
    assert len(messages) == 1
    assert 'trains entirely in fp32' in messages[0]
    assert "Add dtype='bfloat16'" in messages[0] and 'casts the model itself' in messages[0]


@pytest.mark.parametrize('wrapper', ['FP16', 'O2'])
def test_weights_written_by_a_before_train_hook_are_the_start(tmp_path, wrapper):
    """Item 1, hook order: before_train runs after the Runner's load; its writes count too."""
    class WritesWeights(Hook):
        def before_train(self, runner):
            with torch.no_grad():
                runner.model.fc1.weight.fill_(0.3125)

    runner = make_runner(tmp_path, wrapper, 'bfloat16', optimizer=LR0, iters=2)
    runner.register_hook(WritesWeights())
    record = RecordHook()
    runner.register_hook(record)
    train(runner)
    assert torch.all(record.masters[-1]['fc1.weight'] == 0.3125)
    assert torch.all(runner.model.fc1.weight == 0.3125)
