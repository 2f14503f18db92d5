"""FSDP1 through mmengine's FlexibleRunner, launched as users launch it: torchrun + a train script.

``configs/digits/cnn_fsdp_apex_O2_bf16.py`` (mp_wrappers.MixedPrecisionFSDPStrategy, ApexOptimWrapper
O2 bf16, FusedAdam, clip_grad, evaluation every epoch, mmengine's EMAHook), with inf planted into rank 1's local gradient
shard at iterations 10 and 40 (skipped on every rank, at 2 and 3 ranks), a dynamic loss scale that
grows every 10 steps and ``accumulative_counts=2`` (no_sync). Through tools/train.py: 2 processes
train 2 epochs with a full checkpoint per epoch; a second 2-process run resumes from the first
epoch's checkpoint and ends bitwise equal, with the same loss scale; one process without FSDP
resumes it too, and its evaluation of those weights gives the accuracy the 2 ranks logged. Through
a toolbox's own train script (no tools/train.py, no hook of ours: what a config alone gives): a
3-process run resumes from the same 2-process checkpoint (N -> M); with ``state_dict_cfg='local'``
(each rank writes its ShardedTensors) and accumulation, the same one-rank overflow, evaluation, and
a resume that is bitwise, loaded with exactly torch's ShardedTensor classes allow-listed, and
refused on another rank count. Runs of one rank count share a launch (fsdp_train_check.py
``--then``). Every rank records the same validation metrics. Each rank's optimizer state is about
total / N elements (the fp32 shards are the masters: none extra). The EMA (Note [EMA of a sharded
model]) holds each rank's pieces, is evaluated (the logged accuracy is the EMA's), saved gathered
(``'full'``) or as flat pieces (``'local'``) like the model, and resumes bitwise, on 3 ranks and in
one process without FSDP too. (mmengine's ``EMAHook`` under an FSDP1 model wrapped without our
strategy: refused before training, tests/runner/test_runner_checkpoint.py.)
``configs/digits/cnn_fsdp2_apex_O2_bf16.py`` (FSDP2 through mp_wrappers.FullyShardedRunner): training,
checkpoints and resume in tests/runner/test_runner_checkpoint.py.
"""
import glob
import importlib.util
import os
import re
import sys

import pytest
import torch

import torchrun

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # projects.digits, which the configs import, for runs in this process
    sys.path.append(REPO)
CONFIG = 'tests/configs/fsdp_shard_fault.py'  # the shipped FSDP1 config + a one-rank fault
PLAIN = 'tests/configs/fsdp_plain_fault.py'  # the same without any hook of ours
OPTIONS = ['train_cfg.max_epochs=2', 'train_cfg.val_interval=1', 'default_hooks.checkpoint.interval=1',
           'optim_wrapper.loss_scale=dynamic', 'optim_wrapper.init_scale=256.',
           'optim_wrapper.scale_window=10',
           # 30 iterations per epoch on 2 ranks: the checkpoint falls on an accumulation boundary
           # (mmengine warns and drops a half window when it does not)
           'train_dataloader.batch_size=24']


def _env():
    # tests/ on the path: the configs import tests/_reliability_hooks.py
    return dict(os.environ, OMP_NUM_THREADS='1',
                PYTHONPATH=os.pathsep.join([os.path.join(REPO, 'tests'), REPO,
                                            os.environ.get('PYTHONPATH', '')]))


def _args(work_dir, result, extra=(), accumulate=2, config=CONFIG, options=None):
    return [config, str(result), '--launcher', 'pytorch', '--work-dir', str(work_dir), *extra,
            '--cfg-options', *(OPTIONS if options is None else options),
            f'optim_wrapper.accumulative_counts={accumulate}']


