"""The 8-bit Adam CUDA kernel (cuda/multi_tensor_adam8bit.cu) executed on the CPU (host-execution
build; see tests/kernels/test_cuda_host.py for how the module is built and run).

Same pattern as the other host tests: the real entry point of multi_tensor_adam8bit_ (checks, the
launch planner with chunks of whole quantization blocks, dtype dispatch, launches with real warp
shuffles) in both geometries, on lists with several tensors, sizes that are not multiples of the
256-element block, tensors over several chunks and (tiny geometry) several launches, aligned and
misaligned storage, every param x grad x model-copy dtype. Compared bit for bit with the CPU kernel
and with ops/reference/quant.py: the arithmetic is per element in the same IEEE fp32 operations and
order, the square root is correctly rounded in all three, the bias corrections are the same float64
expressions rounded once, and the absmax is a max (exact in any order). A found_inf step must
change no bit and write no byte; every written tensor lies between guard canaries.
"""
import collections

import pytest
import torch

from _guards import flat, guarded
from _quant_ties import tie_moments
from mp_wrappers.ops import reference
from mp_wrappers.ops.reference.quant import EXP_AVG_CODE, EXP_AVG_SQ_CODE, quantize_blockwise
from test_cuda_host import _bits_equal, host, representative  # noqa: F401 (host is a fixture)
from test_cuda_host_planner import blocks_per_launch, planned_launches
from test_quantized_states import ADAM, ADAM_L2, EdgeCase

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.mp_wrappers, 'multi_tensor_adam8bit_'),
                                reason='the C++ extension mp_wrappers._C is not built')

OP = 'multi_tensor_adam8bit_'
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (param dtype, grad dtype, model-copy dtype or None, grad_scale or None)
SETUPS = {
    'fp32': (F32, F32, None, None),
    'o2-bf16': (F32, BF16, BF16, 1.0),
    'o2-fp16-scaled': (F32, F16, F16, 1024.0),
    'fp32-odd-scale': (F32, F32, F32, 3.0),  # a real divide by the scale; an fp32 model copy
    'bf16-params': (BF16, BF16, None, None),
    'fp16-params': (F16, F32, BF16, 2048.0),
}
HP = {'adamw': ADAM, 'l2': ADAM_L2}
# Kernel launches that are not the update (the step counter).
_UPDATE = 'adam8bit'


def sizes_of(host):
    """Around quantization blocks and chunks: a single element, a short block, whole blocks, a
    chunk and one more, an empty tensor, a tensor over several chunks with a short last block;
    (tiny geometry) a tensor longer than one launch."""
    q = host.geometry['quant_chunk_size']
    sizes = [1, 255, 256, 257, q, 0, q + 1, 3 * q + 300, 7]
    if host.geometry['name'] == 'TinyGeometry':
        sizes.append(host.geometry['max_blocks'] * q + 5)
    return sizes


class State:
    """One call's tensors: params, grads and moments from a few fp32 Adam steps, as codes."""

    def __init__(self, setup, sizes, seed=0, shift=0):
        pdt, self.gdt, mdt, scale = SETUPS[setup]
        g = torch.Generator().manual_seed(seed)
        self.gen, self.sizes = g, sizes
        self.scale = None if scale is None else guarded(torch.full((1,), scale))
        self.params = [guarded(torch.randn(n, generator=g).to(pdt), shift) for n in sizes]
        self.model = [guarded(p.to(mdt), shift) for p in self.params] if mdt else []
        self.mc, self.ma, self.vc, self.va = [], [], [], []
        for n in sizes:
            m = torch.randn(n, generator=g) * 0.1 * torch.exp(torch.randn(n, generator=g))
            v = torch.rand(n, generator=g) * 0.01 * torch.exp(2 * torch.randn(n, generator=g))
            for codes, absmax, x, code in ((self.mc, self.ma, m, EXP_AVG_CODE),
                                           (self.vc, self.va, v, EXP_AVG_SQ_CODE)):
                c, a = quantize_blockwise(x, code)
                codes.append(guarded(c, shift))
                absmax.append(guarded(a))
        self.step = guarded(torch.full((1,), 2.0))

    def grads(self, shift=0):
        s = 1.0 if self.scale is None else float(self.scale)
        return [guarded((torch.randn(n, generator=self.gen) * s).to(self.gdt), shift)
                for n in self.sizes]

    def tensors(self):
        return self.params + self.model + self.mc + self.ma + self.vc + self.va + [self.step]

    def clone(self, as_flat=False, shift=0):
        c = State.__new__(State)
        c.__dict__.update(self.__dict__)
        for k in ('params', 'model', 'mc', 'ma', 'vc', 'va'):
            lst = getattr(self, k)
            setattr(c, k, (flat(lst, shift) if as_flat else [guarded(t) for t in lst])
                    if lst else [])
        c.step = guarded(self.step)
        return c

    def run(self, fn, grads, hp, found_inf=None, lr_tensor=None):
        fn(self.params, grads, self.mc, self.ma, self.vc, self.va, self.model, self.step,
           *hp.values(), self.scale, found_inf, lr_tensor)


