"""Memory traffic of the element-wise optimizer kernels (cuda/optim_apply.cuh's ElementwiseFunctor),
executed on the host (see tests/kernels/test_cuda_host.py for how the module is built and run,
tests/kernels/test_cuda_host_traffic.py for the reduction kernels): the block's skip flag and
constants are loaded by one thread; every thread doing it gives the same results, so only the
traffic shows it (mutant optim_apply.cuh:99:rel:8e0c7ce0, docs/cuda_mutants.md). Likewise which
path a chunk takes: the vector path and the element path store the same bits, the number of stores
tells them apart (optim_apply.cuh:121:rel:995f2238).
"""
import torch

from test_cuda_host import OPT_DTYPES, OPT_VARIANTS, _host_state, _shifted, representative
from test_cuda_host import host  # noqa: F401 (a fixture)


def test_adam_loads_each_element_once(host):
    """fp32 p, g, m and v once per element; per block, found_inf, step and grad_scale once
    (thread 0; lr is a number here)."""
    representative(host, True)
    op = 'multi_tensor_adam_'
    st = _host_state(op, host.sizes(), OPT_DTYPES[0], seed=67, shift=0)
    assert st.found_inf is not None and st.grad_scale is not None
    host.module.traffic_reset()
    getattr(host.ops, op)(*st.args(op, OPT_VARIANTS[op][0][1]))
    launches = [r for r in host.launches() if r[0] != 'increment_step']
    extra = sum(r[3] for r in launches) - sum(p.numel() for p in st.params) * 16
    assert launches and extra == 12 * sum(r[1] for r in launches)


def _adam_stores(host, model_shift):
    op = 'multi_tensor_adam_'
    st = _host_state(op, [1024, 4096], OPT_DTYPES[1], seed=68, shift=0)  # bf16 grads, model copy
    st.model = [_shifted(t.detach().clone(), model_shift) for t in st.model]
    host.module.traffic_reset()
    getattr(host.ops, op)(*st.args(op, OPT_VARIANTS[op][0][1]))
    return sum(n for kernel, n in host.module.store_log() if kernel != 'increment_step')


def test_a_misaligned_model_copy_takes_the_element_path(host):
    """fp32 p, m, v and a bf16 model copy, all aligned: one store per 4 elements of each stream
    (16-byte and 8-byte packs). A model copy starting one element off: every chunk takes the
    element path, one store per element of each. On a GPU, a pack stored to the misaligned copy is
    a fault; on the host it stores the same bits, so only this count sees the copy's alignment
    left out of the chunk's test."""
    representative(host, True)
    n = 1024 + 4096
    assert _adam_stores(host, 0) == 4 * (n // 4)
    assert _adam_stores(host, 1) == 4 * n
