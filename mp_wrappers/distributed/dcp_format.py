"""How a Runner checkpoint of an FSDP2 model is stored in a ``torch.distributed.checkpoint``
directory, and how it is read back without running code from the files.

A checkpoint is a DCP directory named like mmengine's file (``epoch_3.pth/``): ``.metadata`` plus
one ``__{rank}_0.distcp`` per rank. It holds what mmengine's ordinary checkpoint holds, in the same
layout (``meta``, ``state_dict``, ``message_hub``, ``optimizer`` with our wrapper's keys,
``param_schedulers``, and what hooks add in ``before_save_checkpoint``, e.g. EMAHook's
``ema_state_dict``): the subtrees holding DTensors (``state_dict``, the optimizer's ``state``, a
sharded EMA model) go to DCP as tensors (:func:`split_tensors`: each rank writes its shards; DCP
re-slices them for another rank count on load); everything else is one ``torch.save`` blob under
:data:`REST_KEY` (:func:`to_blob`), read back with the ``weights_only`` loader of
:mod:`mp_wrappers.checkpoint` (:func:`from_blob`). In that blob every tensor leaf that went to DCP
is the string :data:`TENSOR_MARKER`, and :data:`INFO_KEY` records the layout version and which
top-level keys went to DCP.

Safety: DCP itself unpickles two things without restrictions, its ``.metadata`` file
(``pickle.load``) and non-tensor entries (``torch.load(weights_only=False)``). We write no
non-tensor entries, never request any on load (the load state dict holds tensors only), and read
``.metadata`` with :class:`SafeFileSystemReader`, an unpickler that resolves only DCP's own
metadata classes and torch dtypes.

Which runner saves and loads such directories, and when, is :mod:`.runner_checkpoint`'s business;
``tools/consolidate_checkpoint.py`` reads them into one ordinary file.
"""
import io
import os
import os.path as osp
import pickle
from typing import Any, Dict, Tuple

import torch

from ..sharding import is_dtensor

__all__ = ['TENSOR_MARKER', 'REST_KEY', 'INFO_KEY', 'VERSION', 'SafeFileSystemReader',
           'is_sharded_checkpoint', 'read_sharded_checkpoint', 'split_tensors', 'merge_tensors',
           'sharded_keys', 'to_blob', 'from_blob', 'check_plain_tensors', 'rest_template']

TENSOR_MARKER = '__mp_wrappers_dcp_tensor__'  # marks a leaf that lives in the DCP tensors
REST_KEY = '_mp_wrappers_rest'  # the torch.save blob of everything else
INFO_KEY = '_mp_wrappers_sharded'  # in the blob: dict(version=VERSION, keys=[keys sent to DCP])
VERSION = 1


