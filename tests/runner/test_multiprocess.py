"""Many processes on gloo: launched as users launch them, with faults on one rank only.

* torchrun runs of ``tools/train.py --launcher pytorch`` (2 and 3 processes; the rest of the
  matrix is ``slow``): ApexOptimWrapper O0-O3 (bf16, to keep CPU runs fast) and FP16OptimWrapper over
  a bf16 model. A test-only hook (tests/_reliability_hooks.py) plants inf into one rank's gradient at
  chosen iterations and records every rank's weights after every iteration. Checked: O2/O3 work
  under the launcher with no model_wrapper_cfg (tools/train.py adds the cast-before-DDP wrapper),
  every rank skips exactly the steps whose accumulation window saw the fault, and the weights and
  fp32 masters of all ranks are bit-identical after every iteration.
* in-process ``torch.multiprocessing.spawn`` (like tests/runner/test_ddp.py): accumulation under DDP
  ``no_sync`` equals one process with the same global batch, and with ``sync_found_inf`` and no DDP
  (each rank its own gradients, the sharded-style case) one rank's overflow makes all ranks skip.
"""
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mmengine.config import Config
from torch import nn

import torchrun
from mp_wrappers.launch import prepare_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, 'tests')
MAX_ITERS = 8
ACCUM = 2
FAULT_ITERS = (3, 8)  # 1-based; with accumulation 2 the steps at iterations 4 and 8 are skipped


def _config(tmp_path, base, fault_rank):
    path = tmp_path / 'cfg.py'
    hooks = [dict(type='RelTestGradFaultHook', iters=list(FAULT_ITERS), rank=fault_rank,
                  param='head.weight'),
             dict(type='RelTestRecordHook', out_dir=str(tmp_path / 'records'))]
    path.write_text(
        f'_base_ = [{os.path.join(REPO, base)!r}]\n'
        "custom_imports = dict(imports=['mp_wrappers', 'projects.digits', '_reliability_hooks'], "
        'allow_failed_imports=False)\n'
        f'custom_hooks = {hooks!r}\n')
    return str(path)


def _torchrun(tmp_path, nproc, base, options, fault_rank):
    # CUDA_VISIBLE_DEVICES='': the CPU gloo path also on a machine with a GPU.
    env = dict(os.environ, OMP_NUM_THREADS='1', CUDA_VISIBLE_DEVICES='',
               PYTHONPATH=os.pathsep.join([TESTS, os.environ.get('PYTHONPATH', '')]))
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone',
           f'--nproc_per_node={nproc}', 'tools/train.py', _config(tmp_path, base, fault_rank),
           '--launcher', 'pytorch', '--work-dir', str(tmp_path / 'wd'), '--cfg-options',
           f'train_cfg.max_iters={MAX_ITERS}', 'default_hooks.checkpoint.interval=1000',
           'train_dataloader.batch_size=8', *options]
    records = [tmp_path / 'records' / f'rank{r}.pt' for r in range(nproc)]
    proc = torchrun.run(cmd, cwd=REPO, env=env, finished=torchrun.files_exist(records))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(r, weights_only=True) for r in records], proc.stdout + proc.stderr


APEX = 'tests/configs/apex.py'
FP16 = 'tests/configs/fp16_dynamic.py'
# name: (config, options, processes, marks)
RUNS = {
    'O2-bf16-2proc': (APEX, ['optim_wrapper.opt_level=O2', 'optim_wrapper.dtype=bfloat16'], 2, ()),
    'fp16wrapper-bf16model-3proc': (FP16, ['model.dtype=bfloat16', 'optim_wrapper.accumulative_counts=2'],
                                     3, ()),
}
for _level in ('O0', 'O1', 'O2', 'O3'):
    for _n in (2, 3):
        _name = f'{_level}-bf16-{_n}proc'
        if _name not in RUNS:
            RUNS[_name] = (APEX, [f'optim_wrapper.opt_level={_level}', 'optim_wrapper.dtype=bfloat16'],
                           _n, (pytest.mark.slow,))
RUNS['fp16wrapper-bf16model-2proc'] = (FP16, ['model.dtype=bfloat16',
                                              'optim_wrapper.accumulative_counts=2'], 2,
                                       (pytest.mark.slow,))


