"""FusedSGD(state_dtype='int8'): a block-wise 8-bit momentum buffer (Note [8-bit optimizer states]).
Which params get it, its state and checkpoints (small, converting to and from float32 buffers,
bitwise resume), CUDA params, lean bf16 params (``bf16_storage``: the CPU's lean 8-bit kernel;
refused elsewhere), a build without CUDA kernels, and the wrappers (ApexOptimWrapper O2 and its
lean ``master_weights``, FP16OptimWrapper's overflow skip) and mmengine's Runner (our
tools/train.py and a toolbox's own train script, EMAHook, accumulation, resume, load_from)
training with it."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from _optim_training import assert_states_equal as _assert_states_equal
from _optim_training import batches as _batches
from _optim_training import classifier as _classifier
from _optim_training import cls_batches as _cls_batches
from _optim_training import mlp as _mlp
from _optim_training import overflow_step_changes_nothing
from _optim_training import roundtrip as _roundtrip
from _optim_training import states as _states
from _optim_training import train as _train
from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper, FusedSGD, cast_model
from mp_wrappers.ops.quantized_states import check_quantized_device
from mp_wrappers.ops.reference.quant import EXP_AVG_CODE, dequantize_invertibly

SGD = dict(lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True)


# ---- state layout ----------------------------------------------------------------------------------

def test_large_params_get_an_8bit_buffer_small_ones_float32():
    model = _mlp()
    opt = FusedSGD(model.parameters(), state_dtype='int8', **SGD)
    _train(model, opt, _batches(2))
    w, b = opt.state[model[0].weight], opt.state[model[0].bias]
    assert w['momentum_buffer'].dtype == torch.uint8
    assert w['momentum_buffer'].shape == model[0].weight.shape
    assert w['momentum_buffer_absmax'].shape == (8192 // 256,)
    assert b['momentum_buffer'].dtype == torch.float32 and 'momentum_buffer_absmax' not in b
    assert opt.int8_states


def test_min_8bit_size_group_override_and_no_momentum():
    model = _mlp()
    opt = FusedSGD([dict(params=model[0].parameters(), state_dtype='float32'),
                    dict(params=model[2].parameters())], state_dtype='int8', min_8bit_size=0,
                   **SGD)
    _train(model, opt, _batches(1))
    assert opt.state[model[0].weight]['momentum_buffer'].dtype == torch.float32
    assert opt.state[model[2].bias]['momentum_buffer'].dtype == torch.uint8  # 64 elements
    # momentum=0 keeps no buffer: nothing to quantize, plain SGD steps
    model = _mlp()
    plain = FusedSGD(model.parameters(), lr=0.05, state_dtype='int8')
    _train(model, plain, _batches(1))
    assert all(set(st) <= {'step'} for st in plain.state.values())


def test_trains_close_to_a_float32_buffer_and_to_torch_sgd():
    losses = {}
    for name, make in (('int8', lambda p: FusedSGD(p, state_dtype='int8', **SGD)),
                       ('float32', lambda p: FusedSGD(p, **SGD)),
                       ('torch', lambda p: torch.optim.SGD(p, **SGD))):
        model = _mlp()
        losses[name] = _train(model, make(model.parameters()), _batches(30))
    assert losses['int8'][-1] < 0.85 * losses['int8'][0]  # it learns
    for a, b in zip(losses['int8'], losses['torch']):
        assert abs(a - b) <= 0.02 * b
    torch.testing.assert_close(losses['float32'], losses['torch'], rtol=1e-4, atol=0)


def test_mixed_bucket_steps_each_kind_once():
    """8-bit and float32 buffers in one group step bit for bit as the same params in two groups
    of one kind each (the 8-bit call advances a copy of the shared step counter, and both calls
    see the first update), and the step counter advances once per step."""
    model = _mlp()
    opt = FusedSGD(model.parameters(), state_dtype='int8', **SGD)
    _train(model, opt, _batches(4))
    assert {float(st['step']) for st in opt.state.values()} == {4.0}
    assert {st['momentum_buffer'].dtype for st in opt.state.values()} == {torch.uint8,
                                                                          torch.float32}
    twin = _mlp()
    weights = [twin[0].weight, twin[2].weight]
    biases = [twin[0].bias, twin[2].bias]
    apart = FusedSGD([dict(params=weights), dict(params=biases, state_dtype='float32')],
                     state_dtype='int8', **SGD)
    _train(twin, apart, _batches(4))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(model.parameters(), twin.parameters()):
        a, b = opt.state[p], apart.state[q]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- checkpoints -----------------------------------------------------------------------------------

def test_state_dict_is_small_and_resume_is_bitwise():
    batches = _batches(6)
    model = _mlp()
    opt = FusedSGD(model.parameters(), state_dtype='int8', **SGD)
    _train(model, opt, batches[:3])
    saved, nbytes = _roundtrip(opt.state_dict())
    fp32_model = _mlp()
    fp32 = FusedSGD(fp32_model.parameters(), **SGD)
    _train(fp32_model, fp32, batches[:3])
    assert nbytes < 0.5 * _roundtrip(fp32.state_dict())[1]
    model_sd = copy.deepcopy(model.state_dict())
    _train(model, opt, batches[3:])
    resumed = _mlp(seed=5)
    resumed.load_state_dict(model_sd)
    opt2 = FusedSGD(resumed.parameters(), state_dtype='int8', **SGD)
    opt2.load_state_dict(saved)
    _train(resumed, opt2, batches[3:])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))
    _assert_states_equal(_states(opt), _states(opt2))


def test_checkpoints_convert_between_int8_and_float32_buffers():
    model = _mlp()
    opt8 = FusedSGD(model.parameters(), state_dtype='int8', **SGD)
    _train(model, opt8, _batches(3))
    # int8 -> float32: dequantized invertibly ...
    opt32 = FusedSGD(_mlp().parameters(), **SGD)
    opt32.load_state_dict(_roundtrip(opt8.state_dict())[0])
    w8 = opt8.state[model[0].weight]
    w32 = opt32.state[opt32.param_groups[0]['params'][0]]
    assert w32['momentum_buffer'].dtype == torch.float32 and 'momentum_buffer_absmax' not in w32
    assert torch.equal(w32['momentum_buffer'], dequantize_invertibly(
        w8['momentum_buffer'], w8['momentum_buffer_absmax'], EXP_AVG_CODE))
    # ... and back: the same codes and absmax, bit for bit.
    back = FusedSGD(_mlp().parameters(), state_dtype='int8', **SGD)
    back.load_state_dict(_roundtrip(opt32.state_dict())[0])
    _assert_states_equal(_states(opt8), _states(back))
    # float32 -> int8 from a float32-buffer run: quantized, and training continues.
    model = _mlp()
    fp32 = FusedSGD(model.parameters(), **SGD)
    _train(model, fp32, _batches(3))
    opt = FusedSGD(model.parameters(), state_dtype='int8', **SGD)
    opt.load_state_dict(_roundtrip(fp32.state_dict())[0])
    st = opt.state[model[0].weight]
    assert st['momentum_buffer'].dtype == torch.uint8
    b = fp32.state[model[0].weight]['momentum_buffer']
    got = dequantize_invertibly(st['momentum_buffer'], st['momentum_buffer_absmax'], EXP_AVG_CODE)
    assert (got - b).norm() < 0.05 * b.norm()
    _train(model, opt, _batches(2))


def test_an_8bit_state_without_its_absmax_is_refused_on_load():
    model = _mlp()
    opt = FusedSGD(model.parameters(), state_dtype='int8', **SGD)
    _train(model, opt, _batches(1))
    saved = _roundtrip(opt.state_dict())[0]
    for slot in saved['state'].values():
        slot.pop('momentum_buffer_absmax', None)
    with pytest.raises(ValueError, match=r"FusedSGD.load_state_dict: the 8-bit state of param 0 "
                                         r"of its group lacks 'momentum_buffer_absmax'"):
        FusedSGD(_mlp().parameters(), state_dtype='int8', **SGD).load_state_dict(saved)


# ---- refused combinations --------------------------------------------------------------------------

def test_lean_bf16_params_off_the_cpu_are_refused_before_any_step():
    """The lean 8-bit kernel (multi_tensor_sgd8bit_lean_) runs on the CPU and on CUDA: lean bf16
    params on another device are refused when the optimizer is built, or when the wrapper's
    master_weights sets the storage, naming what runs there instead."""
    p = torch.nn.Parameter(torch.zeros(64, 128, device='meta', dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError,
                       match=r"FusedSGD: 8-bit optimizer states \(state_dtype='int8'\) with "
                             r"bf16_storage='kahan' .* run on CPU tensors, and on CUDA tensors "
                             r"with a build that has CUDA kernels; got tensors on meta and there "
                             r"is no meta kernel. Allowed on meta: "
                             r"state_dtype='float32' or 'bfloat16' with bf16_storage='kahan'$"):
        FusedSGD([p], state_dtype='int8', bf16_storage='kahan', **SGD)
    opt = FusedSGD([p], state_dtype='int8', **SGD)  # the wrapper sets the storage later
    with pytest.raises(NotImplementedError, match="bf16_storage='stochastic'"):
        opt.set_bf16_storage('stochastic')
    assert opt.bf16_storage is None  # refused before anything changed
    # a group refused when added is not added; a generator of params is not consumed by the check
    cpu = torch.nn.Parameter(torch.zeros(64, 128, dtype=torch.bfloat16))
    opt = FusedSGD([cpu], state_dtype='int8', bf16_storage='kahan', **SGD)
    with pytest.raises(NotImplementedError, match='got tensors on meta'):
        opt.add_param_group(dict(params=(q for q in [p])))
    with pytest.raises(NotImplementedError, match='got tensors on meta'):
        opt.add_param_group(dict(params=p))  # one Tensor, as torch allows
    assert len(opt.param_groups) == 1
    opt.add_param_group(dict(params=(q for q in [torch.nn.Parameter(cpu.detach().clone())])))
    assert [len(g['params']) for g in opt.param_groups] == [1, 1]
    # a bf16 buffer with a lean storage stays allowed, and params under min_8bit_size
    FusedSGD([p], state_dtype='bfloat16', bf16_storage='kahan', **SGD)
    FusedSGD([p], state_dtype='int8', bf16_storage='kahan', min_8bit_size=10 ** 6, **SGD)


# ---- lean bf16 params: multi_tensor_sgd8bit_lean_ --------------------------------------------------

LEAN_MODES = ['split', 'kahan', 'stochastic']
AUX_KEY = {'split': 'master_low', 'kahan': 'kahan_comp', 'stochastic': None}


def _lean_mlp(seed=0):
    return _mlp(seed).to(torch.bfloat16)


def _lean_train(model, opt, batches):
    # bf16 inputs, the loss in fp32 (torch 2.1 has no bf16 mse_loss on the CPU)
    return _train(lambda x: model(x).float(), opt, [(x.bfloat16(), y) for x, y in batches])


@pytest.mark.parametrize('mode', LEAN_MODES)
def test_lean_storage_with_an_8bit_buffer_layout_and_resume_is_bitwise(mode):
    """bf16 params stored the ``mode`` way keep an 8-bit buffer (codes + absmax) beside their aux
    state; a resumed optimizer steps on bit for bit, and a skipped step (found_inf) changes no
    param, aux, code, absmax or step."""
    batches = _batches(6)
    model = _lean_mlp()
    opt = FusedSGD(model.parameters(), state_dtype='int8', bf16_storage=mode, **SGD)
    _lean_train(model, opt, batches[:3])
    st = opt.state[model[0].weight]
    assert st['momentum_buffer'].dtype == torch.uint8
    assert st['momentum_buffer_absmax'].dtype == torch.float32
    if AUX_KEY[mode]:
        assert st[AUX_KEY[mode]].shape == model[0].weight.shape
    assert opt.state[model[0].bias]['momentum_buffer'].dtype == torch.float32  # a small param
    saved = _roundtrip(opt.state_dict())[0]
    model_sd = copy.deepcopy(model.state_dict())
    _lean_train(model, opt, batches[3:])
    resumed = _lean_mlp(seed=5)
    resumed.load_state_dict(model_sd)
    opt2 = FusedSGD(resumed.parameters(), state_dtype='int8', bf16_storage=mode, **SGD)
    opt2.load_state_dict(saved)
    _lean_train(resumed, opt2, batches[3:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    _assert_states_equal(_states(opt), _states(opt2))
    params, states = [p.detach().clone() for p in model.parameters()], _states(opt)
    (x, y), = _batches(1, seed=4)
    F.mse_loss(model(x.bfloat16()).float(), y).backward()
    opt.step(grad_scale=torch.full((1,), 4.0), found_inf=torch.ones(1))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    _assert_states_equal(states, _states(opt))


@pytest.mark.parametrize('mode', ['split', 'kahan'])
def test_lean_storage_converts_between_int8_and_float32_buffers(mode):
    model = _lean_mlp()
    opt8 = FusedSGD(model.parameters(), state_dtype='int8', bf16_storage=mode, **SGD)
    _lean_train(model, opt8, _batches(3))
    opt32 = FusedSGD(_lean_mlp().parameters(), bf16_storage=mode, **SGD)
    opt32.load_state_dict(_roundtrip(opt8.state_dict())[0])
    w8 = opt8.state[model[0].weight]
    w32 = opt32.state[opt32.param_groups[0]['params'][0]]
    assert torch.equal(w32['momentum_buffer'],
                       dequantize_invertibly(w8['momentum_buffer'], w8['momentum_buffer_absmax'],
                                             EXP_AVG_CODE).view_as(w32['momentum_buffer']))
    assert torch.equal(w32[AUX_KEY[mode]], w8[AUX_KEY[mode]])  # the aux state travels as it is
    twin = _lean_mlp(seed=5)
    twin.load_state_dict(model.state_dict())
    back = FusedSGD(twin.parameters(), state_dtype='int8', bf16_storage=mode, **SGD)
    back.load_state_dict(_roundtrip(opt32.state_dict())[0])
    _assert_states_equal(_states(opt8), _states(back))
    # ... and steps on as the optimizer it came from, bit for bit
    batch = _batches(1, seed=6)
    _lean_train(model, opt8, batch)
    _lean_train(twin, back, batch)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    _assert_states_equal(_states(opt8), _states(back))


@pytest.mark.parametrize('hyper', [dict(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
                                   dict(lr=0.1, momentum=0.8, dampening=0.25, weight_decay=5e-2,
                                        wd_after_momentum=True)], ids=['nesterov', 'dampened'])
@pytest.mark.parametrize('mode', LEAN_MODES)
def test_lean_step_is_the_reference_op_on_the_8bit_slots(mode, hyper):
    """FusedSGD hands multi_tensor_sgd8bit_lean_ every hyper-parameter, the storage, the seed, the
    aux state and the step of its 8-bit slots: one later step (codes read) of a bucket that also
    holds float32-buffer params (the biases, under min_8bit_size) equals the reference op called
    by hand on copies of the 8-bit slots, bit for bit."""
    from mp_wrappers.ops import reference
    model = _lean_mlp()
    opt = FusedSGD(model.parameters(), state_dtype='int8', bf16_storage=mode, seed=7,
                   min_8bit_size=100, **hyper)
    _lean_train(model, opt, _batches(2))
    (x, y), = _batches(1, seed=3)
    F.mse_loss(model(x.bfloat16()).float(), y).backward()
    eight = [p for p in model.parameters() if opt.state[p]['momentum_buffer'].dtype == torch.uint8]
    assert 0 < len(eight) < len(list(model.parameters()))
    key = AUX_KEY[mode]
    copies = dict(params=[p.detach().clone() for p in eight],
                  aux=[opt.state[p][key].clone() for p in eight] if key else [],
                  codes=[opt.state[p]['momentum_buffer'].clone() for p in eight],
                  absmax=[opt.state[p]['momentum_buffer_absmax'].clone() for p in eight])
    step = opt.state[eight[0]]['step'].clone()
    assert step.item() == 2
    grads = [p.grad.clone() for p in eight]
    opt.step()
    hp = dict(dict(dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False),
              **hyper)
    reference.multi_tensor_sgd8bit_lean_(
        copies['params'], copies['aux'], grads, copies['codes'], copies['absmax'], step,
        hp['lr'], hp['momentum'], hp['dampening'], hp['weight_decay'], hp['nesterov'],
        hp['wd_after_momentum'], mode, 7, None, None)
    for i, p in enumerate(eight):
        st = opt.state[p]
        assert torch.equal(p.detach().view(torch.int16), copies['params'][i].view(torch.int16))
        assert torch.equal(st['momentum_buffer'], copies['codes'][i])
        assert torch.equal(st['momentum_buffer_absmax'], copies['absmax'][i])
        if key:
            assert torch.equal(st[key].view(torch.int16), copies['aux'][i].view(torch.int16))


def test_lean_8bit_buffer_refuses_a_tensor_lr_before_any_launch():
    """The lean kernels take lr as a number: a tensor lr is refused at the step, before any bucket
    launches (nothing changes), and capturable=True with a bf16_storage when it is built."""
    with pytest.raises(ValueError, match="capturable=True.*not supported with bf16_storage='kahan'"):
        FusedSGD(_lean_mlp().parameters(), state_dtype='int8', bf16_storage='kahan',
                 capturable=True, **SGD)
    model = _lean_mlp()
    opt = FusedSGD(model.parameters(), state_dtype='int8', bf16_storage='kahan',
                   min_8bit_size=0, **SGD)
    _lean_train(model, opt, _batches(1))
    opt.param_groups[0]['lr'] = torch.tensor([1e-2])
    (x, y), = _batches(1, seed=2)
    F.mse_loss(model(x.bfloat16()).float(), y).backward()
    params, states = [p.detach().clone() for p in model.parameters()], _states(opt)
    with pytest.raises(ValueError, match="tensor lr .capturable=True. is not supported with "
                                         "bf16_storage='kahan'"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    _assert_states_equal(_states(opt), states)


@pytest.mark.parametrize('mode', LEAN_MODES)
def test_lean_storage_with_an_8bit_buffer_trains_close_to_a_float32_buffer(mode):
    """30 steps: the loss falls as with a float32 buffer and as torch's SGD in fp32 (0.46 ->
    0.37 on this MLP), within 2% of both."""
    losses = {}
    for state_dtype in ('int8', 'float32'):
        model = _lean_mlp()
        opt = FusedSGD(model.parameters(), state_dtype=state_dtype, bf16_storage=mode, **SGD)
        losses[state_dtype] = _lean_train(model, opt, _batches(30))
    model = _mlp()
    torch_fp32 = _train(model, torch.optim.SGD(model.parameters(), **SGD), _batches(30))[-1]
    assert losses['int8'][-1] < 0.85 * losses['int8'][0]
    assert abs(losses['int8'][-1] - losses['float32'][-1]) < 0.02 * losses['float32'][-1]
    assert abs(losses['int8'][-1] - torch_fp32) < 0.02 * torch_fp32


@pytest.mark.parametrize('storage', [None] + LEAN_MODES)
@pytest.mark.parametrize('device', ['cuda'])
def test_cuda_params_step_like_the_cpu(device, storage):
    """The CUDA kernels (a build with CUDA kernels, on a GPU; skipped otherwise): FusedSGD's int8
    steps on CUDA params give the CPU's buffers (codes, absmaxes, the small params' float32
    buffers) and params bit for bit (no float64 pow on either side), on fp32 params and on bf16
    params stored the lean way (multi_tensor_sgd8bit_lean_: the aux state too). The grads are the
    CPU model's."""
    make = _mlp if storage is None else _lean_mlp
    models = [make(), make().to(device)]
    opts = [FusedSGD(m.parameters(), state_dtype='int8', bf16_storage=storage, **SGD)
            for m in models]
    for x, y in _batches(3):
        x = x if storage is None else x.bfloat16()
        F.mse_loss(models[0](x).float(), y).backward()  # the same grads for both (CPU matmuls)
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            b.grad = a.grad.to(device, copy=True)
        for o in opts:
            o.step()
            o.zero_grad()
    assert opts[1].state[models[1][0].weight]['momentum_buffer'].dtype == torch.uint8

    def bits(t):  # bit patterns: torch.equal calls -0.0 and +0.0 equal
        return t.detach().cpu().contiguous().view(torch.uint8)
    cpu, cuda = _states(opts[0]), _states(opts[1])
    assert [k for k, _ in cpu] == [k for k, _ in cuda]
    for (k, a), (_, b) in zip(cpu, cuda):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), k
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(bits(a), bits(b))


