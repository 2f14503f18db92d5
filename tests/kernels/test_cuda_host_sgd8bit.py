"""The 8-bit SGD CUDA kernel (cuda/multi_tensor_sgd8bit.cu) executed on the CPU (host-execution
build; see tests/kernels/test_cuda_host.py for how the module is built and run).

The pattern of the 8-bit Adam kernel's host tests (test_cuda_host_adam8bit.py): the real entry
point of multi_tensor_sgd8bit_ (checks, the launch planner with chunks of whole quantization
blocks, dtype dispatch, launches with real warp shuffles) in both geometries, on lists with several
tensors, sizes that are not multiples of the 256-element block, tensors over several chunks and
(tiny geometry) several launches, aligned and misaligned storage, every param x grad x model-copy
dtype, L2 decay, Nesterov, dampening with wd_after_momentum. Compared bit for bit with the CPU
kernel and with ops/reference/quant.py from the first applied update (step 0: the buffer set to the
direction, its codes not read: the first update is told on the device) through later ones. A
found_inf step must change no bit and write no byte; every written tensor lies between guard
canaries.
"""
import collections

import pytest
import torch

from _guards import guarded
from mp_wrappers.ops import reference
from mp_wrappers.ops.reference.quant import EXP_AVG_CODE, quantize_blockwise
from test_cuda_host import host, representative  # noqa: F401 (host is a fixture)
from test_cuda_host_adam8bit import resident  # noqa: F401 (a fixture)
from test_cuda_host_adam8bit import _assert_equal, sizes_of, steps_then_skip
from test_cuda_host_planner import blocks_per_launch, planned_launches
from test_quantized_sgd import DAMPENED, HYPERS, MOMENTUM, Case, EdgeCase

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.mp_wrappers, 'multi_tensor_sgd8bit_'),
                                reason='the C++ extension mp_wrappers._C is not built')

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (param dtype, grad dtype, model-copy dtype or None, grad_scale or None)
SETUPS = {
    'fp32': (F32, F32, None, None),
    'o2-bf16': (F32, BF16, BF16, 1.0),
    'o2-fp16-scaled': (F32, F16, F16, 1024.0),
    'fp32-odd-scale': (F32, F32, F32, 3.0),  # a real divide by the scale; an fp32 model copy
    'bf16-params': (BF16, BF16, None, None),
    'fp16-params': (F16, F32, BF16, 2048.0),  # half params with a model copy (one block per SM)
}
# Kernel launches that are not the update (the step counter).
_UPDATE = 'sgd8bit'


class State(Case):
    """One call's tensors (tests/ops/test_quantized_sgd.py Case: params, grads, the buffer's codes
    and absmax, the step counter) between guard canaries, `shift` elements off alignment. `step`
    0: the first applied update comes next (codes and absmax zero, as FusedSGD makes them); else
    a buffer quantized from random values."""

    def __init__(self, setup, sizes, seed=0, shift=0, step=0.0):
        pdt, self.gdt, mdt, scale = SETUPS[setup]
        g = torch.Generator().manual_seed(seed)
        self.gen, self.sizes = g, sizes
        self.scale = None if scale is None else guarded(torch.full((1,), scale))
        self.params = [guarded(torch.randn(n, generator=g).to(pdt), shift) for n in sizes]
        self.model = [guarded(p.to(mdt), shift) for p in self.params] if mdt else []
        self.codes, self.absmax = [], []
        for n in sizes:
            b = torch.randn(n, generator=g) * 0.1 * torch.exp(torch.randn(n, generator=g))
            c, a = quantize_blockwise(b * (step != 0.0), EXP_AVG_CODE)
            self.codes.append(guarded(c, shift))
            self.absmax.append(guarded(a))
        self.step = guarded(torch.full((1,), step))

    def grads(self, shift=0):
        s = 1.0 if self.scale is None else float(self.scale)
        return [guarded((torch.randn(n, generator=self.gen) * s).to(self.gdt), shift)
                for n in self.sizes]


def _update_launches(host):
    return [r for r in host.launches() if r[0] == _UPDATE]


def _step_and_compare(host, st, hp, steps, what, found_inf=None):
    """`steps` steps of the host kernel, each against the CPU kernel and the reference from the
    same state, bit for bit."""
    for i in range(steps):
        grads = st.grads()
        cpu, ref = st.clone(), st.clone()
        st.run(host.ops.multi_tensor_sgd8bit_, grads, hp, found_inf)
        cpu.run(torch.ops.mp_wrappers.multi_tensor_sgd8bit_, grads, hp, found_inf)
        ref.run(reference.multi_tensor_sgd8bit_, grads, hp, found_inf)
        _assert_equal(st.tensors(), cpu.tensors(), f'{what} step {i + 1} (CPU kernel)')
        _assert_equal(st.tensors(), ref.tensors(), f'{what} step {i + 1} (reference)')


