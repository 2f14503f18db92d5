"""tools/compare_precision.py: run planning, config rewriting, the table, and a tiny real comparison."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from mmengine.config import Config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGITS = os.path.join(REPO, 'configs', 'digits', 'cnn_bf16.py')


@pytest.fixture(scope='module')
def tool():
    spec = importlib.util.spec_from_file_location(
        'compare_precision', os.path.join(REPO, 'tools', 'compare_precision.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_runs(tool):
    assert tool.plan_runs(['O0', 'O2'], ['float16', 'bfloat16']) == [
        ('O0', 'float32'), ('O2', 'float16'), ('O2', 'bfloat16')]
    with pytest.raises(ValueError, match="'00' is not an opt level.*the letter O, not zero"):
        tool.plan_runs(['00'], ['bfloat16'])
    with pytest.raises(ValueError, match="'half' is not supported; allowed: float16, bfloat16"):
        tool.plan_runs(['O1'], ['half'])


def test_build_run_config(tool, tmp_path):
    cfg = Config.fromfile(DIGITS)
    tool.build_run_config(cfg, 'O2', 'bfloat16', 50, str(tmp_path))
    ow = cfg.optim_wrapper
    assert ow.type == 'mp_wrappers.ApexOptimWrapper' and ow.opt_level == 'O2'
    assert ow.dtype == 'bfloat16' and ow.optimizer.type == 'SGD'
    assert cfg.model.dtype is None  # the config's bf16 model would defeat O0/O1
    assert cfg.train_cfg == dict(type='IterBasedTrainLoop', max_iters=50, val_interval=50)
    assert cfg.param_scheduler[1].convert_to_iter_based is True
    assert cfg.custom_hooks[-1].type == 'CompareProbeHook'
    with pytest.raises(ValueError, match='--iters=0 must be a positive integer'):
        tool.build_run_config(Config.fromfile(DIGITS), 'O1', 'bfloat16', 0, str(tmp_path))


def test_format_table(tool):
    base = dict(level='O0', dtype='float32', time_per_iter=0.01, peak_memory_bytes=2 ** 21,
                memory_kind='cpu_peak_rss_growth', final_train_loss=0.5,
                metrics={'accuracy': 95.0}, skipped=0)
    o1 = dict(base, level='O1', dtype='bfloat16', time_per_iter=0.005, metrics={'accuracy': 94.5},
              skipped=2)
    failed = dict(level='O3', dtype='float16', error='exit code 1, see x/run.log')
    table = tool.format_table([base, o1, failed]).splitlines()
    assert table[0].startswith('| level | dtype | states | ms/iter | speed-up vs O0 | '
                               'peak RSS growth (MiB)')
    assert table[3] == ('| O1 | bfloat16 | - | 5.0 | 2.00x | 2.0 | 0.5000 | 94.5000 | -0.50 | 2 |')
    assert 'failed: exit code 1, see x/run.log' in table[4]


def test_state_dtype_column_and_reference_rows(tool):
    """--state-dtypes runs: the measured state dtype is a column; O0 and time-vs-O2 refer to the
    fp32-state runs, whichever order the runs came in."""
    run = dict(dtype='bfloat16', time_per_iter=0.01, peak_memory_bytes=None, final_train_loss=0.5,
               skipped=0, bytes_per_param=14.0)
    o0_int8 = dict(run, level='O0', dtype='float32', states='int8', state_dtype='int8',
                   metrics={'accuracy': 90.0}, bytes_per_param=6.0)
    o0 = dict(run, level='O0', dtype='float32', states='float32', state_dtype='float32',
              metrics={'accuracy': 95.0}, bytes_per_param=12.0)
    o2_int8 = dict(run, level='O2', states='int8', state_dtype='int8', time_per_iter=0.02,
                   metrics={'accuracy': 93.5}, bytes_per_param=8.1)
    o2 = dict(run, level='O2', states='float32', state_dtype='float32', metrics={'accuracy': 96.0})
    failed = dict(level='O2', dtype='float16', states='int8', error='exit code 1')
    table = tool.format_table([o0_int8, o0, o2_int8, o2, failed]).splitlines()
    assert table[0].startswith('| level | dtype | states | B/param | ms/iter | time vs O2 |')
    assert table[2].startswith('| O0 | float32 | int8 | 6.00 | 10.0 | 1.00x |')
    assert table[2].endswith('| 90.0000 | -5.00 | 0 |')  # against the fp32-state O0
    assert table[4].startswith('| O2 | bfloat16 | int8 | 8.10 | 20.0 | 2.00x |')
    assert table[6].startswith('| O2 | float16 | int8 | failed: exit code 1 |')
    met, lines = tool.check_bar([o0_int8, o0, o2_int8, o2], {'accuracy': 1.0})
    assert not met and lines[0].startswith(
        'fidelity bar: O2 bfloat16 int8 states: accuracy 93.5000 vs O0 95.0000')
    assert lines[1].endswith(': met')


def test_state_dtypes_select_the_optimizers_state_dtype(tool, tmp_path, capsys):
    assert tool.check_state_dtypes(['int8', 'float32', 'int8']) == ['int8', 'float32']
    with pytest.raises(ValueError, match="--state-dtypes: 'fp8' is not an optimizer state dtype; "
                                         'allowed: float32, int8'):
        tool.check_state_dtypes(['fp8'])
    assert tool.run_name('O2', 'bfloat16', state='int8') == 'O2_bfloat16_int8state'
    cfg = Config.fromfile(DIGITS)
    cfg.merge_from_dict({'optim_wrapper.optimizer': dict(_delete_=True, type='mp_wrappers.FusedAdam',
                                                         lr=1e-3)})
    tool.build_run_config(cfg, 'O2', 'bfloat16', 10, str(tmp_path), state='int8')
    assert cfg.optim_wrapper.optimizer.state_dtype == 'int8'
    assert cfg.experiment_name == 'compare_O2_bfloat16_int8state'
    # The digits config's torch SGD has no state_dtype: refused, naming the option to change.
    with pytest.raises(ValueError, match="--state-dtypes int8: the optimizer 'SGD' has no "
                                         'state_dtype; .*optim_wrapper.optimizer.type='
                                         'mp_wrappers.FusedAdam'):
        tool.build_run_config(Config.fromfile(DIGITS), 'O2', 'bfloat16', 10, str(tmp_path),
                              state='int8')
    # ... and by the command line before any run starts
    assert tool.main([DIGITS, '--state-dtypes', 'int8', '--work-dir', str(tmp_path / 'w')]) == 2
    assert "the optimizer 'SGD' has no state_dtype" in capsys.readouterr().err
    assert not (tmp_path / 'w').exists()


def test_measured_state_dtype(tool):
    import torch

    from mp_wrappers.optim import FusedAdam, FusedSGD
    big, small = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(8))
    for state in ('int8', 'float32'):
        opt = FusedAdam([big, small], lr=1e-3, state_dtype=state)
        big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
        opt.step()
        assert tool.measured_state_dtype(opt) == state  # the small param's fp32 is a minority
    assert tool.measured_state_dtype(FusedSGD([big], lr=0.1)) is None  # no state before a step


def test_fidelity_bar(tool):
    """--bar: accuracy may drop TOL points, a loss rise TOL percent; O3 and master modes are not
    judged; a failed run, a missing metric or a missing O0 misses the bar."""
    base = dict(level='O0', dtype='float32', metrics={'accuracy': 98.0, 'val_ce': 1.40})
    good = dict(level='O1', dtype='float16', metrics={'accuracy': 97.2, 'val_ce': 1.42})
    better = dict(level='O2', dtype='bfloat16', metrics={'accuracy': 99.0, 'val_ce': 1.30})
    o3 = dict(level='O3', dtype='bfloat16', metrics={'accuracy': 50.0, 'val_ce': 9.0})
    bars = tool.parse_bar(['accuracy=1', 'val_ce=2'])
    assert bars == {'accuracy': 1.0, 'val_ce': 2.0}
    met, lines = tool.check_bar([base, good, better, o3], bars)
    assert met and len(lines) == 4 and all(line.endswith(': met') for line in lines)
    assert lines[0] == ('fidelity bar: O1 float16: accuracy 97.2000 vs O0 98.0000 (-0.80 points, '
                        'allowed -1): met')
    assert '(+1.43 %, allowed +2)' in lines[1]
    worse = dict(good, metrics={'accuracy': 96.9, 'val_ce': 1.43})
    met, lines = tool.check_bar([base, worse], bars)
    assert not met and [line.endswith('MISSED') for line in lines] == [True, True]
    met, lines = tool.check_bar([base, dict(level='O2', dtype='float16', error='exit 1')], bars)
    assert not met and 'MISSED (the run failed: exit 1)' in lines[0]
    met, lines = tool.check_bar([base, good], {'bpc': 1.0})
    assert not met and "no metric 'bpc'" in lines[0]
    assert tool.check_bar([good], bars) == (
        False, ['fidelity bar: no successful O0 run to compare with'])
    for bad in ('accuracy', 'accuracy=', 'accuracy=-1', '=1', 'accuracy=x'):
        with pytest.raises(ValueError, match=rf'--bar {bad!r}: expected METRIC=TOLERANCE'):
            tool.parse_bar([bad])


def test_tiny_comparison_writes_markdown(tmp_path):
    out = tmp_path / 'table.md'
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, 'tools', 'compare_precision.py'), DIGITS,
         '--iters', '6', '--levels', 'O0', 'O2', '--dtypes', 'bfloat16', '--no-progress',
         '--work-dir', str(tmp_path / 'runs'), '--out', str(out), '--bar', 'accuracy=100',
         '--cfg-options', 'default_hooks.logger.interval=3'],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    # --bar: checked after the table, in the output and in the Markdown file
    assert 'fidelity bar: O2 bfloat16: accuracy' in proc.stdout
    assert '- fidelity bar: O2 bfloat16: accuracy' in text and text.rstrip().endswith(': met')
    rows = [line for line in text.splitlines() if line.startswith('| O')]
    assert [r.split(' | ')[:2] for r in rows] == [['| O0', 'float32'], ['| O2', 'bfloat16']]
    assert 'val accuracy' in text and '6 iterations per run' in text
    data = json.loads((tmp_path / 'table.json').read_text())
    o2 = data['results'][1]
    assert o2['iters'] == 6 and o2['skipped'] == 0 and o2['time_per_iter'] > 0
    assert 0 <= o2['metrics']['accuracy'] <= 100
    # each run kept its own mmengine log, with the amp fields of the hook
    (log,) = (tmp_path / 'runs' / 'O2_bfloat16').glob('*/*.log')
    assert 'amp_scale: 1.0000' in log.read_text()


def test_int8_states_through_the_tool(tmp_path):
    """--state-dtypes float32 int8 trains both arms (FusedAdam, O2 bf16) and shows what each kept."""
    out = tmp_path / 'table.md'
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, 'tools', 'compare_precision.py'), DIGITS,
         '--iters', '4', '--levels', 'O2', '--state-dtypes', 'float32', 'int8', '--no-progress',
         '--work-dir', str(tmp_path / 'runs'), '--out', str(out), '--cfg-options',
         'optim_wrapper.optimizer._delete_=True', 'optim_wrapper.optimizer.type=mp_wrappers.FusedAdam',
         'optim_wrapper.optimizer.lr=1e-3'],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split(' | ') for line in out.read_text().splitlines() if line.startswith('| O2')]
    assert [r[:3] for r in rows] == [['| O2', 'bfloat16', 'float32'], ['| O2', 'bfloat16', 'int8']]
    # digits CNN, O2 Adam: bf16 model 2 + fp32 masters 4 + moments 8 (fp32) or ~2.1 (int8)
    assert 13.9 < float(rows[0][3]) < 14.1 and 8.0 < float(rows[1][3]) < 8.3, rows
    data = json.loads((tmp_path / 'table.json').read_text())
    assert [r['states'] for r in data['results']] == ['float32', 'int8']
    assert sorted(os.listdir(tmp_path / 'runs')) == ['O2_bfloat16_float32state',
                                                     'O2_bfloat16_int8state']


def test_master_modes_and_measured_bytes_per_param(tool, tmp_path):
    import torch

    from mp_wrappers import ApexOptimWrapper
    from mp_wrappers.optim import FusedAdam
    assert tool.parse_master_mode('kahan-bf16state') == ('kahan', 'bfloat16')
    assert tool.parse_master_mode('split') == ('split', None)
    with pytest.raises(ValueError, match="'fp8' is not a master mode; allowed: split, kahan"):
        tool.parse_master_mode('fp8')
    cfg = Config.fromfile(DIGITS)
    tool.build_run_config(cfg, 'O2', 'bfloat16', 10, str(tmp_path), master='kahan-bf16state')
    assert cfg.optim_wrapper.master_weights == 'kahan'
    assert cfg.optim_wrapper.optimizer.state_dtype == 'bfloat16'
    # Measured from the tensors after a step: Adam O2 = 2 + 4 + 8, split = 2 + 2 + 8,
    # kahan with bf16 moments = 2 + 2 + 4 (+ the 4-byte step counter, shared).
    for master, want in ((True, 14), ('split', 12), ('kahan', 8)):
        model = torch.nn.Linear(64, 64, bias=False)
        opt = FusedAdam(model.parameters(), lr=1e-3,
                        state_dtype='bfloat16' if master == 'kahan' else 'float32')
        wrapper = ApexOptimWrapper(opt, opt_level='O2', dtype='bfloat16', master_weights=master,
                                   verbosity=0)
        with wrapper.optim_context(model):
            loss = model(torch.randn(2, 64)).float().sum()
        wrapper.update_params(loss)
        got = tool.persistent_bytes_per_param(model, wrapper.optimizer)
        assert want <= got < want + 0.01, (master, got)
