"""Guard canaries around the tensors a kernel writes (issue 25).

ASan sees a write past a tensor's end only when it leaves the allocation; a write into the same
allocation (tensors that are views of one flat buffer: FSDP flat parameters, flat master or state
buffers, chunks of one tensor) corrupts a neighbour silently, and a test that compares only the
outputs it expects never notices. So the kernel tests give every output and in-place tensor as a view
into a larger buffer, ``[guard | tensor | guard]`` in one storage, and compare the guards bit for bit
after every launch (``checked``) and at the end of every test (the autouse fixture in conftest.py):

* floating guards hold a signalling-NaN bit pattern (a kernel that read one and computed with it
  would produce a NaN, never a plausible number); other dtypes hold 0xA5 bytes;
* ``flat`` gives several tensors as adjacent views of one buffer (no gap between them), guards only
  at its two ends: a write past one tensor lands in its neighbour, which the comparison then sees;
* under the ASan build (``tools/cuda_host_check.sh``, libasan preloaded) the guards are also
  poisoned with ASan's manual poisoning API, so the first stray access from instrumented code (the
  host-executed kernels) aborts with the kernel line. Torch itself is not instrumented, so the tests
  fill and read the guards freely; they are unpoisoned around the bitwise check anyway (ASan
  intercepts memcmp/memcpy in every library).

Buffers made during a test are kept (strongly) until the end-of-test check, then dropped.
"""
import ctypes
from typing import List, Optional, Sequence

import torch

__all__ = ['GUARD', 'guarded', 'guarded_empty', 'guarded_full', 'flat', 'check_all', 'reset',
           'checked', 'asan_poisoning']

# Elements of guard on each side: more than one vector pack (4 elements) and a multiple of 16 bytes
# for every dtype, so a guarded tensor keeps the alignment (vector path or not) of its shift.
GUARD = 64

# Signalling NaNs (exponent all ones, quiet bit 0, payload non-zero), 0xA5-like payloads.
_SNAN_BITS = {
    torch.float64: (torch.int64, 0x7FF5A5A5A5A5A5A5),
    torch.float32: (torch.int32, 0x7FA5A5A5),
    torch.float16: (torch.int16, 0x7DA5),
    torch.bfloat16: (torch.int16, 0x7FA5),
}


class _Buffer:
    """One storage: ``[guard | payload | guard]``; ``check()`` compares the guards bitwise."""

    def __init__(self, numel: int, dtype: torch.dtype, device, lead: int):
        self.buf = torch.empty(lead + numel + GUARD, dtype=dtype, device=device)
        self.lead, self.numel = lead, numel
        self.want = self._pattern(lead + numel + GUARD)
        self._raw(self.buf).copy_(self.want)
        self.regions = [(0, lead), (lead + numel, lead + numel + GUARD)]
        _poison(self, True)

    @staticmethod
    def _raw(t):
        return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)

    def _pattern(self, n):
        dtype = self.buf.dtype
        if dtype in _SNAN_BITS:
            itype, bits = _SNAN_BITS[dtype]
            return torch.full((n,), bits, dtype=itype, device=self.buf.device).view(torch.uint8)
        return torch.full((n * self.buf.element_size(),), 0xA5, dtype=torch.uint8,
                          device=self.buf.device)

    def payload(self):
        return self.buf[self.lead:self.lead + self.numel]

    def check(self, what: str = '') -> None:
        _poison(self, False)
        try:
            es = self.buf.element_size()
            raw = self._raw(self.buf)
            for lo, hi in self.regions:
                got, want = raw[lo * es:hi * es], self.want[lo * es:hi * es]
                if not torch.equal(got, want):
                    bad = (got != want).nonzero().flatten()
                    side = 'before' if lo == 0 else 'after'
                    first = (lo * es + bad[0].item()) // es
                    rel = first - self.lead if side == 'before' else first - (self.lead + self.numel)
                    raise AssertionError(
                        f'guard canary {side} a {self.numel}-element {self.buf.dtype} tensor was '
                        f'overwritten ({bad.numel()} bytes; first at element {rel:+d} from its '
                        f'{"start" if side == "before" else "end"}){": " + what if what else ""}')
        finally:
            _poison(self, True)


_live: List[_Buffer] = []


def guarded_empty(shape, dtype=torch.float32, device='cpu', shift: int = 0) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` inside a guarded buffer, ``shift`` elements past an
    aligned start (shift % 4 != 0: misaligned storage, the kernels' guarded path)."""
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
    numel = 1
    for s in shape:
        numel *= s
    b = _Buffer(numel, dtype, device, GUARD + shift)
    _live.append(b)
    return b.payload().view(shape)


def guarded(t: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """A copy of ``t`` (contiguous) inside a guarded buffer."""
    out = guarded_empty(t.shape, t.dtype, t.device, shift)
    out.copy_(t)
    return out


def guarded_full(shape, value, dtype=torch.float32, device='cpu', shift: int = 0):
    out = guarded_empty(shape, dtype, device, shift)
    out.fill_(value)
    return out


def flat(tensors: Sequence[torch.Tensor], shift: int = 0) -> List[torch.Tensor]:
    """Copies of ``tensors`` (one dtype) as adjacent views of one flat buffer, no gap between them,
    guards at the two ends only (an FSDP flat parameter, a flat master or state buffer)."""
    dtype = tensors[0].dtype
    assert all(t.dtype == dtype for t in tensors), 'flat: one dtype per buffer'
    sizes = [t.numel() for t in tensors]
    whole = guarded_empty(sum(sizes), dtype, tensors[0].device, shift)
    out = [v.view(t.shape) for v, t in zip(whole.split(sizes), tensors)]
    for o, t in zip(out, tensors):
        o.copy_(t)
    return out


def check_all(what: str = '') -> None:
    """Every guard made since the last ``reset`` must still hold its pattern."""
    for b in _live:
        b.check(what)


def reset() -> None:
    for b in _live:
        _poison(b, False)
    _live.clear()


class checked:
    """An op namespace (``torch.ops.mp_wrappers``, a host module's) whose every call is followed
    by ``check_all()`` naming the op: a stray write is reported at the launch that made it."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        op = getattr(self._ops, name)

        def call(*args, **kwargs):
            out = op(*args, **kwargs)
            check_all(f'after {name}')
            return out
        call.__name__ = name
        return call


# ---- ASan manual poisoning ------------------------------------------------------------------------

def _asan_api():
    """(poison, unpoison) from the ASan runtime when this process has it (LD_PRELOAD), else None."""
    try:
        lib = ctypes.CDLL(None)
        poison = lib.__asan_poison_memory_region
        unpoison = lib.__asan_unpoison_memory_region
    except (OSError, AttributeError):
        return None
    for fn in (poison, unpoison):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = None
    return poison, unpoison


_ASAN: Optional[tuple] = _asan_api()


def asan_poisoning() -> bool:
    """Whether the guards are poisoned (the ASan runtime is in this process)."""
    return _ASAN is not None


def _poison(b: _Buffer, on: bool) -> None:
    if _ASAN is None or b.buf.device.type != 'cpu':
        return
    fn = _ASAN[0] if on else _ASAN[1]
    es, base = b.buf.element_size(), b.buf.data_ptr()
    for lo, hi in b.regions:
        fn(base + lo * es, (hi - lo) * es)
