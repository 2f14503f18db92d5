"""A ``weights_only`` loader for mmengine checkpoints on torch >= 2.6.

torch 2.6 made ``torch.load`` default to ``weights_only=True``, and mmengine 0.10.7's local-file loader
calls ``torch.load(filename, map_location)`` without saying otherwise. A Runner checkpoint then fails
to load, because besides tensors it holds mmengine ``HistoryBuffer`` objects (the message hub's log
history) and numpy arrays and scalars inside them. Turning ``weights_only`` off would make every
``--resume``/``load_from`` able to run arbitrary code from the file, so this module keeps it on and
allow-lists exactly what an mmengine checkpoint needs (see ``docs/checkpoints.md``):

* ``mmengine.logging.HistoryBuffer`` (its ``__setstate__`` only stores plain state);
* numpy's array and scalar reconstruction: ``numpy.ndarray``, ``numpy.dtype`` and its per-type
  subclasses in ``numpy.dtypes`` (``Float64DType``...),
  ``numpy._core.multiarray._reconstruct`` and ``numpy._core.multiarray.scalar`` (also under the
  numpy 1.x module name ``numpy.core.multiarray``, so checkpoints written with either numpy load);
* under the name ``builtins.getattr``, *not* ``getattr`` but :func:`_history_buffer_method`, which only
  resolves ``HistoryBuffer.min/max/current/mean``: ``HistoryBuffer.__getstate__`` pickles its statistics
  methods, and pickle protocol 2 (``torch.save``'s) spells a method as ``getattr(HistoryBuffer, 'min')``.

The loader is registered with mmengine's own extension point, ``CheckpointLoader.register_scheme``, for
the local-path prefix ``''`` (the only prefix mmengine routes to ``load_from_local``), and is installed
when ``mp_wrappers`` is imported, so ``custom_imports=dict(imports=['mp_wrappers'])`` in any repo's config
is enough. ``MP_WRAPPERS_SECURE_CHECKPOINT_LOADER=0`` skips the installation;
:func:`uninstall_secure_checkpoint_loader` puts the previous loader back.
"""
import os
import os.path as osp
import pickle
import re
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np
import torch
from mmengine.runner import CheckpointLoader

from . import compat

__all__ = ['ENV_SWITCH', 'LOCAL_PREFIXES', 'UnsafeCheckpointError', 'mmengine_safe_globals',
           'sharded_tensor_safe_globals', 'secure_torch_load', 'install_secure_checkpoint_loader',
           'uninstall_secure_checkpoint_loader', 'secure_checkpoint_loader_installed']

ENV_SWITCH = 'MP_WRAPPERS_SECURE_CHECKPOINT_LOADER'
# mmengine routes every path that matches no other scheme to the loader of prefix '' (load_from_local).
LOCAL_PREFIXES: Tuple[str, ...] = ('',)
_ON = ('1', 'true', 'on', 'yes', '')
_OFF = ('0', 'false', 'off', 'no')
# The methods HistoryBuffer._set_default_statistics puts in the pickled `statistics_methods` dict.
_HISTORY_BUFFER_METHODS = ('min', 'max', 'current', 'mean')

