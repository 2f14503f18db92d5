"""Memory traffic of the CUDA reduction kernels, executed on the host (see tests/kernels/test_cuda_host.py
for how the module is built and run): the host build counts every byte each launch loads and stores
(``Host.launches()``: kernel, grid, block, bytes loaded, bytes stored; docs/cuda.md "Memory traffic").
A value the block needs once (a scale, a total) is loaded or stored by one thread; every thread doing it
gives the same results, so only the traffic shows it (mutants of ``threadIdx.x == 0``,
docs/cuda_mutants.md).
"""
import pytest
import torch

from test_cuda_host import OPT_DTYPES, OPT_VARIANTS, _host_state, _rand, representative
from test_cuda_host import host  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.mp_wrappers, 'multi_tensor_l2norm'),
                                reason='the C++ extension mp_wrappers._C is not built')


def _launches(host, kernel):
    return [r for r in host.launches() if r[0] == kernel]


@pytest.mark.parametrize('per_tensor', [False, True])
def test_l2norm_cleanup_stores_each_norm_once(host, per_tensor):
    representative(host, per_tensor)
    xs = _rand(host.sizes(), torch.float32, 61)
    host.module.traffic_reset()
    host.ops.multi_tensor_l2norm(xs, per_tensor)
    (cleanup,) = _launches(host, 'l2norm_cleanup')
    assert cleanup[1] == 1  # one block
    assert cleanup[4] == 4 * (len(xs) * per_tensor + 1)  # the per-tensor norms, the total


def test_novograd_grad_norm_loads_each_grad_once(host):
    """Every grad element once; per block, found_inf and grad_scale once (thread 0)."""
    op = 'multi_tensor_novograd_'
    st = _host_state(op, host.sizes(), OPT_DTYPES[0], seed=62, shift=0)
    assert st.found_inf is not None and st.grad_scale is not None
    host.module.traffic_reset()
    getattr(host.ops, op)(*st.args(op, OPT_VARIANTS[op][0][1]))
    launches = _launches(host, 'novograd_grad_norm')
    grads = sum(g.numel() * g.element_size() for g in st.grads)
    assert launches and sum(r[3] for r in launches) == grads + sum(r[1] for r in launches) * 8


def test_lamb_norms_load_each_element_once(host):
    """p, g, m and v once per element; per block, found_inf, step, the global grad norm and
    grad_scale once (thread 0's per-block constants; lr is a number here)."""
    op = 'multi_tensor_lamb_'
    name, hp = OPT_VARIANTS[op][0]
    assert name == 'trust_ratio'  # the three-launch path
    st = _host_state(op, host.sizes(), OPT_DTYPES[0], seed=63, shift=0)
    assert st.found_inf is not None and st.grad_scale is not None
    host.module.traffic_reset()
    getattr(host.ops, op)(*st.args(op, hp))
    launches = _launches(host, 'lamb_norms')
    elements = sum(p.numel() * (p.element_size() + g.element_size() + 8)
                   for p, g in zip(st.params, st.grads))
    assert launches and sum(r[3] for r in launches) == elements + sum(r[1] for r in launches) * 16


@pytest.mark.parametrize('op,kernel', [('multi_tensor_novograd_', 'novograd_norms'),
                                       ('multi_tensor_lamb_', 'lamb_ratio')])
def test_per_tensor_kernels_launch_one_thread_per_tensor(host, op, kernel):
    """ceil(n / per_tensor_threads) blocks: n one less than, equal to, one more than a block.
    Tiny geometry only: 129 tensors at 512 threads per block are minutes in the real one, and
    the launch arithmetic is the same there."""
    representative(host, False)
    threads = host.geometry['per_tensor_threads']
    for n in (threads - 1, threads, threads + 1):
        st = _host_state(op, [3] * n, OPT_DTYPES[0], seed=64, shift=0)
        host.module.traffic_reset()
        getattr(host.ops, op)(*st.args(op, OPT_VARIANTS[op][0][1]))
        (launch,) = _launches(host, kernel)
        assert (launch[1], launch[2]) == (-(-n // threads), threads), f'{n} tensors'
