"""Memory traffic of the lean CUDA kernel, executed on the host (see tests/kernels/test_cuda_host.py
for how the module is built and run, tests/kernels/test_cuda_host_traffic.py for the reduction
kernels): per launch, the bytes loaded. The block's skip flag and constants (found_inf, step,
grad_scale) are loaded by one thread; every thread doing it gives the same results, so only the
traffic shows it (mutant multi_tensor_lean.cu:117:rel:db117d46, docs/cuda_mutants.md).
"""
import torch

from test_cuda_host import host, representative  # noqa: F401 (host is a fixture)
from test_cuda_host_lean import ADAM, _call, _lean


def test_lean_adam_loads_each_element_once(host):
    """Split storage, fp32 moments, bf16 grads: p, aux, g (2 bytes each) and m, v (4 each) once per
    element; per block, found_inf, step and grad_scale once (thread 0)."""
    representative(host, True)
    sizes = host.sizes()
    got = _lean('split', sizes, torch.float32, ADAM, seed=65)
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(66)).bfloat16() for n in sizes]
    host.module.traffic_reset()
    _call(got, host.ops, 'adam', grads, ADAM, torch.full((1,), 1000.0), torch.zeros(1))
    launches = [r for r in host.launches() if r[0] != 'increment_step']
    assert launches and sum(r[3] for r in launches) == sum(sizes) * 14 + sum(
        r[1] for r in launches) * 12
