"""Kernels of the multi-tensor building-block ops against the references and a float64 oracle.

Every op is called two ways: through the public API (``mp_wrappers.ops``, which validates and
dispatches) and directly as ``torch.ops.mp_wrappers.<op>``. Sizes and planted inf/nan positions follow
apex's fuzz tests; CUDA cases are the same tests, skipped without a GPU.
"""
import contextlib
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

from _compat import needs_opcheck, opcheck
import mp_wrappers
import mp_wrappers.ops as mops
from mp_wrappers.ops import _extension, reference

from _guards import checked, guarded
from _tolerances import TOL


def tolerance(*dtypes):
    """TOL entry for a result that went through all of ``dtypes``: the loosest of them."""
    return dict(rtol=max(TOL[d]['rtol'] for d in dtypes), atol=max(TOL[d]['atol'] for d in dtypes))


# The kernels and (since issue 12) the references accumulate norms in double, but in different
# orders (the references used torch's float32 reductions before, which drifted by up to ~2e-5
# relative on these sizes). Kernel-vs-reference agreement of norms is checked one rounding of fp16
# apart: any real kernel bug (a missed chunk, tensor or scale) is caught by the float64 oracle
# comparison, which is the tight one.
REFERENCE_NORM_TOL = TOL[torch.float16]

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason='no CUDA device'))]
IMPLS = ('api', 'op')
INF, NAN = float('inf'), float('nan')

# apex's fuzz sizes (sizea, sizeb) with lists repeated 1 or 55 times. Long repeat-55 lists of the
# big sizes would dominate the run time on 2 cores, so 55 is used with sizes below one chunk (where
# many tensors share one launch / thread split) and 7777*77 runs with repeat 1 only; the chunk
# boundaries 65535/65536/65537 are also crossed by the 55-times-repeated lists of other tests.
FUZZ = [
    (777, 555, 1), (777, 555, 55),
    (65535, 1, 1), (65536, 1, 1), (65537, 1, 1),
    (33333, 555, 1), (33333, 555, 55),
    (7777 * 77, 555, 1),
]
FUZZ_IDS = [f'{a}x{b}x{r}' for a, b, r in FUZZ]
# All 9 input/output dtype pairs on the repeat-1 sizes; the same-dtype pairs on the long lists.
SCALE_CASES = [pytest.param(i, o, a, b, r, id=f'{i}-{o}-{a}x{b}x{r}'.replace('torch.', ''))
               for (a, b, r) in FUZZ for i, o in itertools.product(FLOATS, FLOATS)
               if r == 1 or i == o]
PLANT_AT = ('first', 'middle', 'last')


@pytest.fixture(scope='module', autouse=True)
def _require_extension():
    # Without the extension the public API runs the references and these comparisons would be
    # reference-against-reference: fail loudly instead of passing for nothing.
    ext = _extension.extension()
    assert ext is not None, f'mp_wrappers._C did not load: {mops.backend()["error"]}'


