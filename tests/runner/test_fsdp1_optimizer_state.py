"""Optimizer state under FSDP1 on CPU with gloo: 8-bit Adam moments and lean bf16 storages
(Note [optimizer state under FSDP1] in mp_wrappers/optim/saved_state.py, Note [8-bit states under
FSDP1] in mp_wrappers/optim/quantized_state.py).

``FusedAdam(state_dtype='int8', min_8bit_size=512)`` over ``FullyShardedDataParallel``
(``use_orig_params=True``, one flat parameter split over 2 ranks): each rank's piece of a param is
quantized in blocks of its own, so ``l2.weight`` (cut between the ranks at an element offset that
is no multiple of 256) keeps 8-bit moments on both, and ``l1.bias`` (256 elements) float32 ones.

* FSDP's full optimizer state dict (``FSDP.optim_state_dict``, nothing set on the optimizer: it
  sees FSDP1's params) holds float32 moments shaped like the params, no absmax; loaded back
  (``optim_state_dict_to_load``) on 2 ranks, the codes and absmax are those that were saved, bit
  for bit, and 2 more steps end bitwise equal to the uninterrupted run.
* The same for a bf16 model with a lean storage (``bf16_storage='split'``: a uint16 low half per
  param, and 8-bit moments; ``'kahan'``: a bf16 compensation), whose states FSDP could not gather
  in their own dtypes.
* The 2 ranks' params stay within quantization error of one unsharded process (blocks differ).
* ApexOptimWrapper O2 bf16 over FSDP's fp32 shards with int8 states trains, and its optimizer saves
  float32 moments.
(Through torchrun, tools/train.py and a toolbox's own train script with mmengine's FlexibleRunner:
tests/runner/test_fsdp_runner.py.)
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchrun
from _compat import requires
from test_fsdp import _free_port, _fsdp1

pytestmark = requires('fsdp_cpu')  # FSDP1 on the CPU device

STEPS = 4  # a checkpoint after 2


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = nn.Linear(12, 256), nn.Linear(256, 500), nn.Linear(500, 3)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


def _adam(model, state_dtype='int8', bf16_storage=None):
    from mp_wrappers import FusedAdam
    return FusedAdam(model.parameters(), lr=0.01, weight_decay=0.01, state_dtype=state_dtype,
                     min_8bit_size=512, bf16_storage=bf16_storage)


def _batch(step, rank, world):
    """This rank's part of step ``step``'s global batch of 8."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
    per = 8 // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _steps(model, opt, first, last, rank, world):
    dtype = next(model.parameters()).dtype
    for step in range(first, last):
        x, y = _batch(step, rank, world)
        F.cross_entropy(model(x.to(dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()


def _named(model):
    """``(name, param)`` with the names of the unwrapped model."""
    return ((n.replace('_fsdp_wrapped_module.', ''), p) for n, p in model.named_parameters())


def _local_state(model, opt):
    """This rank's optimizer state by param name (pieces as they are)."""
    return {n: {k: v.clone() for k, v in opt.state[p].items()}
            for n, p in _named(model) if p in opt.state}


def _full_params(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    with FSDP.summon_full_params(model):
        return {n: p.detach().clone() for n, p in _named(model)}


def _full_state_dicts(model):
    """FSDP's full state dicts as MixedPrecisionFSDPStrategy's ``state_dict_cfg='full'`` on the CPU
    takes them: without ``offload_to_cpu``, whose ``.cpu()`` of a CPU tensor is no copy (torch
    2.13), so that every moment would alias one gather buffer and hold the last one's values."""
    from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig,
                                        FullyShardedDataParallel as FSDP, StateDictType)
    return FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                FullStateDictConfig(offload_to_cpu=False),
                                FullOptimStateDictConfig(offload_to_cpu=False))


def _checkpoint_case(rank, world, state_dtype='int8', bf16_storage=None):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from mp_wrappers import cast_model

    def build():
        net = _Net()
        return _fsdp1(cast_model(net, torch.bfloat16) if bf16_storage else net)
    model = build()
    opt = _adam(model, state_dtype, bf16_storage)
    _steps(model, opt, 0, 2, rank, world)
    saved_local = _local_state(model, opt)
    with _full_state_dicts(model):
        model_sd, optim_sd = model.state_dict(), FSDP.optim_state_dict(model, opt)
    _steps(model, opt, 2, STEPS, rank, world)
    out = dict(saved_local=saved_local, optim_sd=optim_sd, straight=_full_params(model),
               straight_state=_local_state(model, opt),
               pieces={n: p.numel() for n, p in _named(model)})
    model = build()
    model.load_state_dict(model_sd)
    opt = _adam(model, state_dtype, bf16_storage)
    with _full_state_dicts(model):
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model=model, optim=opt,
                                                          optim_state_dict=optim_sd))
    out['loaded_local'] = _local_state(model, opt)
    _steps(model, opt, 2, STEPS, rank, world)
    out['resumed'] = _full_params(model)
    out['resumed_state'] = _local_state(model, opt)
    return out


def _wrapper_case(rank, world):
    """ApexOptimWrapper O2 bf16 over FSDP's fp32 shards, int8 states: trains, no refusal."""
    from mp_wrappers import ApexOptimWrapper
    model = _fsdp1(_Net(), torch.bfloat16)
    wrapper = ApexOptimWrapper(_adam(model), opt_level='O2', dtype='bfloat16', verbosity=0)
    losses = []
    x, y = _batch(0, rank, world)
    for _ in range(3):
        with wrapper.optim_context(model):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        wrapper.update_params(loss)
        losses.append(float(loss.detach()))
    opt = wrapper.optimizer
    dtypes = {n: opt.state[p]['exp_avg'].dtype for n, p in _named(model) if p in opt.state}
    saved = {k: {n: v.dtype for n, v in slot.items()}
             for k, slot in opt.state_dict()['state'].items()}
    return dict(losses=losses, dtypes=dtypes, saved=saved)


