"""Boundary values of the CUDA kernels' comparisons, executed on the host (see
tests/kernels/test_cuda_host.py for how the module is built and run): where `>` and `>=` differ only at
equality, the equal case must give what the CPU kernel gives (mutants of the comparisons,
docs/cuda_mutants.md).
"""
import math

import pytest
import torch

from test_cuda_host import BITWISE_OPS, OPT_DTYPES, OPT_VARIANTS, _compare, _host_state
from test_cuda_host import representative
from test_cuda_host import host  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.mp_wrappers, 'multi_tensor_lamb_'),
                                reason='the C++ extension mp_wrappers._C is not built')


@pytest.mark.parametrize('gnorm', [2.0, math.inf])
def test_lamb_grad_norm_equal_to_max_grad_norm_does_not_clip(host, gnorm):
    """gnorm == max_grad_norm: no clipping (the clip factor is 1, and inf / inf would be NaN)."""
    representative(host, gnorm == math.inf)
    op = 'multi_tensor_lamb_'
    hp = dict(OPT_VARIANTS[op][0][1], max_grad_norm=gnorm)
    got = _host_state(op, host.sizes(), OPT_DTYPES[0], seed=71, shift=0)
    got.gnorm.fill_(gnorm)
    cpu = got.clone()
    getattr(host.ops, op)(*got.args(op, hp))
    getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, hp))
    _compare(op, got, cpu, f'gnorm == max_grad_norm == {gnorm}', op in BITWISE_OPS)
    assert all(torch.isfinite(p).all() for p in got.params)


@pytest.mark.parametrize('variant,zero', [('trust_ratio', 'params'), ('nvlamb_l2', 'update')])
def test_lamb_trust_ratio_with_one_norm_zero(host, variant, zero):
    """A tensor whose param norm or update norm is 0 (and the other not) gets the ratio lr: all-zero
    params, or zero grads without weight decay (zero moments, zero update)."""
    representative(host, zero == 'params')
    op = 'multi_tensor_lamb_'
    hp = dict(OPT_VARIANTS[op])[variant]
    got = _host_state(op, host.sizes(), OPT_DTYPES[0], seed=72, shift=0)
    got.gnorm.fill_(0.5)
    target = got.params if zero == 'params' else got.grads
    target[1].zero_()
    if zero == 'update':
        assert hp['weight_decay'] == 0.0
        for s in got.state:
            s[1].zero_()
    cpu = got.clone()
    getattr(host.ops, op)(*got.args(op, hp))
    getattr(torch.ops.mp_wrappers, op)(*cpu.args(op, hp))
    _compare(op, got, cpu, f'{variant}: {zero} zero', op in BITWISE_OPS)
    assert all(torch.isfinite(p).all() for p in got.params)
