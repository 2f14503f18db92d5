"""The lean 8-bit SGD CUDA kernel (multi_tensor_sgd8bit_lean_ in cuda/multi_tensor_sgd8bit.cu)
executed on the CPU (host-execution build; see tests/kernels/test_cuda_host.py).

The real entry point (checks, the launch planner with chunks of whole quantization blocks,
launches with real warp shuffles) in both geometries, for the three storages, from the first
applied update (step 0: the buffer set to the direction, its codes not read, told on the device)
through later ones, on sizes around quantization blocks and chunks. Compared bit for bit with the
CPU kernel and with ops/reference/quant.py: the 8-bit SGD block update is the fp32-master kernel's
(tests/kernels/test_cuda_host_sgd8bit.py), and the master step is the lean kernels'
(cuda/quant_lean_param.cuh over cuda/lean_param.cuh). A found_inf step must change no bit and
write no byte; every written tensor lies between guard canaries, checked after each launch.
"""
import pytest
import torch

from _guards import checked, guarded
from test_cuda_host import host, representative  # noqa: F401 (host is a fixture)
from test_cuda_host_adam8bit import _assert_equal, sizes_of, steps_then_skip
from test_cuda_host_adam8bit_lean import (LEAN_BYTES, SETUPS, flat_buffers_agree, lean_case,
                                          lean_stepper)
from test_quantized_sgd import HYPERS, MOMENTUM, LeanCase
from test_quantized_states import LEAN_STORAGES

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.mp_wrappers, 'multi_tensor_sgd8bit_lean_'),
                                reason='the C++ extension mp_wrappers._C is not built')

OP = 'multi_tensor_sgd8bit_lean_'
_UPDATE = 'sgd8bit_lean'


def _host_op(host):
    return getattr(checked(host.ops), OP)


def _case(storage, setup, sizes, seed, step=0.0):
    c = lean_case(LeanCase, storage, setup, sizes, seed)
    c.step.fill_(step)
    return c


_step_and_compare = lean_stepper(OP)


@pytest.mark.parametrize('hp', list(HYPERS))
@pytest.mark.parametrize('setup', list(SETUPS))
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_sgd8bit_lean_matches_cpu_kernel_and_reference(host, storage, setup, hp):
    """Three steps from the first applied update, bit for bit against the CPU kernel and the
    reference; then a found_inf step that changes no bit and stores no byte."""
    representative(host, (setup, hp) == ('bf16-grads', 'momentum'))
    c = _case(storage, setup, sizes_of(host), seed=71)
    steps_then_skip(host, c, _host_op(host), HYPERS[hp], f'{storage} {setup} {hp}',
                    _step_and_compare, _UPDATE)
    assert c.step.item() == 3.0
    assert all(a.abs().max() > 0 for a in c.absmax if a.numel())


@pytest.mark.parametrize('hp', ['nesterov', 'dampened-wd-after'])
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_sgd8bit_lean_edge_blocks(host, storage, hp):
    """Blocks down every path of the codes (tests/ops/test_quantized_sgd.py EdgeCase: subnormal
    codes, normal codes only, zero and negative-zero blocks, a subnormal absmax, a short tail),
    past the first update, under the lean master step, bit for bit."""
    representative(host, storage == 'stochastic' and hp == 'nesterov')
    c = LeanCase(storage, seed=73, grad_dtype=torch.float32, edge=True)
    _step_and_compare(host, c, HYPERS[hp], 2, f'edge {storage} {hp}')


def test_sgd8bit_lean_first_update_ignores_the_codes(host):
    """On the first applied update the buffer is the direction whatever the codes and absmax hold;
    the same stale codes count from step 1 (the flag is the device's step)."""
    for step in (0.0, 1.0):
        c = _case('kahan', 'bf16-grads', sizes_of(host)[:5], seed=74, step=step)
        for codes, absmax in zip(c.codes, c.absmax):
            codes.fill_(0x7F)
            absmax.fill_(1e3)
        _step_and_compare(host, c, MOMENTUM, 1, f'stale codes from step {step}')
        moved = c.params[2].float() - LeanCase('kahan', sizes=sizes_of(host)[:5],
                                                 seed=74).params[2].float()
        # Stale codes of value 1e3 dominate the direction only when they are read.
        assert (moved.abs().max() > 1.0) == (step == 1.0)


@pytest.mark.parametrize('shift', [0, 1])
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_sgd8bit_lean_on_flat_buffers(host, storage, shift):
    """Every list as adjacent views of one flat buffer (no gap; shift 1: misaligned codes): a write
    past a tensor's end lands in its neighbour before the neighbour reads it; two steps against
    separate tensors stepped by the CPU kernel."""
    representative(host, (storage, shift) == ('split', 1))
    flat_buffers_agree(host, OP, _case(storage, 'bf16-grads-odd-scale', sizes_of(host), seed=75),
                       MOMENTUM, shift, storage)


@pytest.mark.parametrize('first', [True, False])
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_sgd8bit_lean_traffic(host, storage, first):
    """Each element is read and written once: the lean param (LEAN_BYTES), the bf16 grad (2), one
    code byte written and, but on the first update, read; each block's absmax read and written
    once; per CUDA block, thread 0 reads found_inf, step (once, for the first-update flag and the
    stochastic key) and grad_scale. A short last block reads nothing past its end."""
    representative(host, storage == 'kahan' and not first)
    q = host.geometry['quant_chunk_size']
    sizes = [q + 512, 256 + 40]
    c = _case(storage, 'bf16-grads-odd-scale', sizes, seed=76, step=0.0 if first else 2.0)
    c.run(_host_op(host), c.grads(), MOMENTUM, guarded(torch.zeros(1)))
    n, qblocks, cuda_blocks = sum(sizes), sum(-(-s // 256) for s in sizes), 3
    launches = [r for r in host.launches() if r[0] == _UPDATE]
    lean = LEAN_BYTES[storage]
    assert sum(r[3] for r in launches) == (n * (lean + 2 + (0 if first else 1)) + qblocks * 4
                                           + cuda_blocks * 12)
    assert sum(r[4] for r in launches) == n * (lean + 1) + qblocks * 4


def test_sgd8bit_lean_empty_lists_and_rejects(host):
    """Empty lists: only the step counter moves. The entry point's checks run on the host too: a
    bad storage, aux for 'stochastic', momentum 0 (no buffer to quantize) and (CUDA only: a launch
    dispatches on the first dtype) a grads list of mixed dtypes."""
    op = host.ops.multi_tensor_sgd8bit_lean_
    step = torch.zeros(1)
    op([], [], [], [], [], step, **MOMENTUM, storage='split', seed=0, grad_scale=None,
       found_inf=None)
    assert step.item() == 1.0
    assert [r[0] for r in host.launches()] == ['increment_step']
    c = LeanCase('kahan', sizes=[5, 300], seed=77)
    for storage, match in (('bogus', "storage='bogus' is not allowed"),
                           ('stochastic', "storage='stochastic' keeps no aux")):
        c.storage = storage
        with pytest.raises(RuntimeError, match=match):
            c.run(op, c.grads(), MOMENTUM)
    c.storage = 'kahan'
    with pytest.raises(RuntimeError, match='momentum=0 keeps no momentum buffer to quantize'):
        c.run(op, c.grads(), dict(MOMENTUM, momentum=0.0))
    grads = c.grads()
    grads[1] = grads[1].float()
    with pytest.raises(RuntimeError, match=r'grads mixes dtypes BFloat16 and Float \(index 1\)'):
        c.run(op, grads, MOMENTUM)