@pytest.fixture(scope='module', autouse=True)
def _one_thread_by_default():
    # The references and oracles run hundreds of small torch ops; with OpenMP threads on a shared,
    # busy 2-core machine each op's fork/join spin-waits and the file takes minutes. Run them on one
    # thread and give the kernels two where the thread split matters (_kernel_threads).
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@contextlib.contextmanager
def _kernel_threads(n=2):
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _make_list(sizea, sizeb, repeat, dtype, device, seed=0, scale=10.0):
    """Each tensor between guard canaries (tests/_guards.py): in-place ops write these."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(repeat):
        for n in (sizea, sizeb):
            out.append(guarded((torch.randn(n, generator=gen) * scale).to(dtype=dtype,
                                                                           device=device)))
    return out


def _flag(device):
    """A found_inf flag between guard canaries."""
    return guarded(mops.new_found_inf(device))


def _plant(tensors, where, value):
    """Put ``value`` at the first element, the middle, or the last element of the last tensor."""
    t = tensors[-1]
    idx = {'first': 0, 'middle': t.numel() // 2, 'last': t.numel() - 1}[where]
    t.view(-1)[idx] = value


def _assert_same(actual, expected):
    """Bit-exact equality, with NaN == NaN (torch's NaN bit patterns differ between its own paths)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), 'NaN positions differ'
    a, e = actual[~nan_a], expected[~nan_e]
    mismatch = (a != e).sum().item()
    assert mismatch == 0, (f'{mismatch} of {a.numel()} elements differ; first: '
                           f'{a[a != e][:3].tolist()} vs {e[a != e][:3].tolist()}')


# ---- multi_tensor_scale ----------------------------------------------------------------------

def _scale(impl, inputs, outputs, scale, found_inf):
    if impl == 'api':
        return mops.multi_tensor_scale(inputs, outputs, scale, found_inf)
    s = torch.tensor([scale], dtype=torch.float32, device=found_inf.device)
    checked(torch.ops.mp_wrappers).multi_tensor_scale_(inputs, outputs, s, found_inf)
    return found_inf


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('in_dtype,out_dtype,sizea,sizeb,repeat', SCALE_CASES)
def test_scale_matches_reference_and_oracle(device, in_dtype, out_dtype, sizea, sizeb, repeat,
                                           cpu_isa):
    # Fuzz sizes through the public API; the direct-op path is covered by the tests below.
    scale = 1.0 / 3.0  # not a power of two: the products need rounding
    inputs = _make_list(sizea, sizeb, repeat, in_dtype, device)
    outputs = [guarded(torch.full_like(t, 7.0, dtype=out_dtype)) for t in inputs]
    expected = [torch.empty_like(t) for t in outputs]
    ref_flag = _flag(device)
    reference.multi_tensor_scale_(inputs, expected, torch.tensor([scale], device=device), ref_flag)
    with _kernel_threads():
        flag = _scale('api', inputs, outputs, scale, _flag(device))
    assert flag.item() == 0.0 and ref_flag.item() == 0.0
    _assert_same(torch.cat(outputs), torch.cat(expected))
    oracle = torch.cat(inputs).double() * torch.tensor(scale, dtype=torch.float32).double()
    torch.testing.assert_close(torch.cat(outputs).double(), oracle,
                               **tolerance(in_dtype, out_dtype))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('dtype', FLOATS)
def test_scale_in_place(device, impl, dtype):
    grads = _make_list(65537, 777, 3, dtype, device)
    expected = [(g.float() * 0.25).to(dtype) for g in grads]
    flag = _scale(impl, grads, grads, 0.25, _flag(device))
    assert flag.item() == 0.0
    for g, e in zip(grads, expected):
        _assert_same(g, e)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('value', [INF, -INF, NAN], ids=['inf', '-inf', 'nan'])
@pytest.mark.parametrize('where', PLANT_AT)
@pytest.mark.parametrize('in_dtype,out_dtype', [(torch.float16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.float16)])
def test_scale_flags_nonfinite(device, impl, value, where, in_dtype, out_dtype):
    inputs = _make_list(65537, 555, 2, in_dtype, device)
    _plant(inputs, where, value)
    outputs = [guarded(torch.empty_like(t, dtype=out_dtype)) for t in inputs]
    flag = _scale(impl, inputs, outputs, 0.5, _flag(device))
    assert flag.item() == 1.0
    expected = [(t.float() * 0.5).to(out_dtype) for t in inputs]
    for out, exp in zip(outputs, expected):  # the outputs are still written
        _assert_same(out, exp)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('impl', IMPLS)
def test_scale_checks_input_not_product(device, impl):
    # inf * 0 = nan and huge * huge = inf: only the first is an input overflow.
    flag = _scale(impl, [torch.tensor([1.0, INF, 2.0], device=device)],
                  [torch.empty(3, device=device)], 0.0, _flag(device))
    assert flag.item() == 1.0
    out = torch.empty(3, device=device)
    flag = _scale(impl, [torch.tensor([3e38, 1.0, 2.0], device=device)], [out], 1e10,
                  _flag(device))
    assert flag.item() == 0.0 and out[0].item() == INF


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('impl', IMPLS)
def test_found_inf_accumulates(device, impl):
    flag = _flag(device)
    bad = [torch.tensor([NAN, 1.0], device=device)]
    good = [torch.tensor([1.0, 2.0], device=device)]
    _scale(impl, bad, [torch.empty(2, device=device)], 1.0, flag)
    assert flag.item() == 1.0
    _scale(impl, good, [torch.empty(2, device=device)], 1.0, flag)  # a clean call never clears it
    assert flag.item() == 1.0
    if impl == 'api':
        mops.multi_tensor_unscale_l2norm(good, 1.0, flag)
        mops.multi_tensor_axpby(good, good, [torch.empty(2, device=device)], 1.0, 1.0, -1, flag)
    else:
        one = torch.ones(1, device=device)
        torch.ops.mp_wrappers.multi_tensor_unscale_l2norm(good, one, flag, False)
        torch.ops.mp_wrappers.multi_tensor_axpby_(good, good, [torch.empty(2, device=device)],
                                                  1.0, 1.0, -1, flag)
    assert flag.item() == 1.0


# ---- multi_tensor_l2norm / multi_tensor_unscale_l2norm ----------------------------------------

def _l2norm(impl, tensors, per_tensor, inv_scale=None, found_inf=None):
    """(total, per_tensor or None); the unscale variant when inv_scale is given."""
    if inv_scale is None:
        if impl == 'api':
            return mops.multi_tensor_l2norm(tensors, per_tensor)
        total, norms = torch.ops.mp_wrappers.multi_tensor_l2norm(tensors, per_tensor)
    else:
        if impl == 'api':
            total, norms, _ = mops.multi_tensor_unscale_l2norm(tensors, inv_scale, found_inf,
                                                               per_tensor)
            return total, norms
        s = torch.tensor([inv_scale], dtype=torch.float32, device=found_inf.device)
        total, norms = torch.ops.mp_wrappers.multi_tensor_unscale_l2norm(tensors, s, found_inf,
                                                                         per_tensor)
    assert total.dtype == torch.float32 and total.shape == ()
    assert norms.dtype == torch.float32 and norms.shape == ((len(tensors),) if per_tensor else (0,))
    return total, (norms if per_tensor else None)


def _oracle_norms(tensors, inv_scale=1.0):
    s = torch.tensor(inv_scale, dtype=torch.float32).double()
    per = torch.stack([(t.cpu().double() * s).pow(2).sum().sqrt() for t in tensors])  # on the CPU
    return per.pow(2).sum().sqrt(), per


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', FLOATS)
@pytest.mark.parametrize('unscale', [False, True], ids=['l2norm', 'unscale_l2norm'])
@pytest.mark.parametrize('sizea,sizeb,repeat', FUZZ, ids=FUZZ_IDS)
def test_l2norm_matches_reference_and_oracle(device, dtype, unscale, sizea, sizeb, repeat,
                                            cpu_isa):
    tensors = _make_list(sizea, sizeb, repeat, dtype, device, seed=1)
    inv = 1.0 / 1024.0 + 1e-4 if unscale else 1.0
    flag = _flag(device)
    with _kernel_threads():
        total, per = _l2norm('api', tensors, True, inv if unscale else None, flag)
    o_total, o_per = _oracle_norms(tensors, inv)
    if unscale:
        r_total, r_per = reference.multi_tensor_unscale_l2norm(
            tensors, torch.tensor([inv], device=device), _flag(device), True)
    else:
        r_total, r_per = reference.multi_tensor_l2norm(tensors, True)
    tol = tolerance(torch.float32)
    torch.testing.assert_close(total.double().cpu(), o_total.cpu(), **tol)
    torch.testing.assert_close(per.double().cpu(), o_per.cpu(), **tol)
    torch.testing.assert_close(total, r_total, **REFERENCE_NORM_TOL)
    torch.testing.assert_close(per, r_per, **REFERENCE_NORM_TOL)
    assert flag.item() == 0.0


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('per_tensor', [False, True])
@pytest.mark.parametrize('unscale', [False, True], ids=['l2norm', 'unscale_l2norm'])
def test_l2norm_mixed_dtypes_and_empty_tensors(device, impl, per_tensor, unscale):
    gen = torch.Generator().manual_seed(2)
    tensors = [(torch.randn(n, generator=gen) * 3).to(device=device, dtype=d)
               for n, d in zip([65537, 0, 31, 100000, 1], itertools.cycle(FLOATS))]
    flag = _flag(device)
    total, per = _l2norm(impl, tensors, per_tensor, 0.5 if unscale else None, flag)
    o_total, o_per = _oracle_norms(tensors, 0.5 if unscale else 1.0)
    torch.testing.assert_close(total.double().cpu(), o_total, **tolerance(torch.float32))
    if per_tensor:
        torch.testing.assert_close(per.double().cpu(), o_per, **tolerance(torch.float32))
        assert per[1].item() == 0.0
    else:
        assert per is None


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('value', [INF, NAN], ids=['inf', 'nan'])
@pytest.mark.parametrize('where', PLANT_AT)
@pytest.mark.parametrize('dtype', FLOATS)
def test_unscale_l2norm_flags_nonfinite(device, impl, value, where, dtype):
    tensors = _make_list(65537, 777, 2, dtype, device)
    _plant(tensors, where, value)
    flag = _flag(device)
    total, per = _l2norm(impl, tensors, True, 0.5, flag)
    assert flag.item() == 1.0
    assert not torch.isfinite(total).item() and not torch.isfinite(per[-1]).item()
    torch.testing.assert_close(per[:-1].double().cpu(), _oracle_norms(tensors[:-1], 0.5)[1],
                               **tolerance(torch.float32))


# The CPU kernel finds non-finite grads two ways: from the chunk's own sum of squares when
# inv_scale is finite with |inv_scale| <= 1 (every loss scale >= 1), with a probe on the raw values
# otherwise. Both must flag exactly what the reference flags: the raw values, not the unscaled ones.
@pytest.mark.parametrize('inv_scale', [2.0 ** -16, 1.0, 0.0, -0.5, 2.0, 3.0, INF],
                         ids=['pow2', 'one', 'zero', 'negative', 'two', 'three', 'inf'])
@pytest.mark.parametrize('value', [INF, -INF, NAN, 3e38, None],
                         ids=['inf', '-inf', 'nan', 'finite-overflowing', 'clean'])
@pytest.mark.parametrize('dtype', FLOATS)
def test_unscale_l2norm_flag_and_norm_like_reference_for_any_inv_scale(inv_scale, value, dtype,
                                                                      cpu_isa):
    tensors = _make_list(65537, 40, 2, dtype, 'cpu', seed=3)
    if value is not None:
        if value == 3e38 and dtype != torch.float32:
            value = torch.finfo(dtype).max  # finite, and overflows fp32 once multiplied by 2 or 3
        tensors[1][-1] = value  # the second chunk of a tensor: per-chunk flags are combined
    s = torch.tensor([inv_scale])
    flag, r_flag = torch.zeros(1), torch.zeros(1)
    with _kernel_threads():
        total, per = torch.ops.mp_wrappers.multi_tensor_unscale_l2norm(tensors, s, flag, True)
    r_total, r_per = reference.multi_tensor_unscale_l2norm(tensors, s, r_flag, True)
    raw_bad = value is not None and not math.isfinite(value)
    assert flag.item() == r_flag.item() == float(raw_bad)
    for got, want in zip(torch.cat([total.reshape(1), per]), torch.cat([r_total.reshape(1), r_per])):
        if math.isfinite(want.item()):
            torch.testing.assert_close(got, want, **REFERENCE_NORM_TOL)
        else:  # inf or nan alike: the kernel's double sum may give inf where fp32 gives nan
            assert not math.isfinite(got.item())


@pytest.mark.parametrize('device', DEVICES)
def test_l2norm_does_not_flag_large_finite_values(device):
    # The sum of squares of 1e30 overflows fp32 but the values are finite: no flag, and the
    # double accumulation still gives the right norm.
    tensors = [torch.full((1000,), 1e30, device=device)]
    flag = _flag(device)
    total, _, flag = mops.multi_tensor_unscale_l2norm(tensors, 1.0, flag)
    assert flag.item() == 0.0
    if device == 'cpu':
        torch.testing.assert_close(total.double().cpu(), torch.tensor(1e30 * 1000 ** 0.5,
                                                                      dtype=torch.float64),
                                   **tolerance(torch.float32))


# ---- multi_tensor_axpby ------------------------------------------------------------------------

def _axpby(impl, x, y, out, a, b, arg_to_check, found_inf):
    if impl == 'api':
        return mops.multi_tensor_axpby(x, y, out, a, b, arg_to_check, found_inf)
    checked(torch.ops.mp_wrappers).multi_tensor_axpby_(x, y, out, a, b, arg_to_check,
                                                      found_inf)
    return found_inf


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('x_dtype,y_dtype,out_dtype', list(itertools.product(FLOATS, FLOATS,
                                                                              FLOATS)))
def test_axpby_all_dtype_combinations(device, impl, x_dtype, y_dtype, out_dtype):
    x = _make_list(777, 65537, 2, x_dtype, device, seed=3)
    y = _make_list(777, 65537, 2, y_dtype, device, seed=4)
    out = [guarded(torch.empty_like(t, dtype=out_dtype)) for t in x]
    expected = [torch.empty_like(t) for t in out]
    a, b = 0.3, -1.7
    reference.multi_tensor_axpby_(x, y, expected, a, b, -1, _flag(device))
    flag = _axpby(impl, x, y, out, a, b, -1, _flag(device))
    assert flag.item() == 0.0
    o, xd, yd = torch.cat(out), torch.cat(x).double(), torch.cat(y).double()
    _assert_same(o, torch.cat(expected))
    # a*x + b*y can cancel, so the rounding error is relative to the terms, not the result.
    rtol = tolerance(x_dtype, y_dtype, out_dtype)['rtol']
    terms = abs(a) * xd.abs().max() + abs(b) * yd.abs().max()
    torch.testing.assert_close(o.double(), a * xd + b * yd, rtol=rtol, atol=rtol * terms.item())


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('sizea,sizeb,repeat', FUZZ, ids=FUZZ_IDS)
def test_axpby_fuzz_sizes_in_place(device, sizea, sizeb, repeat, cpu_isa):
    x = _make_list(sizea, sizeb, repeat, torch.bfloat16, device, seed=5)
    y = _make_list(sizea, sizeb, repeat, torch.float32, device, seed=6)
    expected = [(2.0 * xi.float() + 0.5 * yi.float()) for xi, yi in zip(x, y)]
    with _kernel_threads():
        flag = mops.multi_tensor_axpby(x, y, y, 2.0, 0.5)  # out aliases y
    assert flag.item() == 0.0
    _assert_same(torch.cat(y), torch.cat(expected))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('where', PLANT_AT)
@pytest.mark.parametrize('planted_in,arg_to_check,flagged', [
    ('x', -1, True), ('y', -1, True), ('x', 0, True), ('y', 0, False), ('x', 1, False),
    ('y', 1, True)])
def test_axpby_arg_to_check(device, impl, where, planted_in, arg_to_check, flagged):
    x = _make_list(65537, 555, 2, torch.float16, device, seed=7)
    y = _make_list(65537, 555, 2, torch.float32, device, seed=8)
    _plant(x if planted_in == 'x' else y, where, NAN)
    out = [guarded(torch.empty_like(t)) for t in y]
    flag = _axpby(impl, x, y, out, 1.0, 1.0, arg_to_check, _flag(device))
    assert flag.item() == (1.0 if flagged else 0.0)


# ---- update_scale_hysteresis_ ------------------------------------------------------------------

def _scaler_state(device, scale, growth=0, hyst=2, dtype=torch.int32):
    return (guarded(torch.tensor([scale], dtype=torch.float32, device=device)),
            guarded(torch.tensor([growth], dtype=dtype, device=device)),
            guarded(torch.tensor([hyst], dtype=dtype, device=device)))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('tracker_dtype', [torch.int32, torch.int64])
def test_update_scale_hysteresis_sequence(device, impl, tracker_dtype):
    # A sequence that exercises hysteresis, backoff to the floor, growth and the ceiling.
    flags = [1, 1, 1, 0, 0, 0, 1] + [0] * 15 + [1] * 8 + [0, 0, 0]
    args = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2,
                min_scale=2.0, max_scale=64.0)
    k_state = _scaler_state(device, 16.0, dtype=tracker_dtype)
    r_state = _scaler_state(device, 16.0, dtype=tracker_dtype)
    fn = (mops.update_scale_hysteresis_ if impl == 'api'
          else torch.ops.mp_wrappers.update_scale_hysteresis_)
    history = []
    for f in flags:
        found_inf = torch.tensor([float(f)], device=device)
        fn(*k_state, found_inf, *args.values())
        reference.update_scale_hysteresis_(*r_state, found_inf, **args)
        for k, r in zip(k_state, r_state):
            assert torch.equal(k, r), (flags, history, k, r)
        history.append(k_state[0].item())
    assert min(history) == 2.0 and max(history) == 64.0  # the sequence reached floor and ceiling


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('impl', IMPLS)
def test_update_scale_never_grows_to_inf(device, impl):
    fn = (mops.update_scale_hysteresis_ if impl == 'api'
          else torch.ops.mp_wrappers.update_scale_hysteresis_)
    state = _scaler_state(device, 3e38, growth=0, hyst=1)
    fn(*state, torch.zeros(1, device=device), 2.0, 0.5, 1, 1, 0.0, INF)
    assert state[0].item() == pytest.approx(3e38) and state[1].item() == 0