@pytest.mark.parametrize('shift', [0, 1])
@pytest.mark.parametrize('hp', list(HYPERS))
@pytest.mark.parametrize('setup', list(SETUPS))
def test_sgd8bit_matches_cpu_kernel_and_reference(host, setup, hp, shift):
    """Three steps from the first applied update, bit for bit against the CPU kernel and the
    reference (shift 1: misaligned storage, the guarded path); then a found_inf step that changes
    no bit and stores no byte."""
    representative(host, setup == 'o2-bf16' and hp == 'momentum' and shift == 0)
    st = State(setup, sizes_of(host), seed=51, shift=shift)
    steps_then_skip(host, st, host.ops.multi_tensor_sgd8bit_, HYPERS[hp],
                    f'{setup} {hp} shift {shift}', _step_and_compare, _UPDATE)
    assert st.step.item() == 3.0
    assert all(a.abs().max() > 0 for a in st.absmax if a.numel())


@pytest.mark.parametrize('hp', list(HYPERS))
@pytest.mark.parametrize('setup', ['fp32', 'o2-bf16', 'fp32-odd-scale', 'fp16-params'])
def test_sgd8bit_edge_blocks(host, setup, hp):
    """Blocks down every path of the codes (tests/ops/test_quantized_sgd.py EdgeCase: subnormal
    codes, normal codes only, zero and negative-zero blocks, a subnormal absmax whose encode factor
    overflows, a short tail), past the first update, bit for bit against the CPU kernel and the
    reference."""
    representative(host, setup == 'fp32' and hp == 'momentum')
    e = EdgeCase('fp32')
    st = State(setup, e.sizes, seed=52, step=3.0)
    st.codes, st.absmax = e.codes, e.absmax
    grads = st.grads

    def edge_grads():
        (g,) = grads()
        (edge,) = EdgeCase.grads(e)
        B = 256
        g[2 * B:4 * B] = edge[2 * B:4 * B].to(g.dtype)  # zero and negative-zero grads
        return [g]
    st.grads = edge_grads
    _step_and_compare(host, st, HYPERS[hp], 3, f'edge {setup} {hp}')


def test_sgd8bit_first_update_ignores_the_codes(host):
    """On the first applied update (step 0) the buffer is the direction whatever the codes and
    absmax hold (a checkpoint's leftovers, a torch.empty state): the kernel must not use them (it
    reads no code; the absmax it reads is not used). The same call from step 1 uses them (the flag
    is the device's step, not a constant)."""
    st = State('o2-bf16', sizes_of(host)[:5], seed=53)
    for c, a in zip(st.codes, st.absmax):
        c.fill_(0x7F)
        a.fill_(1e3)
    ref = st.clone()
    grads = st.grads()
    st.run(host.ops.multi_tensor_sgd8bit_, grads, MOMENTUM)
    ref.run(reference.multi_tensor_sgd8bit_, grads, MOMENTUM)
    _assert_equal(st.tensors(), ref.tensors(), 'first update over stale codes')
    zero = State('o2-bf16', sizes_of(host)[:5], seed=53)
    zero.run(reference.multi_tensor_sgd8bit_, grads, MOMENTUM)
    _assert_equal(st.tensors(), zero.tensors(), 'first update: the codes are not read')
    # From step 1 the (stale) codes count.
    later, later_ref = st.clone(), st.clone()
    for c, a in zip(later.codes, later.absmax):
        c.fill_(0x7F)
        a.fill_(1e3)
    for c, a in zip(later_ref.codes, later_ref.absmax):
        c.fill_(0x7F)
        a.fill_(1e3)
    grads = st.grads()
    later.run(host.ops.multi_tensor_sgd8bit_, grads, MOMENTUM)
    later_ref.run(reference.multi_tensor_sgd8bit_, grads, MOMENTUM)
    _assert_equal(later.tensors(), later_ref.tensors(), 'second update')
    st.run(reference.multi_tensor_sgd8bit_, grads, MOMENTUM)
    assert not torch.equal(later.params[0], st.params[0])


