"""FusedAdam(state_dtype='int8'): which params get 8-bit moments, their state and checkpoints, the
refused combinations, and the wrappers (ApexOptimWrapper O2, FP16OptimWrapper, mmengine's Runner)
training with it (Note [8-bit optimizer states])."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _optim_training import assert_states_equal as _assert_states_equal
from _optim_training import batches as _batches
from _optim_training import classifier as _classifier
from _optim_training import cls_batches as _cls_batches
from _optim_training import mlp as _mlp
from _optim_training import overflow_step_changes_nothing
from _optim_training import roundtrip as _roundtrip
from _optim_training import states as _states
from _optim_training import train as _train
from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper, FusedAdam, FusedSGD, cast_model

ADAMW = dict(lr=1e-2, weight_decay=0.01)


# ---- state layout ----------------------------------------------------------------------------------

def test_large_params_get_8bit_moments_small_ones_float32():
    model = _mlp()
    opt = FusedAdam(model.parameters(), state_dtype='int8', **ADAMW)
    _train(model, opt, _batches(1))
    w, b = opt.state[model[0].weight], opt.state[model[0].bias]
    assert w['exp_avg'].dtype == w['exp_avg_sq'].dtype == torch.uint8
    assert w['exp_avg'].shape == model[0].weight.shape
    assert w['exp_avg_absmax'].shape == w['exp_avg_sq_absmax'].shape == (32,)
    assert b['exp_avg'].dtype == torch.float32 and 'exp_avg_absmax' not in b
    assert opt.int8_states and opt.min_8bit_size == 4096


def test_min_8bit_size_and_group_override():
    model = _mlp()
    groups = [dict(params=[model[0].weight, model[0].bias]),
              dict(params=[model[2].weight, model[2].bias], state_dtype='float32')]
    opt = FusedAdam(groups, state_dtype='int8', min_8bit_size=100, **ADAMW)
    _train(model, opt, _batches(2))
    dtypes = [opt.state[p]['exp_avg'].dtype for p in model.parameters()]
    assert dtypes == [torch.uint8, torch.uint8, torch.float32, torch.float32]
    # ... and the other way round: one group in 8-bit in a float32-state optimizer.
    model = _mlp()
    opt = FusedAdam([dict(params=[model[0].weight], state_dtype='int8'),
                     dict(params=[model[2].weight])], **ADAMW)
    _train(model, opt, _batches(1))
    assert [opt.state[p]['exp_avg'].dtype for p in (model[0].weight, model[2].weight)] == \
        [torch.uint8, torch.float32]


def test_trains_close_to_float32_states():
    batches = _batches(40)
    ref = _mlp()
    ref_losses = _train(ref, FusedAdam(ref.parameters(), **ADAMW), batches)
    model = _mlp()
    losses = _train(model, FusedAdam(model.parameters(), state_dtype='int8', **ADAMW), batches)
    assert losses[-1] < 0.5 * losses[0]
    assert abs(losses[-1] - ref_losses[-1]) < 0.1 * ref_losses[-1]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p - q).norm() < 0.1 * q.norm()


@pytest.mark.parametrize('state_dtype', ['int8', 'float32'])
def test_a_step_without_some_gradients_counts_like_float32_states(state_dtype):
    # One counter per group, whatever the moments' dtype (Note [step cohorts]): the 8-bit params
    # without a gradient at step 2 advance with the float32-moment ones, as with float32 states,
    # and after loading the group shares one counter again.
    model = _mlp()
    opt = FusedAdam(model.parameters(), state_dtype=state_dtype, **ADAMW)
    for i, (x, y) in enumerate(_batches(4)):
        F.mse_loss(model(x), y).backward()
        if i == 1:
            model[0].weight.grad = model[2].weight.grad = None
        opt.step()
        opt.zero_grad()
    assert [opt.state[p]['step'].item() for p in model.parameters()] == [4.0] * 4
    assert len({id(s['step']) for s in opt.state.values()}) == 1
    opt2 = FusedAdam(copy.deepcopy(model).parameters(), state_dtype=state_dtype, **ADAMW)
    opt2.load_state_dict(opt.state_dict())
    assert len({id(s['step']) for s in opt2.state.values()}) == 1


def test_mixed_bucket_advances_its_step_counter_once():
    # The group's one counter, shared by 8-bit and float32 moments: one bucket, two op calls, and
    # the counter still advances once a step (set again by hand here: the same tensor already).
    model, ref = _mlp(), _mlp()
    ref.load_state_dict(model.state_dict())
    opt = FusedAdam(model.parameters(), state_dtype='int8', **ADAMW)
    ref_opt = FusedAdam(ref.parameters(), state_dtype='int8', **ADAMW)
    batches = _batches(3)
    _train(model, opt, batches[:1])
    _train(ref, ref_opt, batches[:1])
    shared = opt.state[model[0].weight]['step']
    for p in model.parameters():
        opt.state[p]['step'] = shared
    _train(model, opt, batches[1:])
    _train(ref, ref_opt, batches[1:])
    assert {opt.state[p]['step'].item() for p in model.parameters()} == {3.0}
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_collect_asks_state_dtypes_once_per_group_and_dtype():
    # The host time of a step on a GPU (Note [collect fast path]): no lookup of each slot's state
    # to tell 8-bit codes from float32 moments.
    model = _mlp()
    opt = FusedAdam(model.parameters(), state_dtype='int8', min_8bit_size=100, **ADAMW)
    _train(model, opt, _batches(1))
    asked = []
    state_dtype = opt._state_dtype

    def counting(key, t):
        asked.append(key)
        return state_dtype(key, t)
    opt._state_dtype = counting
    _train(model, opt, _batches(1))
    assert sorted(asked) == ['exp_avg', 'exp_avg_sq']  # the one SlotSpec of the step


def test_channels_last_param_matches_its_memory_order():
    """Blocks follow memory order: a channels_last param steps as the contiguous tensor of its
    memory order (NHWC) does."""
    torch.manual_seed(0)
    w = torch.randn(8, 16, 8, 8)
    a = nn.Parameter(w.permute(0, 2, 3, 1).contiguous())
    b = nn.Parameter(w.clone().to(memory_format=torch.channels_last))
    oa = FusedAdam([a], state_dtype='int8', **ADAMW)
    ob = FusedAdam([b], state_dtype='int8', **ADAMW)
    for _ in range(3):
        g = torch.randn_like(w)
        a.grad = g.permute(0, 2, 3, 1).contiguous()
        b.grad = g.clone().to(memory_format=torch.channels_last)
        oa.step()
        ob.step()
    assert torch.equal(a, b.permute(0, 2, 3, 1))
    assert ob.state[b]['exp_avg'].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(oa.state[a]['exp_avg'], ob.state[b]['exp_avg'].permute(0, 2, 3, 1))


# ---- checkpoints -----------------------------------------------------------------------------------

def test_state_dict_is_small_and_resume_is_bitwise():
    batches = _batches(6)
    model = _mlp()
    opt = FusedAdam(model.parameters(), state_dtype='int8', **ADAMW)
    _train(model, opt, batches[:3])
    saved, nbytes = _roundtrip(opt.state_dict())
    _, fp32_bytes = _roundtrip(_fp32_state_dict())
    assert nbytes < 0.4 * fp32_bytes
    opt2 = _resume_bitwise(model, opt, saved, batches[3:])
    _assert_states_equal(_states(opt), _states(opt2))


def _resume_bitwise(model, opt, saved, rest, check_loaded=None):
    """Train ``model`` on ``rest``; a fresh model with its weights of now and an int8 FusedAdam
    loaded from ``saved`` (``check_loaded`` sees it) train on ``rest`` too and end bitwise alike."""
    model_sd = copy.deepcopy(model.state_dict())
    _train(model, opt, rest)
    resumed = _mlp(seed=5)
    resumed.load_state_dict(model_sd)
    opt2 = FusedAdam(resumed.parameters(), state_dtype='int8', **ADAMW)
    opt2.load_state_dict(saved)
    if check_loaded is not None:
        check_loaded(opt2)
    _train(resumed, opt2, rest)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    return opt2


def test_absmax_of_a_consolidated_fsdp2_checkpoint_is_flattened_back():
    """Under FSDP2 an absmax is (rows, row / 256) (Note [8-bit blocks on FSDP2 shards]); a
    consolidated checkpoint of it loads into an unsharded optimizer and resumes bitwise."""
    batches = _batches(4)
    model = _mlp()
    opt = FusedAdam(model.parameters(), state_dtype='int8', **ADAMW)
    _train(model, opt, batches[:2])
    saved = _roundtrip(opt.state_dict())[0]
    for state in saved['state'].values():
        if 'exp_avg_absmax' in state:  # 32 blocks each, 2-D as a consolidated checkpoint has them
            for key in ('exp_avg_absmax', 'exp_avg_sq_absmax'):
                state[key] = state[key].reshape(2, -1)

    def flat_again(opt2):
        assert all(s['exp_avg_absmax'].dim() == 1 for s in opt2.state.values()
                   if 'exp_avg_absmax' in s)
    _resume_bitwise(model, opt, saved, batches[2:], flat_again)


def _fp32_state_dict():
    model = _mlp()
    opt = FusedAdam(model.parameters(), **ADAMW)
    _train(model, opt, _batches(3))
    return opt.state_dict()


def test_checkpoints_convert_between_int8_and_float32_states():
    model = _mlp()
    opt8 = FusedAdam(model.parameters(), state_dtype='int8', **ADAMW)
    _train(model, opt8, _batches(3))
    # int8 -> float32: dequantized.
    opt32 = FusedAdam(_mlp().parameters(), **ADAMW)
    opt32.load_state_dict(_roundtrip(opt8.state_dict())[0])
    w8 = opt8.state[model[0].weight]
    w32 = opt32.state[opt32.param_groups[0]['params'][0]]
    assert w32['exp_avg'].dtype == torch.float32 and 'exp_avg_absmax' not in w32
    from mp_wrappers.ops.reference.quant import EXP_AVG_CODE, dequantize_invertibly
    assert torch.equal(w32['exp_avg'],
                       dequantize_invertibly(w8['exp_avg'], w8['exp_avg_absmax'], EXP_AVG_CODE))
    # ... and back: the same codes and absmax, bit for bit.
    back = FusedAdam(_mlp().parameters(), state_dtype='int8', **ADAMW)
    back.load_state_dict(_roundtrip(opt32.state_dict())[0])
    _assert_states_equal(_states(opt8), _states(back))
    # float32 -> int8 from a float32-state run: quantized, and training continues.
    model = _mlp()
    fp32 = FusedAdam(model.parameters(), **ADAMW)
    _train(model, fp32, _batches(3))
    opt = FusedAdam(model.parameters(), state_dtype='int8', **ADAMW)
    opt.load_state_dict(_roundtrip(fp32.state_dict())[0])
    st = opt.state[model[0].weight]
    assert st['exp_avg'].dtype == torch.uint8
    m = fp32.state[model[0].weight]['exp_avg']
    got = dequantize_invertibly(st['exp_avg'], st['exp_avg_absmax'], EXP_AVG_CODE)
    assert (got - m).norm() < 0.05 * m.norm()
    _train(model, opt, _batches(2))


# ---- a tensor lr (capturable=True) -------------------------------------------------------------------

def test_capturable_steps_like_a_float_lr_under_a_schedule():
    """capturable=True: each group's lr becomes a 1-element tensor at the first step, which the
    8-bit kernel (and the float32-moment one of the small params) reads when it runs; an LR
    schedule writing into it in place gives the same bits as float lrs."""
    models = [_mlp(), _mlp()]
    opts = [FusedAdam(models[0].parameters(), state_dtype='int8', **ADAMW),
            FusedAdam(models[1].parameters(), state_dtype='int8', capturable=True, **ADAMW)]
    for i, (x, y) in enumerate(_batches(4)):
        lr = ADAMW['lr'] * 0.5 ** i
        for model, opt in zip(models, opts):
            group = opt.param_groups[0]
            if isinstance(group['lr'], torch.Tensor):
                group['lr'].fill_(lr)  # as torch's schedulers write a tensor lr
            else:
                group['lr'] = lr
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    lr = opts[1].param_groups[0]['lr']
    assert isinstance(lr, torch.Tensor) and lr.shape == (1,) and lr.dtype == torch.float32
    assert opts[1].state[models[1][0].weight]['exp_avg'].dtype == torch.uint8
    _assert_states_equal(_states(opts[0]), _states(opts[1]))
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize('mixed', [False, True], ids=['bf16', 'fp32-then-bf16'])
def test_lean_params_with_8bit_moments_refuse_a_tensor_lr(mixed):
    """The lean bf16 storages' kernels take lr as a number: a tensor lr is refused at the step,
    saying so, before any bucket launches: nothing changes, not even the fp32 params of the same
    group, whose bucket steps first (capturable=True with bf16_storage: at construction)."""
    with pytest.raises(ValueError, match="capturable=True.*not supported with bf16_storage='kahan'"):
        FusedAdam(_mlp().parameters(), state_dtype='int8', bf16_storage='kahan', capturable=True,
                  **ADAMW)
    model = _mlp()
    if mixed:
        model[2].to(torch.bfloat16)  # fp32 first layer, bf16 last: two buckets, one step counter
    else:
        model = cast_model(model, torch.bfloat16)
    opt = FusedAdam(model.parameters(), state_dtype='int8', bf16_storage='kahan',
                    min_8bit_size=0, **ADAMW)

    def backward(x, y):
        h = model[1](model[0](x.to(model[0].weight.dtype)))
        F.mse_loss(model[2](h.to(model[2].weight.dtype)).float(), y).backward()
    (x, y), (x2, y2) = _batches(2)
    backward(x, y)
    opt.step()  # a float lr: the state exists, with 8-bit moments and Kahan compensations
    opt.zero_grad()
    opt.param_groups[0]['lr'] = torch.tensor([1e-2])
    backward(x2, y2)
    params, states = [p.clone() for p in model.parameters()], _states(opt)
    assert any(k == 'kahan_comp' for k, _ in states)
    with pytest.raises(ValueError, match="tensor lr .capturable=True. is not supported with "
                                         "bf16_storage='kahan'"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    _assert_states_equal(_states(opt), states)


# ---- refused combinations --------------------------------------------------------------------------

@pytest.mark.parametrize('kwargs,match', [
    (dict(master_weights=True), "master_weights=True is not supported with state_dtype='int8'"),
    (dict(min_8bit_size=-1), 'min_8bit_size=-1 is not allowed'),
])
def test_refused_options_name_option_value_and_alternatives(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedAdam(_mlp().parameters(), state_dtype='int8', **kwargs)


@pytest.mark.parametrize('value', ['int4', 'float16', torch.int8, None])
def test_refused_state_dtype_names_every_allowed_value(value):
    # The lean storages' parser alone would list 'float32' and 'bfloat16' and leave out 'int8'.
    with pytest.raises(ValueError, match=rf"FusedAdam: state_dtype={value!r} is not supported; "
                                         r"allowed: 'float32', 'bfloat16', 'int8'$"):
        FusedAdam(_mlp().parameters(), state_dtype=value)


def test_refused_group_values():
    with pytest.raises(ValueError, match=r"state_dtype='int4' is not allowed; expected one of "
                                         r"\['float32', 'int8'\]"):
        FusedAdam([dict(params=_mlp().parameters(), state_dtype='int4')])
    # A group's int8 may not bring in what the optimizer-wide one refuses, before any step.
    for option in ('master_weights',):
        with pytest.raises(ValueError, match=rf"state_dtype='int8' is not supported with "
                                             rf"{option}=True; set the group's "
                                             rf"state_dtype='float32', or {option}=False"):
            FusedAdam([dict(params=_mlp().parameters(), state_dtype='int8')], **{option: True})
        opt = FusedAdam(_mlp().parameters(), **{option: True})
        with pytest.raises(ValueError, match=f'{option}=True'):
            opt.add_param_group(dict(params=_mlp().parameters(), state_dtype='int8'))


@pytest.mark.parametrize('cls', [FusedAdam, FusedSGD])
def test_unknown_state_dtypes_are_refused_naming_all_three(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: state_dtype='int4' is not supported; "
                                         r"allowed: 'float32', 'bfloat16', 'int8'"):
        cls(_mlp().parameters(), lr=0.1, state_dtype='int4')


def test_params_without_an_8bit_kernel_are_refused():
    p = nn.Parameter(torch.zeros(64, 128, device='meta'))
    p.grad = torch.zeros_like(p)
    opt = FusedAdam([p], state_dtype='int8')
    with pytest.raises(NotImplementedError, match="run on CPU tensors, and on CUDA tensors with a "
                                                  "build that has CUDA kernels; got tensors on meta"):
        opt.step()


@pytest.mark.parametrize('device', ['cuda'])
def test_cuda_params_step_like_the_cpu(device):
    """The CUDA kernel (a build with CUDA kernels, on a GPU; skipped otherwise): FusedAdam's int8
    steps on CUDA params give the CPU's states and params, bit for bit without bias correction (no
    float64 pow on the device); with it, within an ulp-level tolerance (CUDA's pow,
    docs/quantized_states.md), codes at most one step apart. The grads are the CPU model's."""
    for bias_correction in (False, True):
        models = [_mlp(), _mlp().to(device)]
        opts = [FusedAdam(m.parameters(), state_dtype='int8', bias_correction=bias_correction,
                          **ADAMW) for m in models]
        for x, y in _batches(3):
            F.mse_loss(models[0](x), y).backward()  # the same grads for both (CPU matmuls)
            for a, b in zip(models[0].parameters(), models[1].parameters()):
                b.grad = a.grad.to(device)
            for o in opts:
                o.step()
                o.zero_grad()
        for (ka, a), (kb, b) in zip(_states(opts[0]), _states(opts[1])):
            assert ka == kb and a.dtype == b.dtype
            b = b.cpu()
            if not bias_correction:
                assert torch.equal(a, b), ka
            elif a.dtype == torch.uint8:
                assert (a.int() - b.int()).abs().max().item() <= 1, ka
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=ka)


