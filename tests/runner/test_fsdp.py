"""FSDP2 (``fully_shard``) and FSDP1 on CPU with gloo: our wrappers and fused optimizers step shards.

One ``torch.multiprocessing.spawn`` per world size (2 and 3 ranks; process start-up dominates), every
case inside it. Checked against a single-process run over the same global batch (the reference is
computed in each worker): ApexOptimWrapper O2 bf16 with FSDP's mixed precision (the fp32 shards are
the masters) and FusedAdam, with accumulation and active norm clipping; the global gradient norm
equals the single-process norm; FP16OptimWrapper over a model cast to bf16 before sharding (fp32
masters of the local half shards) with torch's SGD (the unfused path through the gradient stash)
and with FusedSGD; a planted inf on one rank skips the step on every rank with the same scale
after; per-rank optimizer state + masters ~ total / N; a sharded checkpoint (DCP) resumes bitwise;
refusals (no FSDP mixed precision under O2, LAMB on shards). FSDP1 (``FullyShardedDataParallel``
with ``use_orig_params=True`` on the CPU device), in the same processes: FP16OptimWrapper over an fp32
model with FSDP ``MixedPrecision(param_dtype=bf16)`` (the fp32 shards are the masters) and
ApexOptimWrapper O1 (autocast), both with accumulation (``no_sync`` around backward) and clipping,
against one process, and a planted inf on one rank. (FSDP1 through mmengine's FlexibleRunner and
tools/train.py: tests/runner/test_fsdp_runner.py.)
"""
import os
import socket

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchrun
from _compat import requires
from mp_wrappers import compat

STEPS = 4
BATCH = 6  # per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 6*16+16 + 16*16+16 + 16*3+3: uneven shard sizes on 3 ranks
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches(world: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH * world, 6, generator=g), torch.randint(0, 3, (BATCH * world,),
                                                                      generator=g))
            for _ in range(STEPS)]


def _shard(model: nn.Module, param_dtype=torch.bfloat16) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _run(model, wrapper, batches, rank, world, accumulate=1, fault=None, dtype=None):
    """Train; each rank takes its slice of the global batch (all of it when world == 1)."""
    norms, skipped, scales = [], [], []
    for i, (x, y) in enumerate(batches):
        if world > 1:
            x, y = x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]
        with wrapper.optim_context(model):
            out = model(x if dtype is None else x.to(dtype))
        loss = F.cross_entropy(out.float(), y) / accumulate
        if fault is not None and hasattr(wrapper, 'update_master_grads'):
            # FP16OptimWrapper unscales in backward by default: plant before that
            wrapper.backward(loss, update_master_grads=False)
        else:
            wrapper.backward(loss)
        if (i + 1) % accumulate:
            continue
        if fault is not None and i == fault[0] and rank == fault[1]:
            from mp_wrappers.sharding import local_tensor
            for p in model.parameters():  # the first param with a local shard here
                g = local_tensor(p.grad)
                if g is not None and g.numel():
                    g.view(-1)[0] = float('inf')
                    break
        wrapper.step()
        wrapper.zero_grad()
        norms.append(None if wrapper._outcomes.grad_norm is None else float(wrapper._outcomes.grad_norm))
        skipped.append(wrapper.last_step_skipped)
        scales.append(wrapper.loss_scale)
    return dict(norms=norms, skipped=skipped, scales=scales)