def torchrun_runs(nproc, *runs):
    """Each of ``runs`` (a dict of :func:`_torchrun`'s arguments) in turn, in one launch of
    ``nproc`` processes (fsdp_train_check.py ``--then``: starting processes is most of a launch's
    time). Returns ``[(result, rank 0's log file of that run)]``."""
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}',
           'tests/fsdp_train_check.py']
    for i, run in enumerate(runs):
        cmd += (['--then'] if i else []) + _args(**run)
    proc = torchrun.run(cmd, cwd=REPO, env=_env(), finished=lambda p: _all_done(p, nproc))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [(torch.load(run['result'], weights_only=True), run_log(run['work_dir'])) for run in runs]


def _torchrun(nproc, work_dir, result, extra=(), accumulate=2, config=CONFIG, options=None):
    """Train under torchrun with tools/train.py's setup (``'--plain'`` in ``extra``: a toolbox's)."""
    return torchrun_runs(nproc, dict(work_dir=work_dir, result=result, extra=extra,
                                     accumulate=accumulate, config=config, options=options))[0]


def run_log(work_dir):
    """Rank 0's log of the run in ``work_dir`` (mmengine's ``<work_dir>/<timestamp>/*.log``)."""
    return ''.join(open(path).read()
                   for path in sorted(glob.glob(os.path.join(str(work_dir), '*', '*.log'))))


def accuracies(log):
    """``{epoch: accuracy}`` of the ``Epoch(val)`` lines of a run's log."""
    return {int(e): float(a) for e, a in
            re.findall(r'Epoch\(val\) \[(\d+)\]\[\d+/\d+\]\s+accuracy: ([\d.]+)', log)}


def same_on_every_rank(val, logged, nproc):
    """Every rank's last ``val/accuracy`` is the same number, the one rank 0 logged (4 decimals)."""
    assert len(val) == nproc and val[0] is not None and val == val[:1] * nproc, val
    assert val[0] == pytest.approx(logged, abs=1e-4)