@pytest.mark.parametrize('scale', [2.0 ** -127, 2.0 ** -130])
def test_sgd8bit_unscale_by_a_scale_whose_reciprocal_overflows(host, scale):
    """A power-of-two grad_scale whose reciprocal overflows (below 2**-127): make_unscale divides,
    as the reference does, instead of multiplying finite grads by inf (optim_apply.cuh, shared by
    every optimizer kernel); 2**-127's reciprocal is finite and multiplies."""
    st = State('fp32-odd-scale', sizes_of(host)[:5], seed=66, step=1.0)
    st.scale = guarded(torch.full((1,), scale))
    _step_and_compare(host, st, MOMENTUM, 2, f'scale {scale}')
    assert all(torch.isfinite(p).all() for p in st.params)


@pytest.mark.parametrize('misaligned', ['params', 'grads', 'momentum_buffers', 'model'])
def test_sgd8bit_one_misaligned_list(host, misaligned):
    """Only one list misaligned: its storage alone must send the chunk down the guarded path (a
    vector access there is a misaligned-address fault, which host execution reports)."""
    representative(host, misaligned == 'momentum_buffers')
    st = State('o2-bf16', sizes_of(host)[:5], seed=54, step=1.0)
    attr = {'params': 'params', 'momentum_buffers': 'codes', 'model': 'model'}
    if misaligned in attr:
        setattr(st, attr[misaligned], [guarded(t, 1) for t in getattr(st, attr[misaligned])])
    if misaligned == 'grads':
        grads = st.grads
        st.grads = lambda: [guarded(g, 1) for g in grads()]
    _step_and_compare(host, st, MOMENTUM, 2, f'{misaligned} misaligned')


def test_sgd8bit_without_scale_and_flag(host):
    """grad_scale and found_inf absent (None): the grads used as they are, the update applied."""
    st = State('fp32', sizes_of(host)[:5], seed=55)
    _step_and_compare(host, st, DAMPENED, 2, 'no scale, no flag')
    assert st.step.item() == 2.0


@pytest.mark.parametrize('shift', [0, 1])
def test_sgd8bit_on_flat_buffers(host, shift):
    """Every list as adjacent views of one flat buffer (no gap): a write past a tensor's end lands
    in its neighbour before the neighbour reads it; two steps against separate tensors."""
    representative(host, shift == 1)
    st = State('o2-bf16', sizes_of(host), seed=56)
    got = st.clone(as_flat=True, shift=shift)
    for i in range(2):
        grads = st.grads()
        got.run(host.ops.multi_tensor_sgd8bit_, grads, MOMENTUM)
        st.run(torch.ops.mp_wrappers.multi_tensor_sgd8bit_, grads, MOMENTUM)
        _assert_equal(got.tensors(), st.tensors(), f'flat buffers step {i + 1}')


def test_sgd8bit_tensor_lr(host):
    """lr_tensor (capturable=True), read by thread 0 of each block when the kernel runs: the bits of
    the CPU kernel with the float lr, the tensor's value changed between steps (the float passed
    with it is 0: a kernel reading that instead would not move the params)."""
    st = State('o2-bf16', sizes_of(host), seed=57)
    cpu = st.clone()
    lr = guarded(torch.zeros(1))
    for value in (5e-2, 2e-2):
        grads = st.grads()
        lr.fill_(value)
        st.run(host.ops.multi_tensor_sgd8bit_, grads, dict(MOMENTUM, lr=0.0), lr_tensor=lr)
        cpu.run(torch.ops.mp_wrappers.multi_tensor_sgd8bit_, grads, dict(MOMENTUM, lr=value))
        _assert_equal(st.tensors(), cpu.tensors(), f'lr {value}')


