"""The host emulation's barriers (mp_wrappers/csrc/include/mp_wrappers/cuda_host/emulation.h).

Every host test relies on them: the block reductions of the kernels are right only if a barrier
holds each live thread until the last one arrives, and a thread that returned no longer counts. A
divergent barrier, which would hang a GPU, must abort with a message instead of hanging CI. Two
kernels of the host module's own (cuda_host/module.cpp) show this without a real kernel. Skipped
unless a host variant is built (tools/cuda_host_check.sh).
"""
import os
import subprocess
import sys

import pytest

import cuda_host

VARIANT_NAMES = os.environ.get('MP_WRAPPERS_CUDA_HOST_VARIANTS', 'real,tiny').split(',')


@pytest.fixture(params=VARIANT_NAMES)
def variant(request):
    if cuda_host.load(request.param) is None:
        pytest.skip(f'cuda host module {request.param!r} is not built: run `bash '
                    'tools/cuda_host_check.sh` or set MP_WRAPPERS_CUDA_ON_HOST=1')
    return request.param


@pytest.mark.parametrize('threads,live', [(64, 64), (64, 37), (512, 512), (512, 5), (1024, 1000)])
def test_block_barrier_holds_every_live_thread(variant, threads, live):
    blocks = 3
    out = cuda_host.load(variant).emulation_rotate_through_shared(blocks, threads, live)
    expected = []
    for b in range(blocks):
        expected += [b * 10000 + (t + 1) % live if t < live else -1 for t in range(threads)]
    assert out == expected


def test_divergent_barrier_aborts_with_a_message(variant):
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ('import cuda_host\n'
            f'cuda_host.load({variant!r}).emulation_divergent_barrier(64)\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [tests_dir, os.path.dirname(tests_dir), os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    # The scheduler names the barrier of the lowest-numbered thread still waiting: thread 0's.
    assert ('mp_wrappers cuda host emulation: __syncthreads() not reached by every live thread '
            'of the group (deadlock)') in proc.stderr, proc.stderr[-2000:]
