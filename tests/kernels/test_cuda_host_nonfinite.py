"""Non-finite edges of the CUDA kernels' shared helpers (cuda/multi_tensor_apply.cuh), executed on
the host (see tests/kernels/test_cuda_host.py for how the module is built and run): FLT_MAX is
finite for the overflow checks, and the NaN-propagating max keeps a NaN that meets finite values
after it (mutants multi_tensor_apply.cuh:236:rel:4ced622a and :256:logic:e1663e18,
docs/cuda_mutants.md).
"""
import math

import pytest
import torch

from _guards import guarded
from test_cuda_host import OPT_DTYPES, OPT_VARIANTS, _bits_equal, _host_state, _shifted
from test_cuda_host import representative
from test_cuda_host import host  # noqa: F401 (a fixture)
from mp_wrappers.ops import reference

FLT_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize('shift', [0, 1])
def test_float_max_is_finite(host, shift):
    """+-FLT_MAX, the largest finite floats, raise no overflow flag (vector path, shift 0, and the
    guarded path) in the scale and the unscale + norm checks; the scaled values are the
    reference's."""
    representative(host, shift == 0)
    x = torch.randn(host.chunk + 8)
    x[0], x[5], x[-1] = FLT_MAX, -FLT_MAX, FLT_MAX
    xs = [_shifted(x, shift)]
    outs = [_shifted(torch.zeros_like(x), shift)]
    want = [torch.zeros_like(x)]
    fi, fi_ref = guarded(torch.zeros(1)), torch.zeros(1)
    host.ops.multi_tensor_scale_(xs, outs, torch.tensor([1.0]), fi)
    reference.multi_tensor_scale_(xs, want, torch.tensor([1.0]), fi_ref)
    assert fi.item() == 0.0 == fi_ref.item()
    assert _bits_equal(outs[0], want[0])
    fi = guarded(torch.zeros(1))
    host.ops.multi_tensor_unscale_l2norm(xs, torch.tensor([1.0]), fi, False)
    assert fi.item() == 0.0


@pytest.mark.parametrize('where', ['first', 'middle'])
def test_a_nan_grad_makes_novograds_inf_norm_nan(host, where):
    """NovoGrad's per-tensor max-norm of a grad holding one NaN among finite values is NaN (the
    NaN meets larger and smaller finite values in the thread, block and chunk reductions after
    it), the other tensors' norms are finite, as in the CPU kernel."""
    representative(host, where == 'first')
    op = 'multi_tensor_novograd_'
    hp = dict(OPT_VARIANTS[op])['inf_reg_inside_init_zero']
    sizes = host.sizes()
    t = max(range(len(sizes)), key=lambda k: sizes[k])  # the longest: several chunks
    st = _host_state(op, sizes, OPT_DTYPES[0], seed=73, shift=0)
    st.grads[t].view(-1)[0 if where == 'first' else sizes[t] // 2] = math.nan
    cpu = st.clone()
    getattr(host.ops, op)(*st.args(op, hp))
    getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, hp))
    nan = torch.isnan(st.norms)
    assert nan.tolist() == [k == t for k in range(len(sizes))]
    assert torch.equal(nan, torch.isnan(cpu.norms))