# ---- validation ----------------------------------------------------------------------------------

def _direct_calls(x, y, out, flag):
    s = torch.ones(1)
    return {
        'scale': lambda: torch.ops.mp_wrappers.multi_tensor_scale_(x, out, s, flag),
        'l2norm': lambda: torch.ops.mp_wrappers.multi_tensor_l2norm(x + y, True),
        'unscale_l2norm': lambda: torch.ops.mp_wrappers.multi_tensor_unscale_l2norm(
            x + y, s, flag, True),
        'axpby': lambda: torch.ops.mp_wrappers.multi_tensor_axpby_(x, y, out, 1.0, 1.0, -1,
                                                                   flag),
    }


@pytest.mark.parametrize('op', ['scale', 'axpby'])
def test_direct_op_rejects_mismatched_lengths(op):
    x, y = [torch.ones(3), torch.ones(4)], [torch.ones(3), torch.ones(4)]
    with pytest.raises(RuntimeError, match='has 1 tensors but'):
        _direct_calls(x, y, [torch.ones(3)], torch.zeros(1))[op]()


@pytest.mark.parametrize('op', ['scale', 'l2norm', 'unscale_l2norm', 'axpby'])
@pytest.mark.parametrize('bad,match', [
    ('noncontiguous', 'is not contiguous'), ('int', 'expected Float, Half or BFloat16'),
    ('numel', 'elements but')])
