"""A quick self-test of every compiled op against its pure-PyTorch reference (``python -m mp_wrappers``).

Each case builds small inputs (a few tensors, sizes that cross the 8/16-lane vector widths and the
64K chunk boundary, fp32 and bf16/fp16 mixes), runs ``torch.ops.mp_wrappers.<op>`` on one copy and
:mod:`mp_wrappers.ops.reference` on another, and compares every tensor argument (the ops update
them in place) and every returned tensor. On the CPU it runs once per kernel flavour the CPU can run
(avx512, avx2, baseline). An op declared by the extension without a case here is reported as not
covered. Meant for bug reports and fresh installs: a few seconds, no timing.
"""
import copy
import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .ops import reference
from .ops.quantized_states import num_blocks

__all__ = ['CaseResult', 'run_selftest', 'CASES']

_SIZES = (7, 33, 1000, 65537)
_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16


@dataclasses.dataclass
class CaseResult:
    """One op on one device (and CPU flavour): ``ok`` False with ``error`` when it disagreed."""

    op: str
    device: str
    isa: Optional[str]
    ok: bool
    error: Optional[str] = None


def _rand(gen: torch.Generator, dtype: torch.dtype, device: str, scale: float = 1.0,
          positive: bool = False) -> List[Tensor]:
    out = []
    for n in _SIZES:
        t = torch.randn(n, generator=gen) * scale
        out.append((t.abs() if positive else t).to(dtype).to(device))
    return out


def _scalar(value: float, device: str, dtype: torch.dtype = _F32) -> Tensor:
    return torch.tensor([value], dtype=dtype, device=device)


def _optim_common(gen, device, state_lists: int, positive_last: bool = True):
    params = _rand(gen, _F32, device)
    grads = [g * 1024 for g in _rand(gen, _F32, device)]
    grads = [g.to(_BF16) for g in grads]
    states = [_rand(gen, _F32, device, 0.1, positive=positive_last and i == state_lists - 1)
              for i in range(state_lists)]
    model = [p.to(_BF16) for p in params]
    return params, grads, states, model


# Each builder returns the op's positional arguments; tensors in them are compared after the call.
def _scale(gen, device):
    return (_rand(gen, _F16, device, 100.0), _rand(gen, _F32, device), _scalar(1 / 3, device),
            _scalar(0.0, device))


def _l2norm(gen, device):
    return (_rand(gen, _BF16, device, 3.0), True)


def _unscale_l2norm(gen, device):
    return (_rand(gen, _F16, device, 100.0), _scalar(1 / 1000, device), _scalar(0.0, device), True)


def _axpby(gen, device):
    return (_rand(gen, _F32, device), _rand(gen, _BF16, device), _rand(gen, _F16, device), 0.7,
            -1.3, -1, _scalar(0.0, device))


def _hysteresis(gen, device):
    return (_scalar(2.0 ** 16, device), _scalar(1999, device, torch.int32),
            _scalar(1, device, torch.int32), _scalar(1.0, device), 2.0, 0.5, 2000, 2, 1.0,
            2.0 ** 24)


def _adam(gen, device):
    p, g, (m, v), model = _optim_common(gen, device, 2)
    return (p, g, m, v, model, _scalar(3.0, device), 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True,
            _scalar(1024.0, device), _scalar(0.0, device))


def _sgd(gen, device):
    p, g, (buf,), model = _optim_common(gen, device, 1, positive_last=False)
    return (p, g, buf, model, _scalar(3.0, device), 0.1, 0.9, 0.0, 1e-4, True, False,
            _scalar(1024.0, device), _scalar(0.0, device))


def _lamb(gen, device):
    p, g, (m, v), model = _optim_common(gen, device, 2)
    return (p, g, m, v, model, _scalar(3.0, device), 1e-3, 0.9, 0.999, 1e-6, 0.01, True, True,
            True, 1.0, False, _scalar(2.5, device), _scalar(1024.0, device), _scalar(0.0, device))


def _adagrad(gen, device):
    p, g, (h,), model = _optim_common(gen, device, 1)
    return (p, g, h, model, _scalar(3.0, device), 1e-2, 1e-10, 1e-4, False,
            _scalar(1024.0, device), _scalar(0.0, device))


