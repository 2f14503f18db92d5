"""tests/torchrun.py relaunches once, and only for a rank's abort at exit after every rank finished."""
import os
import sys

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