def test_params_without_the_8bit_kernel_are_refused_naming_the_fix(monkeypatch):
    from mp_wrappers.ops import quantized_states
    # CUDA params: the build's CUDA kernel runs them (csrc/cuda/multi_tensor_sgd8bit.cu) ...
    monkeypatch.setattr(quantized_states, '_op_has_kernel',
                        lambda name, device_type: name == 'multi_tensor_sgd8bit_')
    check_quantized_device('FusedSGD', torch.device('cuda:0'), op='multi_tensor_sgd8bit_')
    # ... and a build without CUDA kernels refuses them, saying how to get it
    monkeypatch.setattr(quantized_states, '_op_has_kernel',
                        lambda name, device_type: device_type == 'cpu')
    with pytest.raises(NotImplementedError,
                       match=r"FusedSGD: 8-bit optimizer states \(state_dtype='int8'\) run on CPU "
                             r"tensors, and on CUDA tensors with a build that has CUDA kernels; got "
                             r"tensors on cuda:0 and this mp_wrappers build has no CUDA kernels "
                             r"\(rebuild it with MP_WRAPPERS_CUDA=1.*Use state_dtype='float32' on "
                             r"cuda"):
        check_quantized_device('FusedSGD', torch.device('cuda:0'), op='multi_tensor_sgd8bit_')
    monkeypatch.undo()
    # through the optimizer: meta params (no kernel), refused at their first step ...
    param = torch.nn.Parameter(torch.zeros(64, 128, device='meta'))
    param.grad = torch.zeros_like(param)
    opt = FusedSGD([param], state_dtype='int8', **SGD)
    with pytest.raises(NotImplementedError, match=r"FusedSGD: 8-bit optimizer states "
                                                  r"\(state_dtype='int8'\) .* there is no meta "
                                                  r"kernel. Use state_dtype='float32' on meta"):
        opt.step()
    assert not any(opt.state.values())  # no state made: a second step is refused again
    with pytest.raises(NotImplementedError, match='there is no meta kernel'):
        opt.step()
    # ... and when an 8-bit checkpoint is loaded for them, before anything is loaded
    model = _mlp()
    saved = FusedSGD(model.parameters(), state_dtype='int8', **SGD)
    _train(model, saved, _batches(1))
    on_meta = [torch.nn.Parameter(torch.zeros_like(p, device='meta')) for p in model.parameters()]
    opt = FusedSGD(on_meta, state_dtype='int8', **SGD)
    with pytest.raises(NotImplementedError, match='there is no meta kernel'):
        opt.load_state_dict(_roundtrip(saved.state_dict())[0])
    assert not any(opt.state.values())
    with pytest.raises(ValueError, match=r"op='multi_tensor_lamb_' is not an 8-bit update"):
        check_quantized_device('FusedSGD', torch.device('cpu'), op='multi_tensor_lamb_')


