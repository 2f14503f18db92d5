"""HSDP on CPU with gloo: 4 processes as 2 replicas x 2 shards (Note [HSDP] in mp_wrappers/sharding.py).

One ``torch.multiprocessing.spawn`` of 4 ranks, every case inside it, each against one process over
the same global batch (computed in each worker), as in tests/runner/test_fsdp.py:

* FSDP2 ``fully_shard(mesh=init_device_mesh('cpu', (2, 2)))``: ApexOptimWrapper O2 bf16 (FSDP's
  fp32 shards are the masters) with FusedAdam and active clipping. The clip norm is the global norm
  (squared shard norms summed over the shard group only: over all 4 ranks each element would count
  twice, a norm sqrt(2) too large); a planted inf on one rank skips the step on all four; a sharded
  checkpoint (DCP) resumes bitwise.
* mmengine's EMA of the HSDP model (Note [EMA of a sharded model]): sharded like it, equal to one
  process's bit for bit.
* ``FusedAdam(state_dtype='int8')`` on the HSDP mesh (tests/runner/test_fsdp2_8bit.py's model and
  seeded gradients): the 8-bit params' codes and absmax (DTensors placed like the params) and the
  params equal one process's bit for bit.
* A 2-D mesh laid out otherwise (``(Shard(0), Shard(0))``) is refused, naming HSDP's layout.
* FSDP1 ``ShardingStrategy.HYBRID_SHARD`` on the same 2-D mesh: FP16OptimWrapper over FSDP's fp32
  shards (bf16 compute) with FusedSGD and clipping, against one process.
"""
import os

import pytest
import torch
import torch.distributed as dist

import torchrun
from test_fsdp import _batches, _close, _ema_case, _free_port, _full, _model, _run, check_ema

WORLD = 4


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh('cpu', (2, 2), mesh_dim_names=('replicate', 'shard'))


def _hsdp(model, mesh):
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _apex(model):
    from mp_wrappers import ApexOptimWrapper, FusedAdam
    return ApexOptimWrapper(FusedAdam(model.parameters(), lr=0.02, eps=1e-3), opt_level='O2',
                            dtype='bfloat16', verbosity=0, loss_scale='dynamic',
                            init_scale=2.**10, clip_grad=dict(max_norm=0.1))


def _fsdp2_cases(rank, mesh, tmp):
    from mp_wrappers.distributed.checkpoint import load_sharded, save_sharded
    from mp_wrappers.sharding import sharding_of
    out = {}
    batches = _batches(WORLD)
    model = _hsdp(_model(), mesh)
    wrapper = _apex(model)
    out['o2'] = _run(model, wrapper, batches, rank, WORLD)
    out['o2']['params'] = _full(model)
    out['placements'] = sorted({str(p.placements) for p in model.parameters()})
    out['group_size'] = dist.get_world_size(sharding_of(model).group)
    ref = _model()
    ref_wrapper = _apex(ref)
    out['o2_ref'] = _run(ref, ref_wrapper, batches, rank, 1)
    out['o2_ref']['params'] = [m.detach().clone() for m in ref_wrapper.master_params()]
    # planted inf on the last rank (the second replica): every rank skips
    model = _hsdp(_model(), mesh)
    wrapper = _apex(model)
    _run(model, wrapper, batches[:1], rank, WORLD)
    before = _full(model)
    faulty = _run(model, wrapper, batches[1:2], rank, WORLD, fault=(0, WORLD - 1))
    out['fault'] = dict(faulty=faulty, before=before, after=_full(model))
    # sharded checkpoint: resume bitwise
    model = _hsdp(_model(), mesh)
    wrapper = _apex(model)
    _run(model, wrapper, batches[:2], rank, WORLD)
    save_sharded(os.path.join(tmp, 'hsdp_ckpt'), model, wrapper)
    _run(model, wrapper, batches[2:], rank, WORLD)
    model2 = _hsdp(_model(), mesh)
    wrapper2 = _apex(model2)
    load_sharded(os.path.join(tmp, 'hsdp_ckpt'), model2, wrapper2)
    _run(model2, wrapper2, batches[2:], rank, WORLD)
    out['resume'] = dict(straight=_full(model), resumed=_full(model2),
                         scales=(wrapper.loss_scale, wrapper2.loss_scale))
    return out


def _fsdp1_hybrid(rank, mesh):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    from mp_wrappers import FP16OptimWrapper, FusedSGD, cast_model
    out = {}
    for sharded in (True, False):
        if sharded:
            model = FSDP(_model(), device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                         device_id=torch.device('cpu'), use_orig_params=True,
                         mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32))
            dtype = None
        else:
            model, dtype = cast_model(_model(), torch.bfloat16), torch.bfloat16
        wrapper = FP16OptimWrapper(FusedSGD(model.parameters(), lr=0.1, momentum=0.9),
                                   verbose=False, clip_grad=dict(max_norm=0.05))
        stats = _run(model, wrapper, _batches(WORLD), rank, WORLD if sharded else 1, dtype=dtype)
        fp32 = _full(model) if sharded else [m.detach().clone() for m in wrapper.master_params()]
        out['sharded' if sharded else 'ref'] = dict(stats, params=fp32)
    return out