def _full(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from mp_wrappers.sharding import is_dtensor
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            return [p.detach().float().clone() for p in model.parameters()]
    return [(p.full_tensor() if is_dtensor(p) else p).detach().float().clone()
            for p in model.parameters()]


def _local_numel(tensors):
    from mp_wrappers.sharding import local_tensor
    return sum(local_tensor(t).numel() for t in tensors)


def _optimizer_numel(wrapper):
    opt = wrapper.optimizer
    per_elem = sum(_local_numel([v for v in st.values() if v.numel() > 1])
                   for st in opt.state.values())
    masters = [m for m, p in wrapper._master_params().half_pairs()]
    return per_elem + _local_numel(masters)


def _apex_o2(rank, world, sharded, tmp):
    from mp_wrappers import ApexOptimWrapper, FusedAdam
    model = _model()
    if sharded:
        _shard(model)
    wrapper = ApexOptimWrapper(FusedAdam(model.parameters(), lr=0.02, eps=1e-3), opt_level='O2',
                               dtype='bfloat16', verbosity=0, accumulative_counts=2,
                               clip_grad=dict(max_norm=0.1))
    stats = _run(model, wrapper, _batches(world), rank, world if sharded else 1, accumulate=2)
    # the fp32 values: FSDP's shards (the params), or the single process's masters
    fp32 = _full(model) if sharded else [m.detach().clone() for m in wrapper.master_params()]
    out = dict(stats, params=fp32, opt_numel=_optimizer_numel(wrapper),
               total=sum(p.numel() for p in model.parameters()))
    if sharded:
        # masters are FSDP's fp32 shards: none of our own, the optimizer steps DTensors
        out['no_masters'] = not wrapper._master_params().has_half
        out['param_types'] = sorted({type(p).__name__ for p in model.parameters()})
    return out


def _fp16_wrapper(rank, world, sharded, optimizer):
    from mp_wrappers import FP16OptimWrapper, FusedSGD, cast_model
    model = cast_model(_model(), torch.bfloat16)
    if sharded:
        _shard(model, param_dtype=None)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == 'torch'
           else FusedSGD(model.parameters(), lr=0.1, momentum=0.9))
    wrapper = FP16OptimWrapper(opt, verbose=False, clip_grad=dict(max_norm=0.5))
    stats = _run(model, wrapper, _batches(world), rank, world if sharded else 1,
                 dtype=torch.bfloat16)
    return dict(stats, params=_full(model),
                masters=[(m.full_tensor() if hasattr(m, 'full_tensor') else m).clone()
                         for m, _ in wrapper._master_params().half_pairs()],
                opt_numel=_optimizer_numel(wrapper), total=sum(p.numel() for p in model.parameters()))


def _fault(rank, world):
    from mp_wrappers import ApexOptimWrapper, FusedAdam
    model = _shard(_model())
    wrapper = ApexOptimWrapper(FusedAdam(model.parameters(), lr=0.02), opt_level='O2',
                               dtype='bfloat16', loss_scale='dynamic', verbosity=0)
    before = []

    class _Snap:  # weights before the faulty step
        pass
    stats = _run(model, wrapper, _batches(world)[:2], rank, world)
    before = _full(model)
    stats2 = _run(model, wrapper, _batches(world)[2:3], rank, world, fault=(0, world - 1))
    return dict(first=stats, faulty=stats2, before=before, after=_full(model),
                steps=wrapper.loss_scalers[0].steps, skipped_total=wrapper.loss_scalers[0].skipped_steps)


def _resume(rank, world, tmp):
    from mp_wrappers import ApexOptimWrapper, FusedAdam
    from mp_wrappers.distributed.checkpoint import load_sharded, save_sharded

    def build():
        model = _shard(_model())
        wrapper = ApexOptimWrapper(FusedAdam(model.parameters(), lr=0.02), opt_level='O2',
                                   dtype='bfloat16', loss_scale='dynamic', init_scale=2.**10,
                                   verbosity=0, clip_grad=dict(max_norm=0.3))
        return model, wrapper
    batches = _batches(world)
    model, wrapper = build()
    _run(model, wrapper, batches[:2], rank, world)
    wrapper.loss_scale = 256.0  # a state a fresh wrapper would not have
    save_sharded(os.path.join(tmp, 'ckpt'), model, wrapper)
    _run(model, wrapper, batches[2:], rank, world)
    straight = _full(model)
    model2, wrapper2 = build()
    load_sharded(os.path.join(tmp, 'ckpt'), model2, wrapper2)
    scale_after_load = wrapper2.loss_scale
    _run(model2, wrapper2, batches[2:], rank, world)
    return dict(straight=straight, resumed=_full(model2), scale_after_load=scale_after_load,
                scales=(wrapper.loss_scale, wrapper2.loss_scale))


