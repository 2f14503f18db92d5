"""The one launch planner of the CUDA kernels (for_each_launch in multi_tensor_apply.cuh), executed
on the host: the launches it makes must be exactly those of a plain model of the rules below, for
lists that need several launches, with tensors split across chunks and across launches, more tensors
than one launch holds and empty tensors in between; and every element must be processed once.

Rules: tensors are cut into chunks of chunk_size elements, one block per chunk, in list order,
empty tensors skipped; a launch is made when it holds max_blocks blocks (the geometry's, or fewer where
a kernel's launches come in whole waves of the blocks the device holds at once: blocks_per_launch),
or when its tensor slots
(max_tensors for the list depth) are full at the end of a tensor, or at the end of the list; a tensor
cut by a launch continues in the next one. See tests/kernels/test_cuda_host.py for how the module is built.
"""
import pytest
import torch

from _guards import guarded
from mp_wrappers.ops import reference
from test_cuda_host import Host, VARIANT_NAMES, _bits_equal, _rand, backend, representative

pytestmark = pytest.mark.skipif(not backend()['extension'],
                                reason='the C++ extension mp_wrappers._C is not built')


def blocks_per_launch(total, resident, most_blocks):
    """Blocks per launch of a call of `total` blocks on a device holding `resident` of them at
    once: at most the whole waves that fit in `most_blocks` (`most_blocks` when resident is
    unknown, 0, or larger), in as few launches as that allows, the blocks spread evenly over
    them; a launch of more than one wave rounded up to whole waves; at least 1."""
    waves = most_blocks // resident if resident > 0 else 0
    most = waves * resident if waves > 0 else most_blocks
    launches = max(1, -(-total // most))
    per = max(1, -(-total // launches))
    if waves > 0 and per > resident:
        per = -(-per // resident) * resident
    return per


def planned_launches(sizes, depth, geometry, max_blocks=None):
    """Blocks per launch, by the rules in the module docstring (at most `max_blocks` a launch,
    geometry['max_blocks'] when None)."""
    chunk = geometry['chunk_size']
    max_blocks = max_blocks or geometry['max_blocks']
    max_tensors = geometry['max_tensors'][depth - 1]
    launches, blocks, slots = [], 0, 0
    for n in sizes:
        if n == 0:
            continue
        slots += 1
        chunks = -(-n // chunk)
        for c in range(chunks):
            blocks += 1
            last = c == chunks - 1
            if blocks == max_blocks or (last and slots == max_tensors):
                launches.append(blocks)
                blocks = 0
                slots = 0 if last else 1
    if blocks:
        launches.append(blocks)
    return launches


@pytest.fixture(params=VARIANT_NAMES)
def host(request):
    from test_cuda_host import _hosts
    if request.param not in _hosts:
        _hosts[request.param] = Host(request.param)
    h = _hosts[request.param]
    h.module.traffic_reset()
    return h


def _cases(h):
    g = h.geometry
    c, mb, mt = g['chunk_size'], g['max_blocks'], g['max_tensors'][1]
    return {
        # More tensors than one launch holds (slots full), small ones.
        'many_small': [3, 1, 4] * (mt + 2),
        # One tensor longer than a launch: continues in the next launch as slot 0.
        'long_tensor': [5, mb * c + c // 2, 9] if c * mb <= 4_000_000 else [5, 3 * c + 1, 9],
        # Empty tensors between and at the end (the trailing launch).
        'with_empty': [0, c + 1, 0, 0, 2, 0] + [1] * (mt - 1) + [0],
        # Slots full exactly when a tensor ends on the last block of a launch.
        'exact_fit': [c] * mt + [c + 1] * 2,
    }


@pytest.mark.parametrize('case', ['many_small', 'long_tensor', 'with_empty', 'exact_fit'])
def test_launches_follow_the_plan(host, case):
    representative(host, case in ('many_small', 'with_empty'))
    sizes = _cases(host)[case]
    xs = _rand(sizes, torch.float32, 21)
    # Between guard canaries (tests/_guards.py), checked after the launches.
    outs = [guarded(torch.full_like(x, float('nan'))) for x in xs]
    want = [torch.empty_like(x) for x in xs]
    host.ops.multi_tensor_scale_(xs, outs, torch.tensor([2.5]), guarded(torch.zeros(1)))
    reference.multi_tensor_scale_(xs, want, torch.tensor([2.5]), torch.zeros(1))
    # Every element written exactly as the reference (an element no block covers stays NaN).
    for i, (o, w) in enumerate(zip(outs, want)):
        assert _bits_equal(o, w), f'{case}: tensor {i} (numel {sizes[i]})'
    got = [r[1] for r in host.launches()]
    assert got == planned_launches(sizes, 2, host.geometry), case
    assert all(r[2] == host.geometry['block_size'] for r in host.launches())


@pytest.mark.parametrize('case', ['many_small', 'long_tensor', 'with_empty'])
def test_reductions_across_launches(host, case):
    """Per-chunk partials of a norm are indexed across launches: the per-tensor norms of lists that
    need several launches are those of each tensor alone."""
    representative(host, case == 'many_small')
    sizes = _cases(host)[case]
    xs = _rand(sizes, torch.bfloat16, 22)
    total, norms = host.ops.multi_tensor_l2norm(xs, True)
    assert [r[1] for r in host.launches()][:-1] == planned_launches(sizes, 1, host.geometry)
    # Each norm against the tensor's norm alone (a sample of the list in the real geometry,
    # where every call runs 512-thread barriers).
    picks = range(len(xs)) if host.variant != 'real' else sorted({0, 1, len(xs) // 2, len(xs) - 1})
    for i in picks:
        x = xs[i]
        alone, _ = host.ops.multi_tensor_l2norm([x], False)
        assert norms[i].item() == alone.item(), f'{case}: tensor {i}'
    want = torch.linalg.vector_norm(torch.cat([x.double() for x in xs]))
    torch.testing.assert_close(total.double(), want, rtol=3 * 2.0 ** -24, atol=0)


@pytest.mark.parametrize('op', ['multi_tensor_adam_', 'multi_tensor_lamb_',
                                'multi_tensor_novograd_'])
def test_optimizers_across_launches(host, op):
    """The O2 fused step (fp32 masters, bf16 grads and model: depth 5) over lists that need several
    launches, against the CPU kernel."""
    from test_cuda_host import OPT_VARIANTS, BITWISE_OPS, _compare, _host_state
    from test_cpu_kernels import DTYPES
    representative(host, op == 'multi_tensor_adam_')
    hp = OPT_VARIANTS[op][0][1]
    c = host.geometry['chunk_size']
    mt = host.geometry['max_tensors'][4]
    sizes = [7, 2 * c + 3, 0] * (mt // 2 + 1)
    st = _host_state(op, sizes, DTYPES[1], seed=23, shift=0)
    cpu = st.clone()
    getattr(host.ops, op)(*st.args(op, hp))
    getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, hp))
    _compare(op, st, cpu, f'{op} across launches', op in BITWISE_OPS)
    assert sum(1 for r in host.launches() if r[0] in ('adam', 'lamb_apply', 'novograd')) >= 2
