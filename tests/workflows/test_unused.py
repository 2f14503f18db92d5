"""Parameters that get no gradient are not updated, through mmengine's Runner (issue 10, item 5).

``late`` is used at iteration 0 only (a branch the graph stops using), ``unused`` never. torch.optim
leaves a parameter whose gradient is None alone; the wrappers consume the model gradients at every
step (the unscale into the fp32 stash, or the fused master step), so a parameter that got no gradient
in this step's backward(s) gets no update and no optimizer state, whatever ``zero_grad``'s
``set_to_none``, the optimizer (torch's AdamW, our FusedAdam) and the path (fused master step or not).
"""
import itertools

import pytest
import torch

from _workflow import RecordHook, make_runner, train

# Note [two launchers] (tests/_workflow.py): every test runs through both.
pytestmark = pytest.mark.usefixtures('launcher')

OPTIMIZERS = {
    'AdamW': (dict(type='AdamW', lr=0.05, weight_decay=0.1), None),
    'FusedAdam-fused': (dict(type='mp_wrappers.FusedAdam', lr=0.05, weight_decay=0.1), None),
    # clip_grad with norm_type=1 is not fusable: the unfused path (unscale, clip, step, copy)
    'FusedAdam-unfused': (dict(type='mp_wrappers.FusedAdam', lr=0.05, weight_decay=0.1),
                          dict(max_norm=1e6, norm_type=1.0)),
}
CASES = [(w, o, s) for w, o, s in itertools.product(['FP16', 'O2'], OPTIMIZERS, [True, False])]
CASES += [('O1', 'FusedAdam-fused', False), ('O3', 'FusedAdam-fused', False),
          ('O3', 'AdamW', False), ('fp32', 'AdamW', True)]


def _slot(runner, param):
    """The tensor the optimizer steps for ``param`` (its master, or itself)."""
    wrapper = runner.optim_wrapper
    full = wrapper.full_precision_weights() if hasattr(wrapper, 'full_precision_weights') else {}
    return full.get(id(param), param)


@pytest.mark.parametrize('wrapper,optimizer,set_to_none', CASES)
def test_no_gradient_no_update(tmp_path, wrapper, optimizer, set_to_none):
    opt, clip = OPTIMIZERS[optimizer]
    record = RecordHook()
    runner = make_runner(tmp_path, wrapper, 'bfloat16', iters=4, optimizer=dict(opt),
                         model=dict(late_iters=(0,), zero_kwargs=dict(set_to_none=set_to_none)),
                         extra_wrapper=dict(clip_grad=clip) if clip else None)
    runner.register_hook(record)
    initial = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
    train(runner)
    model = runner.model
    after_first = record.weights[0]
    for name in ('unused.weight', 'unused.bias'):
        assert torch.equal(after_first[name].float(), initial[name].to(after_first[name].dtype)
                           .float()), name
    for name in ('late.weight', 'late.bias', 'unused.weight', 'unused.bias'):
        assert torch.equal(dict(model.named_parameters())[name], after_first[name]), \
            f'{name} moved after its last gradient'
    assert not torch.equal(model.fc1.weight, after_first['fc1.weight'])  # the rest trains
    state = runner.optim_wrapper.optimizer.state
    for p in (model.unused.weight, model.unused.bias):
        assert not state.get(_slot(runner, p)), 'a parameter without gradient got optimizer state'