def test_direct_op_rejects_bad_tensors(op, bad, match):
    x, y, out = [torch.ones(6)], [torch.ones(6)], [torch.ones(6)]
    if bad == 'noncontiguous':
        x[0] = torch.ones(6, 2)[:, 0]
    elif bad == 'int':
        x[0] = torch.ones(6, dtype=torch.int32)
    elif bad == 'numel':
        if op in ('l2norm', 'unscale_l2norm'):
            pytest.skip('a single list has no parallel numel to mismatch')
        out[0] = torch.ones(5)
    with pytest.raises(RuntimeError, match=match):
        _direct_calls(x, y, out, torch.zeros(1))[op]()


@pytest.mark.parametrize('op', ['scale', 'unscale_l2norm', 'axpby'])
def test_direct_op_rejects_bad_found_inf(op):
    with pytest.raises(RuntimeError, match='found_inf must be a 1-element float32 tensor'):
        _direct_calls([torch.ones(3)], [torch.ones(3)], [torch.ones(3)],
                      torch.zeros(1, dtype=torch.int32))[op]()


def test_direct_op_rejects_bad_arg_to_check_and_scaler_state():
    with pytest.raises(RuntimeError, match='arg_to_check=2'):
        torch.ops.mp_wrappers.multi_tensor_axpby_([torch.ones(2)], [torch.ones(2)],
                                                  [torch.ones(2)], 1.0, 1.0, 2, torch.zeros(1))
    with pytest.raises(RuntimeError, match='growth_tracker must be a 1-element int32'):
        torch.ops.mp_wrappers.update_scale_hysteresis_(
            torch.ones(1), torch.zeros(1), torch.ones(1, dtype=torch.int32), torch.zeros(1),
            2.0, 0.5, 10, 1, 0.0, INF)