# ---- the wrappers ----------------------------------------------------------------------------------

def _apex(state_dtype, steps=12, clip=None, accum=1):
    model = _classifier()
    w = ApexOptimWrapper(FusedSGD(model.parameters(), state_dtype=state_dtype, **SGD),
                         opt_level='O2', dtype='bfloat16', verbosity=0, clip_grad=clip,
                         accumulative_counts=accum)
    for x, y in _cls_batches(steps):
        with w.optim_context(model):
            loss = F.cross_entropy(model(x), y)
        w.update_params(loss)
    return model, w


@pytest.mark.parametrize('clip,accum', [(None, 1), (dict(max_norm=1.0), 2)],
                         ids=['plain', 'clip-accum'])
def test_apex_o2_trains_close_to_a_float32_buffer(clip, accum):
    m8, w8 = _apex('int8', clip=clip, accum=accum)
    m32, _ = _apex('float32', clip=clip, accum=accum)
    first = w8.optimizer.param_groups[0]['params'][0]  # the fp32 master of the first weight
    assert first.dtype == torch.float32
    assert w8.optimizer.state[first]['momentum_buffer'].dtype == torch.uint8
    for p, q in zip(m8.parameters(), m32.parameters()):
        assert (p.float() - q.float()).norm() < 0.05 * q.float().norm() + 1e-3


