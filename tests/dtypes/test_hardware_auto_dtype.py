"""dtype='auto' and honest warnings in the wrappers, the default config, tools/train.py --amp, the ISA
switch and the doctor, with the hardware probe faked per CPU class."""
import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from mmengine.config import Config
from torch import nn

import mp_wrappers
from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper, hardware
from mp_wrappers.policy import resolve_properties
from projects.digits import DigitsCNN

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AVX2 = {'avx', 'avx2', 'fma', 'f16c'}
AVX512 = AVX2 | {'avx512f', 'avx512bw', 'avx512vl'}
CPU_CLASSES = {
    'avx2': (AVX2, 'AVX2'),
    'avx512-bf16': (AVX512 | {'avx512_bf16'}, 'AVX512'),
    'avx512-fp16-only': (AVX512 | {'avx512_fp16'}, 'AVX512'),
}


@pytest.fixture
def fake_cpu(monkeypatch):
    """fake_cpu('avx2') makes the probe see that CPU class for the rest of the test."""
    def use(kind):
        flags, torch_isa = CPU_CLASSES[kind]
        cap = hardware.cpu_capability(flags, arch='x86_64', torch_isa=torch_isa,
                                      onednn_max_isa='', name=f'fake {kind} CPU')
        monkeypatch.setattr(hardware.probe, '_probe_cpu', lambda: cap)
        return cap
    return use


@pytest.fixture
def logs(monkeypatch):
    """Messages the wrappers print_log, in order."""
    seen = []

    def record(msg, logger=None, level=None):
        seen.append(msg)
    monkeypatch.setattr(mp_wrappers.wrappers.apex, 'print_log', record)
    monkeypatch.setattr(mp_wrappers.wrappers.fp16, 'print_log', record)
    return seen


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5))


def _batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g))
            for _ in range(n)]


def _apex(model, **kw):
    kw.setdefault('verbosity', 0)
    return ApexOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), **kw)


def _train(model, wrapper, batches):
    for x, y in batches:
        with wrapper.optim_context(model):
            loss = F.cross_entropy(model(x).float(), y)
        wrapper.update_params(loss)


# ---- ApexOptimWrapper ----------------------------------------------------------------------------

@pytest.mark.parametrize('level', ['O1', 'O2', 'O3'])
def test_auto_on_avx2_computes_fp32_and_matches_plain_fp32(fake_cpu, logs, level):
    fake_cpu('avx2')
    model, plain = _model(), _model()
    w = _apex(model, opt_level=level, dtype='auto')
    assert w.properties.dtype == torch.float32 and w.properties.loss_scale == 1.0
    assert len([m for m in logs if 'resolved to float32' in m]) == 1
    assert 'no native bfloat16 or float16' in logs[0]
    autocast_seen = []
    model[0].register_forward_hook(lambda *a: autocast_seen.append(mp_wrappers.compat.autocast_enabled('cpu')))
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # no slowness warning: fp32 is what runs
        _train(model, w, _batches())
    assert autocast_seen == [False] * 3
    assert all(p.dtype == torch.float32 for p in model.parameters())
    opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for x, y in _batches():
        opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opt.step()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize('kind,dtype,scale', [('avx512-bf16', torch.bfloat16, 1.0),
                                              ('avx512-fp16-only', torch.float16, 'dynamic')])
def test_auto_picks_the_native_half_type(fake_cpu, logs, kind, dtype, scale):
    fake_cpu(kind)
    model = _model()
    w = _apex(model, opt_level='O2', dtype='auto')
    assert w.properties.dtype == dtype and w.properties.loss_scale == scale
    assert f"resolved to {str(dtype).replace('torch.', '')} on cpu" in logs[0]
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        _train(model, w, _batches(1))
    assert model[0].weight.dtype == dtype and model[1].weight.dtype == torch.float32


def test_explicit_bf16_on_avx2_is_honoured_with_the_real_reason(fake_cpu):
    fake_cpu('avx2')
    model = _model()
    w = _apex(model, opt_level='O2', dtype='bfloat16')
    with pytest.warns(UserWarning, match=r'without native bf16: bf16 on this CPU \(fake avx2 CPU, '
                      r'avx2\) has no native instructions: expect slower than fp32') as rec:
        _train(model, w, _batches(1))
    assert "dtype='auto' (here: dtype='float32')" in str(rec[0].message)
    assert 'faster' not in str(rec[0].message)
    assert model[0].weight.dtype == torch.bfloat16


def test_explicit_fp16_warning_has_no_false_bf16_claim(fake_cpu):
    fake_cpu('avx2')
    model = _model()
    w = _apex(model, opt_level='O1', dtype='float16')
    with pytest.warns(UserWarning, match='without native fp16') as rec:
        _train(model, w, _batches(1))
    text = ' '.join(str(r.message) for r in rec)
    assert 'faster than fp32' not in text and "dtype='float32'" in text


