"""FSDP2 checkpoints through mmengine's CheckpointHook, as users run them: torchrun + a train script.

``configs/digits/cnn_fsdp2_apex_O2_bf16.py`` (mp_wrappers.FullyShardedRunner, FullyShardedModel,
ApexOptimWrapper O2 bf16, FusedAdam, clip_grad, evaluation, mmengine's EMAHook) with a dynamic loss
scale that grows every 10 steps, a checkpoint every epoch, ``max_keep_ckpts=2`` and ``save_best='accuracy'``, and inf
planted into rank 1's local gradient shard at iterations 6, 50 and 70 (tests/configs/
fsdp2_shard_fault.py): rank 0 skips those steps too, at 2 and 3 ranks, with and without
accumulation. Runs of one rank count share a launch (tests/fsdp_train_check.py ``--then``): 4
launches for the 8 runs below.

* 2 ranks train 3 epochs; each checkpoint is a DCP directory whose metadata covers every element of
  every tensor, written by both ranks (never rank 0's shards alone), the EMA's shards included; the
  oldest is removed.
* ``--resume`` of epoch 2 on 2 ranks ends bitwise equal to the uninterrupted run (weights, EMA, loss
  scale, skip count).
* The EMA (Note [EMA of a sharded model]): sharded like the weights, updated every iteration,
  swapped in for evaluation (the logged accuracy is the EMA's) and into the checkpoints'
  ``state_dict`` (mmengine's convention), with the raw weights under ``ema_state_dict``.
* Another rank count (2 -> 3 and 3 -> 2): the continued run equals, bitwise, the same number of
  ranks continued from the consolidated checkpoint (``tools/consolidate_checkpoint.py
  --resumable``). Bitwise and not "close": both runs hand the same fp32 values to the same sharding
  and then compute identically (same reduction order). A single-process reference would differ by
  more than reduction order: BatchNorm's batch statistics depend on the per-rank batch.
* ``load_from`` a DCP directory and the same weights consolidated into one ordinary file (each rank
  reads it whole and keeps its shards) train alike, bitwise, EMA included. The consolidated file
  resumes the EMA from full tensors (each rank keeps its shards), the DCP directory re-sliced.
* The consolidated best checkpoint loads with ``torch.load(weights_only=True)`` and, evaluated by a
  single process (the same O2 bf16 model without FSDP), gives the accuracy logged by the sharded
  run for that epoch.
* Through a toolbox's own train script and a config without hooks of ours (what a config alone
  gives; the ``load_from`` runs, with ``accumulative_counts=2``, and the 3-rank runs): the one-rank
  overflow, clipping, evaluation (every rank records the metrics rank 0 logged), whole DCP
  checkpoints.
* Refused before training, naming the config line, through a toolbox's train script (one launch
  for all, tests/refusal_check.py): mmengine's plain ``Runner`` with an FSDP2 model (it would save
  rank 0's shards only). (An ``EMAHook`` under FSDP1 wrapped without our strategy, which cannot run
  on CPU: refused, in ``test_attach_refuses_without_processes``.)
"""
import os
import shutil
import sys

import pytest
import torch

import torchrun
from test_fsdp_runner import (REPO, _env, accuracies, in_this_process, same_on_every_rank,
                              torchrun_runs)

# the shipped config + inf planted into rank 1's local gradient shard at iterations 6, 50 and 70
CONFIG = 'tests/configs/fsdp2_shard_fault.py'
PLAIN = 'tests/configs/fsdp2_plain_fault.py'  # the same without any hook of ours
SCALE = ['optim_wrapper.loss_scale=dynamic', 'optim_wrapper.init_scale=256.',
         'optim_wrapper.scale_window=10']


def _options(epochs):
    return [f'train_cfg.max_epochs={epochs}', 'train_cfg.val_interval=1',
            'default_hooks.checkpoint.interval=1', 'default_hooks.checkpoint.max_keep_ckpts=2',
            'default_hooks.checkpoint.save_best=accuracy', *SCALE]


def _spec(tmp, name, epochs, resume=None, plain=False):
    """A run of :func:`torchrun_runs`: tools/train.py, or with ``plain`` a toolbox's train script
    and PLAIN (no hook of ours)."""
    extra = (['--plain'] if plain else []) + (['--resume', str(resume)] if resume else [])
    return dict(work_dir=tmp / name, result=tmp / f'{name}.pt', extra=extra, accumulate=1,
                config=PLAIN if plain else CONFIG, options=_options(epochs))


