"""Stores of the reductions' per-chunk partials (cuda/multi_tensor_apply.cuh ChunkPartials),
executed on the host (see tests/kernels/test_cuda_host.py for how the module is built and run):
each block's partial once, and each tensor's range (first block, chunk count) once, by thread 0.
Every thread of the block holds the same reduced value, so more writers store the same bits;
only the bytes stored show them (mutant multi_tensor_apply.cuh:295:rel:d5a1223c,
docs/cuda_mutants.md).
"""
import pytest
import torch

from test_cuda_host import OPT_DTYPES, OPT_VARIANTS, _host_state, _rand, representative
from test_cuda_host import host  # noqa: F401 (a fixture)


def _partial_bytes(host, sizes, width):
    """A double per partial per block (one block per chunk), two int64 per non-empty tensor."""
    chunks = sum(-(-n // host.chunk) for n in sizes)
    return 8 * width * chunks + 16 * sum(n > 0 for n in sizes)


@pytest.mark.parametrize('kernel', ['l2norm_sumsq', 'novograd_grad_norm'])
def test_partials_are_stored_once_per_block(host, kernel):
    representative(host, kernel == 'l2norm_sumsq')
    sizes = host.sizes()
    host.module.traffic_reset()
    if kernel == 'l2norm_sumsq':
        host.ops.multi_tensor_l2norm(_rand(sizes, torch.float32, 74), True)
    else:
        op = 'multi_tensor_novograd_'
        st = _host_state(op, sizes, OPT_DTYPES[0], seed=75, shift=0)
        getattr(host.ops, op)(*st.args(op, OPT_VARIANTS[op][0][1]))
    launches = [r for r in host.launches() if r[0] == kernel]
    assert launches and sum(r[4] for r in launches) == _partial_bytes(host, sizes, 1)
