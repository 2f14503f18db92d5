"""Crash-safe checkpoint writes for mmengine, and a resume that only picks complete checkpoints.

mmengine 0.10.7 writes a checkpoint with ``LocalBackend.put(bytes, path)``, which opens the *final*
path with ``'wb'`` (truncating it) and writes: a process killed during the write (SIGKILL, OOM
killer, a preempted node) leaves a truncated file under the name ``--resume`` looks for. The same
holds for ``put_text``. This module fixes that with mmengine's own extension point: importing
``mp_wrappers`` registers :class:`AtomicLocalBackend` as the ``'local'`` storage backend
(``mmengine.fileio.register_backend('local', ..., force=True, prefixes='')``), whose writes go to a
temporary file in the same directory, are ``fsync``-ed, and are renamed over the final name with
``os.replace`` (atomic on POSIX and Windows), then the directory is fsync-ed. A reader sees the old
file or the new one, never a part.

mmengine's ``CheckpointHook`` writes the ``last_checkpoint`` pointer with a plain ``open()``, not
through a backend, so no storage backend can make that write atomic. :func:`resolve_resume_checkpoint`
covers it on the reading side: ``tools/train.py --resume`` asks it for the checkpoint to resume
from, and it returns the pointer's target only when that file is a complete checkpoint, else the
newest complete checkpoint in the work dir (a truncated pointer, a checkpoint written by a
non-atomic writer, or one the switch below left non-atomic).

``MP_WRAPPERS_ATOMIC_CHECKPOINTS=0`` leaves mmengine's backend alone (see ``docs/reliability.md``).
"""
import glob
import os
import os.path as osp
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Union

import mmengine.fileio.io as _fileio_io
from mmengine.fileio import LocalBackend, register_backend
from mmengine.fileio.backends import backends as _registered_backends
from mmengine.fileio.backends import prefix_to_backends as _prefix_backends
from mmengine.logging import print_log

__all__ = ['AtomicLocalBackend', 'ENV_SWITCH', 'atomic_write', 'install_atomic_checkpoint_writes',
           'uninstall_atomic_checkpoint_writes', 'atomic_checkpoint_writes_installed',
           'is_complete_checkpoint', 'resolve_resume_checkpoint']

ENV_SWITCH = 'MP_WRAPPERS_ATOMIC_CHECKPOINTS'
_ON = ('1', 'true', 'on', 'yes', '')
_OFF = ('0', 'false', 'off', 'no')
_TMP_PREFIX = '.mp_wrappers_tmp.'


def atomic_write(data: Union[bytes, str], filepath: Union[str, Path],
                 encoding: str = 'utf-8') -> None:
    """Write ``data`` to ``filepath`` so that the file is either the old one or all of the new one.

    The data goes to a temporary file in the same directory (``os.replace`` is atomic only within
    one file system), which is flushed and fsync-ed before it is renamed over ``filepath``; the
    directory is fsync-ed afterwards so the rename itself survives a power loss. On any error the
    temporary file is removed and ``filepath`` is untouched.
    """
    filepath = os.fspath(filepath)
    directory = osp.dirname(osp.abspath(filepath))
    os.makedirs(directory, exist_ok=True)
    payload = data.encode(encoding) if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX + osp.basename(filepath) + '.', dir=directory)
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600 files; give the checkpoint the permissions open() would have.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, filepath)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicLocalBackend(LocalBackend):
    """mmengine's ``LocalBackend`` whose ``put``/``put_text`` are atomic (see :func:`atomic_write`).

    Registered as mmengine's ``'local'`` backend on ``import mp_wrappers``; reads are mmengine's.
    """

    def put(self, obj: bytes, filepath: Union[str, Path]) -> None:
        """Write bytes to ``filepath`` atomically (temporary file, fsync, ``os.replace``)."""
        atomic_write(obj, filepath)

    def put_text(self, obj: str, filepath: Union[str, Path], encoding: str = 'utf-8') -> None:
        """Write text to ``filepath`` atomically (temporary file, fsync, ``os.replace``)."""
        atomic_write(obj, filepath, encoding=encoding)


def atomic_checkpoint_writes_installed() -> bool:
    """Whether mmengine's local storage backend is :class:`AtomicLocalBackend`."""
    return (_registered_backends.get('local') is AtomicLocalBackend
            and _prefix_backends.get('') is AtomicLocalBackend)