def _tool():
    sys.path.insert(0, os.path.join(REPO, 'tools'))
    try:
        import consolidate_checkpoint
    finally:
        sys.path.remove(os.path.join(REPO, 'tools'))
    return consolidate_checkpoint


def _consolidate(src, out, *flags):
    _tool().main([str(src), str(out), *flags])  # the command line, in this process
    return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('fsdp2_ckpt')
    (a, log_a), = torchrun_runs(2, _spec(tmp, 'a', 3))
    epoch_2 = tmp / 'a' / 'epoch_2.pth'
    full_a = _consolidate(epoch_2, tmp / 'a_epoch_2_full.pth', '--resumable')
    plain = _consolidate(epoch_2, tmp / 'a_epoch_2_weights.pth')
    # One launch of 2 processes, three runs in turn: --resume of epoch 2 (b); then through a
    # toolbox's train script, no hook of ours, with accumulation (the fault at iteration 6 falls on
    # a step) and evaluation, load_from (weights only, new optimizer state) of the DCP directory
    # (g) and of the same weights consolidated into an ordinary file (h)
    opts = ['train_cfg.max_epochs=1', 'train_cfg.val_interval=1', *SCALE]
    load = dict(extra=['--plain'], accumulate=2, config=PLAIN)
    (b, _), (g, log_g), (h, _) = torchrun_runs(
        2, _spec(tmp, 'b', 3, resume=epoch_2),
        dict(load, work_dir=tmp / 'g', result=tmp / 'g.pt', options=[*opts, f'load_from={epoch_2}']),
        dict(load, work_dir=tmp / 'h', result=tmp / 'h.pt', options=[*opts, f'load_from={plain}']))
    # 2 -> 3 (epoch 2 of a, one more epoch), against 3 ranks from the consolidated checkpoint,
    # both through a toolbox's train script
    (c, _), (d, _) = torchrun_runs(3, _spec(tmp, 'c', 3, resume=epoch_2, plain=True),
                                   _spec(tmp, 'd', 3, resume=full_a, plain=True))
    # 3 -> 2: c's epoch 3 was written by 3 ranks
    full_c = _consolidate(tmp / 'c' / 'epoch_3.pth', tmp / 'c_epoch_3_full.pth', '--resumable')
    (e, _), (f, _) = torchrun_runs(2, _spec(tmp, 'e', 4, resume=tmp / 'c' / 'epoch_3.pth'),
                                   _spec(tmp, 'f', 4, resume=full_c))
    return dict(tmp=tmp, a=a, b=b, c=c, d=d, e=e, f=f, g=g, h=h, log_a=log_a, log_g=log_g)


def _equal(x, y):
    assert x['iters'] == y['iters'] and x['world_size'] == y['world_size']
    assert x['scale'] == y['scale'] and x['skipped'] == y['skipped']
    for p, q in zip(x['params'], y['params']):
        assert torch.equal(p, q)
    assert x['ema']['steps'] == y['ema']['steps'] == x['iters']
    for p, q in zip(x['ema']['params'], y['ema']['params'], strict=True):
        assert torch.equal(p, q)


def test_every_rank_writes_its_shards(runs):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mp_wrappers.distributed.dcp_format import SafeFileSystemReader
    work = runs['tmp'] / 'a'
    # max_keep_ckpts=2 removed epoch 1 (a directory); the best one (no optimizer) is separate
    assert not (work / 'epoch_1.pth').exists()
    assert (work / 'epoch_2.pth' / '.metadata').is_file()
    assert (work / 'last_checkpoint').read_text().strip().endswith('epoch_3.pth')
    assert sorted(os.listdir(work / 'epoch_3.pth')) == ['.metadata', '__0_0.distcp', '__1_0.distcp']
    meta = SafeFileSystemReader(str(work / 'epoch_3.pth')).read_metadata().state_dict_metadata
    sharded = 0
    for key, entry in meta.items():
        assert isinstance(entry, TensorStorageMetadata), key  # no pickled objects in DCP
        covered = sum(torch.Size(c.sizes).numel() for c in entry.chunks)
        assert covered == entry.size.numel(), key  # every element is in the checkpoint
        sharded += len(entry.chunks) == 2
    assert sharded >= 8  # weights and Adam moments come in two shards
    ema = [k for k, e in meta.items() if k.startswith('ema_state_dict.module.') and len(e.chunks) == 2]
    assert len(ema) >= 4  # and the EMA's weights