# ---- reading .metadata without running code from the file -----------------------------------------
# DCP's metadata: dataclasses and enums (the unpickler only sets their fields) and nothing else of
# those modules (a writer or reader class could be called with arguments from the file).
_SAFE_CLASSES = {
    'torch.distributed.checkpoint.metadata': (
        'Metadata', 'TensorStorageMetadata', 'BytesStorageMetadata', 'ChunkStorageMetadata',
        'TensorProperties', 'MetadataIndex', 'StorageMeta', '_MEM_FORMAT_ENCODING'),
    'torch.distributed.checkpoint.filesystem': ('_StorageInfo',),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata dataclasses and enums, ``torch.Size``, dtypes, layouts, formats."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _SAFE_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if (module, name) == ('torch.serialization', '_get_layout'):
            return torch.serialization._get_layout  # a lookup of torch.strided & co. by name
        if module == 'pathlib' and name in ('PosixPath', 'WindowsPath', 'PurePosixPath',
                                            'PureWindowsPath'):
            import pathlib
            return getattr(pathlib, name)  # StorageMeta.checkpoint_id
        if module == 'torch' and name == 'Size':
            return torch.Size
        if module == 'torch' and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module == 'collections' and name == 'OrderedDict':
            import collections
            return collections.OrderedDict
        if module == 'builtins' and name in ('set', 'frozenset', 'slice'):
            import builtins
            return getattr(builtins, name)
        raise pickle.UnpicklingError(
            f'DCP metadata refers to {module}.{name}, which is not one of its own metadata types; '
            'refusing to unpickle it (it could run code from the file)')


def _make_safe_reader():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """``FileSystemReader`` whose ``.metadata`` is unpickled with a restricted unpickler."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get('rank'))
            with self.fs.create_stream(path, 'rb') as f:
                try:
                    metadata = _MetadataUnpickler(f).load()
                except pickle.UnpicklingError as exc:
                    raise pickle.UnpicklingError(f'{self.path}: {exc}') from None
            if getattr(metadata, 'storage_meta', None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader


def SafeFileSystemReader(path: str) -> Any:  # noqa: N802 - a class built lazily (torch import)
    """A DCP ``FileSystemReader`` for ``path`` that reads ``.metadata`` without running code."""
    return _make_safe_reader()(path)


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a complete DCP directory (DCP writes ``.metadata`` last, by a rename)."""
    return isinstance(path, (str, os.PathLike)) and osp.isfile(osp.join(path, '.metadata'))


# ---- splitting a checkpoint into DCP tensors and a plain blob -------------------------------------
def split_tensors(tree: Any, keys: Tuple[str, ...]) -> Tuple[Dict[str, Any], Any]:
    """``(tensors for DCP, rest)``: every tensor leaf under the top-level ``keys`` goes to DCP
    (nested dicts of tensors), replaced by :data:`TENSOR_MARKER` in the rest."""
    tensors: Dict[str, Any] = {}
    rest = dict(tree)

    def walk(node: Any, out: Dict[str, Any]) -> Any:
        if isinstance(node, dict):
            kept = {}
            for k, v in node.items():
                if torch.is_tensor(v):
                    out[str(k)] = v
                    kept[k] = TENSOR_MARKER
                elif isinstance(v, dict):
                    sub: Dict[str, Any] = {}
                    kept[k] = walk(v, sub)
                    if sub:
                        out[str(k)] = sub
                else:
                    kept[k] = v
            return kept
        return node

    for key in keys:
        if key in tree and isinstance(tree[key], dict):
            sub: Dict[str, Any] = {}
            rest[key] = walk(tree[key], sub)
            tensors[key] = sub
    return tensors, rest


def merge_tensors(rest: Any, tensors: Dict[str, Any]) -> Any:
    """Inverse of :func:`split_tensors`."""
    def walk(node: Any, src: Dict[str, Any]) -> Any:
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if isinstance(v, str) and v == TENSOR_MARKER:
                out[k] = src[str(k)]
            elif isinstance(v, dict):
                out[k] = walk(v, src.get(str(k), {}))
            else:
                out[k] = v
        return out

    merged = dict(rest)
    for key, sub in tensors.items():
        merged[key] = walk(rest[key], sub)
    return merged


def sharded_keys(checkpoint: Dict[str, Any]) -> Tuple[str, ...]:
    """Top-level keys whose subtree holds a DTensor (plus ``state_dict``, ``optimizer``)."""
    def has_dtensor(node: Any) -> bool:
        if is_dtensor(node):
            return True
        if isinstance(node, dict):
            return any(has_dtensor(v) for v in node.values())
        if isinstance(node, (list, tuple)):
            return any(has_dtensor(v) for v in node)
        return False
    keys = [k for k in ('state_dict', 'optimizer') if k in checkpoint]
    keys += [k for k, v in checkpoint.items() if k not in keys and has_dtensor(v)]
    return tuple(keys)


def to_blob(obj: Any) -> torch.Tensor:
    """``obj`` as ``torch.save`` writes it, in a uint8 tensor (DCP stores tensors only)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def from_blob(t: torch.Tensor, where: str) -> Any:
    """What :func:`to_blob` stored, read with the ``weights_only`` loader (errors name ``where``)."""
    from ..checkpoint import secure_torch_load
    f = io.BytesIO(t.numpy().tobytes())
    f.name = where
    return secure_torch_load(f)


def check_plain_tensors(tensors: Dict[str, Any], where: str = '') -> None:
    """Raise TypeError unless every leaf of ``tensors`` is a tensor (DCP would pickle others)."""
    for k, v in tensors.items():
        if isinstance(v, dict):
            check_plain_tensors(v, f'{where}{k}.')
        elif not torch.is_tensor(v):  # pragma: no cover - split_tensors only yields tensors
            raise TypeError(f'{where}{k} is not a tensor')


# ---- loading ---------------------------------------------------------------------------------------
def rest_template(path: str, reader: Any) -> torch.Tensor:
    """An empty uint8 tensor the size of the checkpoint's blob, for DCP to load it into."""
    meta = reader.read_metadata()
    entry = meta.state_dict_metadata.get(REST_KEY)
    if entry is None:
        raise ValueError(f'{path} is a DCP checkpoint but not a Runner checkpoint of mp_wrappers '
                         f'(no {REST_KEY!r}); load it with torch.distributed.checkpoint directly')
    return torch.empty(entry.size, dtype=torch.uint8)


def read_sharded_checkpoint(path: str) -> Dict[str, Any]:
    """The plain part of a Runner DCP checkpoint (meta, message hub, param groups...), no tensors.

    Tensor leaves are the marker string ``'__mp_wrappers_dcp_tensor__'``. Needs no process group.
    """
    import torch.distributed.checkpoint as dcp
    reader = SafeFileSystemReader(path)
    state = {REST_KEY: rest_template(path, reader)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return from_blob(state[REST_KEY], path)