def _errors(rank, world):
    from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper, FusedAdam, FusedLAMB, cast_model
    errors = {}
    model = _shard(_model(), param_dtype=None)
    wrapper = ApexOptimWrapper(FusedAdam(model.parameters()), opt_level='O2', dtype='bfloat16',
                               verbosity=0)
    try:
        with wrapper.optim_context(model):
            pass
    except RuntimeError as exc:
        errors['o2_without_fsdp_mp'] = str(exc)
    model = _shard(_model())
    wrapper = FP16OptimWrapper(FusedLAMB(model.parameters()), verbose=False)
    try:
        with wrapper.optim_context(model):
            pass
    except NotImplementedError as exc:
        errors['lamb'] = str(exc)
    model = _shard(_model())
    wrapper = ApexOptimWrapper(FusedAdam(model.parameters()), opt_level='O3', dtype='bfloat16',
                               verbosity=0)
    try:
        with wrapper.optim_context(model):
            pass
    except RuntimeError as exc:
        errors['o3_over_fp32_shards'] = str(exc)
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, init_device_mesh
    mesh = init_device_mesh('cpu', (world,))
    for name, grad_placement, param_placement in (('partial', Partial(), Partial()),
                                                  ('mismatch', Replicate(), Shard(0))):
        param = nn.Parameter(DTensor.from_local(torch.zeros(4), mesh, [param_placement]))
        n = 4 * world if isinstance(grad_placement, Replicate) else 4  # the same global shape
        param.grad = DTensor.from_local(torch.ones(n), mesh, [grad_placement])
        try:
            FusedAdam([param]).step()
        except (NotImplementedError, ValueError) as exc:
            errors[name] = str(exc)
    from mp_wrappers.distributed.checkpoint import save_sharded
    model = cast_model(_model(), torch.bfloat16)
    _shard(model, param_dtype=None)
    wrapper = FP16OptimWrapper(FusedAdam(model.parameters()), verbose=False)
    try:
        save_sharded('unused', model, wrapper)
    except NotImplementedError as exc:
        errors['checkpoint_half_masters'] = str(exc)
    lamb = FusedLAMB(_shard(_model()).parameters())
    m = lamb.param_groups[0]['params'][0]
    m.grad = torch.zeros_like(m)
    try:
        lamb.step()
    except NotImplementedError as exc:
        errors['lamb_direct'] = str(exc)
    return errors


def _fsdp1(module, param_dtype=None):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    mixed = None if param_dtype is None else MixedPrecision(param_dtype=param_dtype,
                                                             reduce_dtype=torch.float32)
    return FSDP(module, device_id=torch.device('cpu'), use_orig_params=True,
                mixed_precision=mixed)


def _fsdp1_cases(rank, world):
    """FP16OptimWrapper over FSDP's fp32 shards (bf16 compute) and O1, each vs one process."""
    from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper, FusedAdam, FusedSGD, cast_model
    out = {}
    for sharded in (True, False):
        if sharded:
            model = _fsdp1(_model(), torch.bfloat16)
            dtype = None  # FSDP casts the root's inputs
        else:  # the same numerics on one process: bf16 model, fp32 masters
            model, dtype = cast_model(_model(), torch.bfloat16), torch.bfloat16
        wrapper = FP16OptimWrapper(FusedSGD(model.parameters(), lr=0.1, momentum=0.9),
                                   verbose=False, accumulative_counts=2, clip_grad=dict(max_norm=0.05))
        stats = _run(model, wrapper, _batches(world), rank, world if sharded else 1, accumulate=2,
                     dtype=dtype)
        fp32 = _full(model) if sharded else [m.detach().clone() for m in wrapper.master_params()]
        out['fp16' if sharded else 'fp16_ref'] = dict(
            stats, params=fp32, opt_numel=_optimizer_numel(wrapper),
            masters=wrapper._master_params().has_half)
    for sharded in (True, False):
        model = _fsdp1(_model()) if sharded else _model()
        wrapper = ApexOptimWrapper(FusedAdam(model.parameters(), lr=0.02, eps=1e-3),
                                   opt_level='O1', dtype='bfloat16', verbosity=0,
                                   accumulative_counts=2, clip_grad=dict(max_norm=0.1))
        stats = _run(model, wrapper, _batches(world), rank, world if sharded else 1, accumulate=2)
        out['o1' if sharded else 'o1_ref'] = dict(stats, params=_full(model))
    model = _fsdp1(_model(), torch.bfloat16)
    wrapper = FP16OptimWrapper(FusedSGD(model.parameters(), lr=0.1), verbose=False,
                               dynamic_loss_scale=True)
    first = _run(model, wrapper, _batches(world)[:1], rank, world)
    before = _full(model)
    faulty = _run(model, wrapper, _batches(world)[1:2], rank, world, fault=(0, world - 1))
    out['fault'] = dict(first=first, faulty=faulty, before=before, after=_full(model))
    return out


