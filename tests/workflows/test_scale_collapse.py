"""Scale collapse end to end: tools/train.py stops with a clear error when the scale cannot help.

A static loss scale (it can never go lower) meets a persistent overflow, planted into ``head.weight``'s
gradient from iteration 4 on by a test-only hook. With ``on_scale_collapse='raise'`` and
``collapse_patience=3`` the process must exit non-zero after the third overflowing step, naming the
iteration, the scale and the parameter, instead of training on with every step skipped.
"""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, 'tests')


def test_train_tool_exits_on_scale_collapse_naming_iteration_scale_and_params(tmp_path):
    cfg = tmp_path / 'collapse.py'
    cfg.write_text(
        f"_base_ = [{os.path.join(REPO, 'tests/configs/fp16_dynamic.py')!r}]\n"
        "custom_imports = dict(imports=['mp_wrappers', 'projects.digits', '_reliability_hooks'], "
        "allow_failed_imports=False)\n"
        "custom_hooks = [dict(type='RelTestGradFaultHook', from_iter=4, param='head.weight')]\n"
        "optim_wrapper = dict(_delete_=True, type='mp_wrappers.FP16OptimWrapper',\n"
        "                     optimizer=dict(type='SGD', lr=0.05, momentum=0.9),\n"
        "                     static_loss_scale=128.0, on_scale_collapse='raise',\n"
        "                     collapse_patience=3)\n")
    env = dict(os.environ, OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([TESTS, os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.run([sys.executable, 'tools/train.py', str(cfg), '--work-dir',
                           str(tmp_path / 'wd')], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    # Iterations 4, 5 and 6 (1-based; mmengine's 0-based iter 5 at the third) overflowed.
    match = re.search(r'FloatingPointError: mp_wrappers: the loss scale collapsed at iteration (\d+): '
                      r'3 consecutive steps had non-finite gradients while the scale \(128\.0\) '
                      r'could not go lower; .*head\.weight', out)
    assert match, out[-3000:]
    assert match.group(1) == '5'
    # It trained normally up to the fault, then stopped: no iteration after the collapse ran.
    assert re.search(r'Iter\(train\) \[ *3/16\]', proc.stdout)
    assert not re.search(r'Iter\(train\) \[ *6/16\]', proc.stdout)
