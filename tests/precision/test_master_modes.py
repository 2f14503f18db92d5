"""``ApexOptimWrapper(master_weights='split'|'kahan'|'stochastic')`` (mp_wrappers/master_modes.py).

* The policy refuses combinations that make no sense, naming the option and the value.
* Through mmengine's Runner (the tiny digits config, accumulation 2, FusedAdam): 'split' keeps O2's
  fp32 masters bit for bit when O2's forward weights are rounded toward zero as split's are (a test
  hook does that to O2's model copy after every step), i.e. the only difference between the two is
  the forward rounding mode.
* ``--resume`` from a mid-run checkpoint is bitwise equal to an uninterrupted run, and the
  checkpoint's model weights load into a plain fp32 model as full-precision weights.
"""
import copy
import os

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.runner import Runner

from mp_wrappers import ApexOptimWrapper
from mp_wrappers.master_modes import LeanMasterParams
from mp_wrappers.ops.reference.lean import bf16_join, bf16_split
from mp_wrappers.optim import FusedAdam, FusedSGD
from mp_wrappers.policy import resolve_properties
from projects.digits import DigitsCNN

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- policy and construction errors ---------------------------------------------------------------

@pytest.mark.parametrize('kwargs,err,match', [
    (dict(opt_level='O2', dtype='float16', master_weights='split'), ValueError,
     "master_weights='split' needs dtype='bfloat16'.*an fp16 model has no such master"),
    (dict(opt_level='O2', dtype='float32', master_weights='kahan'), ValueError,
     "master_weights='kahan' needs dtype='bfloat16'.*an fp32 model needs no lean storage"),
    (dict(opt_level='O1', dtype='bfloat16', master_weights='kahan'), RuntimeError,
     "master_weights='kahan' .* O1"),
    (dict(opt_level='O0', dtype='bfloat16', master_weights='stochastic'), ValueError,
     "master_weights='stochastic' needs a bf16 model, but opt_level='O0'"),
    (dict(opt_level='O2', dtype='bfloat16', master_weights='fp8'), ValueError,
     "master_weights='fp8' is not allowed; expected True, False, None .*'split'"),
    (dict(opt_level='O2', dtype='bfloat16', master_weights='split',
          cast_model_type=torch.float16), ValueError, 'needs a bf16 model'),
])
def test_policy_refuses_nonsense(kwargs, err, match):
    with pytest.raises(err, match=match):
        resolve_properties(**kwargs)


def test_policy_resolves_lean_modes():
    for mode in ('split', 'kahan', 'stochastic'):
        for level in ('O2', 'O3'):
            props = resolve_properties(level, dtype='bfloat16', master_weights=mode)
            assert props.master_weights == mode and props.lean_storage == mode
    assert resolve_properties('O2', dtype='bfloat16').lean_storage is None


def _model_params():
    return list(torch.nn.Linear(4, 4).parameters())


def test_wrapper_needs_a_lean_optimizer():
    with pytest.raises(TypeError, match="master_weights='kahan' needs an optimizer with a fused "
                                        'lean bf16 update.*got AdamW'):
        ApexOptimWrapper(torch.optim.AdamW(_model_params()), opt_level='O2', dtype='bfloat16',
                         master_weights='kahan')
    with pytest.raises(ValueError, match="master_weights='split' but the optimizer was built with "
                                         "bf16_storage='kahan'"):
        ApexOptimWrapper(FusedAdam(_model_params(), bf16_storage='kahan'), opt_level='O2',
                         dtype='bfloat16', master_weights='split')


@pytest.mark.parametrize('cls,kwargs,err,match', [
    (FusedSGD, dict(lr=0.1, bf16_storage='fp4'), ValueError, "bf16_storage='fp4' is not allowed"),
    (FusedAdam, dict(bf16_storage='split', state_dtype='float16'), ValueError, 'state_dtype'),
    (FusedAdam, dict(bf16_storage='kahan', master_weights=True), ValueError,
     'cannot be combined with master_weights=True'),
    (FusedSGD, dict(lr=0.1, bf16_storage='stochastic', seed=1.5), TypeError, 'seed must be an int'),
    (FusedSGD, dict(lr=0.1, bf16_storage='stochastic', seed=2**70), ValueError,
     r'FusedSGD: seed=1180591620717411303424 is out of range; expected an int in \[-2\*\*63, '
     r'2\*\*63\)'),
    # None is no choice: refused here, not at the first step as a 'bfloat16' without a storage.
    (FusedSGD, dict(lr=0.1, state_dtype=None), ValueError,
     r"FusedSGD: state_dtype=None is not supported; allowed: 'float32', 'bfloat16', 'int8'$"),
    (FusedSGD, dict(lr=0.1, state_dtype='int4'), ValueError,
     r"FusedSGD: state_dtype='int4' is not supported; allowed: 'float32', 'bfloat16', 'int8'$"),
])
def test_optimizer_options_are_validated(cls, kwargs, err, match):
    with pytest.raises(err, match=match):
        cls(_model_params(), **kwargs)


def test_bf16_state_without_a_storage_is_refused_at_the_step():
    params = _model_params()
    opt = FusedAdam(params, state_dtype='bfloat16')
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="state_dtype='bfloat16' needs bf16_storage"):
        opt.step()


# ---- through mmengine's Runner --------------------------------------------------------------------