def _one_dominant_grad_per_block(model):
    """Grads where one element of every 256 dwarfs the rest: the others' new exp_avg rounds to
    magnitude 0, the negative ones to the negative zero code 0x80."""
    for p in model.parameters():
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 1e-6
        g.view(-1)[::256] = 1e3
        p.grad = g.to(p.dtype)


@pytest.mark.parametrize('storage,state_dtype', [(None, 'int8'), ('split', 'int8'),
                                                 ('kahan', 'float32'), ('kahan', 'int8')])
def test_float32_state_dict_loads_back_bitwise(storage, state_dtype):
    """Note [optimizer state under FSDP1] (set by itself for FSDP1's params;
    ``save_float32_state`` here): every state tensor saved as float32 (8-bit moments by
    ``dequantize_invertibly``, no absmax; a lean storage's uint16 low half or bf16 compensation as
    their values), loaded back to the same dtypes and bits, codes 0x80 included, and training goes
    on as if never saved. (Under FSDP1 itself: tests/runner/test_fsdp1_optimizer_state.py.)"""
    make = _lean_mlp if storage else _mlp
    train = _lean_train if storage else _train
    kw = dict(ADAMW, state_dtype=state_dtype, bf16_storage=storage)
    model = make()
    opt = FusedAdam(model.parameters(), **kw)
    train(model, opt, _batches(3))
    _one_dominant_grad_per_block(model)
    opt.step()
    opt.zero_grad()
    first = opt.state[model[0].weight]
    if state_dtype == 'int8':
        assert (first['exp_avg'] == 0x80).any()
    opt.save_float32_state = True
    saved = _roundtrip(opt.state_dict())[0]
    for slot in saved['state'].values():
        assert 'exp_avg_absmax' not in slot
        assert all(v.dtype == torch.float32 for k, v in slot.items() if k != 'step')
    assert first['exp_avg'].dtype == (torch.uint8 if state_dtype == 'int8' else torch.float32)
    twin = make()
    twin.load_state_dict(model.state_dict())
    back = FusedAdam(twin.parameters(), **kw)
    back.load_state_dict(saved)
    _assert_states_equal(_states(opt), _states(back))
    train(model, opt, _batches(2, seed=5))
    train(twin, back, _batches(2, seed=5))
    _assert_states_equal(_states(opt), _states(back))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


