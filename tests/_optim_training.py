"""Small models, batches and checks the 8-bit optimizer-state tests share
(tests/optim/test_quantized_state.py: FusedAdam; tests/optim/test_quantized_sgd_optim.py: FusedSGD).

``mlp`` has 8192- and 8320-element weights (8-bit moments under the default ``min_8bit_size``) and
128- and 64-element biases (float32); ``classifier`` is the wrappers' model. ``overflow_step``
runs one FP16OptimWrapper step with an inf gradient, to check that it changes nothing.
"""
import io

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ['mlp', 'batches', 'train', 'states', 'assert_states_equal', 'roundtrip', 'classifier',
           'cls_batches', 'overflow_step_changes_nothing']


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(64, 64, generator=g) / 8
    out = []
    for _ in range(n):
        x = torch.randn(32, 64, generator=g)
        out.append((x, torch.tanh(x @ teacher)))
    return out


def train(model, opt, data):
    """An MSE step per batch; the losses."""
    losses = []
    for x, y in data:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def states(opt):
    """(key, tensor copy) of every state tensor, param by param."""
    return [(k, v.clone()) for st in opt.state.values() for k, v in sorted(st.items())
            if isinstance(v, torch.Tensor)]


def assert_states_equal(a, b):
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), k


def roundtrip(state_dict):
    """``state_dict`` through torch.save / torch.load(weights_only=True), and its size in bytes."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True), buf.getbuffer().nbytes


def classifier():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def cls_batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
            for _ in range(n)]


def overflow_step_changes_nothing(model, wrapper):
    """One FP16OptimWrapper step of the fp16 ``classifier`` with an inf in a grad: skipped, and
    the params, masters and optimizer state keep their bits."""
    snap = [t.detach().clone() for t in list(model.parameters()) + wrapper.master_params()]
    before = states(wrapper.optimizer)
    (x, y), = cls_batches(1)
    wrapper.backward(F.cross_entropy(model(x.half()).float(), y), update_master_grads=False)
    model[2].weight.grad[0, 0] = float('inf')
    wrapper.step()
    wrapper.zero_grad()
    assert wrapper.last_step_skipped
    assert all(torch.equal(a, b.detach()) for a, b in
               zip(snap, list(model.parameters()) + wrapper.master_params()))
    assert_states_equal(before, states(wrapper.optimizer))
    return before