@pytest.mark.parametrize('n_resident', [None, 0, 4, 9])
def test_sgd8bit_launches_follow_the_planner(host, resident, n_resident):
    """Chunks of quant_chunk_size elements (whole quantization blocks), 5 lists per launch, launches
    of whole waves of the blocks the device holds at once: the launches are those of the planner's
    rules (tests/kernels/test_cuda_host_planner.py), and the result that of the CPU kernel."""
    representative(host, n_resident is None)
    if n_resident is not None:
        resident(n_resident)
    q = host.geometry['quant_chunk_size']
    sizes = sizes_of(host)
    st = State('o2-bf16', sizes, seed=58, step=1.0)
    cpu = st.clone()
    grads = st.grads()
    st.run(host.ops.multi_tensor_sgd8bit_, grads, MOMENTUM)
    cpu.run(torch.ops.mp_wrappers.multi_tensor_sgd8bit_, grads, MOMENTUM)
    _assert_equal(st.tensors(), cpu.tensors(), f'resident {n_resident}')
    geometry = dict(host.geometry, chunk_size=q)
    total = sum(-(-n // q) for n in sizes)
    per_launch = blocks_per_launch(total, host.module.resident_blocks(), geometry['max_blocks'])
    assert [r[1] for r in _update_launches(host)] == planned_launches(sizes, 5, geometry,
                                                                       per_launch)
    assert all(r[2] == host.geometry['block_size'] for r in _update_launches(host))


@pytest.mark.parametrize('first', [True, False])
@pytest.mark.parametrize('model', [False, True])
def test_sgd8bit_traffic(host, model, first):
    """Each element is read and written once: fp32 p (4 + 4), g (4), one code byte written and,
    but on the first update, read; each block's absmax read and written once (4 bytes each); per
    CUDA block, thread 0 reads found_inf, step and grad_scale. A bf16 model copy adds 2 bytes
    stored."""
    representative(host, not model and not first)
    q = host.geometry['quant_chunk_size']
    sizes = [q + 512, 256]
    st = State('o2-bf16' if model else 'fp32', sizes, seed=59, step=0.0 if first else 4.0)
    if not model:
        st.scale = guarded(torch.full((1,), 4.0))
    st.run(host.ops.multi_tensor_sgd8bit_, st.grads(), MOMENTUM, guarded(torch.zeros(1)))
    n, qblocks, cuda_blocks = sum(sizes), sum(sizes) // 256, 3
    launches = _update_launches(host)
    gbytes = 2 if model else 4
    code_read = 0 if first else 1
    assert sum(r[3] for r in launches) == n * (4 + gbytes + code_read) + qblocks * 4 + \
        cuda_blocks * 12
    assert sum(r[4] for r in launches) == n * (4 + 1 + (2 if model else 0)) + qblocks * 4


@pytest.mark.parametrize('first', [True, False])
@pytest.mark.parametrize('shift', [0, 1])
def test_sgd8bit_short_blocks_load_nothing_past_their_end(host, shift, first):
    """Tensors whose last quantization block is short (the guarded path; shift 1: every block
    guarded): each element's bytes are loaded once (fp32 p and g, its code but on the first
    update), each block's absmax once, and per CUDA block thread 0's found_inf, step and
    grad_scale. A code read at the block's size, or on the first update, stays inside the
    allocation, so only this count sees it."""
    representative(host, shift == 0 and not first)
    q = host.geometry['quant_chunk_size']
    sizes = [1, 255, 257, q + 300]
    st = State('fp32', sizes, seed=64, shift=shift, step=0.0 if first else 2.0)
    st.scale = guarded(torch.full((1,), 4.0))
    host.module.traffic_reset()
    st.run(host.ops.multi_tensor_sgd8bit_, st.grads(), MOMENTUM, guarded(torch.zeros(1)))
    launches = _update_launches(host)
    n, qblocks = sum(sizes), sum(-(-s // 256) for s in sizes)
    cuda_blocks = sum(r[1] for r in launches)
    assert launches and sum(r[3] for r in launches) == n * (4 + 4 + (0 if first else 1)) + \
        qblocks * 4 + cuda_blocks * 12
    assert sum(r[4] for r in launches) == n * (4 + 1) + qblocks * 4


def _stores(host, setup, n, shift=0):
    st = State(setup, [n], seed=65, shift=shift, step=1.0)
    host.module.traffic_reset()
    st.run(host.ops.multi_tensor_sgd8bit_, st.grads(), MOMENTUM)
    return sum(count for kernel, count in host.module.store_log() if kernel == _UPDATE)


def test_sgd8bit_model_copy_keeps_the_vector_path(host):
    """Whole aligned blocks take the vector path with or without a model copy: p, the copy and the
    codes are stored 4 elements a store, each block's absmax once. Misaligned storage sends every
    block down the element path: one store per element. The bits and bytes are the same on both
    paths: only the number of stores tells a copy that wrongly takes the element path."""
    n = 2 * 256
    blocks = n // 256
    vector = _stores(host, 'fp32', n)
    assert vector == n // 4 + n // 4 + blocks
    assert _stores(host, 'o2-bf16', n) == vector + n // 4
    assert _stores(host, 'o2-bf16', n, shift=1) == 3 * n + blocks


def _expected_prefetches(st, grads, q, warps, first):
    """The lines the update asks of L2 ahead of use (prefetch_qblock): in each chunk of ``q``
    elements, every whole quantization block but the first ``warps`` (those the warps start on) is
    asked for once, by the warp working ``warps`` blocks before it: 128-byte lines from its first
    element over the block's 256 elements of the param, the grad and (but on the first update) the
    codes, and its absmax. The model copy is only written: never asked for."""
    want = collections.Counter()
    for i, n in enumerate(st.sizes):
        for begin in range(0, n, q):
            for blk in range(warps, min(q, n - begin) // 256):
                e = begin + blk * 256
                for t in (st.params[i], grads[i]) + (() if first else (st.codes[i],)):
                    base = t.data_ptr() + e * t.element_size()
                    want.update(base + byte for byte in range(0, 256 * t.element_size(), 128))
                want[st.absmax[i].data_ptr() + e // 256 * 4] += 1
    return want


@pytest.mark.parametrize('first', [True, False])
@pytest.mark.parametrize('setup', ['fp32', 'o2-bf16'])
def test_sgd8bit_prefetches_exactly_the_next_blocks_lines(host, setup, first):
    """The next-block prefetch changes no result, so only its addresses show a wrong one: each
    recorded prefetch_l2 address must be one line of a block the warp works next, each such line
    asked for once; the codes not on the first update, which does not read them."""
    representative(host, setup == 'o2-bf16' and not first)
    q = host.geometry['quant_chunk_size']
    warps = host.geometry['block_size'] // 32
    sizes = [q + (warps + 3) * 256 + 100, (warps + 1) * 256, 300] + (
        sizes_of(host) if host.geometry['name'] == 'TinyGeometry' else [])
    st = State(setup, sizes, seed=60, step=0.0 if first else 2.0)
    grads = st.grads()
    host.module.traffic_reset()
    st.run(host.ops.multi_tensor_sgd8bit_, grads, MOMENTUM)
    want = _expected_prefetches(st, grads, q, warps, first)
    got = collections.Counter(host.module.prefetch_log())
    assert sum(want.values()) > 0
    missing, extra = want - got, got - want
    assert not missing and not extra, (
        f'{setup}: {sum(missing.values())} expected prefetches missing, '
        f'{sum(extra.values())} unexpected ({len(want)} distinct lines expected)')


def test_sgd8bit_empty_lists_and_tensors(host):
    """Empty lists: only the step counter moves (one launch). Only empty tensors: no update launch,
    the step still counted, as the CPU kernel does."""
    st = State('fp32', [], seed=61)
    st.run(host.ops.multi_tensor_sgd8bit_, [], MOMENTUM)
    assert st.step.item() == 1.0
    assert [r[0] for r in host.launches()] == ['increment_step']
    st, cpu = State('o2-bf16', [0, 0], seed=62), State('o2-bf16', [0, 0], seed=62)
    st.run(host.ops.multi_tensor_sgd8bit_, st.grads(), MOMENTUM)
    cpu.run(torch.ops.mp_wrappers.multi_tensor_sgd8bit_, cpu.grads(), MOMENTUM)
    _assert_equal(st.tensors(), cpu.tensors(), 'empty tensors')
    assert _update_launches(host) == []


def test_sgd8bit_rejects_mixed_dtype_lists_and_bad_states(host):
    """A launch dispatches on a list's first dtype: a mixed list is refused with its index (CUDA
    only; the CPU kernel dispatches per tensor). The state checks and the momentum check are the
    CPU kernel's (op_args.h)."""
    st = State('fp32', [5, 300], seed=63)
    grads = st.grads()
    grads[1] = grads[1].half()
    with pytest.raises(RuntimeError, match=r'grads mixes dtypes Float and Half \(index 1\)'):
        st.run(host.ops.multi_tensor_sgd8bit_, grads, MOMENTUM)
    with pytest.raises(RuntimeError, match=r'momentum=0 keeps no momentum buffer to quantize'):
        st.run(host.ops.multi_tensor_sgd8bit_, st.grads(), dict(MOMENTUM, momentum=0.0))
    st.absmax[1] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r'momentum_buffer_absmaxes\[1\] must be a contiguous '
                                           r'float32 tensor on cpu with 2 elements \(one per '
                                           r'block of 256\)'):
        st.run(host.ops.multi_tensor_sgd8bit_, st.grads(), MOMENTUM)
    st.codes[0] = torch.zeros(5)
    with pytest.raises(RuntimeError, match=r'momentum_buffers\[0\] must be a contiguous uint8'):
        st.run(host.ops.multi_tensor_sgd8bit_, st.grads(), MOMENTUM)
