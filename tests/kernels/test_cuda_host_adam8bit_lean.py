"""The lean 8-bit Adam CUDA kernel (multi_tensor_adam8bit_lean_ in cuda/multi_tensor_adam8bit.cu)
executed on the CPU (host-execution build; see tests/kernels/test_cuda_host.py).

Same pattern as tests/kernels/test_cuda_host_adam8bit.py: the real entry point (checks, the launch
planner with chunks of whole quantization blocks, launches with real warp shuffles) in both
geometries, for the three storages (split, kahan, stochastic), on sizes around quantization blocks
and chunks (a short last block, tensors over several chunks, several launches in the tiny geometry).
Compared bit for bit with the CPU kernel and with ops/reference/quant.py: the 8-bit update is
per element in the same IEEE fp32 operations (tests/kernels/test_cuda_host_adam8bit.py says why
that is bitwise), and the master step is the lean kernels' (cuda/lean_param.cuh). A found_inf step
must change no bit and write no byte; every written tensor lies between guard canaries, checked
after each launch.
"""
import pytest
import torch

from _guards import checked, guarded
from mp_wrappers.ops import reference
from test_cuda_host import host, representative  # noqa: F401 (host is a fixture)
from test_cuda_host_adam8bit import _assert_equal, sizes_of, steps_then_skip
from test_quantized_states import ADAM, ADAM_L2, LEAN_STORAGES, LeanCase

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.mp_wrappers, 'multi_tensor_adam8bit_lean_'),
                                reason='the C++ extension mp_wrappers._C is not built')

OP = 'multi_tensor_adam8bit_lean_'
_UPDATE = 'adam8bit_lean'
# (grad dtype, grad_scale or None): as tests/ops/test_quantized_states.py LEAN_SETUPS.
SETUPS = {'bf16-grads': (torch.bfloat16, None), 'fp32-grads-scaled': (torch.float32, 1024.0),
          'bf16-grads-odd-scale': (torch.bfloat16, 3.0)}
HP = {'adamw': ADAM, 'l2': ADAM_L2}


def _host_op(host):
    return getattr(checked(host.ops), OP)


def _update_launches(host):
    return [r for r in host.launches() if r[0] == _UPDATE]


def lean_case(case_cls, storage, setup, sizes, seed):
    """A ``case_cls`` (a LeanCase of tests/ops) of ``SETUPS[setup]``, its grad_scale guarded."""
    gdt, scale = SETUPS[setup]
    c = case_cls(storage, sizes=sizes, seed=seed, grad_dtype=gdt, scale=scale)
    if c.scale is not None:
        c.scale = guarded(c.scale)
    return c


def lean_stepper(op):
    """The step_and_compare of the lean 8-bit op ``op``: `steps` steps of the host kernel, each
    against the CPU kernel and the reference from the same state, bit for bit."""
    def step_and_compare(host, c, hp, steps, what, found_inf=None):
        for i in range(steps):
            grads = c.grads()
            cpu, ref = c.clone(), c.clone()
            c.run(getattr(checked(host.ops), op), grads, hp, found_inf)
            cpu.run(getattr(checked(torch.ops.mp_wrappers), op), grads, hp, found_inf)
            ref.run(getattr(reference, op), grads, hp, found_inf)
            _assert_equal(c.tensors(), cpu.tensors(), f'{what} step {i + 1} (CPU kernel)')
            _assert_equal(c.tensors(), ref.tensors(), f'{what} step {i + 1} (reference)')
    return step_and_compare


def _case(storage, setup, sizes, seed):
    return lean_case(LeanCase, storage, setup, sizes, seed)


_step_and_compare = lean_stepper(OP)


@pytest.mark.parametrize('hp', list(HP), ids=list(HP))
@pytest.mark.parametrize('setup', list(SETUPS))
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_adam8bit_lean_matches_cpu_kernel_and_reference(host, storage, setup, hp):
    """Three steps bit for bit against the CPU kernel and the reference; then a found_inf step
    that changes no bit and stores no byte (test_cuda_host_adam8bit.py steps_then_skip)."""
    representative(host, (setup, hp) == ('fp32-grads-scaled', 'adamw'))
    c = _case(storage, setup, sizes_of(host), seed=51)
    steps_then_skip(host, c, _host_op(host), HP[hp], f'{storage} {setup} {hp}', _step_and_compare,
                    _UPDATE)


