"""Crash and resume through tools/train.py, and atomic checkpoint writes (mp_wrappers.atomic_io).

A run is SIGKILLed at a seeded iteration (by a test-only hook, before or after that iteration's
checkpoint is written), resumed with ``--resume`` and finished. Its final checkpoint must equal,
bit for bit, that of a run that was never interrupted: model weights, fp32 masters, optimizer state
(moments, step counters), loss-scaler state and LR schedulers. Deterministic CPU settings: one
thread, ``randomness.deterministic``, an iteration-based loop whose data order mmengine replays.

Reproduce a case: ``MP_CRASH_SEED=<seed> python -m pytest tests/base/test_atomic_io.py -k <case>``.
"""
import io
import os
import random
import re
import signal
import subprocess
import sys
import time
import zlib

import pytest
import torch
from mmengine.fileio import get_file_backend
from mmengine.runner.checkpoint import save_checkpoint

from mp_wrappers import atomic_io
from mp_wrappers.atomic_io import (AtomicLocalBackend, atomic_checkpoint_writes_installed,
                                   is_complete_checkpoint, resolve_resume_checkpoint)
from _compat import requires
from _workflow import load as secure_torch_load  # the weights_only loader where torch has it

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, 'tests')
SEED = int(os.environ.get('MP_CRASH_SEED', '7'))
MAX_ITERS = 16
CKPT_INTERVAL = 2  # tests/configs/_base_/tiny_iter.py


def _env():
    env = dict(os.environ, OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([TESTS, os.environ.get('PYTHONPATH', '')]))
    env.pop('MP_WRAPPERS_ATOMIC_CHECKPOINTS', None)
    return env


def _config(tmp_path, name, base, hooks=(), extra=''):
    """A config file in tmp_path that extends ``base`` with test hooks."""
    path = tmp_path / f'{name}.py'
    path.write_text(
        f'_base_ = [{os.path.join(REPO, base)!r}]\n'
        "custom_imports = dict(imports=['mp_wrappers', 'projects.digits', '_reliability_hooks'], "
        'allow_failed_imports=False)\n'
        f'custom_hooks = {list(hooks)!r}\n{extra}')
    return str(path)


def _train(config, work_dir, *args, options=(), expect_rc=0, timeout=240):
    cmd = [sys.executable, os.path.join(REPO, 'tools', 'train.py'), config, '--work-dir',
           str(work_dir), *args]
    if options:
        cmd += ['--cfg-options', *options]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True), expect_rc, timeout


def _wait(started):
    proc, expect_rc, timeout = started
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == expect_rc, f'rc={proc.returncode} (expected {expect_rc}):\n{out[-4000:]}'
    return out


def _assert_bitwise_equal(a, b, where=''):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f'{where}: keys {sorted(a)} != {sorted(b)}'
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f'{where}.{k}')
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise_equal(x, y, f'{where}[{i}]')
    else:
        assert a == b, f'{where}: {a!r} != {b!r}'


CASES = {
    # name: (config, --cfg-options, marks)
    # fp16 on CPU needs torch >= 2.2 (the run is a subprocess: the mark states the gate up front).
    'fp16_dynamic': ('tests/configs/fp16_dynamic.py', [], (requires('cpu_fp16'),)),
    'apex_O2_fp16_accum2': ('tests/configs/apex.py', ['optim_wrapper.opt_level=O2'],
                            (requires('cpu_fp16'),)),
    'apex_O1_fp16_accum2': ('tests/configs/apex.py', ['optim_wrapper.opt_level=O1'],
                            (pytest.mark.slow, requires('cpu_fp16'))),
    'apex_O2_bf16_accum2_sgd': ('tests/configs/apex.py', [
        'optim_wrapper.opt_level=O2', 'optim_wrapper.dtype=bfloat16',
        'optim_wrapper.loss_scale=dynamic', 'optim_wrapper.optimizer.type=SGD',
        'optim_wrapper.optimizer.lr=0.05', 'optim_wrapper.optimizer.momentum=0.9'],
        (pytest.mark.slow,)),
}


def _kill_plan(case):
    rng = random.Random(zlib.crc32(f'{SEED}:{case}'.encode()))
    at_iter = rng.randint(3, MAX_ITERS - 2)
    after_ckpt = rng.random() < 0.5
    # The checkpoint of iteration at_iter exists only when the kill comes after the checkpoint hook.
    last = at_iter if after_ckpt and at_iter % CKPT_INTERVAL == 0 else \
        (at_iter - 1) // CKPT_INTERVAL * CKPT_INTERVAL
    return at_iter, after_ckpt, last


