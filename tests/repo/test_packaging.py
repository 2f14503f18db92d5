"""What ships is the library: the wheel holds the ``mp_wrappers`` package and its extension, no test,
demo, tool or benchmark code; and ``import mp_wrappers`` registers no demo workload.

The wheel's file list is computed without compiling anything: ``setup.py`` runs with
``setuptools.setup`` replaced by a recorder, and setuptools' own ``build_py`` command, given the
recorded arguments, lists the modules and package data it would copy (``find_all_modules`` and
``data_files``: what ``bdist_wheel`` puts in the wheel beside the extension, which is listed by name).
A real ``python -m build --wheel --no-isolation`` compiles the extension for minutes; the summary of
one such build is in the branch's report, this test keeps it honest.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs setup.py of each root given on the command line (as cwd, as pip would) and prints
# {root: [files the wheel would hold]}.
_LIST_WHEEL_FILES = r'''
import json, os, runpy, sys
import setuptools
from setuptools.dist import Distribution

out = {}
for root in sys.argv[1:]:
    recorded = {}
    setuptools.setup = lambda **kwargs: recorded.update(kwargs)
    os.chdir(root)
    sys.argv = ['setup.py']
    runpy.run_path(os.path.join(root, 'setup.py'), run_name='__main__')
    # With include_package_data the manifest (egg_info's SOURCES.txt) would decide what else ships:
    # setup.py must say what it ships instead.
    assert recorded.get('include_package_data') is False, 'setup.py: include_package_data=False'
    for key in ('py_modules', 'data_files', 'scripts'):
        assert not recorded.get(key), f'setup.py ships {key}={recorded[key]!r}'
    kwargs = {k: v for k, v in recorded.items() if k not in ('ext_modules', 'cmdclass')}
    dist = Distribution(kwargs)
    dist.script_name = 'setup.py'
    build_py = dist.get_command_obj('build_py')
    build_py.ensure_finalized()
    files = [path for _, _, path in build_py.find_all_modules()]
    files += [os.path.join(src, name) for _, src, _, names in build_py.data_files for name in names]
    files += [ext.name.replace('.', '/') + '.so' for ext in recorded.get('ext_modules', [])]
    out[root] = sorted(os.path.normpath(f) for f in files)
print(json.dumps(out))
'''

# Folders and files of the repository that must never ship, wherever they would appear.
_NOT_SHIPPED = re.compile(r'(^|/)(tests?|projects|benchmarks|tools|configs|docs|workloads)(/|$)'
                          r'|(^|/)(test_[^/]*|[^/]*_test|conftest|cuda_host)\.py$')


def wheel_files(*roots: str) -> dict:
    env = dict(os.environ, MP_WRAPPERS_CUDA='0')  # the CUDA decision does not change the file list
    proc = subprocess.run([sys.executable, '-c', _LIST_WHEEL_FILES, *roots], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def not_shipped(files) -> list:
    """The files that must not be in the wheel: outside ``mp_wrappers/``, or test/demo code."""
    return [f for f in files if not f.startswith('mp_wrappers/') or _NOT_SHIPPED.search(f)]


def test_not_shipped_names_tests_demos_and_outside_files():
    files = ['mp_wrappers/__init__.py', 'mp_wrappers/ops/reference.py', 'mp_wrappers/_C.so',
             'mp_wrappers/workloads/models.py', 'mp_wrappers/ops/cuda_host.py',
             'mp_wrappers/tests/helpers.py', 'mp_wrappers/test_scaler.py', 'projects/digits/model.py',
             'tools/train.py', 'conftest.py']
    assert not_shipped(files) == files[3:]


def test_wheel_holds_the_library_only(tmp_path):
    # The checkout as it is, and a copy of its packaging with demo and test code put back into the
    # package: the listing must see them (so the first answer means something).
    copy = tmp_path / 'copy'
    shutil.copytree(os.path.join(REPO, 'mp_wrappers'), copy / 'mp_wrappers',
                    ignore=shutil.ignore_patterns('csrc', '*.so', '__pycache__'))
    for name in ('setup.py', 'build_config.py', 'pyproject.toml'):
        shutil.copy(os.path.join(REPO, name), copy / name)
    for planted in ('mp_wrappers/workloads/__init__.py', 'mp_wrappers/tests/__init__.py',
                    'mp_wrappers/tests/test_scaler.py'):
        (copy / planted).parent.mkdir(exist_ok=True)
        (copy / planted).write_text('')
    listed = wheel_files(REPO, str(copy))
    files = listed[REPO]

    assert not not_shipped(files), f'the wheel would ship test or demo code: {not_shipped(files)}'
    for expected in ('mp_wrappers/__init__.py', 'mp_wrappers/registry.py', 'mp_wrappers/_C.so',
                     'mp_wrappers/wrappers/base.py', 'mp_wrappers/ops/reference/__init__.py',
                     'mp_wrappers/optim/adam.py', 'mp_wrappers/distributed/fsdp.py'):
        assert expected in files
    # Every module of the package ships (and only Python modules and the extension).
    package = sorted(os.path.relpath(os.path.join(d, n), REPO)
                     for d, _, names in os.walk(os.path.join(REPO, 'mp_wrappers'))
                     for n in names if n.endswith('.py'))
    assert sorted(f for f in files if f.endswith('.py')) == package
    assert [f for f in files if not f.endswith('.py')] == ['mp_wrappers/_C.so']

    assert sorted(not_shipped(listed[str(copy)])) == [
        'mp_wrappers/tests/__init__.py', 'mp_wrappers/tests/test_scaler.py',
        'mp_wrappers/workloads/__init__.py']


@pytest.mark.parametrize('name', ['DigitsCNN', 'CharTransformerLM'])
def test_importing_the_library_registers_no_demo(name):
    """The demo workloads (projects/) register only when a config imports them."""
    config = 'configs/digits/cnn_fp32.py' if name == 'DigitsCNN' else 'configs/charlm/lm_fp32.py'
    code = ('import sys; import mp_wrappers; from mmengine.registry import MODELS; '
            f'assert MODELS.get("mp_wrappers.{name}") is None; '
            'assert not [m for m in sys.modules if m.split(".")[0] == "projects"]; '
            f'from mmengine.config import Config; Config.fromfile("{config}"); '
            f'assert MODELS.get("mp_wrappers.{name}") is not None')
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