SafeGlobal = Union[Callable, Tuple[Callable, str]]
MapLocation = Union[str, torch.device, Callable, dict, None]


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds Python globals outside the allow-list; loading it could execute code."""


def _history_buffer_method(owner: Any, name: str) -> Callable:
    """Stand-in for ``getattr`` while unpickling: resolves only HistoryBuffer's statistics methods.

    Raises:
        pickle.UnpicklingError: for any other object or attribute (torch turns it into its
            weights_only error, which :func:`secure_torch_load` reports with the file name).
    """
    from mmengine.logging import HistoryBuffer
    if owner is HistoryBuffer and name in _HISTORY_BUFFER_METHODS:
        return getattr(HistoryBuffer, name)
    if name == 'ProcessGroupState' and _is_sharded_tensor_class(owner):
        # FSDP1 'local' checkpoints: ShardedTensor's nested state class. Reachable only while
        # ShardedTensor itself is allow-listed (sharded_tensor_safe_globals).
        return owner.ProcessGroupState
    raise pickle.UnpicklingError(
        f'getattr({owner!r}, {name!r}) is not allowed: the secure checkpoint loader resolves only '
        f'getattr(HistoryBuffer, name) for name in {_HISTORY_BUFFER_METHODS}')


def _is_sharded_tensor_class(owner: Any) -> bool:
    try:
        from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return owner is ShardedTensor


def mmengine_safe_globals() -> List[SafeGlobal]:
    """The globals, beyond torch's defaults, that an mmengine Runner checkpoint needs.

    Returns:
        Entries for ``torch.serialization.safe_globals``: objects, or ``(object, 'module.name')``
        pairs where the pickled name differs from the object's own (numpy 1.x vs 2.x module names,
        and the restricted ``getattr`` stand-in).
    """
    from mmengine.logging import HistoryBuffer
    # Take numpy's reconstructors from numpy's own __reduce__ so the objects are right on any version.
    reconstruct = np.arange(2).__reduce__()[0]
    scalar = np.float64(0.0).__reduce__()[0]
    entries: List[SafeGlobal] = [HistoryBuffer, np.ndarray, np.dtype,
                                 (_history_buffer_method, 'builtins.getattr')]
    # np.dtype(...) returns an instance of a per-type subclass (numpy.dtypes.Float64DType, ...), and
    # the unpickler only BUILDs (sets the state of) instances of allow-listed types.
    entries += _numpy_dtype_classes()
    for module in ('numpy.core.multiarray', 'numpy._core.multiarray'):
        entries.append((reconstruct, f'{module}._reconstruct'))
        entries.append((scalar, f'{module}.scalar'))
    return entries


def sharded_tensor_safe_globals() -> List[SafeGlobal]:
    """The globals an FSDP1 ``state_dict_cfg='local'`` checkpoint adds: torch ``ShardedTensor`` objects.

    Allowed only while :class:`mp_wrappers.MixedPrecisionFSDPStrategy` loads such a checkpoint (not
    by the loader in general). All are torch's data classes: ``ShardedTensor.__setstate__`` stores
    its local shards and metadata and checks the current process group's rank against the saved
    one; the metadata classes, the chunk sharding spec and ``_remote_device`` (built from a
    ``'rank:0/cpu'`` string) hold plain values; ``MEM_FORMAT_ENCODING`` is an enum.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (MEM_FORMAT_ENCODING,
                                                                  ShardedTensorMetadata,
                                                                  TensorProperties)
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed._shard.sharding_spec.chunk_sharding_spec import ChunkShardingSpec
    from torch.distributed.remote_device import _remote_device
    return [ShardMetadata, ShardedTensor, ShardedTensor.ProcessGroupState, MEM_FORMAT_ENCODING,
            ShardedTensorMetadata, TensorProperties, Shard, ChunkShardingSpec, _remote_device]


def _numpy_dtype_classes() -> List[type]:
    dtypes_module = getattr(np, 'dtypes', None)  # numpy >= 1.25
    if dtypes_module is None:
        return []
    return [cls for name in sorted(dir(dtypes_module))
            if isinstance(cls := getattr(dtypes_module, name), type) and issubclass(cls, np.dtype)
            and cls is not np.dtype]


def _not_yet_allowed(entries: List[SafeGlobal]) -> List[SafeGlobal]:
    # safe_globals() removes its entries on exit; leave alone those the user had added for good.
    present = torch.serialization.get_safe_globals()
    return [e for e in entries if e not in present]


def _disallowed_globals(f: Any, message: str) -> List[str]:
    """Name the offending globals: statically from the zip's pickle (no code runs), else from torch's text."""
    names: List[str] = []
    if isinstance(f, (str, os.PathLike)):
        try:
            names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(f))
        except Exception:  # legacy (non-zip) format or unreadable: fall back on the message
            names = []
    if not names:
        names = sorted(set(re.findall(r'GLOBAL (\S+) (?:was not|whose module)', message)))
    return names


def _reason(message: str) -> str:
    # torch wraps the unpickler's reason in paragraphs of advice (including turning weights-only
    # loading off, which is exactly what not to do); keep the reason only.
    advice = ('Weights only load failed', 'Check the documentation', 'Please file an issue')
    lines = [line.strip() for line in message.splitlines()]
    reason = [line.replace('WeightsUnpickler error:', '').strip() for line in lines
              if line and not line.startswith(advice)]
    reason = [line for line in reason if line]
    return ' '.join(reason) if reason else message


