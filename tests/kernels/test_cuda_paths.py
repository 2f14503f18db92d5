"""CUDA paths that only a GPU exercises (docs/cuda.md, "Paths unexercised until a GPU run").

Every case is parametrised with ``device='cuda'``, so tests/conftest.py skips it without a GPU or
without our CUDA kernels (failing instead under MP_WRAPPERS_TEST_REQUIRE_CUDA=1, which
tools/gpu_check.sh sets) and fails it if a reference stands in for a kernel. The CPU kernels and the
references are the oracles; the launch geometry (65536-element chunks, 320 blocks per launch) is
that of mp_wrappers/csrc/include/mp_wrappers/cuda/*.cuh.
"""
import itertools

import pytest
import torch

from mmengine.logging import MessageHub

from _tolerances import TOL
from mp_wrappers import (ApexOptimWrapper, FP16OptimWrapper, FusedAdagrad, FusedAdam, FusedLAMB,
                         FusedNovoGrad, FusedSGD, cast_model, ops)
from mp_wrappers.ops import reference

CHUNK = 65536
BLOCKS_PER_LAUNCH = 320
CUDA = [pytest.param('cuda', marks=pytest.mark.cuda)]
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adam_w_mode=True,
            bias_correction=True)


def _randn(n, dtype, device, seed=0, scale=10.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype=dtype, device=device)


def _scale_both(inputs, scale):
    """(kernel outputs, reference outputs, kernel flag, reference flag) of multi_tensor_scale."""
    outs = [torch.empty_like(t, dtype=torch.float32) for t in inputs]
    refs = [torch.empty_like(t, dtype=torch.float32) for t in inputs]
    flag, ref_flag = ops.new_found_inf(inputs[0].device), ops.new_found_inf(inputs[0].device)
    s = torch.tensor([scale], device=inputs[0].device)
    ops.multi_tensor_scale(inputs, outs, s, flag)
    reference.multi_tensor_scale_(inputs, refs, s, ref_flag)
    return outs, refs, flag, ref_flag


def _norm_oracle(tensors):
    return torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tensors])).item()


def _adam_both(params, grads, device):
    """Run one Adam step with the CUDA kernel and the same step on CPU copies with the CPU kernel."""
    n = len(params)
    cpu = [[t.cpu().clone() for t in ts] for ts in (params, grads)]
    m = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    v = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    mc, vc = [t.cpu().clone() for t in m], [t.cpu().clone() for t in v]
    step, step_c = torch.zeros(1, device=device), torch.zeros(1)
    ops.multi_tensor_adam(params, grads, m, v, [], step, **ADAM)
    ops.multi_tensor_adam(cpu[0], cpu[1], mc, vc, [], step_c, **ADAM)
    for i in range(n):
        tol = TOL[params[i].dtype]
        torch.testing.assert_close(params[i].cpu(), cpu[0][i], **tol)
        torch.testing.assert_close(m[i].cpu(), mc[i], **TOL[torch.float32])
        torch.testing.assert_close(v[i].cpu(), vc[i], **TOL[torch.float32])


@pytest.mark.parametrize('device', CUDA)
def test_tensor_split_across_launches(device):
    # 400 chunks: one tensor needs two launches (320 blocks each), with an odd tail.
    n = 400 * CHUNK + 3
    x = _randn(n, torch.float32, device)
    outs, refs, flag, _ = _scale_both([x], 0.5)
    assert torch.equal(outs[0], refs[0]) and flag.item() == 0
    total, _ = ops.multi_tensor_l2norm([x])
    assert total.item() == pytest.approx(_norm_oracle([x]), rel=1e-6)
    _adam_both([x.clone()], [_randn(n, torch.float32, device, seed=1)], device)