def _lean_cases(rank, world):
    """Lean master modes (no fp32 copy) over a bf16 model sharded as it is, vs one process."""
    from mp_wrappers import ApexOptimWrapper, FusedAdam, cast_model
    out = {}
    for mode in ('split', 'kahan'):
        for sharded in (True, False):
            model = cast_model(_model(), torch.bfloat16)
            if sharded:
                _shard(model, param_dtype=None)
            wrapper = ApexOptimWrapper(FusedAdam(model.parameters(), lr=0.02, eps=1e-3),
                                       opt_level='O2', dtype='bfloat16', master_weights=mode,
                                       verbosity=0, clip_grad=dict(max_norm=0.1))
            stats = _run(model, wrapper, _batches(world), rank, world if sharded else 1,
                         dtype=torch.bfloat16)
            out[(mode, sharded)] = dict(stats, params=_full(model),
                                        opt_numel=_optimizer_numel(wrapper))
    return out


def _ema_case(rank, world, shard=None):
    """mmengine's ExponentialMovingAverage of a sharded model (Note [EMA of a sharded model])
    against the same average of the unsharded model in this process (``shard``: how the model is
    sharded; FSDP2 over all ranks by default)."""
    from mmengine.model import ExponentialMovingAverage

    from mp_wrappers.distributed.sharded_ema import ShardedShadow, install_sharded_deepcopy
    model, ref = _model(), _model()
    (shard or (lambda m: _shard(m, param_dtype=None)))(model)
    install_sharded_deepcopy(model)
    ema, ref_ema = (ExponentialMovingAverage(m, momentum=0.1) for m in (model, ref))
    for step in range(3):  # the weights move (as the optimizer moves them), the EMA follows
        with torch.no_grad():
            for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
                p.mul_(0.5 + 0.1 * step).add_(0.01 * i)
                q.mul_(0.5 + 0.1 * step).add_(0.01 * i)
        ema.update_parameters(model)
        ref_ema.update_parameters(ref)
    out = dict(shadow=type(ema.module) is ShardedShadow,
               types=sorted({type(p).__name__ for p in ema.module.parameters()}),
               ema=_full(ema.module), ref=[p.detach().clone() for p in ref_ema.module.parameters()])
    # loading: DTensors (a DCP checkpoint) and full tensors (an ordinary file, every rank reads it)
    for name, state in (('dtensor', ema.state_dict()), ('full', ref_ema.state_dict())):
        again = ExponentialMovingAverage(model, momentum=0.1)
        again.load_state_dict(state)
        out[name] = _full(again.module)
    try:
        ema(torch.zeros(1, 6))
    except RuntimeError as e:
        out['forward'] = str(e)
    return out


def _worker(rank, world, port, out_dir):
    with torchrun.gloo_group(rank, world, port):
        if not (compat.has('fsdp2') and compat.has('fsdp2_cpu')):  # the FSDP1 cases only
            result = dict(fsdp1=_fsdp1_cases(rank, world))
            torch.save(result, os.path.join(out_dir, f'rank{rank}.pt'))
            return
        result = dict(
            apex_o2=_apex_o2(rank, world, True, out_dir),
            apex_o2_ref=_apex_o2(rank, world, False, out_dir),
            fp16_torch=_fp16_wrapper(rank, world, True, 'torch'),
            fp16_torch_ref=_fp16_wrapper(rank, world, False, 'torch'),
            fp16_fused=_fp16_wrapper(rank, world, True, 'fused'),
            fp16_fused_ref=_fp16_wrapper(rank, world, False, 'fused'),
            fault=_fault(rank, world),
            resume=_resume(rank, world, out_dir),
            errors=_errors(rank, world),
            fsdp1=_fsdp1_cases(rank, world),
            lean=_lean_cases(rank, world),
            ema=_ema_case(rank, world))
        torch.save(result, os.path.join(out_dir, f'rank{rank}.pt'))


@pytest.fixture(scope='module', params=[2, 3], ids=['2ranks', '3ranks'])
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f'fsdp2_{world}')
    torchrun.spawn(_worker, lambda: (world, _free_port(), str(out)), world,
                   [out / f'rank{r}.pt' for r in range(world)])
    return [torch.load(out / f'rank{r}.pt', weights_only=False) for r in range(world)]