def test_explicit_dtype_on_a_native_cpu_does_not_warn(fake_cpu):
    fake_cpu('avx512-bf16')
    model = _model()
    w = _apex(model, opt_level='O2', dtype='bfloat16')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        _train(model, w, _batches(1))


def test_resolve_properties_dtype_values():
    assert resolve_properties('O2', dtype='float32').cast_model_type == torch.float32
    assert resolve_properties('O1', dtype='float32').loss_scale == 1.0
    with pytest.raises(ValueError, match="dtype='int8' is not supported; allowed: 'float16', "
                       "'bfloat16', 'float32', 'auto'"):
        resolve_properties('O1', dtype='int8')


def test_auto_resolves_for_cuda_by_compute_capability(monkeypatch):
    for cc, want in (((7, 0), torch.float16), ((8, 0), torch.bfloat16)):
        monkeypatch.setattr(hardware.probe, '_probe_cuda',
                            lambda index, cc=cc: hardware.cuda_capability(cc, index=index))
        monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
        assert resolve_properties('O1', dtype='auto', device='cuda:0').dtype == want


# ---- FP16OptimWrapper and the default model ------------------------------------------------------

def _fp16_wrapper(model, **kw):
    return FP16OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), **kw)


@pytest.mark.parametrize('kind,dtype,dynamic', [('avx2', torch.float32, False),
                                                ('avx512-bf16', torch.bfloat16, False),
                                                ('avx512-fp16-only', torch.float16, True)])
def test_fp16_wrapper_auto(fake_cpu, logs, kind, dtype, dynamic):
    fake_cpu(kind)
    model = DigitsCNN(width=4, dtype='auto')
    assert model.head.weight.dtype == dtype
    assert model.features[1].weight.dtype == torch.float32  # BatchNorm stays fp32
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        w = _fp16_wrapper(model, dtype='auto')
    assert w.dtype == dtype and w.dynamic_loss_scale is dynamic
    assert f"resolved to {str(dtype).replace('torch.', '')}" in logs[0]
    # fp32 masters exactly for the half params (none when 'auto' chose fp32).
    halves = [p for p in model.parameters() if p.dtype != torch.float32]
    masters = [p for g in w.optimizer.param_groups for p in g['params']]
    assert all(p.dtype == torch.float32 for p in masters)
    assert (len(halves) > 0) == (dtype != torch.float32)
    x = torch.randn(8, 1, 8, 8)
    y = torch.randint(0, 10, (8,))
    before = model.head.weight.detach().clone()
    w.update_params(model(x, y, mode='loss')['loss'])
    assert not torch.equal(before, model.head.weight)


def test_fp16_wrapper_dtype_must_match_the_model(fake_cpu):
    fake_cpu('avx512-bf16')
    model = DigitsCNN(width=4, dtype='bfloat16')
    with pytest.raises(ValueError, match=r"FP16OptimWrapper\(dtype='float16'\) expects the model in "
                       r'torch.float16 .* parameter 0 of the optimizer is torch.bfloat16'):
        _fp16_wrapper(model, dtype='float16')
    with pytest.raises(ValueError, match="dtype='fp8' is not supported; allowed: 'float16', "
                       "'bfloat16', 'float32', 'auto' or None"):
        _fp16_wrapper(model, dtype='fp8')
    assert _fp16_wrapper(model, dtype='bfloat16').dynamic_loss_scale is False
    assert _fp16_wrapper(model, dtype='bfloat16', dynamic_loss_scale=True).dynamic_loss_scale


def test_fp16_wrapper_warns_about_a_slow_half_model(fake_cpu):
    fake_cpu('avx2')
    model = DigitsCNN(width=4, dtype='bfloat16')
    with pytest.warns(UserWarning, match='bf16 on this CPU .* has no native instructions: expect '
                      'slower than fp32'):
        w = _fp16_wrapper(model)
    assert w.dtype is None and w.dynamic_loss_scale is False  # apex's defaults without dtype


# ---- the default config and tools/train.py --amp, through mmengine's Runner ---------------------

