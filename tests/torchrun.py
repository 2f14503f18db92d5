"""Launching ``torch.distributed.run`` (``run``) or ``torch.multiprocessing.spawn`` (``spawn``) from the
tests, with the one retry torch's gloo teardown needs.

Now and then (about once in a hundred launches on a loaded 2-core machine) a rank that finished its
work, wrote its results and left the process group aborts at interpreter exit with "terminate called
without an active exception": a C++ thread of torch's distributed stack is still joinable when the
process is torn down. The run itself is complete and correct; the exit status is not. ``run`` launches
again once, and only then: when that exact message is in the output *and* the caller's ``finished``
says every rank got to its end. Any other failure, or a second abort, fails the test.
``PYTHONFAULTHANDLER=1`` makes such an abort print every thread's Python stack, so the log of a
failing run says where each rank was.
"""
import contextlib
import os
import subprocess
import warnings
from typing import Callable, Dict, Iterator, Sequence

EXIT_ABORT = 'terminate called without an active exception'


def run(cmd: Sequence[str], *, cwd: str, env: Dict[str, str],
        finished: Callable[[subprocess.CompletedProcess], bool],
        timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(env, PYTHONFAULTHANDLER='1')
    proc = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0 and aborted_at_exit(proc) and finished(proc):
        warnings.warn(f'a rank aborted at exit after finishing ({EXIT_ABORT!r}); launching once more')
        proc = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    return proc


def aborted_at_exit(proc: subprocess.CompletedProcess) -> bool:
    return EXIT_ABORT in proc.stdout + proc.stderr


def files_exist(paths: Sequence[os.PathLike]) -> Callable[[subprocess.CompletedProcess], bool]:
    """A ``finished`` check: every rank wrote its result file."""
    return lambda proc: all(os.path.exists(p) for p in paths)


def spawn(worker: Callable, make_args: Callable[[], tuple], nprocs: int,
          results: Sequence[os.PathLike]) -> None:
    """``torch.multiprocessing.spawn(worker, make_args(), nprocs)`` with the same one retry: when a
    rank dies of SIGABRT (the abort at exit above; its message goes to the terminal, not to us) after
    every rank wrote its ``results`` file, spawn once more with fresh ``make_args()`` (a new port)."""
    import torch.multiprocessing as mp
    try:
        mp.spawn(worker, args=make_args(), nprocs=nprocs, join=True)
    except mp.ProcessExitedException as exc:
        if exc.signal_name != 'SIGABRT' or not all(os.path.exists(p) for p in results):
            raise
        warnings.warn(f'a rank aborted at exit after finishing (SIGABRT, {EXIT_ABORT!r}); '
                      'spawning once more')
        for p in results:
            os.remove(p)
        mp.spawn(worker, args=make_args(), nprocs=nprocs, join=True)


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """The process group of a ``spawn`` worker: gloo on localhost at ``port``, one intra-op thread
    (2 cores shared by every rank), destroyed however the worker leaves."""
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group('gloo', rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
