"""8-bit Adam moments under FSDP2 on CPU with gloo (Note [8-bit blocks on FSDP2 shards] in
mp_wrappers/optim/quantized_shards.py).

``FusedAdam(state_dtype='int8', min_8bit_size=512)`` over a model whose params cover every case:
rows of 256 and 512 elements split unevenly over 2 ranks ((3, 512): 2 rows and 1), a rank holding
no rows ((1, 512)), and params that keep float32 moments under FSDP2 (rows of 12 elements, 1-D).
The gradients are the same seeded full tensors in every run (each rank takes its rows), so the
sharded optimizer is compared with one process bit for bit, codes and absmax included:

* 2 ranks equal one unsharded process for the 8-bit params; the others get float32 moments.
* A DCP checkpoint written by 2 ranks resumes bitwise on 2 ranks and on 1 (re-sliced by DCP).
* A skipped step (``found_inf``) leaves codes, absmax, params and step counters unchanged.
* The sharded int8 state loads into a float32-state FusedAdam (dequantized) and back (quantized):
  the same codes and absmax, bit for bit.
* The wrapper under FSDP2 (ApexOptimWrapper O2 bf16 over FSDP's fp32 shards) no longer refuses
  int8 and trains.
* Through torchrun, tools/train.py and mmengine's Runner:
  ``configs/digits/cnn_fsdp2_apex_O2_bf16.py`` plus ``optim_wrapper.optimizer.state_dtype=int8``
  trains 2 epochs on 2 ranks, its DCP checkpoints hold the head's codes and absmax (the
  convolutions, rows of 9 and 288 elements, keep float32 moments), and ``--resume`` of epoch 1
  ends bitwise equal to the uninterrupted run; on 1 rank, resuming the DCP directory (re-sliced)
  and the same consolidated into one file (``tools/consolidate_checkpoint.py --resumable``) end
  bitwise equal.
* A plain (unsharded) optimizer state dict loaded straight into the sharded optimizer is refused,
  naming the sharded loader.
* bf16 params stored the lean way ('split', 'kahan': no fp32 master anywhere) with 8-bit moments
  (``multi_tensor_adam8bit_lean_`` on each rank's rows): 2 ranks equal one process bit for bit,
  the aux state (low halves, compensations) sharded like the param. 'stochastic' hashes an
  element's index in the tensor the kernel sees, a shard's rows under FSDP2: its roundings are not
  one process's, by design.
"""
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchrun
from _compat import requires
from test_fsdp import _free_port
from test_fsdp_runner import REPO, torchrun_runs

pytestmark = requires('fsdp2_cpu')  # every case shards with fully_shard on CPU

STEPS = 4  # a checkpoint after 2
EIGHT_BIT = ('l2.weight', 'l3.weight', 'l4.weight')
FP32_UNDER_FSDP2 = ('l1.weight', 'l2.bias')  # rows of 12 elements; 1-D (both >= 512 elements)
LEAN_MODES = ('split', 'kahan')


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(12, 256), nn.Linear(256, 512)
        self.l3, self.l4 = nn.Linear(512, 3), nn.Linear(512, 1, bias=False)

    def forward(self, x):
        h = F.relu(self.l2(F.relu(self.l1(x))))
        return self.l3(h) + self.l4(h)