@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_adam8bit_lean_edge_blocks(host, storage):
    """Blocks down every path of the codes (tests/ops/test_quantized_states.py EdgeCase: subnormal
    codes, zero and negative-zero blocks, a subnormal absmax, a short tail) under the lean master
    step, bit for bit against the CPU kernel and the reference."""
    representative(host, storage == 'split')
    c = LeanCase(storage, seed=55, grad_dtype=torch.float32, edge=True)
    _step_and_compare(host, c, ADAM, 2, f'edge {storage}')


@pytest.mark.parametrize('shift', [0, 1])
@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_adam8bit_lean_on_flat_buffers(host, storage, shift):
    """Every list as adjacent views of one flat buffer (no gap; shift 1: misaligned codes, the
    guarded path): a write past a tensor's end lands in its neighbour before the neighbour reads
    it; two steps against separate tensors stepped by the CPU kernel."""
    representative(host, (storage, shift) == ('kahan', 1))
    flat_buffers_agree(host, OP, _case(storage, 'bf16-grads-odd-scale', sizes_of(host), seed=52),
                       ADAM, shift, storage)


def flat_buffers_agree(host, op, c, hp, shift, what):
    """Two steps of the host kernel of ``op`` on ``c``'s lists as views of flat buffers (``shift``
    elements off alignment) against the CPU kernel on separate tensors, bit for bit."""
    got = c.clone(as_flat=True, shift=shift)
    for i in range(2):
        grads = c.grads()
        got.run(getattr(checked(host.ops), op), grads, hp)
        c.run(getattr(torch.ops.mp_wrappers, op), grads, hp)
        _assert_equal(got.tensors(), c.tensors(), f'{what} flat buffers step {i + 1}')


# Bytes per element of a lean param and its aux, read and written (cuda/lean_param.cuh): 'split'
# reads and writes both halves, 'kahan' the bf16 param and its compensation, 'stochastic' the param.
LEAN_BYTES = {'split': 4, 'kahan': 4, 'stochastic': 2}


@pytest.mark.parametrize('storage', LEAN_STORAGES)
def test_adam8bit_lean_traffic(host, storage):
    """Each element is read and written once: the lean param (LEAN_BYTES), the bf16 grad (2), one
    byte per moment code read and written; each block's two absmaxes read and written once; per
    CUDA block, thread 0 reads found_inf, step and grad_scale. A short last block reads nothing
    past its end (a stray read inside the allocation that neither the guards nor ASan see)."""
    representative(host, storage == 'kahan')
    q = host.geometry['quant_chunk_size']
    sizes = [q + 512, 256 + 40]
    c = _case(storage, 'bf16-grads-odd-scale', sizes, seed=53)
    c.run(_host_op(host), c.grads(), ADAM, guarded(torch.zeros(1)))
    n, qblocks, cuda_blocks = sum(sizes), sum(-(-s // 256) for s in sizes), 3
    launches = _update_launches(host)
    assert sum(r[3] for r in launches) == (n * (LEAN_BYTES[storage] + 2 + 2) + qblocks * 8
                                           + cuda_blocks * 12)
    assert sum(r[4] for r in launches) == n * (LEAN_BYTES[storage] + 2) + qblocks * 8


def test_adam8bit_lean_empty_lists_and_rejects(host):
    """Empty lists: only the step counter moves. The entry point's checks run on the host too: a
    bad storage, aux for 'stochastic', and (CUDA only: a launch dispatches on the first dtype) a
    grads list of mixed dtypes."""
    c = LeanCase('kahan', sizes=[5, 300], seed=54)
    op = host.ops.multi_tensor_adam8bit_lean_
    step = torch.zeros(1)
    op([], [], [], [], [], [], [], step, **ADAM, storage='split', seed=0, grad_scale=None,
       found_inf=None)
    assert step.item() == 1.0
    assert [r[0] for r in host.launches()] == ['increment_step']
    for storage, match in (('bogus', "storage='bogus' is not allowed"),
                           ('stochastic', "storage='stochastic' keeps no aux")):
        c.storage = storage
        with pytest.raises(RuntimeError, match=match):
            c.run(op, c.grads(), ADAM)
    c.storage = 'kahan'
    grads = c.grads()
    grads[1] = grads[1].float()
    with pytest.raises(RuntimeError, match=r'grads mixes dtypes BFloat16 and Float \(index 1\)'):
        c.run(op, grads, ADAM)
