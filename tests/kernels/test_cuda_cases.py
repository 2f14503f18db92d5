"""The conftest fixture that makes CUDA test cases able to fail (issue 12, item 3), checked without a GPU.

One pytest run in a subprocess collects three small test files next to a copy of tests/conftest.py,
each faking a GPU machine (a module-scoped fixture, so it is in place before the conftest's
function-scoped one runs). A CUDA case must skip with the reason when the build has no CUDA kernels,
fail instead under MP_WRAPPERS_TEST_REQUIRE_CUDA=1, and fail when a reference stands in for a kernel.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
REPO = os.path.dirname(HERE)

CASES = '''
import pytest
import torch

import mp_wrappers.ops


@pytest.fixture(scope='module', autouse=True)
def _fake_gpu_machine():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, 'is_available', lambda: True)
        if {require!r}:
            mp.setenv('MP_WRAPPERS_TEST_REQUIRE_CUDA', '1')
        if {kernels_built!r}:  # what backend() says when our CUDA kernels are in the build
            mp.setattr(mp_wrappers.ops, 'backend',
                       lambda: dict(extension=True, cpu='cpp', cuda='cuda', error=None))
        yield


@pytest.mark.parametrize('device', ['cpu', 'cuda'])
def test_case(device):
    if device == 'cuda':
        from mp_wrappers.ops import _dispatch
        # This build has no CUDA kernels, so the dispatcher picks a reference for CUDA tensors.
        _dispatch.implementation('multi_tensor_scale_', torch.device('cuda'))
'''


@pytest.fixture(scope='module')
def fake_gpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('fake_gpu')
    # The conftest and the helper module its fixtures import (the guard canaries).
    for helper in ('conftest.py', '_guards.py'):
        shutil.copy(os.path.join(HERE, helper), tmp / helper)
    for name, require, built in (('cpu_build', False, False), ('required', True, False),
                                 ('kernels_built', False, True)):
        (tmp / f'test_{name}.py').write_text(CASES.format(require=require, kernels_built=built))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get('PYTHONPATH', '')]),
               COLUMNS='1000')  # whole summary lines
    env.pop('MP_WRAPPERS_TEST_REQUIRE_CUDA', None)
    proc = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-rA', '-p', 'no:cacheprovider',
                           '-W', 'ignore::DeprecationWarning', str(tmp)], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.stdout + proc.stderr


pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason='fakes a GPU on a CPU machine')


def test_cpu_cases_are_untouched(fake_gpu_run):
    for name in ('cpu_build', 'required', 'kernels_built'):
        assert f'PASSED test_{name}.py::test_case[cpu]' in fake_gpu_run, fake_gpu_run


def test_cuda_case_skips_with_the_reason_when_no_cuda_kernels_are_built(fake_gpu_run):
    assert ("test_cpu_build.py:20: the build has no CUDA kernels: "
            "mp_wrappers.ops.backend()['cuda'] is 'reference'") in fake_gpu_run, fake_gpu_run


def test_cuda_case_fails_when_cuda_kernels_are_required(fake_gpu_run):
    assert ('ERROR test_required.py::test_case[cuda] - Failed: MP_WRAPPERS_TEST_REQUIRE_CUDA=1 but '
            'the build has no CUDA kernels') in fake_gpu_run, fake_gpu_run


def test_cuda_case_fails_when_a_reference_stands_in_for_a_kernel(fake_gpu_run):
    assert ('FAILED test_kernels_built.py::test_case[cuda] - AssertionError: mp_wrappers.ops: the '
            'pure-PyTorch reference of multi_tensor_scale_ was picked in a CUDA test case'
            ) in fake_gpu_run, fake_gpu_run