@pytest.mark.parametrize('run', [pytest.param(r, marks=RUNS[r][3]) for r in RUNS])
def test_torchrun_fault_on_one_rank_keeps_every_rank_equal(tmp_path, run):
    base, options, nproc, _ = RUNS[run]
    fault_rank = nproc - 1
    results, log = _torchrun(tmp_path, nproc, base, options, fault_rank)
    assert all(r['world_size'] == nproc for r in results)
    per_rank = [r['records'] for r in results]
    assert [len(r) for r in per_rank] == [MAX_ITERS] * nproc
    if 'O2' in run or 'O3' in run:
        assert 'MixedPrecisionDistributedDataParallel' in log  # added by tools/train.py
    expect_skipped = 0
    for i in range(MAX_ITERS):
        it = i + 1
        ref = per_rank[0][i]
        for rank in range(1, nproc):
            got = per_rank[rank][i]
            assert torch.equal(ref['params'], got['params']), f'{run}: rank {rank} iter {it}'
            assert torch.equal(ref['masters'], got['masters']), f'{run}: rank {rank} iter {it}'
            assert (got['skipped'], got['scale']) == (ref['skipped'], ref['scale']), (run, it)
        if it % ACCUM == 0:
            window_faulty = any(it - ACCUM < f <= it for f in FAULT_ITERS)
            expect_skipped += window_faulty
            assert ref['last_step_skipped'] == window_faulty, (run, it)
            if window_faulty and i >= 1:  # a skipped step leaves the weights as they were
                assert torch.equal(ref['masters'], per_rank[0][i - 1]['masters']), (run, it)
            elif not window_faulty:
                assert not torch.equal(ref['masters'], per_rank[0][i - 1]['masters']), (run, it)
        assert ref['skipped'] == expect_skipped, (run, it, ref['skipped'])
    assert expect_skipped == len(FAULT_ITERS)
    assert all(torch.isfinite(r[-1]['masters']).all() for r in per_rank)


@pytest.mark.parametrize('level,dtype,expected', [
    ('O2', 'float16', ('float16', True)), ('O3', 'bfloat16', ('bfloat16', False)),
    ('O1', 'float16', None), ('O0', 'float16', None)])
def test_prepare_distributed_adds_cast_before_ddp_for_casting_levels(monkeypatch, level, dtype,
                                                                     expected):
    # With CUDA mmengine starts the group; the wrapper choice does not depend on the device.
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    cfg = prepare_distributed(Config(dict(optim_wrapper=dict(
        type='mp_wrappers.ApexOptimWrapper', opt_level=level, dtype=dtype,
        optimizer=dict(type='SGD', lr=0.1)))), 'pytorch')
    if expected is None:
        assert cfg.get('model_wrapper_cfg') is None
    else:
        w = cfg.model_wrapper_cfg
        assert w.type == 'mp_wrappers.MixedPrecisionDistributedDataParallel'
        assert (w.dtype, w.keep_batchnorm_fp32) == expected
    # A user's own model_wrapper_cfg is never replaced, and launcher none adds nothing.
    user = dict(type='MMDistributedDataParallel', find_unused_parameters=True)
    cfg = prepare_distributed(Config(dict(model_wrapper_cfg=dict(user), optim_wrapper=dict(
        type='mp_wrappers.ApexOptimWrapper', opt_level='O2'))), 'pytorch')
    assert cfg.model_wrapper_cfg == user
    cfg = prepare_distributed(Config(dict(optim_wrapper=dict(
        type='mp_wrappers.ApexOptimWrapper', opt_level='O2'))), 'none')
    assert cfg.get('model_wrapper_cfg') is None