def _worker(rank, world, port, out_dir):
    with torchrun.gloo_group(rank, world, port):
        if world == 1:
            model = _Net()
            opt = _adam(model)
            _steps(model, opt, 0, STEPS, 0, 1)
            result = dict(reference={n: p.detach().clone() for n, p in model.named_parameters()})
        else:
            result = dict(_checkpoint_case(rank, world), wrapper=_wrapper_case(rank, world),
                          lean={storage: _checkpoint_case(rank, world, dtype, storage)
                                for storage, dtype in (('split', 'int8'), ('kahan', 'float32'))})
        torch.save(result, os.path.join(out_dir, f'world{world}_rank{rank}.pt'))


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp('fsdp1_state')
    results = {}
    for world in (2, 1):
        files = [out / f'world{world}_rank{r}.pt' for r in range(world)]
        torchrun.spawn(_worker, lambda w=world: (w, _free_port(), str(out)), world, files)
        results[world] = [torch.load(f, weights_only=False) for f in files]
    return results


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key, x in a[name].items():
            y = b[name][key]
            assert x.dtype == y.dtype and torch.equal(x, y), (name, key)


def test_each_ranks_piece_is_quantized_in_blocks_of_its_own(runs):
    r0, r1 = runs[2]
    # l2.weight (128000 elements) is cut between the ranks at no multiple of 256
    assert r0['pieces']['l2.weight'] % 256 and r0['pieces']['l2.weight'] + \
        r1['pieces']['l2.weight'] == 128000
    for r in runs[2]:
        state = r['saved_local']['l2.weight']
        assert state['exp_avg'].dtype == state['exp_avg_sq'].dtype == torch.uint8
        assert state['exp_avg_absmax'].numel() == -(-r['pieces']['l2.weight'] // 256)
    assert runs[2][0]['saved_local']['l1.bias']['exp_avg'].dtype == torch.float32  # 256 < 512
    # the memory of 8-bit moments on each rank: 2 B per element of its piece + 2 absmax per block
    for r in runs[2]:
        n = r['pieces']['l2.weight']
        state = r['saved_local']['l2.weight']
        assert sum(v.nbytes for k, v in state.items() if k != 'step') == 2 * n + 8 * -(-n // 256)


def test_full_optimizer_state_dict_holds_float32_moments_shaped_like_the_params(runs):
    shapes = {n: p.shape for n, p in _Net().named_parameters()}
    for r in runs[2]:
        state, names = r['optim_sd']['state'], set(r['optim_sd']['state'])
        assert names == set(shapes), names
        for name, slot in state.items():
            assert set(slot) == {'step', 'exp_avg', 'exp_avg_sq'}, (name, set(slot))
            assert slot['exp_avg'].dtype == torch.float32
            assert slot['exp_avg'].shape == shapes[name], name


def test_loading_it_back_gives_the_saved_codes_and_absmax_and_a_bitwise_resume(runs):
    for r in runs[2]:
        assert r['saved_local']['l2.weight']['exp_avg'].dtype == torch.uint8
        _assert_same_state(r['loaded_local'], r['saved_local'])
        _assert_same_state(r['resumed_state'], r['straight_state'])
        for name, value in r['straight'].items():
            assert torch.equal(r['resumed'][name], value), name


def test_two_ranks_stay_within_quantization_error_of_one_process(runs):
    ref = runs[1][0]['reference']
    for r in runs[2]:
        for name, value in r['straight'].items():
            # other blocks, other codes: the distance from one process's params is a few
            # percent of how far 4 Adam steps moved them
            init = dict(_Net().named_parameters())[name].detach()
            moved = (ref[name] - init).norm()
            assert (value - ref[name]).norm() < 0.05 * moved, name


@pytest.mark.parametrize('storage', ['split', 'kahan'])
def test_lean_storages_save_as_float32_and_resume_bitwise(runs, storage):
    aux = {'split': ('master_low', torch.uint16), 'kahan': ('kahan_comp', torch.bfloat16)}[storage]
    for r in runs[2]:
        case = r['lean'][storage]
        assert case['saved_local']['l2.weight'][aux[0]].dtype == aux[1]
        if storage == 'split':
            assert case['saved_local']['l2.weight']['exp_avg'].dtype == torch.uint8
        for slot in case['optim_sd']['state'].values():
            assert all(v.dtype == torch.float32 for k, v in slot.items() if k != 'step')
        _assert_same_state(case['loaded_local'], case['saved_local'])
        _assert_same_state(case['resumed_state'], case['straight_state'])
        for name, value in case['straight'].items():
            assert torch.equal(case['resumed'][name], value), name


def test_wrapper_trains_with_int8_states_and_saves_float32_moments(runs):
    for r in runs[2]:
        w = r['wrapper']
        assert all(torch.isfinite(torch.tensor(w['losses']))) and w['losses'][-1] < w['losses'][0]
        assert w['dtypes']['l2.weight'] == torch.uint8
        for slot in w['saved'].values():
            assert 'exp_avg_absmax' not in slot and slot['exp_avg'] == torch.float32
