"""Two CPU processes on gloo: O2 keeps ranks in sync, and casting after DDP is refused."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchrun


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _data(rank, steps=5):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(steps)]


def _train(rank, mode):
    from mp_wrappers import ApexOptimWrapper, MixedPrecisionDistributedDataParallel
    model = _model()
    if mode == 'cast_first':
        ddp = MixedPrecisionDistributedDataParallel(model, dtype='bfloat16')
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    wrapper = ApexOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               opt_level='O2', dtype='bfloat16', verbosity=0,
                               accumulative_counts=2)
    try:
        for x, y in _data(rank):
            with wrapper.optim_context(ddp):
                loss = F.cross_entropy(ddp(x), y)
            wrapper.update_params(loss)
    except RuntimeError as exc:
        return {'error': str(exc)}
    return {'params': [p.detach().clone() for p in model.parameters()],
            'masters': [m.detach().clone() for m in wrapper.master_params()]}


def _train_o1_nan_loss(rank):
    """O1 bf16 under plain DDP; rank 1's loss is NaN at step 2. Each rank checks only its own loss
    at a unit scale (Note [unit-scale check]) while DDP averages the NaN gradients into both ranks,
    so the flags must be all-reduced: both ranks skip, and stay equal and finite."""
    from mp_wrappers import ApexOptimWrapper
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    wrapper = ApexOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               opt_level='O1', dtype='bfloat16', verbosity=0)
    for i, (x, y) in enumerate(_data(rank)):
        with wrapper.optim_context(ddp):
            loss = F.cross_entropy(ddp(x).float(), y)
        if rank == 1 and i == 2:
            loss = loss * float('nan')
        wrapper.update_params(loss)
    return {'params': [p.detach().clone() for p in model.parameters()],
            'skipped': wrapper.loss_scalers[0].skipped_steps}


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=world)
    try:
        # One spawn for both cases: starting processes dominates the test's time.
        result = {mode: _train(rank, mode) for mode in ('cast_after', 'cast_first')}
        result['o1_nan_loss'] = _train_o1_nan_loss(rank)
        torch.save(result, os.path.join(out_dir, f'rank{rank}.pt'))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope='module')
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp('ddp')
    torchrun.spawn(_worker, lambda: (2, _free_port(), str(out)), 2,
                   [out / f'rank{r}.pt' for r in range(2)])
    return [torch.load(out / f'rank{r}.pt', weights_only=True) for r in range(2)]


def test_o2_under_ddp_keeps_ranks_equal(two_ranks):
    r0, r1 = (r['cast_first'] for r in two_ranks)
    assert 'error' not in r0, r0.get('error')
    for a, b in zip(r0['params'] + r0['masters'], r1['params'] + r1['masters']):
        assert torch.equal(a, b)
    assert r0['params'][0].dtype == torch.bfloat16
    assert any(not torch.equal(p.float(), q.float()) for p, q in
               zip(r0['params'], _model().parameters()))


def test_casting_after_ddp_is_refused_with_the_fix(two_ranks):
    for r in two_ranks:
        assert 'MixedPrecisionDistributedDataParallel' in r['cast_after']['error']


def test_o1_nan_loss_on_one_rank_skips_on_every_rank(two_ranks):
    r0, r1 = (r['o1_nan_loss'] for r in two_ranks)
    assert r0['skipped'] == r1['skipped'] == 1
    for a, b in zip(r0['params'], r1['params']):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