def _load_train_tool():
    spec = importlib.util.spec_from_file_location('train_tool', os.path.join(REPO, 'tools', 'train.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SHORT = ['train_dataloader.dataset.val_fraction=0.9', 'train_cfg.max_epochs=1',
         'default_hooks.logger.interval=2', 'train_cfg.val_interval=5']


@pytest.fixture
def run_train(tmp_path):
    train = _load_train_tool()
    threads = torch.get_num_threads()
    runs = []

    def run(config, *args):
        runs.append(config)
        cfg = train.build_config(train.parse_args(
            [config, *args, '--work-dir', str(tmp_path / str(len(runs))), '--cfg-options', *SHORT,
             f'experiment_name=auto_dtype_test_{len(runs)}_{os.getpid()}']))
        from mmengine.runner import Runner
        runner = Runner.from_cfg(cfg)
        runner.train()
        return runner
    yield run
    torch.set_num_threads(threads)


@pytest.mark.parametrize('kind,dtype', [('avx2', torch.float32), ('avx512-bf16', torch.bfloat16)])
def test_default_config_follows_the_hardware(fake_cpu, run_train, kind, dtype):
    fake_cpu(kind)
    runner = run_train(os.path.join('configs', 'digits', 'cnn_bf16.py'))
    assert runner.model.head.weight.dtype == dtype
    assert runner.optim_wrapper.dtype == dtype
    assert runner.optim_wrapper.loss_scalers[0].loss_scale == 1.0
    assert runner.message_hub.get_scalar('train/amp_skipped').current() == 0


def test_amp_flag_switches_a_plain_optim_wrapper(fake_cpu, run_train):
    fake_cpu('avx512-bf16')
    train = _load_train_tool()
    cfg = train.build_config(train.parse_args(
        ['configs/digits/cnn_fp32.py', '--amp', '--cfg-options', 'optim_wrapper.accumulative_counts=2',
         'optim_wrapper.clip_grad.max_norm=5.0']))
    ow = cfg.optim_wrapper
    assert (ow.type, ow.opt_level, ow.dtype) == ('mp_wrappers.ApexOptimWrapper', 'O1', 'auto')
    assert ow.optimizer.type == 'SGD' and ow.accumulative_counts == 2 and ow.clip_grad.max_norm == 5.0
    assert any(h['type'] == 'mp_wrappers.MixedPrecisionHook' for h in cfg.custom_hooks)
    runner = run_train(os.path.join('configs', 'digits', 'cnn_fp32.py'), '--amp')
    assert isinstance(runner.optim_wrapper, ApexOptimWrapper)
    assert runner.optim_wrapper.properties.dtype == torch.bfloat16
    assert runner.optim_wrapper.opt_level == 'O1'


def test_amp_flag_leaves_our_wrappers_and_refuses_others():
    from mp_wrappers.train_config import enable_amp
    cfg = Config.fromfile(os.path.join(REPO, 'configs', 'digits', 'cnn_bf16.py'))
    assert enable_amp(cfg) is False and cfg.optim_wrapper.type == 'mp_wrappers.FP16OptimWrapper'
    cfg = Config(dict(optim_wrapper=dict(type='AmpOptimWrapper', optimizer=dict(type='SGD', lr=0.1))))
    with pytest.raises(ValueError, match="optim_wrapper.type is 'AmpOptimWrapper'; allowed: "
                       "'OptimWrapper'"):
        enable_amp(cfg)
    with pytest.raises(ValueError, match='--amp needs an optim_wrapper dict'):
        enable_amp(Config(dict(model=dict())))


def test_train_help_lists_amp(capsys):
    train = _load_train_tool()
    with pytest.raises(SystemExit):
        train.parse_args(['--help'])
    assert '--amp' in capsys.readouterr().out


# ---- the run-time ISA switch ---------------------------------------------------------------------

def test_set_cpu_isa_switches_and_refuses():
    from mp_wrappers.ops._extension import extension
    ext = extension()
    if ext is None:
        pytest.skip('the C++ extension is not built')
    widest = ext.cpu_isa_hardware()
    before = ext.cpu_isa()
    previous = ext._set_cpu_isa('baseline')
    try:
        assert previous == before and mp_wrappers.ops.backend()['cpu'] == 'cpp-baseline'
        with pytest.raises(ValueError, match="unknown ISA 'sse9'; allowed: 'avx512', 'avx2', 'baseline'"):
            ext._set_cpu_isa('sse9')
        if widest != 'avx512':
            with pytest.raises(ValueError, match="cannot run the 'avx512' kernels"):
                ext._set_cpu_isa('avx512')
    finally:
        ext._set_cpu_isa(previous)
    assert ext.cpu_isa() == before


# ---- python -m mp_wrappers -----------------------------------------------------------------------

def test_doctor_runs_clean_in_a_fresh_process():
    proc = subprocess.run([sys.executable, '-m', 'mp_wrappers'], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for section in ('-- versions', 'torch ', 'mmengine ', '-- extension', '-- devices',
                    "dtype='auto' ->", '-- self-test', 'ops agree', 'OK'):
        assert section in out, section
    assert 'FAIL' not in out


def test_doctor_exits_nonzero_when_an_op_disagrees(monkeypatch, capsys):
    from mp_wrappers import __main__ as doctor
    from mp_wrappers.ops import _extension, reference
    if _extension.extension() is None:
        pytest.skip('the C++ extension is not built: nothing compiled to self-test')

    def wrong_scale(inputs, outputs, scale, found_inf):
        for o in outputs:
            o.zero_()
    monkeypatch.setattr(reference, 'multi_tensor_scale_', wrong_scale)
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert 'FAIL multi_tensor_scale_' in out and 'BROKEN' in out
    assert doctor.main(['--no-selftest']) == 0