@pytest.mark.parametrize('case', [pytest.param(c, marks=CASES[c][2]) for c in CASES])
def test_sigkill_then_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, case):
    base, options, _ = CASES[case]
    at_iter, after_ckpt, last = _kill_plan(case)
    where = f'MP_CRASH_SEED={SEED} case={case} kill after iteration {at_iter} ' \
            f'({"after" if after_ckpt else "before"} its checkpoint)'
    plain = _config(tmp_path, 'plain', base)
    killed = _config(tmp_path, 'killed', base, hooks=[dict(
        type='RelTestKillHook', at_iter=at_iter, priority='LOWEST' if after_ckpt else 'NORMAL')])
    # The uninterrupted run and the run to be killed are independent: run them side by side.
    ref = _train(plain, tmp_path / 'ref', options=options)
    crash = _train(killed, tmp_path / 'crash', options=options, expect_rc=-signal.SIGKILL)
    _wait(crash)
    _wait(ref)
    crash_dir = tmp_path / 'crash'
    assert not (crash_dir / f'iter_{MAX_ITERS}.pth').exists(), where
    assert (crash_dir / 'last_checkpoint').read_text().strip().endswith(f'iter_{last}.pth'), where
    if case == 'apex_O2_fp16_accum2':
        # What a non-atomic writer killed mid-save leaves behind: a truncated newer checkpoint that
        # the pointer names. --resume must pass over it to the last complete one.
        good = (crash_dir / f'iter_{last}.pth').read_bytes()
        (crash_dir / f'iter_{last + CKPT_INTERVAL}.pth').write_bytes(good[:len(good) // 2])
        (crash_dir / 'last_checkpoint').write_text(str(crash_dir / f'iter_{last + CKPT_INTERVAL}.pth'))
    out = _wait(_train(killed.replace('killed', 'plain'), crash_dir, '--resume', options=options))
    assert f'resumed epoch: 0, iter: {last}' in out, where + out[-3000:]
    assert re.search(rf'Iter\(train\) \[ *{last + 1}/{MAX_ITERS}\]', out), where
    assert not re.search(rf'Iter\(train\) \[ *{last}/{MAX_ITERS}\]', out), where
    ref_ckpt = secure_torch_load(str(tmp_path / 'ref' / f'iter_{MAX_ITERS}.pth'))
    got_ckpt = secure_torch_load(str(crash_dir / f'iter_{MAX_ITERS}.pth'))
    for key in ('state_dict', 'optimizer', 'param_schedulers'):
        _assert_bitwise_equal(ref_ckpt[key], got_ckpt[key], f'{where}: {key}')
    ours = got_ckpt['optimizer']['mp_wrappers']
    assert ours['loss_scalers'][0]['steps'] > 0, where
    if 'O2' in case or 'fp16_dynamic' in case:
        assert sum(len(g) for g in ours['fp32_master_params']) > 0, where
    assert ref_ckpt['meta']['iter'] == got_ckpt['meta']['iter'] == MAX_ITERS


# ---- atomic writes --------------------------------------------------------------------------------

def test_atomic_backend_is_installed_and_switchable():
    assert atomic_checkpoint_writes_installed()
    assert isinstance(get_file_backend('/tmp/x.pth'), AtomicLocalBackend)
    try:
        assert atomic_io.uninstall_atomic_checkpoint_writes()
        assert type(get_file_backend('/tmp/x.pth')).__name__ == 'LocalBackend'
        assert not atomic_io.uninstall_atomic_checkpoint_writes()
    finally:
        atomic_io.install_atomic_checkpoint_writes()
    assert not atomic_io.install_atomic_checkpoint_writes()
    assert isinstance(get_file_backend('/tmp/x.pth'), AtomicLocalBackend)


@pytest.mark.parametrize('value,installed', [('0', False), ('off', False), ('1', True)])
def test_env_switch(value, installed):
    code = ('import mp_wrappers.atomic_io as a; import mp_wrappers; '
            'print(a.atomic_checkpoint_writes_installed())')
    env = dict(_env(), MP_WRAPPERS_ATOMIC_CHECKPOINTS=value, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == str(installed), out.stderr[-2000:]


def test_env_switch_rejects_unknown_value(monkeypatch):
    monkeypatch.setenv('MP_WRAPPERS_ATOMIC_CHECKPOINTS', 'maybe')
    with pytest.raises(ValueError, match="MP_WRAPPERS_ATOMIC_CHECKPOINTS='maybe'.*use 1"):
        atomic_io._install_from_env()


def _tmp_leftovers(directory):
    return [p for p in os.listdir(directory) if p.startswith('.mp_wrappers_tmp.')]


@pytest.mark.parametrize('fail_in', ['write', 'fsync', 'replace'])
def test_interrupted_write_never_leaves_a_partial_file(tmp_path, monkeypatch, fail_in):
    target = tmp_path / 'iter_4.pth'
    save_checkpoint({'w': torch.arange(10.)}, str(target))  # the previous complete version
    old = target.read_bytes()

    def boom(*args, **kwargs):
        raise KeyboardInterrupt(f'interrupted in {fail_in}')

    if fail_in == 'write':
        real_fdopen = os.fdopen

        class _Half:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                self.f.write(data[:len(data) // 2])  # part of it reaches the disk, then...
                boom()

        monkeypatch.setattr(atomic_io.os, 'fdopen', lambda fd, mode: _Half(real_fdopen(fd, mode)))
    else:
        monkeypatch.setattr(atomic_io.os, fail_in, boom)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({'w': torch.arange(1000.)}, str(target))
    monkeypatch.undo()
    assert target.read_bytes() == old and is_complete_checkpoint(target)
    assert _tmp_leftovers(tmp_path) == []
    # And a new file that was never complete does not appear at all.
    with pytest.raises(RuntimeError):
        with monkeypatch.context() as m:
            m.setattr(atomic_io.os, 'replace', lambda *a: (_ for _ in ()).throw(RuntimeError()))
            save_checkpoint({'w': torch.ones(3)}, str(tmp_path / 'iter_6.pth'))
    assert not (tmp_path / 'iter_6.pth').exists() and _tmp_leftovers(tmp_path) == []


def test_sigkill_during_a_large_save_keeps_the_previous_checkpoint(tmp_path):
    """A real SIGKILL while the bytes of a 64 MB checkpoint are on their way to the disk."""
    target = tmp_path / 'iter_2.pth'
    save_checkpoint({'w': torch.zeros(4)}, str(target))
    old = target.read_bytes()
    marker = tmp_path / 'writing'
    # Serialise here, as save_checkpoint does before handing the bytes to the backend: after a fork
    # the child must not run torch ops (an OpenMP pool inherited from the parent can hang it).
    buf = io.BytesIO()
    torch.save({'w': torch.ones(16 * 2**20)}, buf)
    payload = buf.getvalue()
    backend = get_file_backend(str(target))
    pid = os.fork()
    if pid == 0:  # child: write, and stop for good just before the data is synced
        try:
            def stall(fd):
                marker.write_text('x')
                time.sleep(120)

            atomic_io.os.fsync = stall
            backend.put(payload, str(target))
        finally:
            os._exit(3)
    try:
        deadline = time.time() + 60
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert marker.exists(), 'the child never reached the write'
    finally:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert target.read_bytes() == old and is_complete_checkpoint(target)
    # The killed writer's temporary file is left (nobody could remove it) but under a hidden name
    # that neither mmengine nor resolve_resume_checkpoint ever picks.
    leftovers = _tmp_leftovers(tmp_path)
    assert len(leftovers) == 1
    assert resolve_resume_checkpoint(tmp_path) == str(target)


def test_resolve_resume_checkpoint_passes_over_truncated_files(tmp_path):
    assert resolve_resume_checkpoint(tmp_path) is None
    for i in (2, 4):
        save_checkpoint({'i': torch.tensor(i)}, str(tmp_path / f'iter_{i}.pth'))
        os.utime(tmp_path / f'iter_{i}.pth', ns=(i * 10**9, i * 10**9))
    # No pointer: the newest complete file.
    assert resolve_resume_checkpoint(tmp_path) == str(tmp_path / 'iter_4.pth')
    # A valid pointer wins, even over a newer file.
    (tmp_path / 'last_checkpoint').write_text(str(tmp_path / 'iter_2.pth'))
    assert resolve_resume_checkpoint(tmp_path) == str(tmp_path / 'iter_2.pth')
    # A pointer to a truncated file (and an empty pointer, and one to a missing file) falls back.
    data = (tmp_path / 'iter_4.pth').read_bytes()
    (tmp_path / 'iter_6.pth').write_bytes(data[:-30])
    os.utime(tmp_path / 'iter_6.pth', ns=(6 * 10**9, 6 * 10**9))
    for pointer in (str(tmp_path / 'iter_6.pth'), '', str(tmp_path / 'iter_8.pth')):
        (tmp_path / 'last_checkpoint').write_text(pointer)
        assert resolve_resume_checkpoint(tmp_path) == str(tmp_path / 'iter_4.pth')
    assert not is_complete_checkpoint(tmp_path / 'iter_6.pth')
    assert not is_complete_checkpoint(tmp_path / 'nope.pth')