def test_fsdp2_config_trains(runs):
    a = runs['a']
    assert a['world_size'] == 2 and a['iters'] == 3 * 23
    # one-rank overflow through the Runner: inf in rank 1's shard at iterations 6 and 50, and
    # rank 0 skipped both (the flag is all-reduced); the scale grew every 10 clean steps
    assert a['scale'] > 256.0 and a['skipped'] == 2
    assert sum(a['opt_numel']) == 2 * a['total']  # Adam's m and v as DTensor shards, no masters
    assert all(abs(n - a['total']) <= 64 for n in a['opt_numel'])
    logged = accuracies(runs['log_a'])
    # the EMA is evaluated (momentum 0.1: epoch 1's average still holds some of the initial weights)
    assert sorted(logged) == [1, 2, 3] and logged[1] > 20.0 and min(logged[2], logged[3]) > 80.0
    same_on_every_rank(a['val'], logged[3], 2)
    assert a['ema']['steps'] == a['iters']
    assert not any(torch.equal(p, q) for p, q in zip(a['ema']['params'], a['params']))


def test_resume_is_bitwise(runs):
    _equal(runs['a'], runs['b'])


def test_two_to_three_ranks_matches_consolidated_reference(runs):
    assert runs['c']['world_size'] == 3
    assert runs['c']['skipped'] == 2  # 6 (in the checkpoint), then 50 on 3 ranks
    _equal(runs['c'], runs['d'])
    assert runs['c']['scale'] >= runs['a']['scale'] / 2  # scaler state carried over, not reset
    assert runs['c']['val'][0] is not None and runs['c']['val'] == runs['c']['val'][:1] * 3


def test_three_to_two_ranks_matches_consolidated_reference(runs):
    assert runs['e']['world_size'] == 2
    assert runs['e']['skipped'] == 3  # 6 and 50 (in the checkpoint), then 70
    _equal(runs['e'], runs['f'])
    assert all(torch.isfinite(p).all() for p in runs['e']['params'])


def test_load_from_sharded_or_ordinary_file_alike(runs):
    # the same weights, re-sliced by DCP or read whole by every rank, train the same epoch
    _equal(runs['g'], runs['h'])
    assert runs['g']['iters'] == 23  # a new run from epoch 0
    assert runs['g']['skipped'] == 1  # the fault at iteration 6, with accumulative_counts=2


def test_plain_runner_trains_evaluates_and_saves_whole_checkpoints(runs):
    """A toolbox's train script and a config without hooks of ours (runs g and h)."""
    g, log = runs['g'], runs['log_g']
    assert 'MixedPrecisionHook' not in log
    # 12 steps (23 iterations, accumulation 2): step 3 (iteration 6) skipped on both ranks, the
    # scale halved there, and the 9 clean steps after it are under the 10-step growth window
    assert g['skipped'] == 1 and g['scale'] == 128.0
    logged = accuracies(log)
    assert sorted(logged) == [1] and logged[1] > 80.0
    same_on_every_rank(g['val'], logged[1], 2)
    assert runs['h']['val'] == g['val']
    ckpt = runs['tmp'] / 'g' / 'epoch_1.pth'  # save_last: FullyShardedRunner from the config
    assert sorted(os.listdir(ckpt)) == ['.metadata', '__0_0.distcp', '__1_0.distcp']