# ---- the wrappers ----------------------------------------------------------------------------------

def _apex(state_dtype, steps=12, clip=None, accum=1):
    model = _classifier()
    w = ApexOptimWrapper(FusedAdam(model.parameters(), state_dtype=state_dtype, **ADAMW),
                         opt_level='O2', dtype='bfloat16', verbosity=0, clip_grad=clip,
                         accumulative_counts=accum)
    for x, y in _cls_batches(steps):
        with w.optim_context(model):
            loss = F.cross_entropy(model(x), y)
        w.update_params(loss)
    return model, w


def _fp16(state_dtype, steps=12, clip=None, accum=1):
    model = cast_model(_classifier(), torch.float16)
    w = FP16OptimWrapper(FusedAdam(model.parameters(), state_dtype=state_dtype, **ADAMW),
                         dynamic_loss_scale=True, clip_grad=clip, accumulative_counts=accum)
    for x, y in _cls_batches(steps):
        w.update_params(F.cross_entropy(model(x.half()).float(), y))
    return model, w


@pytest.mark.parametrize('run', [_apex, _fp16], ids=['apex-o2-bf16', 'fp16'])
@pytest.mark.parametrize('clip,accum', [(None, 1), (dict(max_norm=1.0), 2)],
                         ids=['plain', 'clip-accum'])