def test_mixed_devices_are_rejected():
    cpu, meta = torch.ones(3), torch.ones(3, device='meta')
    with pytest.raises(ValueError, match='must share a device'):
        mops.multi_tensor_scale([cpu], [meta], 2.0)
    if mp_wrappers.compat.has('fake_kernels'):  # the Meta kernel is the fake one (torch >= 2.4)
        with pytest.raises(ValueError, match='must share a device'):  # through the Meta kernel
            torch.ops.mp_wrappers.multi_tensor_scale_([cpu], [meta], torch.ones(1), torch.zeros(1))
    with pytest.raises(ValueError, match='must share a device'):
        mops.multi_tensor_l2norm([cpu, meta])


def test_public_api_rejects_bad_input():
    with pytest.raises(ValueError, match='the lists must be parallel'):
        mops.multi_tensor_scale([torch.ones(2)], [], 1.0)
    with pytest.raises(TypeError, match='expected float32, float16 or bfloat16'):
        mops.multi_tensor_l2norm([torch.ones(2, dtype=torch.int64)])
    with pytest.raises(ValueError, match='not contiguous'):
        mops.multi_tensor_unscale_l2norm([torch.ones(4, 2).t()], 1.0)
    with pytest.raises(ValueError, match='arg_to_check'):
        mops.multi_tensor_axpby([torch.ones(2)], [torch.ones(2)], [torch.ones(2)], 1, 1, 5)