def test_consolidated_checkpoint_is_plain_and_evaluates_alike(runs, tmp_path):
    tmp = runs['tmp']
    logged = accuracies(runs['log_a'])
    best_epoch = max(logged, key=lambda k: (logged[k], -k))
    best = tmp / 'a' / f'best_accuracy_epoch_{best_epoch}.pth'
    assert (best / '.metadata').is_file()
    out = _consolidate(best, tmp_path / 'best.pth')
    plain = torch.load(out, weights_only=True)
    assert plain['meta']['epoch'] == best_epoch
    weights = [v for k, v in plain['state_dict'].items() if 'running' not in k and 'batches' not in k]
    assert sum(t.numel() for t in weights) == runs['a']['total']
    assert all(t.dtype in (torch.float32, torch.int64) for t in plain['state_dict'].values())
    # the last checkpoint's weights are the gathered EMA of the finished run (EMAHook swaps it into
    # state_dict), and its ema_state_dict the gathered raw weights
    from mp_wrappers.checkpoint import secure_torch_load  # a resumable file holds the message hub
    last = secure_torch_load(_consolidate(tmp / 'a' / 'epoch_3.pth', tmp_path / 'last.pth',
                                          '--resumable'))
    params = [v for k, v in last['state_dict'].items() if 'running' not in k and 'batches' not in k]
    assert all(torch.equal(p, q) for p, q in zip(params, runs['a']['ema']['params'], strict=True))
    raw = [v for k, v in last['ema_state_dict'].items()
           if k.startswith('module.') and 'running' not in k and 'batches' not in k]
    assert all(torch.equal(p, q) for p, q in zip(raw, runs['a']['params'], strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(params, raw))
    half = torch.load(_consolidate(best, tmp_path / 'half.pth', '--dtype', 'bfloat16'),
                      weights_only=True)['state_dict']
    assert half['features.0.weight'].dtype == torch.bfloat16
    assert half['features.1.weight'].dtype == torch.float32  # BatchNorm stays fp32
    from mmengine.config import Config
    from mmengine.runner import Runner
    cfg = Config.fromfile(os.path.join(REPO, 'configs', 'digits', 'cnn_apex_O2_bf16.py'))
    cfg.load_from, cfg.work_dir = str(out), str(tmp_path / 'eval')
    # FSDP2 evaluated with bf16 weights and activations (its MixedPrecisionPolicy), BatchNorm fp32:
    # the single process under bf16 autocast computes the same
    cfg.val_cfg = dict(type='mp_wrappers.MixedPrecisionValLoop', fp16=True, dtype='bfloat16')
    accuracy = in_this_process(lambda: Runner.from_cfg(cfg).val()['accuracy'])
    assert accuracy == pytest.approx(logged[best_epoch], abs=1e-3)


# Two optim wrappers (tests/_two_optimizers.py), as a GAN's config builds them.
_TWO_OPTIMIZERS = (
    "custom_imports = dict(imports=['mp_wrappers', 'projects.digits', '_reliability_hooks', "
    "'_two_optimizers'], allow_failed_imports=False)\n"
    "_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16', "
    "optimizer=dict(type='mp_wrappers.FusedAdam', lr=1e-3))\n"
    "optim_wrapper = dict(_delete_=True, constructor='RelTestTwoOptimizersConstructor', "
    "first=_wrapper, rest=_wrapper)\n"
    "param_scheduler = None\n")  # a list of schedulers would need one per wrapper

REFUSED = {
    # mmengine's plain Runner would save rank 0's shards of an FSDP2 model
    'runner_fsdp2': (PLAIN, "runner_type = 'Runner'\n",
                     "runner_type = 'mp_wrappers.FullyShardedRunner'"),
    # sharded checkpoints hold one optimizer: an OptimWrapperDict would fail at its first save
    'optim_wrapper_dict_fsdp2': (PLAIN, _TWO_OPTIMIZERS, "save_optimizer=False"),
    'optim_wrapper_dict_fsdp1': ('tests/configs/fsdp_plain_fault.py', _TWO_OPTIMIZERS,
                                 "strategy=dict(type='DDPStrategy', model_wrapper=dict("),
}


@pytest.fixture(scope='module')
def refusals(tmp_path_factory):
    """One launch, every config of REFUSED in turn: ``{name: (outcome line, work dir)}``."""
    tmp = tmp_path_factory.mktemp('refused')
    configs = []
    for name, (base, line, _) in REFUSED.items():
        configs.append(tmp / f'{name}.py')
        configs[-1].write_text(f"_base_ = [{os.path.join(REPO, base)!r}]\n{line}")
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=1',
           'tests/refusal_check.py', str(tmp / 'work'), *map(str, configs)]
    proc = torchrun.run(cmd, cwd=REPO, env=_env(),
                        finished=lambda p: 'refusal_check: rank 0 done' in p.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    outcomes = dict(line.split(': ', 3)[2:] for line in proc.stdout.splitlines()
                    if line.startswith('refusal_check: rank 0: '))
    return {name: (outcomes[name], tmp / 'work' / name) for name in REFUSED}


@pytest.mark.parametrize('name', list(REFUSED))
def test_refused_before_training_with_the_config_line(refusals, name):
    outcome, work_dir = refusals[name]
    assert outcome != 'trained' and REFUSED[name][2] in outcome, outcome
    # nothing trained, nothing saved
    logs = [os.path.join(d, f) for d, _, fs in os.walk(work_dir) for f in fs if f.endswith('.log')]
    assert logs and not any('Epoch(train)' in open(log).read() for log in logs)
    assert not any(f.endswith('.pth') for _, ds, fs in os.walk(work_dir) for f in [*ds, *fs])


def test_resume_picks_complete_sharded_checkpoints(tmp_path):
    from mp_wrappers.atomic_io import is_complete_checkpoint, resolve_resume_checkpoint
    done, cut = tmp_path / 'epoch_1.pth', tmp_path / 'epoch_2.pth'
    done.mkdir()
    (done / '.metadata').write_bytes(b'x')
    cut.mkdir()
    (cut / '__0_0.distcp').write_bytes(b'x')  # killed before DCP wrote .metadata
    (tmp_path / 'last_checkpoint').write_text(str(cut))
    assert is_complete_checkpoint(done) and not is_complete_checkpoint(cut)
    assert resolve_resume_checkpoint(tmp_path) == str(done)


def test_metadata_reader_refuses_foreign_globals(tmp_path):
    import pickle

    from mp_wrappers.distributed.dcp_format import SafeFileSystemReader, read_sharded_checkpoint

    class Evil:
        def __reduce__(self):
            return (os.system, ('echo pwned',))

    ckpt = tmp_path / 'evil.pth'
    ckpt.mkdir()
    (ckpt / '.metadata').write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match='system'):
        SafeFileSystemReader(str(ckpt)).read_metadata()
    with pytest.raises(pickle.UnpicklingError, match='not one of its own metadata types'):
        read_sharded_checkpoint(str(ckpt))


