"""compile_step through mmengine's Runner, under our tools/train.py and a toolbox's own train script.

Note [compiled step] (mp_wrappers/wrappers/compiled_step.py): a step that would make optimizer state
or an lr tensor runs eagerly, the others run the device stages compiled. Here a real config trains
with what users combine: O2 bf16, FusedAdam with capturable=True, mmengine's LinearLR (which assigns
a new lr tensor every iteration), gradient accumulation, EMAHook and a head whose params get their
first gradient at iteration 3, with float32 and with 8-bit moments (``state_dtype='int8'``), and
FusedSGD with an 8-bit momentum buffer. The
compiled run ends bitwise equal to the same run without compile_step. The 'eager' backend traces with dynamo (whole graphs, fullgraph=True) and runs the
graph eagerly: seconds on a CPU.
"""
import pytest
import torch

from _compat import needs_extension, requires
from _workflow import train_recorded

pytestmark = [requires('fake_kernels'), requires('compile_list_ops'), needs_extension]


def _run(work_dir, compile_step, states='float32'):
    if states == 'sgd-int8':  # FusedSGD's 8-bit momentum buffer
        optimizer = dict(type='mp_wrappers.FusedSGD', lr=0.05, momentum=0.9, state_dtype='int8')
    else:
        optimizer = dict(type='mp_wrappers.FusedAdam', lr=1e-2, state_dtype=states)
    return train_recorded(work_dir, dict(optimizer, capturable=True, min_8bit_size=0),
                          dict(compile_step=compile_step))


@pytest.mark.parametrize('launcher, states', [('tools_train', 'float32'), ('toolbox', 'float32'),
                                              ('toolbox', 'int8'), ('toolbox', 'sgd-int8')],
                         indirect=['launcher'])
def test_compiled_step_trains_like_eager_under_the_runner(tmp_path, launcher, states):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    runner, eager = _run(tmp_path / 'eager', False, states)
    if states != 'float32':  # the head's and the body's moments (or buffers) are codes
        key = 'momentum_buffer' if states == 'sgd-int8' else 'exp_avg'
        state = runner.optim_wrapper.optimizer.state
        assert state and all(s[key].dtype == torch.uint8 for s in state.values())
    counters.clear()
    _, compiled = _run(tmp_path / 'compiled', dict(backend='eager'), states)
    graphs = counters['stats']['unique_graphs']
    torch._dynamo.reset()
    assert graphs >= 1  # the update iterations that make no state ran compiled
    assert len(eager.weights) == len(compiled.weights) == 8
    for a, b in zip(eager.weights + eager.masters, compiled.weights + compiled.masters):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # The late head took part: its first update (an eager step) and the compiled ones after it.
    assert not torch.equal(compiled.weights[2]['late.weight'], compiled.weights[-1]['late.weight'])