def test_wrappers_train_close_to_float32_states(run, clip, accum):
    m8, w8 = run('int8', clip=clip, accum=accum)
    m32, _ = run('float32', clip=clip, accum=accum)
    assert w8.optimizer.state[w8.optimizer.param_groups[0]['params'][0]]['exp_avg'].dtype \
        == torch.uint8
    for p, q in zip(m8.parameters(), m32.parameters()):
        assert (p.float() - q.float()).norm() < 0.1 * q.float().norm() + 1e-3


def test_fp16_overflow_skip_leaves_8bit_state_bitwise():
    model, w = _fp16('int8', steps=2)
    overflow_step_changes_nothing(model, w)


def test_apex_o2_resume_is_bitwise():
    model, w = _apex('int8', steps=4)
    saved = _roundtrip(w.state_dict())[0]
    model_sd = copy.deepcopy(model.state_dict())
    batches = _cls_batches(7)[4:]

    def _more(model, w):
        for x, y in batches:
            with w.optim_context(model):
                loss = F.cross_entropy(model(x), y)
            w.update_params(loss)

    _more(model, w)
    model2, w2 = _apex('int8', steps=0)
    model2.load_state_dict(model_sd)
    w2.load_state_dict(saved)
    _more(model2, w2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    _assert_states_equal(_states(w.optimizer), _states(w2.optimizer))


def test_runner_config_selects_int8_states(tmp_path):
    from _workflow import make_runner
    runner = make_runner(str(tmp_path), wrapper='O2', dtype='bfloat16', iters=3,
                         optimizer=dict(type='mp_wrappers.FusedAdam', lr=1e-3,
                                        state_dtype='int8', min_8bit_size=0))
    runner.train()
    opt = runner.optim_wrapper.optimizer
    assert isinstance(opt, FusedAdam) and opt.int8_states
    assert all(st['exp_avg'].dtype == torch.uint8 for st in opt.state.values())


# ---- lean bf16 masters with 8-bit states -----------------------------------------------------------
# bf16 params stepped with bf16_storage='split'|'kahan'|'stochastic' (a wrapper's master_weights)
# and 8-bit moments: multi_tensor_adam8bit_lean_, the aux state stepped in the same pass.

LEAN_MODES = ['split', 'kahan', 'stochastic']
AUX_KEY = {'split': 'master_low', 'kahan': 'kahan_comp', 'stochastic': None}


def _lean_mlp(seed=0):
    return _mlp(seed).to(torch.bfloat16)


def _lean_train(model, opt, batches):
    return _train(model, opt, [(x.bfloat16(), y.bfloat16()) for x, y in batches])


@pytest.mark.parametrize('mode', LEAN_MODES)
def test_lean_storage_with_8bit_states_layout_and_resume_is_bitwise(mode):
    batches = _batches(6)
    model = _lean_mlp()
    opt = FusedAdam(model.parameters(), state_dtype='int8', bf16_storage=mode, **ADAMW)
    _lean_train(model, opt, batches[:3])
    st = opt.state[model[0].weight]
    assert st['exp_avg'].dtype == torch.uint8 and st['exp_avg_sq_absmax'].dtype == torch.float32
    if AUX_KEY[mode]:
        assert st[AUX_KEY[mode]].shape == model[0].weight.shape
    assert opt.state[model[0].bias]['exp_avg'].dtype == torch.float32  # under min_8bit_size
    saved = _roundtrip(opt.state_dict())[0]
    model_sd = copy.deepcopy(model.state_dict())
    _lean_train(model, opt, batches[3:])
    resumed = _lean_mlp(seed=5)
    resumed.load_state_dict(model_sd)
    opt2 = FusedAdam(resumed.parameters(), state_dtype='int8', bf16_storage=mode, **ADAMW)
    opt2.load_state_dict(saved)
    _lean_train(resumed, opt2, batches[3:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    _assert_states_equal(_states(opt), _states(opt2))


@pytest.mark.parametrize('mode', LEAN_MODES)
def test_lean_storage_with_8bit_states_skipped_step_changes_nothing(mode):
    """found_inf set: params, aux state, codes, absmax and step of the 8-bit slots and of the
    small params' fp32-moment slots of the same bucket keep their bits."""
    model = _lean_mlp()
    opt = FusedAdam(model.parameters(), state_dtype='int8', bf16_storage=mode, **ADAMW)
    _lean_train(model, opt, _batches(2))
    params = [p.detach().clone() for p in model.parameters()]
    states = _states(opt)
    (x, y), = _batches(1, seed=4)
    F.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
    opt.step(grad_scale=torch.full((1,), 4.0), found_inf=torch.ones(1))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    _assert_states_equal(states, _states(opt))


@pytest.mark.parametrize('mode', ['split', 'kahan'])
def test_lean_storage_converts_between_int8_and_float32_states(mode):
    from mp_wrappers.ops.reference.quant import EXP_AVG_CODE, dequantize_invertibly
    model = _lean_mlp()
    opt8 = FusedAdam(model.parameters(), state_dtype='int8', bf16_storage=mode, **ADAMW)
    _lean_train(model, opt8, _batches(3))
    opt32 = FusedAdam(_lean_mlp().parameters(), bf16_storage=mode, **ADAMW)
    opt32.load_state_dict(_roundtrip(opt8.state_dict())[0])
    w8 = opt8.state[model[0].weight]
    w32 = opt32.state[opt32.param_groups[0]['params'][0]]
    assert torch.equal(w32['exp_avg'],
                       dequantize_invertibly(w8['exp_avg'], w8['exp_avg_absmax'], EXP_AVG_CODE))
    assert torch.equal(w32[AUX_KEY[mode]], w8[AUX_KEY[mode]])  # the aux state travels as it is
    back = FusedAdam(_lean_mlp().parameters(), state_dtype='int8', bf16_storage=mode, **ADAMW)
    back.load_state_dict(_roundtrip(opt32.state_dict())[0])
    _assert_states_equal(_states(opt8), _states(back))
    _lean_train(_lean_mlp(), back, _batches(1))


@pytest.mark.parametrize('mode', LEAN_MODES)
def test_lean_storage_with_8bit_states_trains_close_to_float32_states(mode):
    losses = {}
    for state_dtype in ('int8', 'float32'):
        model = _lean_mlp()
        opt = FusedAdam(model.parameters(), state_dtype=state_dtype, bf16_storage=mode, lr=3e-3)
        losses[state_dtype] = _lean_train(model, opt, _batches(30))
    assert losses['int8'][-1] < 0.7 * losses['int8'][0]
    assert abs(losses['int8'][-1] - losses['float32'][-1]) < 0.05 * losses['float32'][-1]


def test_lean_8bit_params_without_a_kernel_are_refused_before_any_step():
    p = nn.Parameter(torch.zeros(64, 128, device='meta', dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match=r"state_dtype='int8'\) with bf16_storage='kahan' "
                                                  r"\(a wrapper's master_weights='kahan'\) run on "
                                                  r'CPU tensors, and on CUDA tensors with a build '
                                                  r'that has CUDA kernels; got tensors on meta'):
        FusedAdam([p], state_dtype='int8', bf16_storage='kahan')
    opt = FusedAdam([p], state_dtype='int8')  # the wrapper sets the storage later
    # fp32 masters are no way out where the 8-bit op itself has no kernel: not offered
    with pytest.raises(NotImplementedError, match=r"Allowed on meta: state_dtype='float32' or "
                                                  r"'bfloat16' with bf16_storage='split'$"):
        opt.set_bf16_storage('split')
    FusedAdam([p], state_dtype='int8', bf16_storage='kahan', min_8bit_size=10 ** 6)  # fp32 moments


def _apex_lean_steps(model, w, batches):
    for x, y in batches:
        with w.optim_context(model):
            loss = F.cross_entropy(model(x), y)
        w.update_params(loss)


def _apex_lean(mode, state_dtype, steps):
    model = _classifier().to(torch.bfloat16)
    w = ApexOptimWrapper(FusedAdam(model.parameters(), state_dtype=state_dtype, **ADAMW),
                         opt_level='O2', dtype='bfloat16', verbosity=0, master_weights=mode)
    _apex_lean_steps(model, w, _cls_batches(steps))
    return model, w


@pytest.mark.parametrize('mode', LEAN_MODES)
def test_apex_lean_masters_with_8bit_states_resume_is_bitwise(mode):
    model, w = _apex_lean(mode, 'int8', steps=3)
    assert w.optimizer.bf16_storage == mode
    assert w.optimizer.state[model[0].weight]['exp_avg'].dtype == torch.uint8
    saved = _roundtrip(w.state_dict())[0]
    model_sd = copy.deepcopy(model.state_dict())
    more = _cls_batches(6)[3:]
    _apex_lean_steps(model, w, more)
    model2, w2 = _apex_lean(mode, 'int8', steps=0)
    model2.load_state_dict(model_sd)
    w2.load_state_dict(saved)
    _apex_lean_steps(model2, w2, more)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    _assert_states_equal(_states(w.optimizer), _states(w2.optimizer))


@pytest.mark.parametrize('mode', LEAN_MODES)
def test_runner_lean_masters_with_8bit_states_resume_is_bitwise(tmp_path, mode):
    """Through mmengine's Runner: ApexOptimWrapper O2 bf16 master_weights=mode with
    FusedAdam(state_dtype='int8'); a run resumed from its iteration-3 checkpoint ends with the
    uninterrupted run's params and optimizer state, bit for bit."""
    from _workflow import make_runner
    kw = dict(wrapper='O2', dtype='bfloat16', iters=6, extra_wrapper=dict(master_weights=mode),
              optimizer=dict(type='mp_wrappers.FusedAdam', lr=1e-3, state_dtype='int8',
                             min_8bit_size=0))
    full = make_runner(str(tmp_path / 'full'), ckpt_interval=3, **kw)
    full.train()
    opt = full.optim_wrapper.optimizer
    assert opt.bf16_storage == mode
    moments = [st['exp_avg'] for st in opt.state.values() if 'exp_avg' in st]  # unused heads: none
    assert moments and all(m.dtype == torch.uint8 for m in moments)
    ckpt = next((tmp_path / 'full').rglob('iter_3.pth'))
    resumed = make_runner(str(tmp_path / 'resumed'), load_from=str(ckpt), resume=True, **kw)
    resumed.train()
    for p, q in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    _assert_states_equal(_states(opt), _states(resumed.optim_wrapper.optimizer))
