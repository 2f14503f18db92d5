"""tools/train.py end to end (train, then --resume) and mp_wrappers.launch.prepare_distributed."""
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from mmengine.config import Config

from mp_wrappers import compat
from mp_wrappers.launch import prepare_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join('configs', 'digits', 'cnn_fp32.py')
# A 180-image training split makes 6 iterations per epoch at batch 32; validation keeps its own split.
SHORT = ['train_dataloader.dataset.val_fraction=0.9', 'default_hooks.checkpoint.interval=1',
         'default_hooks.logger.interval=2', 'train_cfg.val_interval=1']


def _load_train_tool():
    spec = importlib.util.spec_from_file_location('train_tool', os.path.join(REPO, 'tools', 'train.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def train_main(capsys):
    """tools/train.py's main() in this process (no interpreter and torch start-up per run).

    Returns a function that runs ``main`` with CLI arguments plus ``--cfg-options`` and returns what it
    printed. Global torch
    settings the run changes (threads, deterministic algorithms) are put back afterwards.
    """
    train = _load_train_tool()
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    runs = []

    def run(*args, options=()):
        runs.append(len(runs))
        # A distinct experiment name per run: mmengine keys its logger and message hub by it.
        train.main([CONFIG, *args, '--cfg-options', *options, f'experiment_name=train_tool_test_{len(runs)}'])
        return capsys.readouterr().out

    yield run
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def test_train_then_resume(tmp_path, train_main):
    work_dir = tmp_path / 'wd'
    out = train_main('--work-dir', str(work_dir), options=['train_cfg.max_epochs=2', *SHORT])
    assert (work_dir / 'epoch_1.pth').is_file() and (work_dir / 'epoch_2.pth').is_file()
    assert (work_dir / 'last_checkpoint').read_text().strip().endswith('epoch_2.pth')
    assert 'Epoch(train) [2][6/6]' in out and 'accuracy:' in out
    assert 'mp_wrappers ops backend:' in out

    out = train_main('--work-dir', str(work_dir), '--resume', options=['train_cfg.max_epochs=3', *SHORT])
    if compat.has('safe_globals'):  # torch < 2.5: mmengine's own loader (mp_wrappers.checkpoint)
        assert 'Loads checkpoint by local_secure backend' in out
    assert 'resumed epoch: 2, iter: 12' in out
    assert 'Epoch(train) [3][6/6]' in out and 'Epoch(train) [1]' not in out
    assert (work_dir / 'epoch_3.pth').is_file()
    # mmengine also writes the log to a file in the work dir.
    logs = list(work_dir.glob('*/*.log'))
    assert any('Epoch(train) [3][6/6]' in log.read_text() for log in logs)


def test_cli_runs_as_a_script(tmp_path):
    """The script itself, in a fresh interpreter, with the repository not on sys.path."""
    work_dir = tmp_path / 'wd'
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, 'tools', 'train.py'), os.path.join(REPO, CONFIG),
         '--work-dir', str(work_dir), '--cfg-options', 'train_cfg.max_epochs=1', *SHORT],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'Epoch(train) [1][6/6]' in proc.stdout and (work_dir / 'epoch_1.pth').is_file()


def test_build_config_work_dir_and_resume_options():
    train = _load_train_tool()
    cfg = train.build_config(train.parse_args([CONFIG]))
    assert cfg.work_dir == os.path.join('./work_dirs', 'cnn_fp32')
    assert cfg.resume is False and cfg.launcher == 'none'
    cfg = train.build_config(train.parse_args([CONFIG, '--resume']))
    assert cfg.resume is True and cfg.load_from is None
    cfg = train.build_config(train.parse_args([CONFIG, '--resume', 'x.pth', '--work-dir', 'wd',
                                               '--cfg-options', 'train_cfg.max_epochs=7']))
    assert (cfg.resume, cfg.load_from, cfg.work_dir, cfg.train_cfg.max_epochs) == (True, 'x.pth', 'wd', 7)


def test_prepare_distributed_rejects_unknown_launcher():
    with pytest.raises(ValueError, match="launcher='torchrun'"):
        prepare_distributed(Config(dict()), 'torchrun')


def test_prepare_distributed_missing_env_names_variable(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)  # the CPU path, on any machine
    for name in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match='RANK'):
        prepare_distributed(Config(dict()), 'pytorch')


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_prepare_distributed_starts_gloo_and_configures_cpu_ddp(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)  # the gloo path, on any machine
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '1')
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')
    monkeypatch.setenv('MASTER_PORT', str(_free_port()))
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    try:
        cfg = prepare_distributed(Config(dict(env_cfg=dict(dist_cfg=dict(backend='nccl')))), 'pytorch')
        assert dist.is_initialized() and dist.get_backend() == 'gloo'
        assert cfg.launcher == 'pytorch' and os.environ['LOCAL_RANK'] == '0'
        assert cfg.model_wrapper_cfg == dict(type='MMDistributedDataParallel', device_ids=None,
                                             broadcast_buffers=False, find_unused_parameters=False)
        # A user's wrapper config is kept; only the CPU-incompatible device_ids default is fixed.
        user = prepare_distributed(Config(dict(model_wrapper_cfg=dict(
            type='MMDistributedDataParallel', find_unused_parameters=True))), 'pytorch')
        assert user.model_wrapper_cfg == dict(type='MMDistributedDataParallel',
                                              find_unused_parameters=True, device_ids=None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_cpu_training_keeps_ranks_equal(tmp_path):
    result = tmp_path / 'result.json'
    env = dict(os.environ, OMP_NUM_THREADS='1', CUDA_VISIBLE_DEVICES='')  # gloo on any machine
    proc = subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2', '--master_port',
         str(_free_port()), 'tests/ddp_equal_weights.py', CONFIG, str(result), '--launcher', 'pytorch',
         '--work-dir', str(tmp_path / 'wd'), '--cfg-options', 'train_cfg.max_epochs=1', *SHORT],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(result.read_text())
    # 180 images / 2 ranks / batch 32 = 3 iterations each, all-reduced into identical weights.
    assert summary['world_size'] == 2 and summary['iters'] == 3
    assert summary['max_abs_diff'] == 0.0


@pytest.mark.parametrize('value', [0, -2, 1.5, True, '2'])
def test_configure_torch_threads_rejects_bad_values(value):
    from mp_wrappers.launch import configure_torch_threads
    with pytest.raises(ValueError, match=f'torch_num_threads={value!r}'):
        configure_torch_threads(Config(dict(torch_num_threads=value)))


def test_configure_torch_threads_none_leaves_torch_alone():
    from mp_wrappers.launch import configure_torch_threads
    before = torch.get_num_threads()
    assert configure_torch_threads(Config(dict())) is None
    assert torch.get_num_threads() == before