def _assert_equal(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert _bits_equal(a, b) if a.is_floating_point() else torch.equal(a, b), \
            f'{what}: tensor {i} differs'


def _update_launches(host):
    return [r for r in host.launches() if r[0] == _UPDATE]


def _step_and_compare(host, st, hp, steps, what, found_inf=None):
    """`steps` steps of the host kernel, each against the CPU kernel and the reference from the
    same state, bit for bit."""
    for i in range(steps):
        grads = st.grads()
        cpu, ref = st.clone(), st.clone()
        st.run(host.ops.multi_tensor_adam8bit_, grads, hp, found_inf)
        cpu.run(torch.ops.mp_wrappers.multi_tensor_adam8bit_, grads, hp, found_inf)
        ref.run(reference.multi_tensor_adam8bit_, grads, hp, found_inf)
        _assert_equal(st.tensors(), cpu.tensors(), f'{what} step {i + 1} (CPU kernel)')
        _assert_equal(st.tensors(), ref.tensors(), f'{what} step {i + 1} (reference)')


def steps_then_skip(host, st, op, hp, what, step_and_compare, update):
    """Three steps of ``step_and_compare`` (each against the CPU kernel and the reference) with a
    zero found_inf, several `update` launches in the tiny geometry; then a found_inf step of `op`
    that changes no bit and stores no byte (the decision is on the device: the kernels still
    launch)."""
    def updates():
        return [r for r in host.launches() if r[0] == update]
    host.module.traffic_reset()
    start = st.step.item()
    step_and_compare(host, st, hp, 3, what, found_inf=guarded(torch.zeros(1)))
    assert st.step.item() == start + 3
    if host.geometry['name'] == 'TinyGeometry':
        assert len(updates()) > 3, 'the tiny geometry must need several launches'
    before = [t.clone() for t in st.tensors()]
    host.module.traffic_reset()
    st.run(op, st.grads(), hp, guarded(torch.ones(1)))
    _assert_equal(st.tensors(), before, f'{what}: a skipped step')
    assert len(updates()) > 0
    assert sum(r[4] for r in host.launches()) == 0


@pytest.mark.parametrize('shift', [0, 1])
@pytest.mark.parametrize('hp', list(HP), ids=list(HP))
@pytest.mark.parametrize('setup', list(SETUPS))
def test_adam8bit_matches_cpu_kernel_and_reference(host, setup, hp, shift):
    """Three steps bit for bit against the CPU kernel and the reference (shift 1: misaligned
    storage, the guarded path); then a found_inf step that changes no bit and stores no byte."""
    representative(host, setup == 'o2-bf16' and hp == 'adamw' and shift == 0)
    st = State(setup, sizes_of(host), seed=31, shift=shift)
    steps_then_skip(host, st, host.ops.multi_tensor_adam8bit_, HP[hp],
                    f'{setup} {hp} shift {shift}', _step_and_compare, _UPDATE)


@pytest.mark.parametrize('hp', list(HP), ids=list(HP))
@pytest.mark.parametrize('setup', ['fp32', 'o2-bf16', 'fp32-odd-scale', 'fp16-params'])
def test_adam8bit_edge_blocks(host, setup, hp):
    """Blocks down every path of the codes (tests/ops/test_quantized_states.py EdgeCase: subnormal
    codes, normal codes only, zero and negative-zero blocks, a subnormal absmax whose encode factor
    overflows, a short tail), bit for bit against the CPU kernel and the reference."""
    representative(host, setup == 'fp32' and hp == 'adamw')
    e = EdgeCase('fp32')
    st = State(setup, e.sizes, seed=32)
    st.mc, st.ma, st.vc, st.va = e.mc, e.ma, e.vc, e.va
    grads = st.grads

    def edge_grads():
        (g,) = grads()
        (edge,) = EdgeCase.grads(e)
        B = 256
        g[2 * B:4 * B] = edge[2 * B:4 * B].to(g.dtype)  # zero and negative-zero grads
        return [g]
    st.grads = edge_grads
    _step_and_compare(host, st, HP[hp], 3, f'edge {setup} {hp}')


def test_adam8bit_rounds_ties_away_from_zero(host):
    """New moments exactly halfway between two codes (tests/_quant_ties.py: normal and subnormal
    codes, both signs, a value just below half a step): the encode rounds away from zero as the
    reference does (Note [ties away from zero])."""
    n = 256 + 40  # a whole block (the vector path) and a short one (the guarded path)
    st = State('fp32', [n], seed=40)
    codes, g, want = tie_moments(n, [0, 256])
    st.mc[0].copy_(codes)
    st.ma[0].fill_(1.875)
    st.grads = lambda: [guarded(g.clone())]
    hp = dict(ADAM, beta1=0.5)
    _step_and_compare(host, st, hp, 1, 'ties')
    assert torch.equal(st.mc[0], want) and st.ma[0].tolist() == [1.875, 1.875]


@pytest.mark.parametrize('misaligned', ['params', 'grads', 'exp_avgs', 'exp_avg_sqs', 'model'])
def test_adam8bit_one_misaligned_list(host, misaligned):
    """Only one list misaligned: its storage alone must send the chunk down the guarded path (a
    vector access there is a misaligned-address fault, which host execution reports)."""
    representative(host, misaligned == 'exp_avgs')
    st = State('o2-bf16', sizes_of(host)[:5], seed=41)
    attr = {'params': 'params', 'exp_avgs': 'mc', 'exp_avg_sqs': 'vc', 'model': 'model'}
    if misaligned in attr:
        setattr(st, attr[misaligned], [guarded(t, 1) for t in getattr(st, attr[misaligned])])
    if misaligned == 'grads':
        grads = st.grads
        st.grads = lambda: [guarded(g, 1) for g in grads()]
    _step_and_compare(host, st, ADAM, 2, f'{misaligned} misaligned')


def test_adam8bit_without_scale_and_flag(host):
    """grad_scale and found_inf absent (None): the grads used as they are, the update applied."""
    st = State('fp32', sizes_of(host)[:5], seed=33)
    _step_and_compare(host, st, ADAM, 1, 'no scale, no flag')
    assert st.step.item() == 3.0


@pytest.mark.parametrize('shift', [0, 1])
def test_adam8bit_on_flat_buffers(host, shift):
    """Every list as adjacent views of one flat buffer (no gap): a write past a tensor's end lands
    in its neighbour before the neighbour reads it; two steps against separate tensors."""
    representative(host, shift == 1)
    st = State('o2-bf16', sizes_of(host), seed=34)
    got = st.clone(as_flat=True, shift=shift)
    for i in range(2):
        grads = st.grads()
        got.run(host.ops.multi_tensor_adam8bit_, grads, ADAM)
        st.run(torch.ops.mp_wrappers.multi_tensor_adam8bit_, grads, ADAM)
        _assert_equal(got.tensors(), st.tensors(), f'flat buffers step {i + 1}')


def test_adam8bit_tensor_lr(host):
    """lr_tensor (capturable=True), read by thread 0 of each block when the kernel runs: the bits of
    the CPU kernel with the float lr, the tensor's value changed between steps (the float passed
    with it is 0: a kernel reading that instead would not move the params)."""
    st = State('o2-bf16', sizes_of(host), seed=37)
    cpu = st.clone()
    lr = guarded(torch.zeros(1))
    for value in (1e-2, 4e-3):
        grads = st.grads()
        lr.fill_(value)
        st.run(host.ops.multi_tensor_adam8bit_, grads, dict(ADAM, lr=0.0), lr_tensor=lr)
        cpu.run(torch.ops.mp_wrappers.multi_tensor_adam8bit_, grads, dict(ADAM, lr=value))
        _assert_equal(st.tensors(), cpu.tensors(), f'lr {value}')


@pytest.fixture
def resident(host):
    """Sets the blocks the emulated device holds at once for one test, then restores it."""
    before = host.module.resident_blocks()
    yield host.module.set_resident_blocks
    host.module.set_resident_blocks(before)


# Blocks the emulated device holds at once: the default (3: whole waves of 6 in the tiny
# geometry's 7), a device that cannot say (0), one block, one wave (4), exactly a launch (7), more
# than a launch holds (9).
@pytest.mark.parametrize('n_resident', [None, 0, 1, 4, 7, 9])
@pytest.mark.parametrize('sizes_case', ['mixed', 'even'])
def test_adam8bit_launches_follow_the_planner(host, resident, n_resident, sizes_case):
    """Chunks of quant_chunk_size elements (whole quantization blocks), 7 lists per launch, launches
    of whole waves of the blocks the device holds at once with the call's chunks spread evenly over
    them: the launches are those of the planner's rules (tests/kernels/test_cuda_host_planner.py),
    and the result that of the CPU kernel."""
    representative(host, n_resident is None and sizes_case == 'mixed')
    if n_resident is not None:
        resident(n_resident)
    q = host.geometry['quant_chunk_size']
    # 'even': 18 chunks, a multiple of the default's 6 blocks a launch.
    sizes = sizes_of(host) if sizes_case == 'mixed' else [6 * q, 5 * q + 1, 6 * q - 7]
    st = State('fp32', sizes, seed=35)
    cpu = st.clone()
    grads = st.grads()
    st.run(host.ops.multi_tensor_adam8bit_, grads, ADAM)
    cpu.run(torch.ops.mp_wrappers.multi_tensor_adam8bit_, grads, ADAM)
    _assert_equal(st.tensors(), cpu.tensors(), f'resident {n_resident}, {sizes_case}')
    geometry = dict(host.geometry, chunk_size=q)
    total = sum(-(-n // q) for n in sizes)
    per_launch = blocks_per_launch(total, host.module.resident_blocks(), geometry['max_blocks'])
    assert [r[1] for r in _update_launches(host)] == planned_launches(sizes, 7, geometry,
                                                                       per_launch)
    assert all(r[2] == host.geometry['block_size'] for r in _update_launches(host))


def test_blocks_per_launch_model():
    """The plan the launches above are held to, on the H100's figures: 264 resident blocks of the
    8-bit kernel, the benchmark's 1672 chunks in launches of at most 320 -> 7 launches of at most
    239 (not 5 of 320, each with a partial second wave, and one of 72)."""
    assert blocks_per_launch(1672, 264, 320) == 239
    assert blocks_per_launch(1672, 0, 320) == 279  # unknown: 6 launches of at most 320, evened
    assert blocks_per_launch(100, 264, 320) == 100
    assert blocks_per_launch(0, 264, 320) == 1
    # A device holding 100 (an 80-SM GPU): 610 blocks in 300, 300, 10 (7 waves), not in 3
    # launches of 204 (3 waves each, the last one partial: 9).
    assert blocks_per_launch(610, 100, 320) == 300


@pytest.mark.parametrize('model', [False, True])
def test_adam8bit_traffic(host, model):
    """Each element is read and written once: fp32 p (4 + 4), g (4), one byte per moment code read
    and written; each block's two absmaxes read and written once (4 bytes each); per CUDA block,
    thread 0 reads found_inf, step and grad_scale. A bf16 model copy adds 2 bytes stored."""
    representative(host, not model)
    q = host.geometry['quant_chunk_size']
    sizes = [q + 512, 256]
    st = State('o2-bf16' if model else 'fp32', sizes, seed=36)
    if not model:
        st.scale = guarded(torch.full((1,), 4.0))
    st.run(host.ops.multi_tensor_adam8bit_, st.grads(), ADAM, guarded(torch.zeros(1)))
    n, qblocks, cuda_blocks = sum(sizes), sum(sizes) // 256, 3
    launches = _update_launches(host)
    gbytes = 2 if model else 4
    assert sum(r[3] for r in launches) == n * (4 + gbytes + 2) + qblocks * 8 + cuda_blocks * 12
    assert sum(r[4] for r in launches) == n * (4 + 2 + (2 if model else 0)) + qblocks * 8


def _expected_prefetches(st, grads, q, warps):
    """The lines the update asks of L2 ahead of use (prefetch_qblock): in each chunk of ``q``
    elements, every whole quantization block but the first ``warps`` (those the warps start on) is
    asked for once, by the warp working ``warps`` blocks before it: 128-byte lines from its first
    element over the block's 256 elements of the param, grad and both code lists, and its two
    absmaxes. The model copy is only written: never asked for."""
    want = collections.Counter()
    for i, n in enumerate(st.sizes):
        for begin in range(0, n, q):
            for blk in range(warps, min(q, n - begin) // 256):
                e = begin + blk * 256
                for t in (st.params[i], grads[i], st.mc[i], st.vc[i]):
                    base = t.data_ptr() + e * t.element_size()
                    want.update(base + byte for byte in range(0, 256 * t.element_size(), 128))
                for a in (st.ma[i], st.va[i]):
                    want[a.data_ptr() + e // 256 * 4] += 1
    return want


@pytest.mark.parametrize('setup', ['fp32', 'o2-bf16', 'bf16-params'])
def test_adam8bit_prefetches_exactly_the_next_blocks_lines(host, setup):
    """The next-block prefetch changes no result, so only its addresses show a wrong one: host
    execution records each prefetch_l2 address, and each must be one line of a block the warp
    works next, each such line asked for once (docs/cuda_mutants_report.md: the mutants of these
    addresses and of their guard survived every result check)."""
    representative(host, setup == 'o2-bf16')
    q = host.geometry['quant_chunk_size']
    warps = host.geometry['block_size'] // 32
    # Chunks with whole blocks past the warps' first ones, a short last block, a chunk of fewer
    # blocks than warps, and (tiny geometry) several chunks and launches.
    sizes = [q + (warps + 3) * 256 + 100, (warps + 1) * 256, 300] + (
        sizes_of(host) if host.geometry['name'] == 'TinyGeometry' else [])
    st = State(setup, sizes, seed=39)
    grads = st.grads()
    host.module.traffic_reset()
    st.run(host.ops.multi_tensor_adam8bit_, grads, ADAM)
    assert {r[2] for r in _update_launches(host)} == {host.geometry['block_size']}
    want = _expected_prefetches(st, grads, q, warps)
    got = collections.Counter(host.module.prefetch_log())
    assert sum(want.values()) > 0
    missing, extra = want - got, got - want
    assert not missing and not extra, (
        f'{setup}: {sum(missing.values())} expected prefetches missing, '
        f'{sum(extra.values())} unexpected ({len(want)} distinct lines expected)')


def test_adam8bit_empty_lists_and_tensors(host):
    """Empty lists: only the step counter moves (one launch). Only empty tensors: no update launch,
    the step still counted, as the CPU kernel does."""
    st = State('fp32', [], seed=37)
    st.run(host.ops.multi_tensor_adam8bit_, [], ADAM)
    assert st.step.item() == 3.0
    assert [r[0] for r in host.launches()] == ['increment_step']
    st, cpu = State('o2-bf16', [0, 0], seed=38), State('o2-bf16', [0, 0], seed=38)
    st.run(host.ops.multi_tensor_adam8bit_, st.grads(), ADAM)
    cpu.run(torch.ops.mp_wrappers.multi_tensor_adam8bit_, cpu.grads(), ADAM)
    _assert_equal(st.tensors(), cpu.tensors(), 'empty tensors')
    assert _update_launches(host) == []


def test_adam8bit_rejects_mixed_dtype_lists_and_bad_states(host):
    """A launch dispatches on a list's first dtype: a mixed list is refused with its index (CUDA
    only; the CPU kernel dispatches per tensor). The state checks are the CPU kernel's (op_args.h)."""
    st = State('fp32', [5, 300], seed=39)
    grads = st.grads()
    grads[1] = grads[1].half()
    with pytest.raises(RuntimeError, match=r'grads mixes dtypes Float and Half \(index 1\)'):
        st.run(host.ops.multi_tensor_adam8bit_, grads, ADAM)
    st.ma[1] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r'exp_avg_absmaxes\[1\] must be a contiguous float32 '
                                           r'tensor on cpu with 2 elements \(one per block of 256\)'):
        st.run(host.ops.multi_tensor_adam8bit_, st.grads(), ADAM)
    st.vc[0] = torch.zeros(5)
    with pytest.raises(RuntimeError, match=r'exp_avg_sqs\[0\] must be a contiguous uint8'):
        st.run(host.ops.multi_tensor_adam8bit_, st.grads(), ADAM)