# ---- in-process spawn: accumulation equivalence and sync_found_inf without DDP ---------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _model():
    torch.manual_seed(0)
    # No BatchNorm: per-rank batch statistics would differ from the single process's by design.
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _global_batches(steps=4, micro=2, per_rank=4, world=2):
    """[step][micro] -> (x, y) of the global micro-batch (world * per_rank samples)."""
    g = torch.Generator().manual_seed(5)
    n = world * per_rank
    return [[(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
             for _ in range(micro)] for _ in range(steps)]


def _accum_run(level, rank=None, world=1):
    from mp_wrappers import ApexOptimWrapper, MixedPrecisionDistributedDataParallel
    model = _model()
    net = model
    calls = []
    if world > 1 and level == 'O2':
        net = MixedPrecisionDistributedDataParallel(model, dtype='bfloat16')
    elif world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)
    if world > 1:

        def counting_hook(state, bucket):
            calls.append(1)
            fut = torch.futures.Future()
            dist.all_reduce(bucket.buffer().div_(world))
            fut.set_result(bucket.buffer())
            return fut

        net.register_comm_hook(None, counting_hook)
    wrapper = ApexOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               opt_level=level, dtype='bfloat16', verbosity=0,
                               accumulative_counts=2)
    wrapper.initialize_count_status(net, 0, 8)
    for micro_batches in _global_batches():
        for x, y in micro_batches:
            if world > 1:
                x, y = x[rank::world], y[rank::world]
            with wrapper.optim_context(net):
                loss = F.cross_entropy(net(x).float(), y)
            wrapper.update_params(loss)
    return {'masters': [m.detach().clone() for m in wrapper.master_params()],
            'allreduce_calls': len(calls)}


def _sharded_run(rank, sync):
    from mp_wrappers import FP16OptimWrapper, cast_model
    model = cast_model(_model(), torch.bfloat16)
    wrapper = FP16OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False,
                               sync_found_inf=sync)
    skipped = []
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data and gradients
    for step in range(4):
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        with wrapper.optim_context(model):
            loss = F.cross_entropy(model(x.bfloat16()).float(), y)
        handle = None
        if step == 2 and rank == 1:
            handle = model[0].weight.register_hook(lambda grad: grad * float('nan'))
        before = [p.detach().clone() for p in wrapper.master_params()]
        wrapper.update_params(loss)
        if handle is not None:
            handle.remove()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, wrapper.master_params()))
        skipped.append((wrapper.last_step_skipped, unchanged))
    return skipped


def _worker(rank, world, port, out_dir):
    with torchrun.gloo_group(rank, world, port):
        result = {f'accum_{lv}': _accum_run(lv, rank, world) for lv in ('O0', 'O2')}
        for sync in (True, None, False):
            result[f'sharded_{sync}'] = _sharded_run(rank, sync)
        torch.save(result, os.path.join(out_dir, f'rank{rank}.pt'))


@pytest.fixture(scope='module')
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp('spawn')
    torchrun.spawn(_worker, lambda: (2, _free_port(), str(out)), 2,
                   [out / f'rank{r}.pt' for r in range(2)])
    return [torch.load(out / f'rank{r}.pt', weights_only=True) for r in range(2)]


@pytest.mark.parametrize('level', ['O0', 'O2'])
def test_no_sync_accumulation_equals_one_process_with_the_global_batch(spawned, level):
    single = _accum_run(level)
    r0, r1 = (r[f'accum_{level}'] for r in spawned)
    # 4 steps x 2 micro-batches: DDP all-reduced once per step, never inside no_sync.
    assert r0['allreduce_calls'] == r1['allreduce_calls'] == 4
    for a, b, s in zip(r0['masters'], r1['masters'], single['masters']):
        assert torch.equal(a, b)
        # Same samples, same math, summed in another order: per-rank means averaged by the
        # all-reduce vs one mean over the global batch. In fp32 (O0) that is a few ulps per step;
        # O2 all-reduces bf16 gradients (one rounding to bf16's 8 bits of mantissa, 2**-8 relative,
        # before the fp32 master update), and lr * 4 steps keeps the drift well under 1e-2.
        tol = dict(rtol=1e-5, atol=1e-6) if level == 'O0' else dict(rtol=1e-2, atol=2e-3)
        torch.testing.assert_close(a, s, **tol)


@pytest.mark.parametrize('sync', [True, None])
def test_sync_found_inf_without_ddp_makes_every_rank_skip(spawned, sync):
    for rank, r in enumerate(spawned):
        # Step 2 overflowed on rank 1 only; every rank skipped it and kept its weights.
        assert r[f'sharded_{sync}'] == [(False, False), (False, False), (True, True),
                                        (False, False)], rank


def test_without_sync_found_inf_only_the_faulty_rank_skips(spawned):
    assert spawned[0]['sharded_False'][2] == (False, False)
    assert spawned[1]['sharded_False'][2] == (True, True)
