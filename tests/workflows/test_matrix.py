"""The workflow matrix: {FP16OptimWrapper over a half model, FP16OptimWrapper casting an fp32 model,
ApexOptimWrapper O1/O2/O3} x {fp16, bf16} x {load_from, EMAHook, accumulation, resume}, through
mmengine's Runner, launched as our tools/train.py does and as a toolbox's train script does
(Note [two launchers]).

Per wrapper, dtype and launcher, one run combines the workflows (load_from an fp32 checkpoint, an EMA
hook: ``mp_wrappers.MixedPrecisionEMAHook`` through tools/train.py, mmengine's ``EMAHook`` through the
toolbox launcher; ``accumulative_counts=2``, checkpoints at iterations 4 and 8) and
a second run resumes it from iteration 4; a plain fp32 ``OptimWrapper`` run with mmengine's own
``EMAHook`` is the reference. Each cell checks its workflow on those runs, and every cell checks that the
run trained (the loss decreased), and that the saved weights, the EMA weights and the masters are full
precision where the level keeps masters.
"""
import pytest
import torch

from _workflow import (KEEPS_MASTERS, LAUNCHER, RecordHook, latest_checkpoint, load, losses,
                       make_runner, save_pretrained, train)

# Note [two launchers] (tests/_workflow.py): every test runs through both.
pytestmark = pytest.mark.usefixtures('launcher')

WRAPPERS = ('FP16', 'FP16cast', 'O1', 'O2', 'O3')
DTYPES = ('float16', 'bfloat16')
WORKFLOWS = ('load_from', 'ema', 'accumulation', 'resume')
ITERS, ACCUM, MOMENTUM = 8, 2, 0.25
_RUNS = {}


def _runs(tmp_path_factory, wrapper, dtype):
    launcher = LAUNCHER[0]
    key = (wrapper, dtype, launcher)
    if key in _RUNS:
        return _RUNS[key]
    root = tmp_path_factory.mktemp(f'matrix_{wrapper}_{dtype}_{launcher}')
    pretrained = save_pretrained(root / 'pretrained.pth')

    def run(work_dir, resume=False):
        record = RecordHook()
        # A toolbox config lists mmengine's EMAHook; ours may name the explicit form.
        ema = 'EMAHook' if wrapper == 'fp32' or launcher == 'toolbox' else \
            'mp_wrappers.MixedPrecisionEMAHook'
        load_from = str(root / 'full' / 'iter_4.pth') if resume else str(root / 'pretrained.pth')
        runner = make_runner(work_dir, wrapper, dtype, iters=ITERS, ckpt_interval=4,
                             accumulative_counts=ACCUM, load_from=load_from, resume=resume,
                             custom_hooks=[dict(type=ema, momentum=MOMENTUM)])
        runner.register_hook(record)
        initial = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
        train(runner)
        return runner, record, initial

    full = run(root / 'full')
    resumed = run(root / 'resumed', resume=True) if wrapper != 'fp32' else None
    _RUNS[key] = dict(root=root, pretrained=pretrained, full=full, resumed=resumed)
    return _RUNS[key]


def _ema(runner):
    (hook,) = [h for h in runner.hooks if type(h).__name__.endswith('EMAHook')]
    return dict(hook.ema_model.module.named_parameters())


@pytest.mark.parametrize('workflow', WORKFLOWS)
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('wrapper', WRAPPERS)
def test_matrix(tmp_path_factory, wrapper, dtype, workflow):
    runs = _runs(tmp_path_factory, wrapper, dtype)
    ref = _runs(tmp_path_factory, 'fp32', 'float32')
    runner, record, _ = runs['full']
    half = getattr(torch, dtype)
    keeps_masters = wrapper in KEEPS_MASTERS
    pretrained = runs['pretrained']

    # Every cell: it trained, close to the fp32 reference, with full-precision weights saved.
    run_losses, ref_losses = losses(runner), losses(ref['full'][0])
    assert sum(run_losses[-2:]) < sum(run_losses[:2]), run_losses
    assert abs(run_losses[-1] - ref_losses[-1]) < 0.05 * ref_losses[-1], (run_losses, ref_losses)
    ckpt = load(latest_checkpoint(runs['root'] / 'full'))
    masters = record.masters[-1]
    assert bool(masters) == keeps_masters
    assert all(m.dtype == torch.float32 for m in masters.values())
    # EMAHook swaps the EMA into state_dict and the model's weights into ema_state_dict.
    model_saved = {k[len('module.'):]: v for k, v in ckpt['ema_state_dict'].items()
                   if k.startswith('module.')}
    for name, p in runner.model.named_parameters():
        assert ckpt['state_dict'][name].dtype == torch.float32, name  # the EMA
        assert model_saved[name].dtype == torch.float32, name
        if name in masters:
            assert torch.equal(model_saved[name], masters[name]), name
        else:
            assert torch.equal(model_saved[name], p.detach().float()), name

    if workflow == 'load_from':
        start = record.masters[0]  # no step at iteration 0 (accumulation): the starting masters
        assert bool(start) == keeps_masters
        for name, p in pretrained.items():
            if name in start:  # masters: the fp32 checkpoint, bit for bit
                assert torch.equal(start[name], pretrained[name]), name
        first_model = runs['full'][2]  # before training: pretrained not loaded yet (init)
        assert not torch.equal(first_model['fc1.weight'].float(), pretrained['fc1.weight'])
    elif workflow == 'ema':
        ema = _ema(runner)
        sequence = [{k: m.get(k, w) for k, w in weights.items()}
                    for weights, m in zip(record.weights, record.masters)]
        expected = {k: v.float().clone() for k, v in sequence[0].items()}
        for weights in sequence[1:]:
            for k, v in expected.items():
                v.lerp_(weights[k].float(), MOMENTUM)
        for name, value in expected.items():
            assert ema[name].dtype == torch.float32, name
            assert torch.equal(ema[name], value), name
            assert torch.equal(ckpt['state_dict'][name], value), name
    elif workflow == 'accumulation':
        # Optimizer steps at iterations 1, 3, 5, 7 only.
        w = [r['fc2.weight'] for r in record.weights]
        for i in range(0, ITERS, 2):
            assert not torch.equal(w[i + 1], w[i]), i + 1
            if i + 2 < ITERS:
                assert torch.equal(w[i + 2], w[i + 1]), i + 2
    elif workflow == 'resume':
        resumed, resumed_record, _ = runs['resumed']
        for (name, a), b in zip(runner.model.named_parameters(), resumed.model.parameters()):
            assert torch.equal(a, b), name
        for name, m in masters.items():
            assert torch.equal(m, resumed_record.masters[-1][name]), name
        ema, ema_resumed = _ema(runner), _ema(resumed)
        for name in ema:
            assert torch.equal(ema[name], ema_resumed[name]), name
        assert losses(resumed)[-1] == run_losses[-1]