@pytest.mark.parametrize('device', CUDA)
def test_more_than_one_launch_per_list(device):
    # 1000 tensors: more than any launch's tensor slots, sizes crossing chunk boundaries.
    g = torch.Generator().manual_seed(3)
    sizes = [int(s) for s in torch.randint(1, 3 * CHUNK // 2, (1000,), generator=g)]
    xs = [_randn(s, torch.float32, device, seed=i) for i, s in enumerate(sizes)]
    outs, refs, flag, _ = _scale_both(xs, 2.0 ** -3)
    assert all(torch.equal(a, b) for a, b in zip(outs, refs)) and flag.item() == 0
    total, per = ops.multi_tensor_l2norm(xs, per_tensor=True)
    assert total.item() == pytest.approx(_norm_oracle(xs), rel=1e-6)
    want = torch.tensor([torch.linalg.vector_norm(t.double()).item() for t in xs],
                        dtype=torch.float64)
    torch.testing.assert_close(per.cpu().double(), want, rtol=1e-6, atol=0)
    xs[-1].view(-1)[-1] = float('nan')  # the last element of the last tensor of the last launch
    _, _, flag, _ = _scale_both(xs, 1.0)
    assert flag.item() == 1
    xs[-1].view(-1)[-1] = 0.0
    _adam_both([x.clone() for x in xs], [_randn(x.numel(), torch.float32, device, seed=7)
                                         for x in xs], device)


@pytest.mark.parametrize('device', CUDA)
def test_more_than_2_pow_31_elements(device):
    free, _ = torch.cuda.mem_get_info()
    n = 2 ** 31 + 17
    if free < 3 * 2 * n:
        pytest.skip(f'needs ~{3 * 2 * n / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} free')
    x = torch.ones(n, dtype=torch.bfloat16, device=device)
    x[-1] = 3.0
    flag = ops.new_found_inf(device)
    ops.multi_tensor_scale([x], [x], 0.5, flag)  # in place: 64-bit indexing past 2**31
    assert flag.item() == 0
    assert x[-1].item() == 1.5 and x[0].item() == 0.5 and x[2 ** 31 + 3].item() == 0.5
    total, _ = ops.multi_tensor_l2norm([x])
    assert total.item() == pytest.approx(((n - 1) * 0.25 + 2.25) ** 0.5, rel=1e-6)
    x[-1] = float('inf')
    ops.multi_tensor_scale([x], [x], 1.0, flag)
    assert flag.item() == 1


@pytest.mark.parametrize('device', CUDA)
@pytest.mark.parametrize('offset', [1, 2, 3])
@pytest.mark.parametrize('dtype', FLOATS)
def test_misaligned_storage_offsets(device, offset, dtype):
    # Views starting 1-3 elements into their storage: not 16-byte aligned, so the guarded path.
    n = CHUNK + 77
    base_in = _randn(n + 4, dtype, device)
    x = base_in[offset:offset + n]
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    base_out = torch.zeros(n + 4, device=device)
    out = base_out[offset:offset + n]
    ref = torch.empty(n, device=device)
    flag = ops.new_found_inf(device)
    ops.multi_tensor_scale([x], [out], 0.25, flag)
    reference.multi_tensor_scale_([x], [ref], torch.tensor([0.25], device=device), flag)
    assert torch.equal(out, ref)
    assert base_out[:offset].eq(0).all() and base_out[offset + n:].eq(0).all()  # no stray writes
    total, _ = ops.multi_tensor_l2norm([x])
    assert total.item() == pytest.approx(_norm_oracle([x]), rel=1e-6)
    p = _randn(n + 4, torch.float32, device, seed=5)[offset:offset + n]
    _adam_both([p], [x], device)  # misaligned params and grads (half grads: the O2 case)


@pytest.mark.parametrize('device', CUDA)
def test_optimizer_ops_without_grad_scale_or_found_inf(device):
    n = 3 * CHUNK + 5
    p, g = _randn(n, torch.float32, device), _randn(n, torch.float32, device, seed=1)
    _adam_both([p], [g], device)  # grad_scale and found_inf are None there
    buf, buf_c = torch.zeros(n, device=device), torch.zeros(n)
    pc, gc = p.cpu(), g.cpu()
    sgd = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=True,
               wd_after_momentum=False)
    for _ in range(2):
        ops.multi_tensor_sgd([p], [g], [buf], [], torch.zeros(1, device=device), **sgd)
        ops.multi_tensor_sgd([pc], [gc], [buf_c], [], torch.zeros(1), **sgd)
    torch.testing.assert_close(p.cpu(), pc, **TOL[torch.float32])


@pytest.mark.parametrize('device', CUDA)
def test_every_adam_dtype_instantiation_agrees_with_the_cpu_kernel(device):
    # Whatever combination the CPU kernel accepts, the CUDA kernel must accept and match; whatever
    # it refuses, the CUDA entry point must refuse too.
    n = CHUNK + 9
    for pd, gd, md in itertools.product(FLOATS, FLOATS, (None,) + FLOATS):
        def make(dev):
            p = _randn(n, pd, dev, scale=1.0)
            g = _randn(n, gd, dev, seed=1, scale=1.0)
            m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
            model = [p.to(md, copy=True)] if md is not None else []
            return p, g, m, v, model
        results = []
        for dev in ('cpu', device):
            p, g, m, v, model = make(dev)
            try:
                ops.multi_tensor_adam([p], [g], [m], [v], model, torch.zeros(1, device=dev),
                                      grad_scale=torch.full((1,), 4.0, device=dev),
                                      found_inf=ops.new_found_inf(dev), **ADAM)
                results.append((p.cpu(), m.cpu(), v.cpu(), [t.cpu() for t in model]))
            except (TypeError, ValueError, RuntimeError) as exc:
                results.append(type(exc))
        cpu, gpu = results
        what = f'param {pd}, grad {gd}, model {md}'
        assert isinstance(cpu, type) == isinstance(gpu, type), (what, cpu, gpu)
        if isinstance(cpu, type):
            continue
        for a, b in zip(cpu[:3], gpu[:3]):
            torch.testing.assert_close(b, a, **TOL[a.dtype], msg=what)
        for a, b in zip(cpu[3], gpu[3]):
            torch.testing.assert_close(b, a, **TOL[a.dtype], msg=what)


@pytest.mark.parametrize('device', CUDA)
def test_non_default_device_and_stream(device):
    x = _randn(2 * CHUNK + 1, torch.float32, device)
    want = (x.cpu() * 0.5)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = torch.empty_like(x)
        flag = ops.new_found_inf(device)
        ops.multi_tensor_scale([x], [out], 0.5, flag)
        total, _ = ops.multi_tensor_l2norm([x])
    s.synchronize()  # only the side stream: the kernels must have been enqueued on it
    assert torch.equal(out.cpu(), want) and flag.item() == 0
    assert total.item() == pytest.approx(_norm_oracle([x]), rel=1e-6)
    if torch.cuda.device_count() < 2:
        pytest.skip('one GPU: the non-default device half needs two')
    y = x.to('cuda:1')
    out1, flag1 = torch.empty_like(y), ops.new_found_inf('cuda:1')
    ops.multi_tensor_scale([y], [out1], 0.5, flag1)  # the current device is still cuda:0
    assert out1.device.index == 1 and torch.equal(out1.cpu(), want) and flag1.item() == 0


@pytest.mark.parametrize('device', CUDA)
def test_graph_capture_and_replay(device):
    # The scale and the flag live on the device: a captured launch must read them at replay time.
    xs = [_randn(n, torch.float16, device) for n in (CHUNK + 1, 777)]
    outs = [torch.empty_like(t, dtype=torch.float32) for t in xs]
    s, flag = torch.tensor([0.5], device=device), ops.new_found_inf(device)
    torch.ops.mp_wrappers.multi_tensor_scale_(xs, outs, s, flag)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.mp_wrappers.multi_tensor_scale_(xs, outs, s, flag)
    for scale in (0.25, 3.0):
        s.fill_(scale)
        for x in xs:
            x.mul_(2)
        graph.replay()
        torch.cuda.synchronize()
        for x, o in zip(xs, outs):
            assert torch.equal(o, x.float() * scale)
    assert flag.item() == 0


@pytest.mark.parametrize('device', CUDA)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_wrapper_fused_master_step_on_cuda(device, dtype):
    def run(fused):
        torch.manual_seed(0)
        model = cast_model(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                               torch.nn.Linear(256, 10)).to(device), dtype)
        w = FP16OptimWrapper(FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                             dynamic_loss_scale=True, clip_grad=dict(max_norm=1.0))
        if not fused:
            w._fusable = lambda: False
        g = torch.Generator().manual_seed(1)
        for it in range(6):
            x = torch.randn(32, 64, generator=g).to(device, dtype)
            y = torch.randint(0, 10, (32,), generator=g).to(device)
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            if it == 3:
                loss = loss * float('inf')  # one overflow: skipped on the device
            w.update_params(loss)
        return model, w
    m1, w1 = run(True)
    m2, w2 = run(False)
    assert not any(t.numel() > 64 for t in w1._stash._buffers.values())  # the fused path ran
    assert w1.loss_scale == w2.loss_scale == 2.0 ** 15
    for a, b in zip(w1.master_params(), w2.master_params()):
        # One rounding apart at most: the clip coefficient is folded into grad_scale when fused.
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('device', CUDA)
@pytest.mark.parametrize('index', [0, 1], ids=['cuda0', 'cuda1_while_cuda0_current'])
@pytest.mark.parametrize('clip', [False, True], ids=['no_clip', 'clip'])
def test_fused_o2_step_with_dynamic_scaling_makes_no_host_sync(device, clip, index):
    """Issue 13, deliverable 3: torch.cuda.set_sync_debug_mode('error') around full fused O2
    steps (backward, unscale + norm, fused update, scaler update), overflowing and clean, as
    mmengine's loop runs them (MessageHub iter set, no publication due). The CPU twin is
    tests/base/test_step_outcomes.py (Note [deferred outcomes])."""
    if index >= torch.cuda.device_count():
        pytest.skip(f'needs {index + 1} GPUs')
    device = f'cuda:{index}'  # the outcome copies and events must follow the model's device
    hub = MessageHub.get_instance(f'test_sync_free_{clip}_{index}')
    MessageHub._instance_dict.pop(hub.instance_name)
    MessageHub._instance_dict[hub.instance_name] = hub  # the current instance
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(device)
    wrapper = ApexOptimWrapper(optimizer=FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                               opt_level='O2', dtype='float16', loss_scale='dynamic', verbosity=0,
                               clip_grad=dict(max_norm=1.0) if clip else None)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 64, generator=g).to(device),
                torch.randint(0, 10, (32,), generator=g).to(device)) for _ in range(10)]
    inf = torch.tensor(float('inf'), device=device)
    guarded = 0
    for it, (x, y) in enumerate(batches):
        hub.update_info('iter', it)
        wrapper.publish_now = False
        with wrapper.optim_context(model):
            loss = torch.nn.functional.cross_entropy(model(x.half()).float(), y)
        if it in (4, 7):
            loss = loss * inf  # an overflowing step
        if it >= 2:  # the first steps build the masters and the optimizer state
            torch.cuda.set_sync_debug_mode('error')
            guarded += 1
        try:
            wrapper.update_params(loss)
        finally:
            torch.cuda.set_sync_debug_mode('default')
    assert guarded == 8
    assert not wrapper.last_step_skipped  # waits for the outcomes: a sync outside the guard
    assert wrapper.loss_scalers[0].skipped_steps >= 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


