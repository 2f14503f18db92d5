"""O1 through ``torch.autocast``, and apex's function annotations without patching torch.

apex O1 monkey-patched ``torch.*`` to insert casts; ``torch.autocast`` applies the same kind of policy
inside the dispatcher (matmul-like ops in half, reductions and most losses in fp32, mixed-type ops
promoted), so :func:`o1_context` simply enters it. The decorators below give user functions apex's
``half_function`` / ``float_function`` / ``promote_function`` behaviour while O1 is active and do
nothing outside it.

Differences from apex's lists that matter (autocast's lists also differ between CPU and CUDA):
on CPU, ``softmax``, ``log_softmax`` and ``layer_norm`` follow their input dtype under autocast
instead of being forced to fp32, so a model that feeds them half activations computes them in half;
wrap such code in :func:`float_function` to get apex's fp32 behaviour.
"""
import contextlib
import functools
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import compat
from .casting import cast_floating

__all__ = ['o1_context', 'half_function', 'float_function', 'promote_function', 'disable_casts',
           'active_autocast', 'cpu_has_native_fp16']

_BCE_MESSAGE = (
    'F.binary_cross_entropy and torch.nn.BCELoss are unsafe under fp16 mixed precision (O1): the '
    'sigmoid before them produces fp16 probabilities that saturate. Use torch.nn.BCEWithLogitsLoss '
    '/ F.binary_cross_entropy_with_logits, which fuses the sigmoid and is safe. If you are sure, '
    'compute the loss in fp32 inside mp_wrappers.float_function or mp_wrappers.disable_casts().')


class _RefuseUnsafeFP16Functions(TorchFunctionMode):
    """Refuses ``F.binary_cross_entropy`` on fp16, as apex O1 did (CUDA autocast refuses it itself).

    Only entered for fp16 O1 on CPU, where autocast lets the call through.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.binary_cross_entropy:
            inp = args[0] if args else kwargs.get('input')
            if compat.autocast_enabled('cpu') or (isinstance(inp, torch.Tensor)
                                                    and inp.dtype == torch.float16):
                raise RuntimeError(_BCE_MESSAGE)
        return func(*args, **kwargs)


@contextlib.contextmanager
def o1_context(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """Run the enclosed forward under apex O1's policy: ``torch.autocast`` with ``dtype``.

    ``dtype=torch.float32`` (what ``dtype='auto'`` picks on a CPU without native half formats) runs
    the block as it is: there is nothing to cast to.
    """
    if dtype == torch.float32:
        yield
        return
    if device_type == 'cpu' and dtype == torch.float16:
        compat.require('cpu_fp16')
    with torch.autocast(device_type=device_type, dtype=dtype):
        if device_type == 'cpu' and dtype == torch.float16:
            with _RefuseUnsafeFP16Functions():
                yield
        else:
            yield


def active_autocast() -> List[Tuple[str, torch.dtype]]:
    """``(device_type, dtype)`` of every autocast region active here (usually zero or one)."""
    return [(dev, compat.autocast_dtype(dev)) for dev in ('cuda', 'cpu')
            if compat.autocast_enabled(dev)]


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """apex's ``amp.disable_casts()``: run the block without autocast's casts (inputs as they are)."""
    with contextlib.ExitStack() as stack:
        for dev, _ in active_autocast():
            stack.enter_context(torch.autocast(device_type=dev, enabled=False))
        yield


def _run_with(fn: Callable, dtype_of: Callable[[tuple, dict, torch.dtype], Optional[torch.dtype]]
              ) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        active = active_autocast()
        if not active:
            return fn(*args, **kwargs)
        dtype = dtype_of(args, kwargs, active[0][1])
        with disable_casts():
            if dtype is None:
                return fn(*args, **kwargs)
            return fn(*cast_floating(args, dtype), **cast_floating(kwargs, dtype))
    return wrapper


def half_function(fn: Callable) -> Callable:
    """Under O1, run ``fn`` with its floating inputs cast to the half dtype in use.

    Examples:
        >>> @mp_wrappers.half_function
        ... def fused_gelu(x):  # a custom kernel that only takes fp16/bf16
        ...     return my_ext.gelu(x)
    """
    return _run_with(fn, lambda args, kwargs, half: half)


def float_function(fn: Callable) -> Callable:
    """Under O1, run ``fn`` with its floating inputs cast to fp32 and autocast off."""
    return _run_with(fn, lambda args, kwargs, half: torch.float32)


def _widest(args, kwargs, half):
    dtypes = set()

    def visit(obj):
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point():
                dtypes.add(obj.dtype)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)
    visit(args)
    visit(kwargs)
    if not dtypes:
        return None
    if len(dtypes) == 1:
        return dtypes.pop()
    # fp16 + bf16 has no common half type: fp32, like torch's promotion.
    return max(dtypes, key=lambda d: torch.finfo(d).bits) if torch.float32 in dtypes or \
        torch.float64 in dtypes else torch.float32


def promote_function(fn: Callable) -> Callable:
    """Under O1, cast all floating inputs of ``fn`` to the widest floating dtype among them."""
    return _run_with(fn, _widest)


@functools.lru_cache(maxsize=None)
def cpu_has_native_fp16() -> bool:
    """Whether this CPU computes fp16 natively (AVX512-FP16/AMX-FP16), see :mod:`mp_wrappers.hardware`."""
    from .hardware import device_capability
    return device_capability('cpu').is_native(torch.float16)