def _shard(model, mesh=None, policy=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = dict(mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    for layer in (model.l1, model.l2, model.l3, model.l4):
        fully_shard(layer, **kw)
    return fully_shard(model, **kw)


def _adam(model, state_dtype='int8', bf16_storage=None):
    from mp_wrappers import FusedAdam
    return FusedAdam(model.parameters(), lr=0.01, weight_decay=0.01, state_dtype=state_dtype,
                     min_8bit_size=512, bf16_storage=bf16_storage)


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in _Net().named_parameters()}


def _steps(model, opt, first, last):
    """Steps ``first..last-1`` with the seeded full gradients (a DTensor param gets its rows)."""
    from torch.distributed.tensor import distribute_tensor
    from mp_wrappers.sharding import is_dtensor
    for step in range(first, last):
        grads = _grads(step)
        for name, p in model.named_parameters():
            g = grads[name].to(p.dtype)  # bf16 grads for a bf16 model
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if is_dtensor(p) else g
        opt.step()
        opt.zero_grad()


def _full(t):
    from torch.distributed.tensor import DTensor
    from mp_wrappers.sharding import is_dtensor
    if not is_dtensor(t):
        return t.detach().clone()
    # gloo gathers no 16-bit dtype: widened exactly (bf16 -> fp32, uint16 -> int32) and back
    wide = {torch.bfloat16: torch.float32, torch.uint16: torch.int32}.get(t.dtype)
    if wide is None:
        return t.full_tensor().detach().clone()
    local = DTensor.from_local(t.to_local().to(wide), t.device_mesh, t.placements,
                               shape=t.shape, stride=t.stride())
    return local.full_tensor().to(t.dtype)


def _record(model, opt):
    """Full params and optimizer state by name (DTensors gathered)."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state[p]
        out[name] = dict(param=_full(p), **{k: _full(v) for k, v in state.items()})
    return out


def _ckpt(path, model, opt, load=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    state = dict(model=model_sd, optim=optim_sd)
    if not load:
        dcp.save(state, checkpoint_id=path)
        return
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state['model'], optim_state_dict=state['optim'])


def _skip_case(model, opt):
    """A step with found_inf set: nothing of the 8-bit state (local shards) may move."""
    from mp_wrappers.sharding import local_tensor
    _steps(model, opt, 0, 1)
    before = {id(t): local_tensor(t).clone() for p in model.parameters()
              for t in (p, *opt.state[p].values())}
    grads = _grads(1)
    from torch.distributed.tensor import distribute_tensor
    for name, p in model.named_parameters():
        p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements)
    opt.step(found_inf=torch.ones(1))
    return all(torch.equal(local_tensor(t), before[id(t)]) for p in model.parameters()
               for t in (p, *opt.state[p].values()))


def _conversion_case(model, opt):
    """The sharded int8 state into a float32-state FusedAdam and back, in memory."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, \
        set_optimizer_state_dict
    _steps(model, opt, 0, 2)
    int8 = _record(model, opt)
    fp32_opt = _adam(model, 'float32')
    set_optimizer_state_dict(model, fp32_opt, get_optimizer_state_dict(model, opt))
    fp32 = _record(model, fp32_opt)
    back_opt = _adam(model, 'int8')
    set_optimizer_state_dict(model, back_opt, get_optimizer_state_dict(model, fp32_opt))
    back = _record(model, back_opt)
    placements = {n: (type(back_opt.state[p]['exp_avg']).__name__,
                      str(back_opt.state[p]['exp_avg_absmax'].placements))
                  for n, p in model.named_parameters() if n in EIGHT_BIT}
    return dict(int8=int8, fp32=fp32, back=back, placements=placements)


def _wrapper_case(rank):
    """ApexOptimWrapper O2 bf16 over FSDP's fp32 shards with int8 states: trains, no refusal."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from mp_wrappers import ApexOptimWrapper
    model = _shard(_Net(), policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32))
    wrapper = ApexOptimWrapper(_adam(model), opt_level='O2', dtype='bfloat16', verbosity=0)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
    losses = []
    for _ in range(3):
        with wrapper.optim_context(model):
            out = model(x[rank * 4:(rank + 1) * 4])
        loss = F.cross_entropy(out.float(), y[rank * 4:(rank + 1) * 4])
        wrapper.update_params(loss)
        losses.append(float(loss))
    dtypes = {n: wrapper.optimizer.state[p]['exp_avg'].dtype for n, p in model.named_parameters()}
    return dict(losses=losses, dtypes=dtypes)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _lean_case(mode, sharded, optimizer=_adam):
    """A bf16 model (sharded as it is: no param_dtype) stepped with 8-bit states and the
    ``mode`` storage by ``optimizer(model, bf16_storage=mode)``."""
    model = _Net().to(torch.bfloat16)
    if sharded:
        _shard(model)
    opt = optimizer(model, bf16_storage=mode)
    _steps(model, opt, 0, STEPS)
    return _record(model, opt)


def _sharded_cases(rank, tmp):
    ckpt = os.path.join(tmp, 'ckpt')
    model = _shard(_Net())
    opt = _adam(model)
    records = _Records()
    logging.getLogger('mp_wrappers.optim.quantized_shards').addHandler(records)
    _steps(model, opt, 0, 2)
    logging.getLogger('mp_wrappers.optim.quantized_shards').removeHandler(records)
    _ckpt(ckpt, model, opt)
    _steps(model, opt, 2, STEPS)
    out = dict(straight=_record(model, opt), logged=records.messages)
    out['local_rows'] = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
    model = _shard(_Net())
    opt = _adam(model)
    _ckpt(ckpt, model, opt, load=True)
    _steps(model, opt, 2, STEPS)
    out['resumed'] = _record(model, opt)
    model = _shard(_Net())
    out['skip_unchanged'] = _skip_case(model, _adam(model))
    model = _shard(_Net())
    out['conversion'] = _conversion_case(model, _adam(model))
    out['wrapper'] = _wrapper_case(rank)
    out['lean'] = {mode: _lean_case(mode, True) for mode in LEAN_MODES}
    return out


def _one_process_cases(tmp):
    """One unsharded process (the reference), and the 2 ranks' checkpoint resumed on 1 rank."""
    model = _Net()
    opt = _adam(model)
    _steps(model, opt, 0, STEPS)
    out = dict(reference=_record(model, opt),
               lean_reference={mode: _lean_case(mode, False) for mode in LEAN_MODES})
    model = _shard(_Net())
    opt = _adam(model)
    _ckpt(os.path.join(tmp, 'ckpt'), model, opt, load=True)
    _steps(model, opt, 2, STEPS)
    out['resumed_on_1'] = _record(model, opt)
    # a plain (unsharded) optimizer state dict loaded straight into the sharded optimizer
    plain = _Net()
    plain_opt = _adam(plain, 'float32')
    _steps(plain, plain_opt, 0, 1)
    model = _shard(_Net())
    try:
        _adam(model).load_state_dict(plain_opt.state_dict())
    except ValueError as exc:
        out['plain_state_error'] = str(exc)
    return out


def _worker(rank, world, port, out_dir):
    with torchrun.gloo_group(rank, world, port):
        result = _sharded_cases(rank, out_dir) if world == 2 else _one_process_cases(out_dir)
        torch.save(result, os.path.join(out_dir, f'world{world}_rank{rank}.pt'))


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp('fsdp2_8bit')
    results = {}
    for world in (2, 1):  # the 1-rank resume reads the 2 ranks' checkpoint
        files = [out / f'world{world}_rank{r}.pt' for r in range(world)]
        torchrun.spawn(_worker, lambda w=world: (w, _free_port(), str(out)), world, files)
        results[world] = [torch.load(f, weights_only=False) for f in files]
    return results


def _assert_equal(a, b, names=None):
    for name in names or a:
        assert a[name].keys() == b[name].keys(), name
        for key in a[name]:
            x, y = a[name][key], b[name][key]
            if key.endswith('absmax'):  # one row per param row under FSDP2; flat in one process
                x, y = x.reshape(-1), y.reshape(-1)
            assert x.dtype == y.dtype and torch.equal(x, y), (name, key)


@pytest.mark.parametrize('mode', LEAN_MODES)
def test_lean_bf16_shards_with_8bit_moments_match_one_process_bitwise(runs, mode):
    """The params whose blocks fit their shards: params, codes, absmaxes and the aux state bit for
    bit on both ranks, the codes beside the aux; those whose blocks would straddle shards keep
    float32 moments beside their aux (8-bit in one process: not comparable)."""
    ref = runs[1][0]['lean_reference'][mode]
    aux = {'split': 'master_low', 'kahan': 'kahan_comp'}[mode]
    for r in runs[2]:
        got = r['lean'][mode]
        for name in EIGHT_BIT:
            assert got[name]['param'].dtype == torch.bfloat16
            assert got[name]['exp_avg'].dtype == got[name]['exp_avg_sq'].dtype == torch.uint8
            assert aux in got[name]
        for name in FP32_UNDER_FSDP2:
            assert got[name]['exp_avg'].dtype == torch.float32 and aux in got[name], name
        _assert_equal(got, ref, EIGHT_BIT)


def test_shards_split_rows_unevenly_and_a_rank_may_hold_none(runs):
    rows = [r['local_rows'] for r in runs[2]]
    assert (rows[0]['l3.weight'], rows[1]['l3.weight']) == (2, 1)
    assert (rows[0]['l4.weight'], rows[1]['l4.weight']) == (1, 0)


def test_eight_bit_params_match_one_process_bitwise(runs):
    ref = runs[1][0]['reference']
    for r in runs[2]:
        got = r['straight']
        for name in EIGHT_BIT:
            assert got[name]['exp_avg'].dtype == torch.uint8, name
            assert got[name]['exp_avg_absmax'].shape == (got[name]['param'].shape[0],
                                                          got[name]['param'][0].numel() // 256)
        _assert_equal(got, ref, EIGHT_BIT)


def test_params_whose_blocks_would_straddle_shards_keep_float32_moments(runs):
    ref = runs[1][0]['reference']
    for name in FP32_UNDER_FSDP2:
        assert ref[name]['exp_avg'].dtype == torch.uint8, name  # 8-bit without sharding
        for r in runs[2]:
            state = r['straight'][name]
            assert state['exp_avg'].dtype == torch.float32 and 'exp_avg_absmax' not in state
            # fp32 moments against the reference's 8-bit ones: within a step's lr after 4 steps
            torch.testing.assert_close(state['param'], ref[name]['param'], rtol=0, atol=0.01)


def test_float32_moments_under_fsdp2_are_logged_once(runs):
    for r in runs[2]:
        assert len(r['logged']) == 1, r['logged']
        assert ("FusedAdam: state_dtype='int8' under FSDP2 keeps float32 moments for params whose "
                '256-element blocks would straddle shards') in r['logged'][0]
        assert 'shape (256, 12) with placements (Shard(dim=0),)' in r['logged'][0]


def test_checkpoint_of_2_ranks_resumes_bitwise_on_2_and_on_1(runs):
    straight = runs[2][0]['straight']
    for r in runs[2]:
        _assert_equal(r['resumed'], straight)
    _assert_equal(runs[1][0]['resumed_on_1'], straight)


def test_plain_state_for_a_sharded_param_is_refused_naming_the_sharded_loader(runs):
    msg = runs[1][0].get('plain_state_error', '')
    assert "FusedAdam: state 'exp_avg' of a DTensor (FSDP2) param of shape (512, 256) is a plain " \
           'tensor of shape (512, 256)' in msg and 'set_optimizer_state_dict' in msg, msg


def test_skipped_step_leaves_codes_and_absmax_unchanged(runs):
    assert all(r['skip_unchanged'] for r in runs[2])


def test_sharded_int8_state_converts_to_float32_and_back(runs):
    from mp_wrappers.ops.reference.quant import (EXP_AVG_CODE, EXP_AVG_SQ_CODE,
                                                 dequantize_invertibly)
    codes = {'exp_avg': EXP_AVG_CODE, 'exp_avg_sq': EXP_AVG_SQ_CODE}
    for r in runs[2]:
        c = r['conversion']
        for name in EIGHT_BIT:
            int8, fp32, back = c['int8'][name], c['fp32'][name], c['back'][name]
            assert c['placements'][name] == ('DTensor', '(Shard(dim=0),)')
            for key, code in codes.items():
                values = dequantize_invertibly(int8[key].reshape(-1),
                                               int8[key + '_absmax'].reshape(-1), code)
                assert fp32[key].dtype == torch.float32 and 'exp_avg_absmax' not in fp32
                assert torch.equal(fp32[key].reshape(-1), values), (name, key)
                # requantized: the same codes and absmax, bit for bit
                assert back[key].dtype == torch.uint8 and torch.equal(back[key], int8[key])
                assert torch.equal(back[key + '_absmax'], int8[key + '_absmax']), (name, key)


def test_wrapper_under_fsdp2_trains_with_int8_states(runs):
    for r in runs[2]:
        w = r['wrapper']
        assert all(torch.isfinite(torch.tensor(w['losses'])))
        assert w['losses'][-1] < w['losses'][0]
        assert {n for n, d in w['dtypes'].items() if d == torch.uint8} == set(EIGHT_BIT)
    assert runs[2][0]['wrapper']['losses'] != runs[2][1]['wrapper']['losses']  # own batches


RUNNER_OPTIONS = ['train_cfg.max_epochs=2', 'train_cfg.val_interval=1',
                  'default_hooks.checkpoint.interval=1']


def _runner_spec(tmp, name, resume=None, state_dtype='int8'):
    return dict(work_dir=tmp / name, result=tmp / f'{name}.pt', accumulate=1,
                config='configs/digits/cnn_fsdp2_apex_O2_bf16.py',
                options=RUNNER_OPTIONS + [f'optim_wrapper.optimizer.state_dtype={state_dtype}'],
                extra=['--resume', str(resume)] if resume else [])


def test_runner_config_trains_saves_and_resumes_int8_states_bitwise(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from test_runner_checkpoint import _consolidate
    epoch_1 = tmp_path / 'a' / 'epoch_1.pth'
    (a, _), (b, _) = torchrun_runs(2, _runner_spec(tmp_path, 'a'),
                                   _runner_spec(tmp_path, 'b', resume=epoch_1))
    # 2 -> 1 rank: the DCP directory (re-sliced) and the same consolidated into one file agree
    full = _consolidate(epoch_1, tmp_path / 'epoch_1_full.pth', '--resumable')
    # 'e': the consolidated file into float32 moments (load_state_dict dequantizes this rank's
    # rows of each whole absmax)
    (c, _), (d, _), (e, _) = torchrun_runs(
        1, _runner_spec(tmp_path, 'c', resume=epoch_1), _runner_spec(tmp_path, 'd', resume=full),
        _runner_spec(tmp_path, 'e', resume=full, state_dtype='float32'))
    assert c['world_size'] == 1 and c['iters'] == d['iters'] == e['iters'] > a['iters']
    for p, q, r in zip(c['params'], d['params'], e['params'], strict=True):
        assert torch.equal(p, q)
        assert not torch.equal(p, r) and torch.allclose(p, r, atol=0.05)  # other moments, close
    keys = FileSystemReader(str(epoch_1)).read_metadata().state_dict_metadata
    codes = {k: m for k, m in keys.items() if k.startswith('optimizer.state.')
             and k.endswith('.exp_avg')}
    absmax = {k: m.size for k, m in keys.items() if k.endswith('.exp_avg_absmax')}
    assert absmax == {'optimizer.state.head.weight.exp_avg_absmax': torch.Size([10, 4])}
    assert codes['optimizer.state.head.weight.exp_avg'].properties.dtype == torch.uint8
    assert codes['optimizer.state.features.3.weight.exp_avg'].properties.dtype == torch.float32
    assert a['iters'] == b['iters'] and a['scale'] == b['scale'] and a['skipped'] == b['skipped']
    for p, q in zip(a['params'], b['params'], strict=True):
        assert torch.equal(p, q)
    # the DCP directory into float32 moments: DCP loads into this run's state, so it is refused
    # before anything changes, naming both ways out
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(
        [REPO, os.environ.get('PYTHONPATH', '')]))
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=1',
           'tools/train.py', 'configs/digits/cnn_fsdp2_apex_O2_bf16.py', '--launcher', 'pytorch',
           '--work-dir', str(tmp_path / 'f'), '--resume', str(epoch_1), '--cfg-options',
           *RUNNER_OPTIONS, 'optim_wrapper.optimizer.state_dtype=float32']
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "entries the model lacks: ['optimizer.state.head.weight.exp_avg_absmax'" in out, out[-3000:]
    assert "Resume with the checkpoint's optim_wrapper.optimizer.state_dtype" in out
    assert 'consolidate_checkpoint.py --resumable' in out