def _novograd(gen, device):
    p, g, (m,), model = _optim_common(gen, device, 1, positive_last=False)
    norms = torch.rand(len(p), generator=gen).to(device) + 0.5
    return (p, g, m, norms, model, _scalar(3.0, device), 1e-3, 0.95, 0.98, 1e-8, 0.01, True, True,
            True, 2, False, _scalar(1024.0, device), _scalar(0.0, device))


def _codes(gen, device, params):
    """Random 8-bit states of ``params``: codes and one absmax per block."""
    codes = [torch.randint(0, 256, (t.numel(),), generator=gen, dtype=torch.uint8).to(device)
             for t in params]
    absmax = [torch.rand(num_blocks(t.numel()), generator=gen).to(device) * 0.1 for t in params]
    return codes, absmax


def _adam8bit(gen, device):
    # Random codes are valid moments: the minifloat codes have no inf/NaN (docs/quantized_states.md).
    p, g, _, model = _optim_common(gen, device, 0)
    (mc, ma), (vc, va) = _codes(gen, device, p), _codes(gen, device, p)
    return (p, g, mc, ma, vc, va, model, _scalar(3.0, device), 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True,
            _scalar(1024.0, device), _scalar(0.0, device))


def _sgd8bit(gen, device):
    # Random codes are a valid buffer; step 3: a later update, which reads them.
    p, g, _, model = _optim_common(gen, device, 0)
    codes, absmax = _codes(gen, device, p)
    return (p, g, codes, absmax, model, _scalar(3.0, device), 0.05, 0.9, 0.0, 1e-4, True, False,
            _scalar(1024.0, device), _scalar(0.0, device))


# ---- lean bf16 params (no fp32 master), stored 'kahan': a bf16 compensation per element (the
# storage every supported torch has; 'split' needs torch.uint16) ----------------------------------
def _lean_common(gen, device):
    params = _rand(gen, _BF16, device)
    # a compensation below half an ulp of its param, as the Kahan update leaves it
    comps = [(p.float() * 2.0 ** -10).to(_BF16) for p in params]
    grads = [(g * 1024).to(_BF16) for g in _rand(gen, _F32, device)]
    return params, comps, grads


def _adam_lean(gen, device):
    p, aux, g = _lean_common(gen, device)
    m, v = _rand(gen, _F32, device, 0.1), _rand(gen, _F32, device, 0.1, positive=True)
    return (p, aux, g, m, v, _scalar(3.0, device), 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True,
            'kahan', 7, _scalar(1024.0, device), _scalar(0.0, device))


def _sgd_lean(gen, device):
    p, aux, g = _lean_common(gen, device)
    return (p, aux, g, _rand(gen, _F32, device, 0.1), _scalar(3.0, device), 0.1, 0.9, 0.0, 1e-4,
            True, False, 'kahan', 7, _scalar(1024.0, device), _scalar(0.0, device))


def _adam8bit_lean(gen, device):
    p, aux, g = _lean_common(gen, device)
    (mc, ma), (vc, va) = _codes(gen, device, p), _codes(gen, device, p)
    return (p, aux, g, mc, ma, vc, va, _scalar(3.0, device), 1e-3, 0.9, 0.999, 1e-8, 0.01, True,
            True, 'kahan', 7, _scalar(1024.0, device), _scalar(0.0, device))


def _sgd8bit_lean(gen, device):
    p, aux, g = _lean_common(gen, device)
    codes, absmax = _codes(gen, device, p)
    return (p, aux, g, codes, absmax, _scalar(3.0, device), 0.05, 0.9, 0.0, 1e-4, True, False,
            'kahan', 7, _scalar(1024.0, device), _scalar(0.0, device))