def _close(a, b, rtol, atol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@requires('fsdp2')
@requires('fsdp2_cpu')
def test_o2_fsdp2_matches_single_process(ranks):
    for r in ranks:
        got, ref = r['apex_o2'], r['apex_o2_ref']
        assert got['no_masters'] and got['param_types'] == ['DTensor']
        # bf16 forward/backward on 1/N of the batch vs the whole batch: bf16 rounding (eps=1e-3
        # keeps Adam from turning rounding noise in near-zero gradients into whole lr steps).
        _close(got['params'], ref['params'], rtol=1e-2, atol=2e-3)
        diff = torch.cat([(a - b).abs().reshape(-1) for a, b in zip(got['params'], ref['params'])])
        assert float(diff.mean()) < 5e-4
        assert got['skipped'] == ref['skipped'] == [False, False]
    # replicated view of the weights (full_tensor) identical on every rank
    for r in ranks[1:]:
        for a, b in zip(r['apex_o2']['params'], ranks[0]['apex_o2']['params']):
            assert torch.equal(a, b)


@requires('fsdp2')
@requires('fsdp2_cpu')
def test_global_norm_clipping_equals_single_process(ranks):
    for r in ranks:
        got, ref = r['apex_o2']['norms'], r['apex_o2_ref']['norms']
        assert all(n > 0.1 for n in ref)  # clipping was active at every step
        assert got == pytest.approx(ref, rel=2e-2)
    assert all(r['apex_o2']['norms'] == ranks[0]['apex_o2']['norms'] for r in ranks)


@requires('fsdp2')
@requires('fsdp2_cpu')
@pytest.mark.parametrize('case', ['fp16_torch', 'fp16_fused'])
def test_masters_of_half_shards_match_single_process(ranks, case):
    for r in ranks:
        got, ref = r[case], r[case + '_ref']
        _close(got['masters'], ref['masters'], rtol=2e-2, atol=2e-3)
        _close(got['params'], ref['params'], rtol=2e-2, atol=1e-2)
        assert got['norms'] == pytest.approx(ref['norms'], rel=2e-2)


@requires('fsdp2')
@requires('fsdp2_cpu')
def test_per_rank_optimizer_and_master_numel_is_total_over_n(ranks):
    world = len(ranks)
    # O2 + Adam: m, v per element (the fp32 masters are FSDP's own shards, i.e. the params; one
    # process keeps separate masters: 3 per element). FP16OptimWrapper + SGD: momentum + master.
    for case, per_elem, ref_per_elem in (('apex_o2', 2, 3), ('fp16_fused', 2, 2)):
        total = ranks[0][case]['total']
        counts = [r[case]['opt_numel'] for r in ranks]
        assert sum(counts) == per_elem * total
        for c in counts:  # dim-0 shards of each of the 6 tensors: within a row of 16 per tensor
            assert abs(c - per_elem * total / world) <= per_elem * 16 * 6
        assert ranks[0][case + '_ref']['opt_numel'] == ref_per_elem * total


@requires('fsdp2')
@requires('fsdp2_cpu')
def test_planted_inf_on_one_rank_skips_everywhere(ranks):
    for r in ranks:
        f = r['fault']
        assert f['first']['skipped'] == [False, False]
        assert f['faulty']['skipped'] == [True]
        assert f['faulty']['scales'] == [2.**15]  # backed off from 2**16 once, on every rank
        for a, b in zip(f['before'], f['after']):
            assert torch.equal(a, b)
        assert (f['steps'], f['skipped_total']) == (3, 1)


@requires('fsdp2')
@requires('fsdp2_cpu')
def test_sharded_resume_is_bitwise(ranks):
    for r in ranks:
        res = r['resume']
        assert res['scale_after_load'] == 256.0
        assert res['scales'][0] == res['scales'][1]
        for a, b in zip(res['straight'], res['resumed']):
            assert torch.equal(a, b)


@requires('fsdp2')
@requires('fsdp2_cpu')
def test_refusals_name_the_fix(ranks):
    errors = ranks[0]['errors']
    assert 'MixedPrecisionPolicy(param_dtype=torch.bfloat16' in errors['o2_without_fsdp_mp']
    assert 'FusedLAMB computes per-tensor norms' in errors['lamb']
    assert 'FusedLAMB computes per-tensor norms' in errors['lamb_direct']
    assert "Use opt_level='O2'" in errors['o3_over_fp32_shards']
    assert 'supports Shard(dim) and Replicate() placements only' in errors['partial']
    assert 'laid out alike' in errors['mismatch']
    assert 'masters of half-precision shards' in errors['checkpoint_half_masters']


def test_sharded_helpers_refuse_bad_options_without_processes():
    from mp_wrappers import FP16OptimWrapper, FusedSGD, cast_model
    from mp_wrappers.distributed.fsdp import _wrapper_extras
    from mp_wrappers.sharding import Sharding, clip_grad_norm_sharded, global_norm
    with pytest.raises(ValueError, match='norm_type=1.0 is not supported'):
        global_norm({True: [torch.ones(1)]}, norm_type=1.0)
    model = _model()
    for p in model.parameters():
        p.grad = torch.full_like(p, float('nan'))
    with pytest.raises(RuntimeError, match='error_if_nonfinite=True'):
        clip_grad_norm_sharded(list(model.parameters()), Sharding('fsdp1', model, None), 1.0,
                               error_if_nonfinite=True)
    half = cast_model(_model(), torch.bfloat16)
    wrapper = FP16OptimWrapper(FusedSGD(half.parameters(), lr=0.1), verbose=False)
    with pytest.raises(NotImplementedError, match='masters of half-precision FSDP shards'):
        _wrapper_extras(wrapper)


@requires('fsdp_cpu')
def test_fsdp1_fp32_shards_are_the_masters_and_match_single_process(ranks):
    world = len(ranks)
    for r in ranks:
        got, ref = r['fsdp1']['fp16'], r['fsdp1']['fp16_ref']
        assert not got['masters'] and ref['masters']  # FSDP's fp32 shards, no copies of ours
        _close(got['params'], ref['params'], rtol=2e-2, atol=2e-3)
        assert all(n > 0.05 for n in ref['norms'])  # clipping active
        assert got['norms'] == pytest.approx(ref['norms'], rel=2e-2)
    total = sum(p.numel() for p in ranks[0]['fsdp1']['fp16']['params'])
    counts = [r['fsdp1']['fp16']['opt_numel'] for r in ranks]  # SGD momentum only
    assert sum(counts) == total and all(abs(c - total / world) <= 16 for c in counts)


@requires('fsdp_cpu')
def test_fsdp1_o1_matches_single_process(ranks):
    for r in ranks:
        got, ref = r['fsdp1']['o1'], r['fsdp1']['o1_ref']
        _close(got['params'], ref['params'], rtol=1e-2, atol=2e-3)
        assert got['norms'] == pytest.approx(ref['norms'], rel=2e-2)


@requires('fsdp_cpu')
def test_fsdp1_planted_inf_on_one_rank_skips_everywhere(ranks):
    for r in ranks:
        f = r['fsdp1']['fault']
        assert f['first']['skipped'] == [False] and f['faulty']['skipped'] == [True]
        assert f['faulty']['scales'] == [2.**15]
        for a, b in zip(f['before'], f['after']):
            assert torch.equal(a, b)


@requires('fsdp2')
@requires('fsdp2_cpu')
@pytest.mark.parametrize('mode', ['split', 'kahan'])
def test_lean_master_modes_on_shards_match_single_process(ranks, mode):
    for r in ranks:
        got, ref = r['lean'][(mode, True)], r['lean'][(mode, False)]
        # bf16 gradients reduced in bf16 (no reduce_dtype for a bf16 model) vs one bf16 backward
        _close(got['params'], ref['params'], rtol=2e-2, atol=4e-3)
        assert got['norms'] == pytest.approx(ref['norms'], rel=3e-2)
        assert got['skipped'] == ref['skipped'] == [False] * 4
    # the extra state (uint16 low half / bf16 compensation) is sharded with the moments
    world = len(ranks)
    assert sum(r['lean'][(mode, True)]['opt_numel'] for r in ranks) == \
        ranks[0]['lean'][(mode, False)]['opt_numel']
    assert world > 1


@requires('fsdp2')
@requires('fsdp2_cpu')
def test_ema_of_sharded_model_is_sharded_and_matches_single_process(ranks):
    check_ema(ranks)


def check_ema(ranks):
    """What :func:`_ema_case` returned on every rank."""
    for r in ranks:
        got = r['ema']
        assert got['shadow'] and got['types'] == ['DTensor']  # sharded like the model's
        for name in ('ema', 'dtensor', 'full'):
            assert all(torch.equal(a, b) for a, b in zip(got[name], got['ref'], strict=True)), name
        assert 'swaps its weights into the sharded model' in got['forward']
