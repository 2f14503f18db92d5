"""Edges of the 8-bit Adam CUDA kernel (cuda/multi_tensor_adam8bit.cu, executed on the host; see
tests/kernels/test_cuda_host_adam8bit.py for the state and the comparisons) that equal results
under ``torch.equal`` or equal results alone do not show: the sign of a zero, a byte loaded past
a short block's end, and the path a block takes (the same bits and bytes either way). Each kills a mutant the other host tests let live (docs/cuda_mutants.md).
"""
import pytest
import torch

from _guards import guarded
from test_cuda_host import host, representative  # noqa: F401 (host is a fixture)
from test_cuda_host_adam8bit import (_UPDATE, HP, OP, State, _step_and_compare,  # noqa: F401
                                     _update_launches)

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.mp_wrappers, OP),
                                reason='the C++ extension mp_wrappers._C is not built')


@pytest.mark.parametrize('hp', list(HP), ids=list(HP))
@pytest.mark.parametrize('setup', ['fp32', 'o2-bf16'])
def test_adam8bit_negative_zero_moment_code(host, setup, hp):
    """Code 0x80 is a negative-zero m (the encoder writes it for a negative moment that rounds to 0
    and for -0.0). With a -0.0 param and a -0.0 grad the sign is all that is left: m stays -0.0
    (code 0x80 again), the update is -0.0, and fma(-lr, -0.0, p) is +0.0; without decay an m
    decoded as +0.0 leaves the param at -0.0 and writes code 0 (with AdamW the decay's FMA already
    makes p +0.0: the codes tell). Bit patterns are compared (torch.equal calls the two zeros
    equal). A whole block (the vector path) and a short one (the guarded path)."""
    representative(host, setup == 'fp32' and hp == 'adamw')
    n = 256 + 40
    st = State(setup, [n], seed=42)
    for p in st.params + st.model:
        p.fill_(-0.0)
    st.mc[0].fill_(0x80)
    st.ma[0].fill_(1.0)
    st.vc[0].zero_()
    st.va[0].fill_(1.0)
    st.grads = lambda: [guarded(torch.full((n,), -0.0).to(st.gdt))]
    _step_and_compare(host, st, HP[hp], 1, f'negative-zero m, {setup} {hp}')
    for p in st.params + st.model:
        assert not p.signbit().any(), 'p - lr * (-0.0) is +0.0'


@pytest.mark.parametrize('shift', [0, 1])
def test_adam8bit_short_blocks_load_nothing_past_their_end(host, shift):
    """Tensors whose last quantization block is short (the guarded path; shift 1: every block
    guarded): each element's bytes are loaded once (fp32 p and g, one byte per moment code), each
    block's two absmaxes once, and per CUDA block thread 0's found_inf, step and grad_scale. A code
    read at the block's size (one past the tensor's last element) stays inside the allocation, so
    only this count sees it."""
    representative(host, shift == 0)
    q = host.geometry['quant_chunk_size']
    sizes = [1, 255, 257, q + 300]
    st = State('fp32', sizes, seed=43, shift=shift)
    st.scale = guarded(torch.full((1,), 4.0))
    host.module.traffic_reset()
    st.run(host.ops.multi_tensor_adam8bit_, st.grads(), HP['adamw'], guarded(torch.zeros(1)))
    launches = _update_launches(host)
    n, qblocks = sum(sizes), sum(-(-s // 256) for s in sizes)
    cuda_blocks = sum(r[1] for r in launches)
    assert launches and sum(r[3] for r in launches) == n * (4 + 4 + 2) + qblocks * 8 + \
        cuda_blocks * 12
    assert sum(r[4] for r in launches) == n * (4 + 2) + qblocks * 8


def _stores(host, setup, n, shift=0):
    st = State(setup, [n], seed=44, shift=shift)
    host.module.traffic_reset()
    st.run(host.ops.multi_tensor_adam8bit_, st.grads(), HP['adamw'])
    return sum(count for kernel, count in host.module.store_log() if kernel == _UPDATE)


def test_adam8bit_model_copy_keeps_the_vector_path(host):
    """Whole aligned blocks take the vector path with or without a model copy: p, the copy and
    each moment's codes are stored 4 elements a store (fp32 and bf16 packs, 4 codes), each block's
    two absmaxes once. A misaligned copy sends every block down the element path: one store per
    element of each. Both paths give the same bits and bytes, so only the number of stores tells
    a copy that wrongly takes the element path (on a GPU: no vector stores on the O2 path)."""
    n = 2 * 256
    blocks = n // 256
    vector = _stores(host, 'fp32', n)
    assert vector == n // 4 + 2 * (n // 4) + 2 * blocks
    assert _stores(host, 'o2-bf16', n) == vector + n // 4
    assert _stores(host, 'o2-bf16', n, shift=1) == 4 * n + 2 * blocks
