"""wrappers/compiled_step: steps that make state run eagerly; static addresses for CUDA graphs.

Note [compiled step]: optimizer state and lr tensors made inside a compiled graph are its outputs,
which a CUDA graph (``mode='reduce-overhead'``) overwrites at its next replay (found on an H100).
So a step that would make them runs eagerly. That is the first step, and also one in which a param
gets its first gradient. On CUDA the tensors the stages update in place are marked static
addresses. The CUDA-graph cases themselves are in tests/wrappers/test_compiled_step.py (GPU only).
Here, on the CPU: where state and lr tensors are made, and that marking leaves CPU tensors (and
dynamo's import) alone.
"""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter

from _compat import needs_extension, requires
from mp_wrappers import ApexOptimWrapper, FusedAdam, compat
from mp_wrappers.optim import base as optim_base

pytestmark = [requires('fake_kernels'), requires('compile_list_ops'), needs_extension]


class _TwoHeads(nn.Module):
    """Head b takes part from step ``b_from`` on: its params get their first gradient late."""

    def __init__(self, b_from: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.b_from = nn.Linear(6, 3), nn.Linear(6, 3), b_from

    def forward(self, x, step):
        return self.a(x) + (self.b(x) if step >= self.b_from else 0)


def _train(b_from, compile_step, device='cpu', steps=5):
    """Train ``steps`` steps of O2 bf16 (dynamic scale, FusedAdam capturable); the model."""
    model = _TwoHeads(b_from).to(device)
    w = ApexOptimWrapper(FusedAdam(model.parameters(), lr=1e-2, capturable=True), opt_level='O2',
                         dtype='bfloat16', loss_scale='dynamic', verbosity=0,
                         compile_step=compile_step)
    w.prepare_for_training(model)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        with w.optim_context(model):
            loss = F.cross_entropy(model(x.to(device).bfloat16(), step).float(), y.to(device))
        w.update_params(loss)
    return model


def _made_while_compiling(monkeypatch, b_from):
    """Train 5 steps with compile_step; returns is_compiling() at each state creation and each
    float lr made a tensor, and how many frames were compiled."""
    seen = []
    init_state, lr_args = optim_base.FusedOptimizer._init_state, optim_base.FusedOptimizer._lr_args

    def spy_init(self, *args, **kwargs):
        seen.append(('state', compat.is_compiling()))
        return init_state(self, *args, **kwargs)

    def spy_lr(self, group, device):
        if not isinstance(group['lr'], torch.Tensor):
            seen.append(('lr', compat.is_compiling()))
        return lr_args(self, group, device)

    monkeypatch.setattr(optim_base.FusedOptimizer, '_init_state', spy_init)
    monkeypatch.setattr(optim_base.FusedOptimizer, '_lr_args', spy_lr)
    torch._dynamo.reset()
    counter = CompileCounter()
    model = _train(b_from, dict(backend=counter))
    torch._dynamo.reset()
    return seen, counter.frame_count, model


def test_state_and_lr_are_made_eagerly_when_a_param_gets_its_first_gradient_late(monkeypatch):
    seen, frames, model = _made_while_compiling(monkeypatch, b_from=3)
    assert ('lr', False) in seen and ('state', False) in seen
    assert all(not compiling for _, compiling in seen), seen
    assert len([s for s in seen if s[0] == 'state']) == 4  # a's two params at step 0, b's at 3
    assert frames >= 1  # steps 1-2 and 4 ran compiled
    assert torch.isfinite(model.b.weight.float()).all()


def test_a_compiled_run_makes_no_state_inside_a_graph(monkeypatch):
    seen, frames, _ = _made_while_compiling(monkeypatch, b_from=0)
    assert all(not compiling for _, compiling in seen), seen
    assert frames == 1  # the first step eager, one graph for the other four


@pytest.mark.parametrize('device', [pytest.param('cuda', marks=pytest.mark.cuda)])
def test_late_gradients_replay_as_cuda_graphs_like_eager(device):
    """On a GPU: with mode='reduce-overhead' a param's first gradient at step 3 takes an eager
    step, the others replay CUDA graphs (none skipped), and the params end as eager's, bitwise."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    eager = _train(3, False, device, steps=7)
    compiled = _train(3, dict(backend='inductor', mode='reduce-overhead'), device, steps=7)
    assert counters['inductor']['cudagraph_skips'] == 0, dict(counters['inductor'])
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(a, b)
    torch._dynamo.reset()


def test_marking_leaves_cpu_tensors_alone_and_never_imports_dynamo():
    code = ('import sys, torch\n'
            'from mp_wrappers import compat\n'
            't = torch.zeros(3)\n'
            'compat.mark_static_addresses([t, None, 1.0])\n'
            "assert getattr(t, '_dynamo_static_input_type', None) is None\n"
            "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n")
    subprocess.run([sys.executable, '-c', code], check=True, timeout=120)


def test_the_8bit_shard_lookup_is_not_asked_without_dtensors(monkeypatch):
    """With fp32 masters of bf16 params (master_weights=True) the slot's target is no state key;
    without FSDP2's DTensor params no shard lookup runs (its data_ptr-keyed dict broke the graph of
    this case's compiled step under torch 2.11's dynamo, on an H100)."""
    from mp_wrappers.optim import quantized_state

    def refuse(self, local_param):
        raise AssertionError('_shard_state asked without DTensor params')

    monkeypatch.setattr(quantized_state.QuantizedStateMixin, '_shard_state', refuse)
    params = [nn.Parameter(torch.randn(64, 8).bfloat16())]
    params[0].grad = torch.randn(64, 8).bfloat16()
    opt = FusedAdam(params, lr=1e-2, master_weights=True)
    before = params[0].detach().clone()
    opt.step()
    opt.step()
    assert not torch.equal(params[0], before)