class RoundO2ModelTowardZero(Hook):
    """Makes O2's bf16 model copy the master rounded toward zero (split's forward weights), before
    every iteration (the first one included: both start from the exact fp32 weights)."""

    priority = 'LOWEST'

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        masters = runner.optim_wrapper._masters
        with torch.no_grad():
            for master, model_p in masters.half_pairs():
                model_p.copy_(bf16_split(master)[0])
        # This write is instrumentation, not a new start: keep the wrapper's check at the first
        # forward (Note [masters lifecycle]) from re-deriving the masters from these weights.
        runner.optim_wrapper._binding.check_at_first_forward = False

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        masters = runner.optim_wrapper._masters  # the final weights too
        with torch.no_grad():
            for master, model_p in masters.half_pairs():
                model_p.copy_(bf16_split(master)[0])


def _cfg(tmp_path, name, max_iters=8, **wrapper):
    cfg = Config.fromfile(os.path.join(REPO, 'tests', 'configs', 'apex.py'))
    cfg.work_dir = str(tmp_path / name)
    cfg.optim_wrapper.update(dtype='bfloat16', **wrapper)
    cfg.train_cfg.max_iters = max_iters
    cfg.default_hooks.logger.interval = 100
    cfg.experiment_name = name
    return cfg


def _full_precision_weights(runner):
    """name -> fp32 weight the run stands for (O2: its master; lean modes: full_precision)."""
    wrapper = runner.optim_wrapper
    masters = wrapper._masters
    out = {}
    by_id = {}
    if isinstance(masters, LeanMasterParams):
        for row in masters.lean_params():
            for p in row:
                by_id[id(p)] = masters.full_precision(p)
    else:
        for master, model_p in masters.half_pairs():
            by_id[id(model_p)] = master.detach().clone()
    for name, p in runner.model.named_parameters():
        out[name] = by_id.get(id(p), p.detach().float())
    return out


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def test_split_masters_equal_o2_through_runner(tmp_path):
    o2 = Runner.from_cfg(_cfg(tmp_path, 'o2'))
    o2.register_hook(RoundO2ModelTowardZero())
    o2.train()
    split = Runner.from_cfg(_cfg(tmp_path, 'split', master_weights='split'))
    split.train()
    assert isinstance(split.optim_wrapper._masters, LeanMasterParams)
    want, got = _full_precision_weights(o2), _full_precision_weights(split)
    assert want.keys() == got.keys()
    n_half = 0
    for name in want:
        assert torch.equal(_bits(want[name]), _bits(got[name])), name
        n_half += dict(o2.model.named_parameters())[name].dtype == torch.bfloat16
    assert n_half > 0
    # Same bf16 forward weights too (hook), and moments bit for bit.
    for (n, a), (_, b) in zip(o2.model.named_parameters(), split.model.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(_bits(a.detach()), _bits(b.detach())), n
    # Slot by slot (the state dicts' insertion orders differ: 'split' creates its low halves first).
    o2_opt, split_opt = o2.optim_wrapper.optimizer, split.optim_wrapper.optimizer
    for ga, gb in zip(o2_opt.param_groups, split_opt.param_groups):
        for pa, pb in zip(ga['params'], gb['params']):
            a, b = o2_opt.state[pa], split_opt.state[pb]
            assert torch.equal(a['exp_avg'], b['exp_avg']) and torch.equal(a['exp_avg_sq'],
                                                                           b['exp_avg_sq'])


def _state_snapshot(runner):
    model = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
    opt = copy.deepcopy(runner.optim_wrapper.optimizer.state_dict()['state'])
    return model, opt


@pytest.mark.parametrize('mode,state_dtype', [('split', 'float32'), ('kahan', 'bfloat16'),
                                              ('stochastic', 'bfloat16')])
def test_resume_is_bitwise_and_checkpoint_loads_into_fp32(tmp_path, mode, state_dtype):
    opt = dict(type='mp_wrappers.FusedAdam', lr=2e-3, weight_decay=1e-4, state_dtype=state_dtype)
    full = Runner.from_cfg(_cfg(tmp_path, 'full', max_iters=6, master_weights=mode, optimizer=opt))
    full.train()
    want_model, want_opt = _state_snapshot(full)
    want_fp32 = _full_precision_weights(full)

    cfg = _cfg(tmp_path, 'resumed', max_iters=6, master_weights=mode, optimizer=opt)
    cfg.resume = True
    cfg.load_from = os.path.join(full.work_dir, 'iter_4.pth')
    resumed = Runner.from_cfg(cfg)
    resumed.train()
    got_model, got_opt = _state_snapshot(resumed)
    for name in want_model:
        assert want_model[name].dtype == got_model[name].dtype
        assert torch.equal(_bits(want_model[name]), _bits(got_model[name])), name
    for idx, st in want_opt.items():
        for key, value in st.items():
            assert torch.equal(value, got_opt[idx][key]), (idx, key)

    # The checkpoint's model weights are fp32 and full precision: a plain fp32 model loads them.
    ckpt = torch.load(os.path.join(full.work_dir, 'iter_6.pth'), weights_only=False)
    weights = ckpt['state_dict']
    fp32_model = DigitsCNN(num_classes=10, width=4)
    fp32_model.load_state_dict(weights)
    for name, p in fp32_model.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(_bits(p.detach()), _bits(want_fp32[name])), name
    lean = [n for n, p in full.model.named_parameters() if p.dtype == torch.bfloat16]
    if mode == 'split':  # the exact master: more than the bf16 value
        for n in lean:
            hi, lo = bf16_split(weights[n])
            assert torch.equal(_bits(bf16_join(hi, lo)), _bits(want_fp32[n]))