def test_consolidate_refuses_what_it_cannot_read(tmp_path):
    tool = _tool()
    plain = tmp_path / 'plain.pth'
    torch.save({'state_dict': {}}, plain)
    with pytest.raises(ValueError, match='no consolidation'):
        tool.consolidate(str(plain))
    with pytest.raises(ValueError, match='drop --dtype'):
        tool.consolidate(str(tmp_path), torch.bfloat16, resumable=True)
    import torch.distributed.checkpoint as dcp
    foreign = tmp_path / 'foreign'
    dcp.save({'w': torch.ones(3), 'note': 'a pickled string'}, checkpoint_id=str(foreign),
             no_dist=True)
    with pytest.raises(ValueError, match='non-tensor DCP entries'):
        tool.consolidate(str(foreign))
    shutil.rmtree(foreign)


def test_attach_refuses_without_processes(monkeypatch):
    from mmengine.hooks import EMAHook
    from mmengine.runner import Runner
    from torch import nn

    from mp_wrappers.distributed import runner_checkpoint
    from mp_wrappers.distributed.fully_shard import FullyShardedRunner

    def runner(cls, hooks=()):
        r = cls.__new__(cls)  # only what attach() reads
        r.model, r._hooks = nn.Linear(1, 1), list(hooks)
        return r

    runner_checkpoint.attach(runner(Runner))  # not FSDP2-sharded: nothing to check
    monkeypatch.setattr(runner_checkpoint, 'fsdp2_root', lambda model: model)
    runner_checkpoint.attach(runner(FullyShardedRunner))
    with pytest.raises(RuntimeError, match="runner_type = 'mp_wrappers.FullyShardedRunner'"):
        runner_checkpoint.attach(runner(Runner))
    runner_checkpoint.attach(runner(FullyShardedRunner, [EMAHook()]))  # FSDP2: a sharded EMA
    # the wrappers' own lifecycle hook checks it too, before anything is saved (no tools/train.py)
    from mp_wrappers.lifecycle import WrapperLifecycleHook
    with pytest.raises(RuntimeError, match="runner_type = 'mp_wrappers.FullyShardedRunner'"):
        WrapperLifecycleHook().before_run(runner(Runner))
    # under FSDP1 an EMAHook is refused, also when load_from/resume come first
    monkeypatch.setattr(runner_checkpoint, '_sharding', lambda model: 'FSDP1')
    with pytest.raises(NotImplementedError, match='EMAHook under FSDP1') as refused:
        runner_checkpoint.attach(runner(Runner, [EMAHook()]))
    for fix in ("strategy = dict(type='mp_wrappers.MixedPrecisionFSDPStrategy'",
                "runner_type = 'mp_wrappers.FullyShardedRunner'",
                "remove the dict(type='EMAHook', ...) entry from custom_hooks"):
        assert fix in str(refused.value)
    # wrapped by MixedPrecisionFSDPStrategy, whose EMA copies each rank's pieces: allowed
    from mp_wrappers.distributed.sharded_ema import install_flat_shard_deepcopy
    ours = runner(Runner, [EMAHook()])
    ours.model.module = nn.Linear(1, 1)
    install_flat_shard_deepcopy(ours.model.module, strategy=None)
    runner_checkpoint.refuse_sharded_ema(ours)
    with pytest.raises(NotImplementedError, match='EMAHook under FSDP1'):
        WrapperLifecycleHook().after_load_checkpoint(runner(Runner, [EMAHook()]), {})