def secure_torch_load(f: Any, map_location: MapLocation = None) -> Any:
    """``torch.load(f, map_location, weights_only=True)`` with mmengine's checkpoint globals allowed.

    Args:
        f: A path or a readable binary file object.
        map_location: As in ``torch.load``.

    Returns:
        The unpickled checkpoint.

    Raises:
        UnsafeCheckpointError: The file holds a global outside the allow-list (torch's default safe
            set, :func:`mmengine_safe_globals` and whatever the caller added with
            ``torch.serialization.add_safe_globals``). Nothing from the file has been executed.
        mp_wrappers.compat.FeatureUnavailableError: torch < 2.5 (no ``safe_globals``).
    """
    compat.require('safe_globals')
    with torch.serialization.safe_globals(_not_yet_allowed(mmengine_safe_globals())):
        try:
            # weights_only=True explicitly: it also wins over torch's environment switch that
            # forces weights-only loading off.
            return torch.load(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            message = str(exc)
            offending = _disallowed_globals(f, message)
            name = f if isinstance(f, (str, os.PathLike)) else getattr(f, 'name', repr(f))
            what = (f'globals that are not allow-listed: {", ".join(offending)}' if offending
                    else 'objects that weights_only loading does not allow')
            raise UnsafeCheckpointError(
                f'Refused to load checkpoint {str(name)!r}: it contains {what}. Unpickling them could '
                f'execute arbitrary code from the file, so mp_wrappers loads checkpoints with '
                f'weights_only=True. If you trust this file and an offending global is a plain data '
                f'class, allow exactly it with torch.serialization.add_safe_globals([...]) before '
                f'loading (see docs/checkpoints.md). torch said: {_reason(message)}'
            ) from None


class _SecureLocalLoader:
    """mmengine scheme loader for local files; remembers the loader it replaced for uninstalling."""

    # CheckpointLoader logs "Loads checkpoint by {__name__[10:]} backend": "local_secure".
    __name__ = 'load_from_local_secure'

    def __init__(self, previous: Optional[Callable]) -> None:
        self.previous = previous

    def __call__(self, filename: str, map_location: MapLocation = None) -> Any:
        filename = osp.expanduser(filename)
        if not osp.isfile(filename):
            raise FileNotFoundError(f'{filename} can not be found.')
        return secure_torch_load(filename, map_location=map_location)

    def __repr__(self) -> str:
        return f'{type(self).__name__}(previous={self.previous!r})'


def secure_checkpoint_loader_installed() -> bool:
    """Whether mmengine's local-file checkpoint scheme is served by the secure loader."""
    return all(isinstance(CheckpointLoader._schemes.get(p), _SecureLocalLoader) for p in LOCAL_PREFIXES)


def install_secure_checkpoint_loader() -> bool:
    """Register the weights_only loader for mmengine's local-file prefixes (idempotent).

    Returns:
        ``True`` if it was installed by this call, ``False`` if it already was.

    Raises:
        mp_wrappers.compat.FeatureUnavailableError: torch < 2.5, whose weights_only unpickler has
            no ``safe_globals`` to allow mmengine's globals with.
    """
    compat.require('safe_globals')
    installed = False
    for prefix in LOCAL_PREFIXES:
        current = CheckpointLoader._schemes.get(prefix)
        if isinstance(current, _SecureLocalLoader):
            continue
        CheckpointLoader.register_scheme(prefixes=prefix, loader=_SecureLocalLoader(current), force=True)
        installed = True
    return installed


def uninstall_secure_checkpoint_loader() -> bool:
    """Put back the loaders the secure loader replaced (mmengine's ``load_from_local`` by default).

    Returns:
        ``True`` if a secure loader was removed, ``False`` if none was installed.
    """
    removed = False
    for prefix in LOCAL_PREFIXES:
        current = CheckpointLoader._schemes.get(prefix)
        if isinstance(current, _SecureLocalLoader):
            if current.previous is not None:
                CheckpointLoader.register_scheme(prefixes=prefix, loader=current.previous, force=True)
            else:
                CheckpointLoader._schemes.pop(prefix)
            removed = True
    return removed


def _install_from_env() -> bool:
    """Install unless ``MP_WRAPPERS_SECURE_CHECKPOINT_LOADER`` says off; called on ``import mp_wrappers``.

    On torch < 2.5 (no ``torch.serialization.safe_globals``) nothing is installed: mmengine's own
    loader serves checkpoints as it always has there (``torch.load`` defaults to
    ``weights_only=False`` before torch 2.6, so resuming works, without the allow-list's protection;
    docs/compatibility.md).
    """
    value = os.environ.get(ENV_SWITCH, '1').strip().lower()
    if value in _OFF:
        return False
    if value not in _ON:
        raise ValueError(f'{ENV_SWITCH}={os.environ[ENV_SWITCH]!r} is not understood; use 1 (install '
                         f'the weights_only checkpoint loader, the default) or 0 (leave mmengine\'s)')
    if not compat.has('safe_globals'):
        return False
    install_secure_checkpoint_loader()
    return True