# ---- opcheck, torch.compile-facing fakes -------------------------------------------------------

def _opcheck_cases(device):
    x = _make_list(777, 65537, 1, torch.float16, device)
    y = _make_list(777, 65537, 1, torch.float32, device)
    f = _flag(device)
    s = torch.tensor([0.5], device=device)
    i32 = dict(dtype=torch.int32, device=device)
    return {
        'multi_tensor_scale_': (x, [t.clone() for t in y], s, f),
        'multi_tensor_l2norm': (x + y, True),
        'multi_tensor_unscale_l2norm': (x + y, s, f, False),
        'multi_tensor_axpby_': (x, y, [t.clone() for t in x], 2.0, -1.0, -1, f),
        'update_scale_hysteresis_': (torch.tensor([8.0], device=device), torch.zeros(1, **i32),
                                     torch.ones(1, **i32), f, 2.0, 0.5, 10, 1, 1.0, 2.0 ** 24),
    }


@needs_opcheck
@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('op', list(_opcheck_cases('cpu')))
def test_opcheck(device, op):
    opcheck(getattr(torch.ops.mp_wrappers, op), _opcheck_cases(device)[op])


@needs_opcheck
def test_fake_kernels_give_output_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        total, norms = torch.ops.mp_wrappers.multi_tensor_l2norm(
            [torch.empty(5, dtype=torch.bfloat16), torch.empty(7)], True)
        assert total.shape == () and norms.shape == (2,) and norms.dtype == torch.float32
        total, norms = torch.ops.mp_wrappers.multi_tensor_unscale_l2norm(
            [torch.empty(5)], torch.ones(1), torch.zeros(1), False)
        assert total.dtype == torch.float32 and norms.shape == (0,)


