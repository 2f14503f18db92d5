"""The kernels' math keeps subnormal fp32 values: nothing may flush them to zero (issue 12, item 1).

``--use_fast_math`` (dropped from the CUDA build, see build_config.NVCC_FLAGS and docs/cuda.md) flushes
subnormals: an inverse loss scale of 2**-127 (legal: a scale of 2**127 with fp32 gradients) becomes 0
and unscaling zeroes every gradient; Adam's second moment of gradients ~1e-20 is subnormal and
becomes 0, which turns the update m / (sqrt(v) + eps) from ~1 into m / eps. Checked here on the CPU
kernels and on the references (the oracle every CUDA kernel is compared with), against float64; the
CUDA build's flags are checked in tests/kernels/test_build_config.py, its kernels by tools/gpu_check.sh.
"""
import pytest
import torch

from mp_wrappers import ops
from mp_wrappers.ops import reference
from mp_wrappers.scaler import StaticLossScaler

TINY = 2.0 ** -127  # subnormal: fp32's smallest normal is 2**-126
IMPLS = ['kernel', 'reference']


def _kernel_built():
    return ops.backend()['cpu'].startswith('cpp')


def test_inverse_of_a_2_pow_127_scale_is_not_zero():
    inv = StaticLossScaler(2.0 ** 127).inv_scale()
    assert inv.dtype == torch.float32 and inv.item() == TINY


@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_unscale_by_2_pow_minus_127_keeps_subnormal_grads(impl, dtype):
    if impl == 'kernel' and not _kernel_built():
        pytest.skip('the C++ extension is not built')
    # 1.5 * 2**-127 and friends are exactly representable subnormals: the result must be exact.
    g = torch.tensor([1.5, -3.0, 0.25, 7.0, 1.0] * 13, dtype=dtype)
    out = torch.empty(g.shape, dtype=torch.float32)
    flag = ops.new_found_inf()
    s = torch.tensor([TINY])
    if impl == 'kernel':
        ops.multi_tensor_scale([g], [out], s, flag)
    else:
        reference.multi_tensor_scale_([g], [out], s, flag)
    expected = (g.double() * TINY).float()
    assert (expected != 0).all() and (expected.abs() < 2.0 ** -126).any()
    assert torch.equal(out, expected) and flag.item() == 0


@pytest.mark.parametrize('impl', IMPLS)
def test_unscale_l2norm_of_subnormal_grads(impl):
    if impl == 'kernel' and not _kernel_built():
        pytest.skip('the C++ extension is not built')
    g = torch.tensor([1.5, -3.0, 0.25, 7.0] * 16)
    flag = ops.new_found_inf()
    inv = torch.tensor([TINY])
    if impl == 'kernel':
        total = ops.multi_tensor_unscale_l2norm([g], inv, found_inf=flag)[0]
    else:
        total = reference.multi_tensor_unscale_l2norm([g], inv, flag, False)[0]
    # Squares of ~2**-124 are ~2**-248: zero in fp32, so both accumulate in double.
    oracle = torch.linalg.vector_norm(g.double() * TINY).item()
    assert total.item() > 0 and total.item() == pytest.approx(oracle, rel=1e-6)


@pytest.mark.parametrize('impl', IMPLS)
def test_adam_with_subnormal_second_moment(impl):
    if impl == 'kernel' and not _kernel_built():
        pytest.skip('the C++ extension is not built')
    # g = 1e-20: (1 - beta2) * g * g = 1e-43 is subnormal (not flushed: about 71 ulps of 2**-149).
    # With eps = 1e-30 the update is m_hat / sqrt(v_hat) ~ 1; a flushed v would give 1e10.
    n = 40
    g = torch.full((n,), 1e-20)
    p = torch.zeros(n)
    m, v = torch.zeros(n), torch.zeros(n)
    step = torch.zeros(1)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-30, weight_decay=0.0, adam_w_mode=True,
              bias_correction=True)
    if impl == 'kernel':
        ops.multi_tensor_adam([p], [g], [m], [v], [], step, **hp)
    else:
        reference.multi_tensor_adam_([p], [g], [m], [v], [], step, grad_scale=None, found_inf=None,
                                     **hp)
    g64 = g.double()
    v64 = (1 - 0.999) * g64 * g64
    m64 = (1 - 0.9) * g64
    p64 = -1e-3 * (m64 / 0.1) / (torch.sqrt(v64 / 0.001) + 1e-30)
    assert (v > 0).all() and (v < 2.0 ** -126).all()  # subnormal, kept
    torch.testing.assert_close(v.double(), v64, rtol=1e-2, atol=0)  # ~71 ulps of subnormal: 1%
    torch.testing.assert_close(p.double(), p64, rtol=1e-2, atol=0)
    assert step.item() == 1


# A power-of-two loss scale whose reciprocal overflows (2**-128 and below, down to the smallest
# subnormal): the kernels divide by it, as the reference does, instead of multiplying by an
# infinite reciprocal. 2**-127 is the smallest power of two whose reciprocal (2**127) is finite.
@pytest.mark.parametrize('scale', [2.0 ** -127, 2.0 ** -128, 2.0 ** -130, 2.0 ** -149])
@pytest.mark.parametrize('op', ['multi_tensor_sgd_', 'multi_tensor_adam_', 'multi_tensor_sgd8bit_',
                                'multi_tensor_adam8bit_'])
def test_optimizers_unscale_by_a_scale_whose_reciprocal_overflows(op, scale):
    if not _kernel_built():
        pytest.skip('the C++ extension is not built')
    from mp_wrappers.ops.reference.quant import num_blocks
    n = 300

    def state():
        g = torch.Generator().manual_seed(7)
        p = [torch.randn(n, generator=g)]
        grads = [torch.randn(n, generator=g) * scale]  # finite grads of a tiny scale
        if op == 'multi_tensor_sgd_':
            lists = ([torch.zeros(n)],)
            hyper = (0.1, 0.9, 0.0, 1e-4, False, False)
        elif op == 'multi_tensor_adam_':
            lists = ([torch.zeros(n)], [torch.zeros(n)])
            hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)
        else:
            moments = 1 if op == 'multi_tensor_sgd8bit_' else 2
            lists = sum((([torch.zeros(n, dtype=torch.uint8)], [torch.zeros(num_blocks(n))])
                         for _ in range(moments)), ())
            hyper = ((0.1, 0.9, 0.0, 1e-4, False, False) if moments == 1 else
                     (1e-3, 0.9, 0.999, 1e-8, 0.01, True, True))
        return p, grads, lists, hyper

    out = []
    for impl in (getattr(torch.ops.mp_wrappers, op), getattr(reference, op)):
        p, grads, lists, hyper = state()
        for _ in range(2):  # the first update, then one that reads the state
            impl(p, grads, *lists, [], torch.zeros(1) + _, *hyper,
                 torch.tensor([scale]), torch.zeros(1))
        out.append([p[0]] + [t for lst in lists for t in lst])
    for a, b in zip(*out):
        assert torch.isfinite(a.float()).all() and torch.equal(a, b)
