"""The vector-path choice of the CUDA kernels, executed on the host (see tests/kernels/test_cuda_host.py
for how the module is built and run): a kernel takes its vector path (Pack loads and stores) only when
every list it touches is pack-aligned, so each list misaligned alone must send the chunk down the
guarded per-element path. A vector access at a misaligned address faults on the GPU; host execution
reports it and the launch fails. The other tests shift every list by the same amount, which a
condition that checks only some of the lists passes (mutants of `&&` -> `||`, docs/cuda_mutants.md).
"""
import pytest
import torch

from _guards import guarded, guarded_empty
from mp_wrappers.ops import reference
from test_cuda_host import _bits_equal, _rand, host, representative  # noqa: F401 (host is a fixture)

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.mp_wrappers, 'multi_tensor_scale_'),
                                reason='the C++ extension mp_wrappers._C is not built')


@pytest.mark.parametrize('misaligned', ['in', 'out'])
def test_scale_one_misaligned_list(host, misaligned):
    representative(host, misaligned == 'out')
    xs = [guarded(t, int(misaligned == 'in')) for t in _rand(host.sizes(), torch.float32, 51)]
    outs = [guarded_empty(x.shape, torch.float32, shift=int(misaligned == 'out')) for x in xs]
    want = [torch.empty_like(o) for o in outs]
    fi = guarded(torch.zeros(1))
    host.ops.multi_tensor_scale_(xs, outs, torch.tensor([0.3]), fi)
    reference.multi_tensor_scale_(xs, want, torch.tensor([0.3]), torch.zeros(1))
    assert all(_bits_equal(o, w) for o, w in zip(outs, want)), f'{misaligned} misaligned'
    assert fi.item() == 0.0


@pytest.mark.parametrize('misaligned', ['x', 'y', 'out'])
def test_axpby_one_misaligned_list(host, misaligned):
    representative(host, misaligned == 'out')
    sizes = host.sizes()
    x = [guarded(t, int(misaligned == 'x')) for t in _rand(sizes, torch.float32, 52)]
    y = [guarded(t, int(misaligned == 'y')) for t in _rand(sizes, torch.float32, 53)]
    out = [guarded_empty(n, torch.float32, shift=int(misaligned == 'out')) for n in sizes]
    want = [torch.empty_like(o) for o in out]
    fi = guarded(torch.zeros(1))
    host.ops.multi_tensor_axpby_(x, y, out, 0.7, -1.3, -1, fi)
    reference.multi_tensor_axpby_(x, y, want, 0.7, -1.3, -1, torch.zeros(1))
    assert all(_bits_equal(o, w) for o, w in zip(out, want)), f'{misaligned} misaligned'
    assert fi.item() == 0.0