# ---- determinism across ISAs and threads ---------------------------------------------------------

def _isa_results(threads: int) -> dict:
    """The ops' results on one fixed input set, with the flavour in use now and ``threads``."""
    from mp_wrappers.ops._extension import extension
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops = torch.ops.mp_wrappers
        gen = torch.Generator().manual_seed(0)
        dts = [torch.float32, torch.float16, torch.bfloat16]
        sizes = [1, 15, 17, 33, 777, 65535, 65537, 100003]
        xs = [(torch.randn(n, generator=gen) * 50).to(dts[i % 3]) for i, n in enumerate(sizes)]
        ys = [(torch.randn(n, generator=gen) * 50).to(dts[(i + 1) % 3]) for i, n in enumerate(sizes)]
        xs[3][5] = float('inf')
        out = {'isa': extension().cpu_isa()}
        f = torch.zeros(1)
        o = [torch.empty(n, dtype=dts[(i + 2) % 3]) for i, n in enumerate(sizes)]
        ops.multi_tensor_scale_(xs, o, torch.tensor([1 / 3.0]), f)
        out['scale'] = [t.float() for t in o] + [f.clone()]
        ops.multi_tensor_axpby_(xs, ys, o, 0.7, -1.3, 1, f)
        out['axpby'] = [t.float() for t in o]
        out['l2norm'] = list(ops.multi_tensor_l2norm(ys, True))
        f = torch.zeros(1)
        out['unscale_l2norm'] = list(ops.multi_tensor_unscale_l2norm(
            ys, torch.tensor([1e-3]), f, True)) + [f]
        return out
    finally:
        torch.set_num_threads(before)