CASES: Dict[str, Callable[[torch.Generator, str], Tuple]] = {
    'multi_tensor_scale_': _scale,
    'multi_tensor_l2norm': _l2norm,
    'multi_tensor_unscale_l2norm': _unscale_l2norm,
    'multi_tensor_axpby_': _axpby,
    'update_scale_hysteresis_': _hysteresis,
    'multi_tensor_adam_': _adam,
    'multi_tensor_sgd_': _sgd,
    'multi_tensor_lamb_': _lamb,
    'multi_tensor_adagrad_': _adagrad,
    'multi_tensor_novograd_': _novograd,
    'multi_tensor_adam8bit_': _adam8bit,
    'multi_tensor_sgd8bit_': _sgd8bit,
    'multi_tensor_adam_lean_': _adam_lean,
    'multi_tensor_sgd_lean_': _sgd_lean,
    'multi_tensor_adam8bit_lean_': _adam8bit_lean,
    'multi_tensor_sgd8bit_lean_': _sgd8bit_lean,
}


def _tensors(value) -> List[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _compare(got: Sequence[Tensor], want: Sequence[Tensor]) -> None:
    if len(got) != len(want):
        raise AssertionError(f'{len(got)} tensors from the kernel, {len(want)} from the reference')
    for i, (a, b) in enumerate(zip(got, want)):
        if a.dtype != b.dtype or a.shape != b.shape:
            raise AssertionError(f'tensor {i}: {a.dtype}{tuple(a.shape)} vs reference '
                                 f'{b.dtype}{tuple(b.shape)}')
        if not a.is_floating_point():
            if not torch.equal(a, b):
                raise AssertionError(f'tensor {i}: {a.tolist()} vs reference {b.tolist()}')
            continue
        # fp32: the kernels repeat the reference's operations (an ulp apart where torch's sqrt is
        # not correctly rounded, or a norm is reduced in another order); half: one rounding.
        tol = dict(rtol=1e-5, atol=1e-6) if a.dtype == _F32 else dict(rtol=1e-2, atol=1e-3)
        try:
            torch.testing.assert_close(a.cpu(), b.cpu(), equal_nan=True, **tol)
        except AssertionError as exc:
            raise AssertionError(f'tensor {i} ({a.dtype}, {a.numel()} elements): {exc}') from None


def _check_op(name: str, device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    args = CASES[name](gen, device)
    ref_args = copy.deepcopy(args)
    got = getattr(torch.ops.mp_wrappers, name)(*args)
    want = getattr(reference, name)(*ref_args)
    _compare(_tensors(args) + _tensors(got), _tensors(ref_args) + _tensors(want))


def declared_ops() -> List[str]:
    """Names of the ops the loaded extension declares under ``torch.ops.mp_wrappers``."""
    names = []
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith('mp_wrappers::'):
            names.append(schema.name.split('::', 1)[1])
    return sorted(set(names))


def run_selftest(devices: Optional[Sequence[str]] = None) -> Tuple[List[CaseResult], List[str], float]:
    """Run every case on every device present (CPU: every flavour the CPU can run).

    Returns:
        (results, ops the extension declares that have no case here, seconds taken). ``results`` is
        empty when the extension is not loaded (nothing compiled to test).
    """
    from .ops import _extension
    from .ops._dispatch import _op_has_kernel
    start = time.perf_counter()
    ext = _extension.extension()
    if ext is None:
        return [], [], 0.0
    if devices is None:
        devices = ['cpu'] + (['cuda'] if torch.cuda.is_available() and ext.cuda_built else [])
    uncovered = [op for op in declared_ops() if op not in CASES]
    results: List[CaseResult] = []
    order = ('avx512', 'avx2', 'baseline')
    setter = getattr(ext, '_set_cpu_isa', None)
    for device in devices:
        isas: List[Optional[str]] = [None]
        if device == 'cpu' and setter is not None:
            widest = ext.cpu_isa_hardware()
            isas = list(order[order.index(widest):])
        for isa in isas:
            previous = setter(isa) if isa is not None else None
            try:
                for name in CASES:
                    if not _op_has_kernel(name, torch.device(device).type):
                        results.append(CaseResult(name, device, isa, False,
                                                  f'no {device} kernel registered'))
                        continue
                    try:
                        _check_op(name, device)
                        results.append(CaseResult(name, device, isa, True))
                    except Exception as exc:  # report every failure, keep testing the rest
                        results.append(CaseResult(name, device, isa, False,
                                                  f'{type(exc).__name__}: {exc}'))
            finally:
                if previous is not None:
                    setter(previous)
    return results, uncovered, time.perf_counter() - start
