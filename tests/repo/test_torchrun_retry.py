"""tests/torchrun.py relaunches once, and only for a rank's abort at exit after every rank finished."""
import os
import sys
import warnings

import pytest

import torchrun

# Fails with the exit-abort message on its first run (no marker yet), succeeds on the next.
FLAKY = ("import os, sys\n"
         "m = sys.argv[1]\n"
         "if os.path.exists(m): sys.exit(0)\n"
         "open(m, 'w').close()\n"
         "sys.stderr.write('terminate called without an active exception\\n'); sys.exit(1)\n")


def _run(tmp_path, script, finished):
    return torchrun.run([sys.executable, '-c', script, str(tmp_path / 'marker')], cwd=str(tmp_path),
                        env=dict(os.environ), finished=finished, timeout=60)


def test_exit_abort_after_finishing_is_launched_once_more(tmp_path):
    with pytest.warns(UserWarning, match='launching once more'):
        proc = _run(tmp_path, FLAKY, finished=lambda p: True)
    assert proc.returncode == 0


def test_exit_abort_before_finishing_is_not_retried(tmp_path):
    proc = _run(tmp_path, FLAKY, finished=torchrun.files_exist([tmp_path / 'rank0.pt']))
    assert proc.returncode == 1 and torchrun.aborted_at_exit(proc)


def test_other_failures_and_a_second_abort_are_not_retried(tmp_path):
    proc = _run(tmp_path, "import sys; sys.exit(3)", finished=lambda p: True)
    assert proc.returncode == 3
    always = "import sys; sys.stderr.write('terminate called without an active exception'); sys.exit(1)"
    with pytest.warns(UserWarning):
        proc = _run(tmp_path, always, finished=lambda p: True)
    assert proc.returncode == 1


def _aborting_spawn(monkeypatch, signals):
    """mp.spawn that dies with the next of ``signals`` (None: succeeds); records its calls."""
    import torch.multiprocessing as mp
    calls = []

    def fake(worker, args, nprocs, join):
        calls.append(args)
        sig = signals[len(calls) - 1]
        if sig is not None:
            raise mp.ProcessExitedException(f'process 1 terminated with signal {sig}',
                                             error_index=1, error_pid=1, exit_code=-6,
                                             signal_name=sig)
    monkeypatch.setattr(mp, 'spawn', fake)
    return calls


def test_spawn_retries_an_abort_after_every_rank_finished(tmp_path, monkeypatch):
    results = [tmp_path / 'rank0.pt', tmp_path / 'rank1.pt']
    for p in results:
        p.write_text('done')
    ports = iter([1, 2])
    calls = _aborting_spawn(monkeypatch, ['SIGABRT', None])
    with pytest.warns(UserWarning, match='aborted at exit after finishing'):
        torchrun.spawn(None, lambda: (next(ports),), 2, results)
    assert calls == [(1,), (2,)]  # fresh args (a new port) for the second launch
    assert not any(p.exists() for p in results)  # the first launch's files were removed


@pytest.mark.parametrize('signals, files', [(['SIGABRT'], False), (['SIGSEGV'], True),
                                            (['SIGABRT', 'SIGABRT'], True)])
def test_spawn_does_not_retry_other_failures(tmp_path, monkeypatch, signals, files):
    import torch.multiprocessing as mp
    results = [tmp_path / 'rank0.pt']
    if files:
        results[0].write_text('done')
    _aborting_spawn(monkeypatch, signals)
    with pytest.raises(mp.ProcessExitedException), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        torchrun.spawn(None, lambda: (), 1, results)
