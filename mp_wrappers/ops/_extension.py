"""Loading of the compiled extension ``mp_wrappers._C``.

Importing ``mp_wrappers`` never fails because the extension is missing or broken: the pure-PyTorch
references take over, and the original error is reported once, at the first op that had to fall back
(docs/semantics.md section 10). ``backend()`` tells what is in use.
"""
import os
import warnings
from typing import Dict, Optional

import torch

from .. import compat
from . import _registration

__all__ = ['backend', 'extension', 'has_kernels']

_ext = None
_load_error: Optional[BaseException] = None
_loaded = False
_warned = False


def extension():
    """Return the imported ``mp_wrappers._C`` module, or None when it is unavailable.

    ``MP_WRAPPERS_DISABLE_EXTENSION=1`` forces the references (useful to compare paths).
    """
    global _ext, _load_error, _loaded
    if not _loaded:
        _loaded = True
        if os.environ.get('MP_WRAPPERS_DISABLE_EXTENSION', '0') not in ('', '0'):
            _load_error = RuntimeError('disabled by MP_WRAPPERS_DISABLE_EXTENSION')
        else:
            try:
                from mp_wrappers import _C  # importing registers torch.ops.mp_wrappers.*
                if compat.has('fake_kernels'):  # torch >= 2.4; eager mode needs none
                    from . import _fake  # noqa: F401  fake kernels need the schemas registered above
                    from . import _fake_optim  # noqa: F401  (same, fused-optimizer ops)
                # Which implementation serves each op, settled once (Note [dispatch decided at
                # registration] in ._registration).
                _registration.register(_C)
                _ext = _C
            except Exception as exc:  # ImportError, undefined symbols, ABI mismatch...
                _load_error = exc
    return _ext


def has_kernels(device: torch.device) -> bool:
    """Whether compiled kernels exist for tensors on ``device``."""
    ext = extension()
    if ext is None:
        _warn_fallback()
        return False
    if device.type == 'cpu':
        return True
    if device.type == 'cuda':
        return bool(ext.cuda_built)
    return False


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            'mp_wrappers: the C++ extension mp_wrappers._C is not available, so the pure-PyTorch '
            f'reference ops are used (correct, but slower). Original error: {_load_error!r}. '
            'Rebuild with `pip install --no-build-isolation -e .`.', RuntimeWarning, stacklevel=3)


def backend() -> Dict[str, object]:
    """Describe the op implementations in use.

    Returns:
        dict: ``extension`` (bool), ``cpu`` ('cpp-<isa>' or 'reference'), ``cuda`` ('cuda',
        'reference' or 'unavailable'), and ``error`` (the load error as text, or None).

    Examples:
        >>> import mp_wrappers
        >>> mp_wrappers.ops.backend()['cpu']
        'cpp-avx512'
    """
    ext = extension()
    cuda_available = torch.cuda.is_available()
    if ext is None:
        cuda = 'reference' if cuda_available else 'unavailable'
        return dict(extension=False, cpu='reference', cuda=cuda,
                    error=repr(_load_error) if _load_error is not None else None)
    if ext.cuda_built:
        cuda = 'cuda' if cuda_available else 'unavailable'
    else:
        cuda = 'reference' if cuda_available else 'unavailable'
    return dict(extension=True, cpu=f'cpp-{ext.cpu_isa()}', cuda=cuda, error=None)
