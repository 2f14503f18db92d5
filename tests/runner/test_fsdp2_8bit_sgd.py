"""FusedSGD's 8-bit momentum buffer under FSDP2 on CPU with gloo: the same optimizer-state code as
FusedAdam's 8-bit moments (tests/runner/test_fsdp2_8bit.py, whose model, sharding, seeded full
gradients and records this module reuses), checked for the buffer.

* 2 ranks equal one unsharded process bit for bit for the params with an 8-bit buffer (codes and
  absmax included; rows split unevenly, a rank holding no rows); params whose blocks would straddle
  shards keep a float32 buffer.
* A DCP checkpoint written by 2 ranks resumes bitwise on 2 ranks.
* A skipped step (``found_inf``) leaves codes, absmax, params and step counters unchanged.
* bf16 params stored 'split' or 'kahan' with an 8-bit buffer (``multi_tensor_sgd8bit_lean_`` on
  each rank's rows): 2 ranks equal one process bit for bit, the aux state included.
"""
import os

import pytest
import torch

import torchrun
from _compat import requires
from test_fsdp import _free_port
from test_fsdp2_8bit import (EIGHT_BIT, FP32_UNDER_FSDP2, LEAN_MODES, STEPS, _assert_equal, _ckpt,
                             _lean_case, _Net, _record, _shard, _skip_case, _steps)

pytestmark = requires('fsdp2_cpu')


def _sgd(model, bf16_storage=None):
    from mp_wrappers import FusedSGD
    return FusedSGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True,
                    state_dtype='int8', min_8bit_size=512, bf16_storage=bf16_storage)


def _worker(rank, world, port, out_dir):
    with torchrun.gloo_group(rank, world, port):
        ckpt = os.path.join(out_dir, 'ckpt')
        if world == 1:  # the unsharded reference
            model = _Net()
            opt = _sgd(model)
            _steps(model, opt, 0, STEPS)
            out = dict(reference=_record(model, opt))
        else:
            model = _shard(_Net())
            opt = _sgd(model)
            _steps(model, opt, 0, 2)
            _ckpt(ckpt, model, opt)
            _steps(model, opt, 2, STEPS)
            out = dict(straight=_record(model, opt))
            model = _shard(_Net())
            opt = _sgd(model)
            _ckpt(ckpt, model, opt, load=True)
            _steps(model, opt, 2, STEPS)
            out['resumed'] = _record(model, opt)
            model = _shard(_Net())
            out['skip_unchanged'] = _skip_case(model, _sgd(model))
        out['lean'] = {mode: _lean_case(mode, world == 2, _sgd) for mode in LEAN_MODES}
        torch.save(out, os.path.join(out_dir, f'world{world}_rank{rank}.pt'))


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp('fsdp2_8bit_sgd')
    results = {}
    for world in (2, 1):
        files = [out / f'world{world}_rank{r}.pt' for r in range(world)]
        torchrun.spawn(_worker, lambda w=world: (w, _free_port(), str(out)), world, files)
        results[world] = [torch.load(f, weights_only=False) for f in files]
    return results


def test_eight_bit_buffers_match_one_process_bitwise(runs):
    reference = runs[1][0]['reference']
    for rank in runs[2]:
        straight = rank['straight']
        for name in EIGHT_BIT:
            assert straight[name]['momentum_buffer'].dtype == torch.uint8, name
        for name in FP32_UNDER_FSDP2:
            assert straight[name]['momentum_buffer'].dtype == torch.float32, name
        _assert_equal(straight, reference, EIGHT_BIT)


@pytest.mark.parametrize('mode', LEAN_MODES)
def test_lean_bf16_shards_with_an_8bit_buffer_match_one_process_bitwise(mode, runs):
    aux = {'split': 'master_low', 'kahan': 'kahan_comp'}[mode]
    for rank in runs[2]:
        got = rank['lean'][mode]
        for name in EIGHT_BIT:
            assert got[name]['momentum_buffer'].dtype == torch.uint8 and aux in got[name], name
        _assert_equal(got, runs[1][0]['lean'][mode], EIGHT_BIT)


def test_checkpoint_of_2_ranks_resumes_bitwise(runs):
    for rank in runs[2]:
        _assert_equal(rank['resumed'], rank['straight'])


def test_skipped_step_leaves_the_buffer_unchanged(runs):
    assert all(rank['skip_unchanged'] for rank in runs[2])