def test_state_keyed_by_name_is_rekeyed_by_position_or_refused():
    from torch import nn

    from mp_wrappers.distributed.runner_checkpoint import optimizer_state_by_position
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opt = torch.optim.Adam([{'params': [model[1].weight, model[1].bias]},
                            {'params': [model[0].weight, model[0].bias], 'lr': 0.1}])
    names = ['1.weight', '1.bias', '0.weight', '0.bias']
    saved = {'state': {n: {'step': torch.tensor(1.), 'exp_avg': torch.full((1,), float(i))}
                       for i, n in enumerate(names)},
             'param_groups': [dict(opt.param_groups[0], params=names[:2]),
                              dict(opt.param_groups[1], params=names[2:])], 'extra': 1}
    saved['param_groups'] = [{k: v for k, v in g.items()} for g in saved['param_groups']]
    out = optimizer_state_by_position(saved, model, opt)
    assert [g['params'] for g in out['param_groups']] == [[0, 1], [2, 3]] and out['extra'] == 1
    assert [float(out['state'][i]['exp_avg']) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
    opt.load_state_dict({k: out[k] for k in ('state', 'param_groups')})  # torch's own layout
    with pytest.raises(KeyError, match='param groups'):
        optimizer_state_by_position(dict(saved, param_groups=saved['param_groups'][:1]), model, opt)
    swapped = dict(saved, param_groups=[dict(saved['param_groups'][0], params=['x', 'y']),
                                        saved['param_groups'][1]])
    with pytest.raises(KeyError, match="'1.weight' is not in the checkpoint"):
        optimizer_state_by_position(swapped, model, opt)


def test_an_optim_wrapper_dict_is_refused_only_when_a_checkpoint_saves_its_state():
    from mmengine.hooks import CheckpointHook, LoggerHook
    from mmengine.optim import OptimWrapper, OptimWrapperDict

    from mp_wrappers.distributed.checkpoint import refuse_optim_wrapper_dict, saves_optimizer_state
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    one = OptimWrapper(torch.optim.SGD(params[:1], lr=0.1))
    pair = OptimWrapperDict(generator=one,
                            discriminator=OptimWrapper(torch.optim.SGD(params[1:], lr=0.1)))
    assert saves_optimizer_state([LoggerHook(), CheckpointHook(interval=1)])
    assert not saves_optimizer_state([CheckpointHook(interval=1, save_optimizer=False)])
    assert not saves_optimizer_state([LoggerHook()])
    for sharding, fix in (('FSDP1', "strategy=dict(type='DDPStrategy', model_wrapper=dict("),
                          ('FSDP2', "runner_type='Runner', model_wrapper_cfg=dict(")):
        with pytest.raises(NotImplementedError) as e:
            refuse_optim_wrapper_dict(pair, sharding, saving=True)
        for part in ("'generator', 'discriminator'", sharding, 'paramwise_cfg',
                     'save_optimizer=False', fix, 'MMSeparateDistributedDataParallel'):
            assert part in str(e.value), (part, str(e.value))
        refuse_optim_wrapper_dict(pair, sharding, saving=False)  # nothing saves the state
        refuse_optim_wrapper_dict(one, sharding, saving=True)  # one wrapper: supported


def test_an_optim_wrapper_dict_that_reached_a_save_gets_the_same_message():
    """The saves' own checks, for dicts no refusal before training saw (mmengine's wrappers)."""
    from mmengine.optim import OptimWrapper, OptimWrapperDict

    from mp_wrappers.distributed.fsdp import MixedPrecisionFSDPStrategy
    from mp_wrappers.distributed.runner_checkpoint import _optimizer_state
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    pair = OptimWrapperDict(generator=OptimWrapper(torch.optim.SGD(params[:1], lr=0.1)),
                            discriminator=OptimWrapper(torch.optim.SGD(params[1:], lr=0.1)))
    strategy = object.__new__(MixedPrecisionFSDPStrategy)  # the save reads only its optim wrapper
    strategy.optim_wrapper = pair
    with pytest.raises(NotImplementedError, match="'generator', 'discriminator'.*FSDP1"):
        strategy.optim_state_dict()
    with pytest.raises(NotImplementedError, match="'generator', 'discriminator'.*FSDP2"):
        _optimizer_state(None, pair)