_ENV_SCRIPT = r'''
import sys, torch
sys.path.insert(0, sys.argv[3]); sys.path.insert(0, sys.argv[4])
import test_multi_tensor as T
torch.save(T._isa_results(int(sys.argv[2])), sys.argv[1])
'''


def _run_with_env_isa(tmp_path, isa, threads):
    """MP_WRAPPERS_CPU_ISA is read when the extension first picks a flavour: a fresh process."""
    path = tmp_path / f'{isa}-{threads}.pt'
    env = dict(os.environ, MP_WRAPPERS_CPU_ISA=isa)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, '-c', _ENV_SCRIPT, str(path), str(threads), tests, here],
                   env=env, check=True, cwd=os.path.dirname(tests))
    return torch.load(path)


def _run_switched(isa, threads):
    from mp_wrappers.ops._extension import extension
    ext = extension()
    order = ['baseline', 'avx2', 'avx512']
    isa = order[min(order.index(isa), order.index(ext.cpu_isa_hardware()))]
    previous = ext._set_cpu_isa(isa)
    try:
        return _isa_results(threads)
    finally:
        ext._set_cpu_isa(previous)


def test_forced_isas_and_thread_counts_give_identical_results(tmp_path):
    results = {('avx2', 1): _run_with_env_isa(tmp_path, 'avx2', 1)}
    results.update({(isa, th): _run_switched(isa, th) for isa, th in [('avx512', 2),
                                                                      ('baseline', 2)]})
    from mp_wrappers.ops._extension import extension
    # The hardware's widest flavour, not this process's (MP_WRAPPERS_CPU_ISA may narrow that).
    native = extension().cpu_isa_hardware()
    order = ['baseline', 'avx2', 'avx512']
    for (isa, _), res in results.items():
        # A forced ISA never exceeds what the hardware has.
        expect = order[min(order.index(isa), order.index(native))]
        assert res['isa'] == expect
    assert results[('baseline', 2)]['isa'] == 'baseline'
    ref = results[('baseline', 2)]
    for key, res in results.items():
        for name in ('scale', 'axpby', 'l2norm', 'unscale_l2norm'):
            for a, b in zip(res[name], ref[name]):
                _assert_same(a, b)
    assert ref['scale'][-1].item() == 1.0 and ref['unscale_l2norm'][-1].item() == 0.0
