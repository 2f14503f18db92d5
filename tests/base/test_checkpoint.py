"""The weights_only loader for mmengine checkpoints: Runner resume, malicious files refused, switch-off."""
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer
from mmengine.runner import CheckpointLoader, Runner
from mmengine.runner.checkpoint import _load_checkpoint, load_from_local

import mp_wrappers  # noqa: F401  (installs the loader)
from _compat import requires
from mp_wrappers.checkpoint import (ENV_SWITCH, UnsafeCheckpointError, install_secure_checkpoint_loader,
                                    mmengine_safe_globals, secure_checkpoint_loader_installed,
                                    secure_torch_load, uninstall_secure_checkpoint_loader)
from projects.digits import DigitsCNN  # noqa: F401  (registers the demo model and dataset)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The loader allow-lists mmengine's globals through torch.serialization.safe_globals (torch >= 2.5).
pytestmark = requires('safe_globals')


class _RunsCode:
    """Pickles as a call to os.system: what a malicious checkpoint looks like."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'echo pwned > {self.marker}',))


class _GetattrGadget:
    """Pickles as getattr(HistoryBuffer, 'register_statistics'): not a statistics method."""

    def __reduce__(self):
        return (getattr, (HistoryBuffer, 'register_statistics'))


def _runner_cfg(work_dir, max_iters, **extra):
    cfg = dict(
        model=dict(type='mp_wrappers.DigitsCNN', width=4),
        work_dir=str(work_dir),
        train_dataloader=dict(batch_size=16, num_workers=0,
                              dataset=dict(type='mp_wrappers.DigitsDataset', split='train'),
                              sampler=dict(type='DefaultSampler', shuffle=True),
                              collate_fn=dict(type='default_collate')),
        train_cfg=dict(type='IterBasedTrainLoop', max_iters=max_iters),
        optim_wrapper=dict(type='OptimWrapper', optimizer=dict(type='SGD', lr=0.01, momentum=0.9)),
        param_scheduler=dict(type='MultiStepLR', milestones=[1], by_epoch=False),
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=2, by_epoch=False),
                           logger=dict(type='LoggerHook', interval=1)),
        randomness=dict(seed=0),
        default_scope='mmengine',
        env_cfg=dict(dist_cfg=dict(backend='gloo')),
    )
    cfg.update(extra)
    return Runner.from_cfg(cfg)


@pytest.fixture(scope='module')
def runner_checkpoint(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp('run')
    runner = _runner_cfg(work_dir, max_iters=2, experiment_name='ckpt_sec_train')
    runner.train()
    path = work_dir / 'iter_2.pth'
    assert path.is_file()
    return path


def test_loader_is_installed_on_import():
    assert secure_checkpoint_loader_installed()
    loader = CheckpointLoader._get_checkpoint_loader('/some/local/file.pth')
    assert loader.__name__ == 'load_from_local_secure'


def test_plain_weights_only_load_fails_on_runner_checkpoint(runner_checkpoint):
    # The trap being fixed: torch 2.13's default torch.load refuses mmengine's checkpoints.
    with pytest.raises(pickle.UnpicklingError):
        torch.load(runner_checkpoint, weights_only=True)


def test_runner_checkpoint_loads_and_resumes(runner_checkpoint, tmp_path):
    ckpt = secure_torch_load(str(runner_checkpoint))
    losses = ckpt['message_hub']['log_scalars']['train/loss']
    assert isinstance(losses, HistoryBuffer) and len(losses.data[0]) == 2
    assert isinstance(losses.data[0], np.ndarray) and np.isfinite(losses.mean())
    # A resumed Runner continues from iteration 2 with the saved message hub and scheduler state.
    runner = _runner_cfg(tmp_path, max_iters=3, resume=True, load_from=str(runner_checkpoint),
                         experiment_name='ckpt_sec_resume')
    runner.train()
    assert runner.iter == 3
    assert len(runner.message_hub.get_scalar('train/loss').data[0]) == 3
    assert runner.param_schedulers[0]._global_step == 3  # restored at 2, stepped once


def test_user_safe_globals_survive_a_load(runner_checkpoint):
    before = torch.serialization.get_safe_globals()
    assert np.ndarray not in before
    # The user allow-listed ndarray for their own reasons; our load must not remove it on exit.
    with torch.serialization.safe_globals([np.ndarray]):
        secure_torch_load(str(runner_checkpoint))
        assert np.ndarray in torch.serialization.get_safe_globals()
    # ...and our own entries are gone again afterwards, while nothing that was there is lost.
    after = torch.serialization.get_safe_globals()
    assert not [g for g in mmengine_safe_globals() if g in after]
    assert all(g in after for g in before)


@pytest.mark.parametrize('load', ['secure_torch_load', 'mmengine', 'runner'])
def test_malicious_checkpoint_is_refused_without_side_effect(tmp_path, load):
    marker = tmp_path / 'pwned.txt'
    path = tmp_path / 'evil.pth'
    torch.save({'state_dict': {}, 'meta': _RunsCode(marker)}, path)
    with pytest.raises(UnsafeCheckpointError) as info:
        if load == 'secure_torch_load':
            secure_torch_load(str(path))
        elif load == 'mmengine':
            _load_checkpoint(str(path))
        else:
            runner = _runner_cfg(tmp_path / 'wd', max_iters=1, experiment_name=f'evil_{load}')
            runner.load_checkpoint(str(path))
    message = str(info.value)
    assert str(path) in message and 'system' in message and 'execute arbitrary code' in message
    assert 'weights_only` set to `False`' not in message  # torch's advice to disable it is dropped
    assert not marker.exists()


def test_refused_even_when_torch_is_told_to_skip_weights_only(tmp_path, monkeypatch):
    # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD only changes torch.load's *default*; we pass weights_only=True.
    monkeypatch.setenv('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', '1')
    marker = tmp_path / 'pwned.txt'
    torch.save({'meta': _RunsCode(marker)}, tmp_path / 'evil.pth')
    with pytest.raises(UnsafeCheckpointError):
        _load_checkpoint(str(tmp_path / 'evil.pth'))
    assert not marker.exists()


def test_getattr_stand_in_only_resolves_history_buffer_statistics(tmp_path):
    path = tmp_path / 'gadget.pth'
    torch.save({'x': _GetattrGadget()}, path)
    with pytest.raises(UnsafeCheckpointError, match='register_statistics'):
        secure_torch_load(str(path))


def test_missing_file_keeps_mmengine_error(tmp_path):
    with pytest.raises(FileNotFoundError, match='can not be found'):
        _load_checkpoint(str(tmp_path / 'absent.pth'))


def test_uninstall_restores_mmengine_loader_and_install_is_idempotent():
    try:
        assert uninstall_secure_checkpoint_loader() is True
        assert CheckpointLoader._schemes[''] is load_from_local
        assert not secure_checkpoint_loader_installed()
        assert uninstall_secure_checkpoint_loader() is False
    finally:
        assert install_secure_checkpoint_loader() is True
    assert install_secure_checkpoint_loader() is False
    assert CheckpointLoader._schemes[''].previous is load_from_local


def _loader_in_fresh_process(value):
    env = dict(os.environ, **{ENV_SWITCH: value})
    code = ('import mp_wrappers; from mmengine.runner import CheckpointLoader; '
            "print(CheckpointLoader._schemes[''].__name__)")
    return subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env, capture_output=True, text=True)


def test_env_switch_off_keeps_mmengine_loader():
    off = _loader_in_fresh_process('0')
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip() == 'load_from_local'


def test_env_switch_rejects_unknown_value():
    bad = _loader_in_fresh_process('maybe')
    assert bad.returncode != 0 and f"{ENV_SWITCH}='maybe'" in bad.stderr