CAPTURABLE = {
    'FusedAdam': lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, capturable=True),
    # 8-bit moments for the params of at least 4096 elements, float32 for the others: one bucket
    # stepping both (its step counter cloned for the 8-bit call) inside the graph.
    'FusedAdam int8': lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, capturable=True,
                                           state_dtype='int8'),
    'FusedSGD': lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, capturable=True),
    'FusedLAMB': lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01, capturable=True),
    'FusedAdagrad': lambda ps: FusedAdagrad(ps, lr=1e-2, capturable=True),
    'FusedNovoGrad': lambda ps: FusedNovoGrad(ps, lr=1e-2, capturable=True),
}


@pytest.mark.parametrize('device', CUDA)
@pytest.mark.parametrize('opt_name', sorted(CAPTURABLE))
def test_capturable_step_replays_a_changing_lr_schedule(device, opt_name):
    """Issue 13, deliverable 3: step() captured in a CUDA graph (capturable=True, Note
    [capturable]) and replayed with new gradients and an lr written into the group's tensor at
    every replay gives exactly the eager steps' parameters and state."""
    g = torch.Generator().manual_seed(2)
    shapes = [(256, 64), (256,), (10, 256), (10,), (CHUNK + 3,)]
    grads = [[torch.randn(s, generator=g).to(device) for s in shapes] for _ in range(6)]
    lrs = [1.0, 0.5, 0.25, 2.0, 0.125, 1.0]

    def build():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
        return params, CAPTURABLE[opt_name](params)

    def set_lr(opt, factor, base):
        lr = opt.param_groups[0]['lr']
        if isinstance(lr, torch.Tensor):
            lr.fill_(base * factor)
        else:
            opt.param_groups[0]['lr'] = base * factor

    eager, opt_e = build()
    base = opt_e.defaults['lr']
    for step_grads, factor in zip(grads, lrs):
        set_lr(opt_e, factor, base)
        for p, gr in zip(eager, step_grads):
            p.grad = gr.clone()
        opt_e.step()

    captured, opt_c = build()
    static = [gr.clone() for gr in grads[0]]
    for p, gr in zip(captured, static):
        p.grad = gr
    set_lr(opt_c, lrs[0], base)
    opt_c.step()  # eager first step: creates the state and turns lr into a device tensor
    assert isinstance(opt_c.param_groups[0]['lr'], torch.Tensor)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_c.step()
    for step_grads, factor in zip(grads[1:], lrs[1:]):
        for buf, gr in zip(static, step_grads):
            buf.copy_(gr)
        set_lr(opt_c, factor, base)
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)
    for pa, pb in zip(eager, captured):
        for key, value in opt_e.state[pa].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, opt_c.state[pb][key]), key


@pytest.mark.parametrize('device', CUDA)
def test_float_lr_under_capture_is_refused(device):
    params = [torch.nn.Parameter(torch.randn(1000, device=device))]
    opt = FusedAdam(params, lr=1e-3)
    params[0].grad = torch.randn(1000, device=device)
    opt.step()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match='captured in a CUDA graph with a float lr'):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            opt.step()