def train_tool():
    """tools/train.py as a module (its import puts the repository root on sys.path)."""
    spec = importlib.util.spec_from_file_location('train_tool', os.path.join(REPO, 'tools', 'train.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_this_process(fn):
    """Run ``fn`` (a Runner's train/val) with the digits configs' one thread, in this process, then
    undo the process-wide settings the Runner makes (threads, deterministic algorithms). Cheaper than
    a subprocess: starting one is most of its time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)


def _all_done(proc, nproc) -> bool:
    out = proc.stdout + proc.stderr
    return all(f'fsdp_train_check: rank {r} done' in out for r in range(nproc))


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('fsdp_runner')
    # 'local' runs: a toolbox's train script, no hook of ours, state_dict_cfg='local' (each rank
    # writes rank{i}.pth of ShardedTensors); each launch runs two configs in turn
    local = [*OPTIONS, 'strategy.state_dict_cfg=local']
    (straight, log), (local_a, local_log) = torchrun_runs(
        2, dict(work_dir=tmp / 'a', result=tmp / 'a.pt'),
        dict(work_dir=tmp / 'la', result=tmp / 'la.pt', extra=['--plain'], config=PLAIN,
             options=local))
    (resumed, _), (local_b, _) = torchrun_runs(
        2, dict(work_dir=tmp / 'b', result=tmp / 'b.pt',
                extra=['--resume', str(tmp / 'a' / 'epoch_1.pth')]),
        dict(work_dir=tmp / 'lb', result=tmp / 'lb.pt', config=PLAIN, options=local,
             extra=['--plain', '--resume', str(tmp / 'la' / 'epoch_1.pth')]))
    # Without accumulation: mmengine resumes the iteration counter of the 2-rank run (30), which
    # on 3 ranks (20 iterations per epoch) overshoots the accumulation bookkeeping's max_iters.
    # Through a toolbox's train script, no hook of ours.
    three, _ = _torchrun(3, tmp / 'c', tmp / 'c.pt',
                         ['--plain', '--resume', str(tmp / 'a' / 'epoch_1.pth')], accumulate=1,
                         config=PLAIN)
    return dict(straight=straight, resumed=resumed, three=three, log=log, local_a=local_a,
                local_b=local_b, local_log=local_log, tmp=tmp)


def test_trains_with_fsdp_mixed_precision(runs):
    a = runs['straight']
    assert a['world_size'] == 2 and a['iters'] == 60
    # inf planted in rank 1's local shard at iterations 10 and 40 (steps 5 and 20 of 30): rank 0
    # skipped both (the overflow flag is all-reduced), and nothing else; the scale halved at each
    # and doubled after 10 clean steps: 256 -> 128 -> 256 -> 128 -> 256
    assert a['skipped'] == 2 and a['scale'] == 256.0
    assert all(torch.isfinite(p).all() for p in a['params'])
    # FSDP's fp32 shards are the masters: Adam's m and v only, split between the ranks
    assert sum(a['opt_numel']) == 2 * a['total']
    assert all(abs(n - a['total']) <= 16 for n in a['opt_numel'])
    # evaluation of the EMA every epoch; every rank got the metrics rank 0 logged for the last one
    logged = accuracies(runs['log'])
    assert sorted(logged) == [1, 2] and logged[1] > 20.0 and logged[2] > 80.0
    same_on_every_rank(a['val'], logged[2], 2)
    assert a['ema']['steps'] == a['iters']
    assert not any(torch.equal(p, q) for p, q in zip(a['ema']['params'], a['params']))


def test_resume_from_full_checkpoint_is_bitwise(runs):
    a, b = runs['straight'], runs['resumed']
    assert b['iters'] == a['iters'] and b['scale'] == a['scale']
    for x, y in zip([*a['params'], *a['ema']['params']], [*b['params'], *b['ema']['params']]):
        assert torch.equal(x, y)
    assert b['ema']['steps'] == a['ema']['steps']


def test_checkpoint_of_two_ranks_resumes_on_three(runs):
    c = runs['three']
    assert c['world_size'] == 3 and c['iters'] == 30 + 20  # one more epoch of 20 iterations
    assert c['skipped'] == 2  # iteration 10 (in the checkpoint) and 40 on 3 ranks
    assert sum(c['opt_numel']) == 2 * c['total']
    assert all(torch.isfinite(p).all() for p in c['params'])
    assert c['val'][0] is not None and c['val'] == c['val'][:1] * 3  # the 3 ranks agree
    assert c['ema']['steps'] == c['iters']  # the EMA went on from the checkpoint's (30 steps)


def test_plain_runner_local_checkpoint_resumes_bitwise(runs):
    """A toolbox's train script and a config without hooks of ours: one-rank overflow, clip_grad,
    accumulation, evaluation and a bitwise resume, from the config alone."""
    a, b = runs['local_a'], runs['local_b']
    assert 'MixedPrecisionHook' not in runs['local_log']
    assert sorted(os.listdir(runs['tmp'] / 'la' / 'epoch_1.pth')) == ['rank0.pth', 'rank1.pth']
    assert a['skipped'] == b['skipped'] == 2 and b['iters'] == a['iters'] == 60
    assert b['scale'] == a['scale'] == 256.0
    for x, y in zip([*a['params'], *a['ema']['params']], [*b['params'], *b['ema']['params']]):
        assert torch.equal(x, y)
    logged = accuracies(runs['local_log'])
    assert sorted(logged) == [1, 2] and logged[2] > 80.0
    same_on_every_rank(a['val'], logged[2], 2)
    assert b['val'] == a['val']


def test_local_checkpoint_loads_only_with_its_allow_list_and_rank_count(runs, tmp_path):
    from mp_wrappers.checkpoint import UnsafeCheckpointError, secure_torch_load
    from mp_wrappers.distributed.fsdp import check_local_checkpoint
    ckpt = runs['tmp'] / 'la' / 'epoch_1.pth'
    # outside MixedPrecisionFSDPStrategy.load_checkpoint, ShardedTensor is not allow-listed
    with pytest.raises(UnsafeCheckpointError, match='ShardedTensor'):
        secure_torch_load(str(ckpt / 'rank0.pth'))
    with pytest.raises(ValueError, match='shards of 2 rank.*this run has 1'):
        check_local_checkpoint(str(ckpt))  # no process group: a world of 1
    (tmp_path / 'rank1.pth').write_bytes(b'x')
    with pytest.raises(ValueError, match='shards of 1 rank'):
        check_local_checkpoint(str(tmp_path))  # rank0 missing
    with pytest.raises(ValueError, match='not an FSDP1'):
        check_local_checkpoint(str(tmp_path / 'nothing'))


def test_full_checkpoint_of_two_ranks_resumes_on_one_process_without_fsdp(runs, tmp_path):
    """FSDP1 'full' (optimizer state keyed by parameter name, FSDP's fp32 shards as the masters)
    -> one process with mmengine's Runner, no FSDP, ApexOptimWrapper O2 keeping its own masters;
    it evaluates those weights to the accuracy the 2 ranks logged for them."""
    ckpt = runs['tmp'] / 'a' / 'epoch_1.pth'
    train = train_tool()
    args = train.parse_args([os.path.join(REPO, CONFIG), '--work-dir', str(tmp_path / 'w'),
                             '--resume', str(ckpt), '--cfg-options', 'runner_type=Runner',
                             'train_cfg.max_epochs=1', 'optim_wrapper.loss_scale=dynamic',
                             'optim_wrapper.init_scale=256.', 'optim_wrapper.scale_window=10'])
    from mmengine.registry import RUNNERS

    def resume_and_evaluate():
        runner = RUNNERS.build(train.build_config(args))
        # resumed at the end of epoch 1 of 1: prepares the wrapper, trains nothing; then evaluates
        # the O2 bf16 model (BatchNorm fp32), as FSDP evaluated it; the val loop itself, since
        # Runner.val() calls before_run again, where EMAHook would copy the model anew
        runner.train()
        return runner, runner.val_loop.run()['accuracy']

    runner, accuracy = in_this_process(resume_and_evaluate)
    w = runner.optim_wrapper
    names = {id(p): n for n, p in runner.model.named_parameters()}
    masters = {names[id(p)]: m for m, p in w._master_params().half_pairs()}
    slots = dict(names)  # fp32 params (BatchNorm) are stepped as they are, half ones via masters
    slots.update({id(m): names[id(p)] for m, p in w._master_params().half_pairs()})
    state = {slots[id(s)]: {k: v for k, v in w.optimizer.state[s].items()
                            if torch.is_tensor(v) and v.numel() > 1}
             for g in w.optimizer.param_groups for s in g['params']}
    from mmengine.hooks import EMAHook
    ema, = [h.ema_model for h in runner.hooks if isinstance(h, EMAHook)]
    got = dict(masters=masters, state=state, scale=w.loss_scale, iter=runner.iter,
               fsdp=type(runner.model).__name__, accuracy=float(accuracy),
               ema=dict(ema.module.named_parameters()), ema_steps=int(ema.steps))
    from mp_wrappers.checkpoint import secure_torch_load
    saved = secure_torch_load(str(ckpt))
    assert got['iter'] == 30 and 'FullyShardedDataParallel' not in got['fsdp']
    assert got['scale'] == saved['optimizer']['mp_wrappers']['loss_scalers'][0]['loss_scale']
    assert got['masters']  # O2: the conv and linear weights are bf16 with fp32 masters
    for name, master in got['masters'].items():
        # the masters start from the checkpoint's fp32 weights (FSDP's shards), bit for bit; as
        # mmengine's EMAHook saves them, the raw weights are under ema_state_dict, the EMA's under
        # state_dict
        assert torch.equal(master, saved['ema_state_dict']['module.' + name]), name
    # the gathered EMA, from the 2 ranks' pieces, in the one process's averaged copy
    assert got['ema_steps'] == 30 and sorted(got['ema']) == sorted(
        k for k in saved['state_dict'] if 'running' not in k and 'batches' not in k)
    for name, value in got['ema'].items():
        assert torch.equal(value, saved['state_dict'][name]), name
    # evaluated in one process, the EMA gives the accuracy the 2 ranks logged for it, within one
    # of the 360 val images: bf16 convolutions over batches of other sizes (one process: 120,
    # 120, 120; each of 2 ranks: 120, 60) may round a borderline image's logits the other way
    assert got['accuracy'] == pytest.approx(accuracies(runs['log'])[1], abs=100 / 360 + 1e-3)
    # every slot's Adam moments, re-keyed from parameter names to positions, bit for bit
    assert sorted(got['state']) == sorted(saved['optimizer']['state'])
    for name, slot in got['state'].items():
        assert set(slot) == {'exp_avg', 'exp_avg_sq'}, name
        for key, value in slot.items():
            assert torch.equal(value, saved['optimizer']['state'][name][key]), (name, key)


def test_int8_optimizer_states_train_and_resume_bitwise(tmp_path):
    """FusedAdam(state_dtype='int8') under FSDP1 (Note [8-bit states under FSDP1] in
    mp_wrappers/optim/quantized_state.py): the FSDP1 config with the one line a user adds (and a
    lower ``min_8bit_size``, so that every rank's pieces of the CNN's weights are 8-bit), on 2
    ranks in one launch: through tools/train.py with 'full' checkpoints, and through a toolbox's own
    train script with 'local' ones (each rank's ShardedTensors), each trained 2 epochs and resumed
    from epoch 1 to a bitwise equal end (params and EMA); the 'full' checkpoint holds float32
    moments shaped like the params and no absmax. (The moments through FSDP's state dicts in detail:
    tests/runner/test_fsdp1_optimizer_state.py.)"""
    int8 = ['optim_wrapper.optimizer.state_dtype=int8', 'optim_wrapper.optimizer.min_8bit_size=1024']
    full, local = [*OPTIONS, *int8], [*OPTIONS, *int8, 'strategy.state_dict_cfg=local']
    (a, log), (b, _), (la, _), (lb, _) = torchrun_runs(
        2, dict(work_dir=tmp_path / 'a', result=tmp_path / 'a.pt', options=full),
        dict(work_dir=tmp_path / 'b', result=tmp_path / 'b.pt', options=full,
             extra=['--resume', str(tmp_path / 'a' / 'epoch_1.pth')]),
        dict(work_dir=tmp_path / 'la', result=tmp_path / 'la.pt', options=local, config=PLAIN,
             extra=['--plain']),
        dict(work_dir=tmp_path / 'lb', result=tmp_path / 'lb.pt', options=local, config=PLAIN,
             extra=['--plain', '--resume', str(tmp_path / 'la' / 'epoch_1.pth')]))
    for first, resumed in ((a, b), (la, lb)):
        assert 'torch.uint8' in first['state_dtypes'] and 'torch.uint8' in resumed['state_dtypes']
        assert first['iters'] == resumed['iters'] == 60 and first['skipped'] == resumed['skipped'] == 2
        assert resumed['scale'] == first['scale']
        for x, y in zip([*first['params'], *first['ema']['params']],
                        [*resumed['params'], *resumed['ema']['params']]):
            assert torch.equal(x, y)
        assert resumed['val'] == first['val']
        # rank 0's optimizer state at the end, codes and absmax included, bit for bit
        assert len(resumed['opt_state']) == len(first['opt_state'])
        for x, y in zip(first['opt_state'], resumed['opt_state']):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    logged = accuracies(log)
    assert sorted(logged) == [1, 2] and logged[2] > 80.0
    saved = torch.load(tmp_path / 'a' / 'epoch_2.pth', map_location='cpu', weights_only=False)
    params = {k.replace('module.', '', 1): v for k, v in saved['state_dict'].items()}
    state = saved['optimizer']['state']
    assert state and all(set(slot) == {'step', 'exp_avg', 'exp_avg_sq'} for slot in state.values())
    for name, slot in state.items():
        assert slot['exp_avg'].dtype == torch.float32 and slot['exp_avg'].shape == params[name].shape