def _forget_cached_local_backends() -> None:
    # get_file_backend caches instances by prefix and arguments; drop cached local ones so the next
    # call builds an instance of the class registered now.
    cache = _fileio_io.backend_instances
    for key in [k for k, v in cache.items() if type(v) in (LocalBackend, AtomicLocalBackend)]:
        del cache[key]


def install_atomic_checkpoint_writes() -> bool:
    """Register :class:`AtomicLocalBackend` as mmengine's ``'local'`` backend (idempotent).

    Returns:
        ``True`` if it was installed by this call, ``False`` if it already was.
    """
    if atomic_checkpoint_writes_installed():
        return False
    register_backend('local', AtomicLocalBackend, force=True, prefixes='')
    _forget_cached_local_backends()
    return True


def uninstall_atomic_checkpoint_writes() -> bool:
    """Put mmengine's own ``LocalBackend`` back. Returns whether anything was changed."""
    if _registered_backends.get('local') is not AtomicLocalBackend:
        return False
    register_backend('local', LocalBackend, force=True, prefixes='')
    _forget_cached_local_backends()
    return True


def _install_from_env() -> bool:
    """Install unless ``MP_WRAPPERS_ATOMIC_CHECKPOINTS`` says off; called on ``import mp_wrappers``."""
    value = os.environ.get(ENV_SWITCH, '1').strip().lower()
    if value in _OFF:
        return False
    if value not in _ON:
        raise ValueError(f'{ENV_SWITCH}={os.environ[ENV_SWITCH]!r} is not understood; use 1 (write '
                         "checkpoints atomically, the default) or 0 (keep mmengine's writes)")
    install_atomic_checkpoint_writes()
    return True


def is_complete_checkpoint(path: Union[str, Path]) -> bool:
    """Whether ``path`` is a whole ``torch.save`` file (zip format, the default since torch 1.6).

    A zip archive's central directory is written last, so a truncated file has none and fails to
    open; the pickle record must be listed too. Reads only the directory at the end of the file.
    A sharded checkpoint (a ``torch.distributed.checkpoint`` directory, FSDP2) is complete when it
    has its ``.metadata``, which DCP writes last (by a rename) after every rank's data.
    An FSDP1 ``state_dict_cfg='local'`` checkpoint (a directory of ``rank{i}.pth``) is complete
    when ranks 0..n-1 are all there and complete.
    """
    if osp.isdir(path):
        if osp.isfile(osp.join(path, '.metadata')):
            return True
        ranks = [n for n in os.listdir(path) if n.startswith('rank') and n.endswith('.pth')]
        return bool(ranks) and all(
            is_complete_checkpoint(osp.join(path, f'rank{i}.pth')) for i in range(len(ranks)))
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith('/data.pkl') or name == 'data.pkl'
                       for name in archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def resolve_resume_checkpoint(work_dir: Union[str, Path]) -> Optional[str]:
    """The checkpoint ``--resume`` should use: the last complete one in ``work_dir``, or None.

    The ``last_checkpoint`` pointer's target when it is complete; otherwise (the pointer is missing,
    empty, or names a truncated or missing file) the most recently written complete ``*.pth`` in
    ``work_dir``, with a warning naming what was passed over.
    """
    work_dir = os.fspath(work_dir)
    pointer = osp.join(work_dir, 'last_checkpoint')
    target = None
    if osp.isfile(pointer):
        with open(pointer) as f:
            target = f.read().strip() or None
    if target is not None and is_complete_checkpoint(target):
        return target
    candidates = sorted(
        (p for p in glob.glob(osp.join(work_dir, '*.pth')) if is_complete_checkpoint(p)),
        key=lambda p: (os.stat(p).st_mtime_ns, p))
    choice = candidates[-1] if candidates else None
    if target is not None or choice is not None:
        why = (f'last_checkpoint names {target!r}, which is not a complete checkpoint'
               if target is not None else 'there is no last_checkpoint pointer')
        print_log(f'mp_wrappers: {why}; resuming from '
                  f'{choice if choice else "nothing (no complete checkpoint found)"}',
                  logger='current', level=30)
    return choice