def _refused(mesh):
    from torch.distributed.tensor import DTensor, Shard

    from mp_wrappers.sharding import local_tensor
    t = DTensor.from_local(torch.zeros(2), mesh, [Shard(0), Shard(0)])  # not HSDP's layout
    try:
        local_tensor(t, 'a test tensor')
    except NotImplementedError as exc:
        return str(exc)
    return None


def _int8_case(mesh):
    from test_fsdp2_8bit import STEPS, _adam, _Net, _record, _shard, _steps
    model = _shard(_Net(), mesh)
    opt = _adam(model)
    _steps(model, opt, 0, STEPS)
    placements = {n: str(opt.state[p]['exp_avg_absmax'].placements)
                  for n, p in model.named_parameters() if 'exp_avg_absmax' in opt.state[p]}
    ref = _Net()
    ref_opt = _adam(ref)
    _steps(ref, ref_opt, 0, STEPS)
    return dict(sharded=_record(model, opt), ref=_record(ref, ref_opt), placements=placements)


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group('gloo', rank=rank, world_size=WORLD)
    try:
        mesh = _mesh()
        result = dict(fsdp2=_fsdp2_cases(rank, mesh, out_dir), fsdp1=_fsdp1_hybrid(rank, mesh),
                      refused=_refused(mesh), ema=_ema_case(rank, WORLD, lambda m: _hsdp(m, mesh)),
                      int8=_int8_case(mesh))
        torch.save(result, os.path.join(out_dir, f'rank{rank}.pt'))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp('hsdp')
    torchrun.spawn(_worker, lambda: (_free_port(), str(out)), WORLD,
                   [out / f'rank{r}.pt' for r in range(WORLD)])
    return [torch.load(out / f'rank{r}.pt', weights_only=False) for r in range(WORLD)]


def test_fsdp2_hsdp_matches_single_process(ranks):
    for r in ranks:
        got, ref = r['fsdp2']['o2'], r['fsdp2']['o2_ref']
        assert r['fsdp2']['placements'] == ['(Replicate(), Shard(dim=0))']
        assert r['fsdp2']['group_size'] == 2  # norms summed over one replica's shards
        # bf16 compute on 1/4 of the batch vs all of it: bf16 rounding, as in tests/runner/test_fsdp.py
        _close(got['params'], ref['params'], rtol=1e-2, atol=2e-3)
        assert got['skipped'] == ref['skipped'] == [False] * 4
    for r in ranks[1:]:
        for a, b in zip(r['fsdp2']['o2']['params'], ranks[0]['fsdp2']['o2']['params']):
            assert torch.equal(a, b)


def test_fsdp2_hsdp_clips_with_the_global_norm(ranks):
    for r in ranks:
        got, ref = r['fsdp2']['o2']['norms'], r['fsdp2']['o2_ref']['norms']
        assert all(n > 0.1 for n in ref)  # clipping active at every step
        # within bf16 rounding of the single-process norm; a double count is 41% larger
        assert got == pytest.approx(ref, rel=2e-2)
    assert len({tuple(r['fsdp2']['o2']['norms']) for r in ranks}) == 1


def test_fsdp2_hsdp_overflow_on_one_rank_skips_everywhere(ranks):
    for r in ranks:
        f = r['fsdp2']['fault']
        assert f['faulty']['skipped'] == [True]
        assert f['faulty']['scales'] == [2.**9]
        for a, b in zip(f['before'], f['after']):
            assert torch.equal(a, b)


def test_fsdp2_hsdp_sharded_resume_is_bitwise(ranks):
    for r in ranks:
        res = r['fsdp2']['resume']
        assert res['scales'][0] == res['scales'][1]
        for a, b in zip(res['straight'], res['resumed']):
            assert torch.equal(a, b)


def test_fsdp1_hybrid_shard_matches_single_process(ranks):
    for r in ranks:
        got, ref = r['fsdp1']['sharded'], r['fsdp1']['ref']
        _close(got['params'], ref['params'], rtol=1e-2, atol=2e-3)
        assert got['norms'] == pytest.approx(ref['norms'], rel=2e-2)
        assert all(n > 0.05 for n in ref['norms'])


def test_other_2d_layouts_are_refused_with_the_supported_one(ranks):
    for r in ranks:
        assert r['refused'] is not None and '(Replicate(), Shard(dim))' in r['refused']


def test_ema_of_hsdp_model_matches_single_process(ranks):
    check_ema(ranks)


def test_int8_states_on_hsdp_match_one_process_bitwise(ranks):
    from test_fsdp2_8bit import EIGHT_BIT, _assert_equal
    for r in ranks:
        assert r['int8']['placements'] == {n: '(Replicate(), Shard(dim=0))' for n in EIGHT_BIT}
        _assert_equal(r['int8']['sharded'], r['int8']['ref'], EIGHT_BIT)