def test_fp16_overflow_skip_leaves_the_8bit_buffer_bitwise():
    model = cast_model(_classifier(), torch.float16)
    w = FP16OptimWrapper(FusedSGD(model.parameters(), state_dtype='int8', **SGD),
                         dynamic_loss_scale=True)
    for x, y in _cls_batches(2):
        w.update_params(F.cross_entropy(model(x.half()).float(), y))
    before = overflow_step_changes_nothing(model, w)
    assert any(v.dtype == torch.uint8 for _, v in before)


# ---- mmengine's Runner -----------------------------------------------------------------------------

def _runner_kw(states, lr=0.05):
    return dict(wrapper='O2', dtype='bfloat16', iters=6, accumulative_counts=2,
                custom_hooks=[dict(type='EMAHook', momentum=0.1)],
                optimizer=dict(type='mp_wrappers.FusedSGD', lr=lr, momentum=0.9,
                               weight_decay=1e-4, state_dtype=states, min_8bit_size=0))


# the same training with mmengine's OptimWrapper over torch's SGD in fp32 (a float32 buffer)
_PLAIN_FP32 = dict(wrapper='fp32', iters=6, accumulative_counts=2,
                   optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4))


def _assert_8bit_buffers(opt):
    """Every momentum buffer of ``opt`` (min_8bit_size=0) is 8-bit: uint8 codes laid out like its
    param and a float32 absmax per block of 256."""
    assert isinstance(opt, FusedSGD) and opt.int8_states
    made = [(p, st) for p, st in opt.state.items() if 'momentum_buffer' in st]
    assert made
    for p, st in made:
        assert st['momentum_buffer'].dtype == torch.uint8
        assert st['momentum_buffer'].shape == p.shape
        absmax = st['momentum_buffer_absmax']
        assert absmax.dtype == torch.float32 and absmax.numel() == -(-p.numel() // 256)


def _resumed_bitwise(tmp_path, kw):
    """Train ``kw``'s run (checkpoints every 4 iterations) with 8-bit buffers; check that the run
    resumed from its iteration-4 checkpoint ends with its params and optimizer state, bit for bit.
    Returns the uninterrupted runner."""
    from _workflow import make_runner, train
    full = train(make_runner(str(tmp_path / 'full'), ckpt_interval=4, **kw))
    opt = full.optim_wrapper.optimizer
    _assert_8bit_buffers(opt)
    ckpt = next((tmp_path / 'full').rglob('iter_4.pth'))
    resumed = train(make_runner(str(tmp_path / 'resumed'), load_from=str(ckpt), resume=True, **kw))
    for p, q in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    _assert_states_equal(_states(opt), _states(resumed.optim_wrapper.optimizer))
    return full


def test_runner_trains_and_resumes_bitwise(tmp_path, launcher):
    """A config line selects it: ApexOptimWrapper O2 bf16 over FusedSGD(state_dtype='int8') with
    accumulation and EMAHook, under our tools/train.py and a toolbox's own train script. A run
    resumed from its iteration-4 checkpoint ends with the uninterrupted run's params and buffer,
    bit for bit; the run stays close to the same run with a float32 buffer and to mmengine's
    OptimWrapper over torch's SGD in fp32."""
    from _workflow import latest_checkpoint, losses, make_runner, train
    full = _resumed_bitwise(tmp_path, _runner_kw('int8'))
    fp32_buffer = train(make_runner(str(tmp_path / 'fp32buf'), **_runner_kw('float32')))
    plain = train(make_runner(str(tmp_path / 'plain'), **_PLAIN_FP32))
    ours, ref, torch_fp32 = losses(full), losses(fp32_buffer), losses(plain)
    assert len(ours) == len(ref) == len(torch_fp32) == 6
    for a, b, c in zip(ours, ref, torch_fp32):
        assert abs(a - b) <= 0.02 * b and abs(a - c) <= 0.05 * c
    assert latest_checkpoint(str(tmp_path / 'full'))


@pytest.mark.parametrize('source', ['int8', 'float32', 'fp32'],
                         ids=['O2-int8', 'O2-float32', 'OptimWrapper-fp32'])
def test_finetune_with_load_from_starts_at_the_pretrained_weights(tmp_path, launcher, source):
    """``load_from`` without ``resume`` (a fine-tune) into ApexOptimWrapper O2 bf16 over
    FusedSGD(state_dtype='int8'), under our tools/train.py and a toolbox's own train script, of a
    checkpoint saved by a run of the test above with an 8-bit or a float32 buffer (EMAHook: its
    weights are the average of the fp32 masters) or by mmengine's OptimWrapper over torch's SGD in
    fp32. At lr=0 the run ends with the checkpoint's weights bit for bit: its fp32 masters are the
    checkpoint's fp32 values (not their bf16 rounding), its bf16 weights their rounding; its
    buffers are new (one step counted, none of the saved run's). At lr=0.05 it trains: finite
    losses within 2% of the same fine-tune with a float32 buffer, its momentum buffers 8-bit."""
    from _workflow import latest_checkpoint, load, losses, make_runner, masters_by_name, train
    source_kw = _PLAIN_FP32 if source == 'fp32' else _runner_kw(source)
    train(make_runner(str(tmp_path / 'pretrained'), ckpt_interval=6, **source_kw))
    pretrained = latest_checkpoint(tmp_path / 'pretrained')
    saved = load(pretrained)['state_dict']
    assert any(not torch.equal(v, v.bfloat16().float()) for v in saved.values())

    def finetune(name, states, lr=0.05, iters=6):
        return train(make_runner(str(tmp_path / name), load_from=pretrained, resume=False,
                                 **dict(_runner_kw(states, lr), iters=iters)))
    still = finetune('lr0', 'int8', lr=0.0, iters=2)
    masters = masters_by_name(still)
    half = [n for n, p in still.model.named_parameters() if p.dtype == torch.bfloat16]
    assert half and sorted(masters) == sorted(half)
    for name, p in still.model.named_parameters():
        assert torch.equal(p.detach(), saved[name].to(p.dtype)), name
        if name in masters:
            assert torch.equal(masters[name], saved[name]), name
    assert {float(st['step']) for st in still.optim_wrapper.optimizer.state.values()} == {1.0}
    ours, ref = finetune('int8', 'int8'), finetune('fp32buf', 'float32')
    _assert_8bit_buffers(ours.optim_wrapper.optimizer)
    ours, ref = losses(ours), losses(ref)
    assert len(ours) == len(ref) == 6 and all(math.isfinite(a) for a in ours)
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 0.02 * b


@pytest.mark.parametrize('mode', LEAN_MODES)
def test_runner_lean_masters_with_an_8bit_buffer_resume_is_bitwise(tmp_path, launcher, mode):
    """One more config line: ApexOptimWrapper O2 bf16 with ``master_weights=mode`` over
    FusedSGD(state_dtype='int8'), accumulation and EMAHook, under our tools/train.py and a
    toolbox's own train script. The bf16 params keep their lean aux state and an 8-bit buffer;
    a run resumed from its iteration-4 checkpoint ends with the uninterrupted run's params and
    optimizer state, bit for bit, and stays close to the same run with a float32 buffer."""
    from _workflow import losses, make_runner, train
    lean = dict(extra_wrapper=dict(master_weights=mode))
    full = _resumed_bitwise(tmp_path, dict(_runner_kw('int8'), **lean))
    assert full.optim_wrapper.optimizer.bf16_storage == mode
    fp32_buffer = train(make_runner(str(tmp_path / 'fp32buf'), **_runner_kw('float32'), **lean))
    for a, b in zip(losses(full), losses(fp32_buffer)):
        assert abs(a - b) <= 0.02 * b
