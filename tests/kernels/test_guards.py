"""The guard canaries of tests/_guards.py catch what they are for: a write one element past a
tensor's end or before its start, in the same allocation."""
import pytest
import torch

import _guards
from _guards import GUARD, check_all, flat, guarded, guarded_empty

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.bool]


def _past(t, k):
    """Element k of t's storage counted from t's first element (k < 0 or k >= numel: a guard)."""
    return t.as_strided((1,), (1,), t.storage_offset() + k)


@pytest.mark.parametrize('shift', [0, 3])
@pytest.mark.parametrize('dtype', DTYPES, ids=str)
def test_guards_catch_one_element_past_either_end(dtype, shift):
    for k in (-1, 5, -GUARD, 5 + GUARD - 1):
        _guards.reset()
        t = guarded(torch.zeros(5, dtype=dtype), shift)
        assert t.storage_offset() == GUARD + shift
        check_all()  # untouched: passes
        _past(t, k).fill_(0)
        with pytest.raises(AssertionError, match='guard canary'):
            check_all()
    _guards.reset()


def test_float_guards_are_signalling_nans():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = guarded_empty(4, dtype)
        g = _past(t, 4)
        assert torch.isnan(g).all()
        # The quiet bit (the mantissa's top bit) is clear: a signalling NaN.
        bits = {torch.float64: 51, torch.float32: 22, torch.float16: 9, torch.bfloat16: 6}[dtype]
        itype = {8: torch.int64, 4: torch.int32, 2: torch.int16}[g.element_size()]
        assert (g.view(itype).item() >> bits) & 1 == 0
    others = guarded_empty(4, torch.int32)
    assert _past(others, -1).view(torch.uint8).tolist() == [0xA5] * 4


def test_flat_views_are_adjacent_and_guarded_at_the_ends():
    ts = flat([torch.ones(3), torch.full((2,), 2.0), torch.full((4,), 3.0)], shift=1)
    assert [t.storage_offset() for t in ts] == [GUARD + 1, GUARD + 4, GUARD + 6]
    assert all(t.untyped_storage().data_ptr() == ts[0].untyped_storage().data_ptr() for t in ts)
    _past(ts[0], 3).fill_(9.0)  # past the first tensor: the second one's first element
    assert ts[1][0].item() == 9.0
    check_all()  # inside the buffer: only the neighbour's own comparison can see it
    _past(ts[2], 4).fill_(9.0)
    with pytest.raises(AssertionError, match='after a 9-element'):
        check_all()
    _guards.reset()


def test_checked_ops_report_the_op():
    t = guarded(torch.zeros(4))

    class Ops:
        @staticmethod
        def bad_(x):
            _past(x, 4).fill_(1.0)

    with pytest.raises(AssertionError, match='after bad_'):
        _guards.checked(Ops).bad_(t)
    _guards.reset()


@pytest.mark.skipif(not _guards.asan_poisoning(),
                    reason='ASan runtime not in this process (tools/cuda_host_check.sh preloads it)')
def test_guards_are_poisoned_under_asan():
    """Under the sanitizer pass the guards are poisoned (the first access from instrumented code,
    a host-executed kernel, aborts), the tensor is not, and reset() unpoisons."""
    import ctypes
    is_poisoned = ctypes.CDLL(None).__asan_region_is_poisoned
    is_poisoned.argtypes, is_poisoned.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p
    t = guarded(torch.zeros(6), shift=2)  # 8-byte aligned end: ASan's granule
    end = t.data_ptr() + t.numel() * 4
    assert not is_poisoned(t.data_ptr(), t.numel() * 4)
    assert is_poisoned(end, 4) == end
    assert is_poisoned(t.data_ptr() - 8, 8)
    check_all()  # reads the guards (unpoisoned around the comparison), poisons them again
    assert is_poisoned(end, 4) == end
    _guards.reset()
    assert not is_poisoned(end, 4)
