"""Which implementation serves each op on each device type: decided once, when the extension loads.

Note [dispatch decided at registration]
    ``torch.ops.mp_wrappers.<name>`` is declared by the extension (schemas in csrc/bindings.cpp) and
    implemented by its kernel files per dispatch key, op by op: an op may be declared before any
    kernel file implements it for a device the build covers (calling it would raise
    NotImplementedError inside the dispatcher). :func:`register` runs once, right after the
    extension has registered its ops and the fake kernels have been added, and settles every
    (op, device type) pair of the devices the build covers:

    * the ops with a compiled kernel are recorded (:func:`has_compiled_kernel`: what the kernel
      tests and ``python -m mp_wrappers`` check against the references);
    * for the others, the pure-PyTorch reference is registered as the op's kernel for that
      dispatch key, so the dispatcher itself serves every call.

    Afterwards :func:`implementations` maps an op name to the one callable for that device type, and
    per call the public ops only look it up (:mod:`._dispatch`). A lookup in a dict fixed at load
    time is something ``torch.compile`` traces without a graph break, where asking the dispatcher
    per call (a query returning a bool) broke every traced optimizer step; and the callable is the
    custom op, whose fake kernel (:mod:`._fake`, :mod:`._fake_optim`) lets the trace go through it
    whole. Ops the extension does not declare at all (an older build) map to their reference.

Device types the build does not cover (CUDA in a CPU-only build, any other device type) have no
entry: :mod:`._dispatch` gives them the references, as before.
"""
from typing import Callable, Dict, FrozenSet, Iterable, Mapping, Optional

import torch

from . import reference

__all__ = ['register', 'register_references', 'implementations', 'has_compiled_kernel', 'declared',
           'register_fake_if_declared']

# Dispatch keys of the device types the extension may build kernels for.
DISPATCH_KEYS = {'cpu': 'CPU', 'cuda': 'CUDA'}
NAMESPACE = 'mp_wrappers'

# device type -> op name -> the callable serving it; filled by register().
_implementations: Dict[str, Dict[str, Callable]] = {}
# device type -> ops with a compiled kernel (before any reference was registered).
_compiled: Dict[str, FrozenSet[str]] = {}
# The torch.library handles of the references registered as kernels (they must stay alive), and
# what they registered: a reload of the extension (tests) must not register a key twice.
_libraries: list = []
_registered: set = set()


def declared(names: Iterable[str], namespace: str = NAMESPACE) -> FrozenSet[str]:
    """Those of ``names`` declared as ops under ``torch.ops.<namespace>``."""
    ops = getattr(torch.ops, namespace)
    return frozenset(name for name in names if hasattr(ops, name))


def register_fake_if_declared(name: str,
                              namespace: str = NAMESPACE) -> Callable[[Callable], Callable]:
    """``torch.library.register_fake`` of ``<namespace>::<name>`` where the loaded extension
    declares that op; a no-op for an op an older build lacks. Registering a fake kernel of an
    undeclared op raises, which would drop the whole extension at import (:mod:`._extension`)
    instead of leaving that one op to its reference (Note [dispatch decided at registration])."""
    def decorate(fn: Callable) -> Callable:
        if declared([name], namespace):
            torch.library.register_fake(f'{namespace}::{name}')(fn)
        return fn
    return decorate


def _has_kernel(qualified: str, key: str) -> bool:
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key))
    except RuntimeError:  # not declared
        return False


def register_references(names: Iterable[str], device_types: Iterable[str],
                        references: Mapping[str, Callable],
                        namespace: str = NAMESPACE) -> Dict[str, FrozenSet[str]]:
    """Register ``references[name]`` as the kernel of each declared op without one, per device
    type; return the ops that had a compiled kernel, per device type."""
    compiled: Dict[str, FrozenSet[str]] = {}
    for device_type in device_types:
        key = DISPATCH_KEYS[device_type]
        have = set()
        for name in names:
            qualified = f'{namespace}::{name}'
            if (qualified, key) in _registered:
                continue  # our reference, registered at an earlier load
            if _has_kernel(qualified, key):
                have.add(name)
            elif name in references:
                lib = torch.library.Library(namespace, 'IMPL')
                lib.impl(name, references[name], key)
                _libraries.append(lib)
                _registered.add((qualified, key))
        compiled[device_type] = frozenset(have)
    return compiled


def register(ext) -> None:
    """Settle every op of the loaded extension ``ext`` on the device types it was built for."""
    device_types = ['cpu'] + (['cuda'] if getattr(ext, 'cuda_built', False) else [])
    refs = {name: getattr(reference, name) for name in reference.__all__
            if callable(getattr(reference, name)) and name.startswith(('multi_tensor_', 'update_'))}
    ops = declared(refs)
    compiled = register_references(sorted(ops), device_types, refs)
    _compiled.clear()
    _compiled.update(compiled)
    _implementations.clear()
    for device_type in device_types:
        _implementations[device_type] = {
            name: getattr(torch.ops.mp_wrappers, name) if name in ops else fn
            for name, fn in refs.items()}


def implementations(device_type: str) -> Optional[Dict[str, Callable]]:
    """Op name -> callable for ``device_type``, or None when the loaded build does not cover it."""
    return _implementations.get(device_type)


def has_compiled_kernel(name: str, device_type: str) -> bool:
    """Whether ``mp_wrappers::<name>`` has a compiled kernel (not a registered reference) for
    ``device_type`` in the loaded extension."""
    return name in _compiled.get(device_type, ())
