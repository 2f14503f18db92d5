"""The shadow copy EMAHook averages into under FSDP2 (Note [EMA of a sharded model]), in one process.

The sharded behaviour (DTensor shards, the average against one process, loading DTensors and full
tensors) runs on 2 and 3 ranks in tests/runner/test_fsdp.py and through the Runner in
tests/runner/test_runner_checkpoint.py. Here: the structure mmengine's hook relies on. Its swaps
``zip`` the copy's ``parameters()``/``buffers()`` with the model's and its checkpoints pair
``state_dict`` keys, so the shadow must list the same tensors in the same order, shared
submodules and tied weights once, non-persistent buffers kept out of ``state_dict``.
"""
import copy

import pytest
import torch
from mmengine.model import ExponentialMovingAverage
from torch import nn

from mp_wrappers.distributed.sharded_ema import ShardedShadow, install_sharded_deepcopy


class Refuses(nn.Module):
    """Stands for an FSDP2 module: its class refuses deepcopy, as ``fully_shard``'s does."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU())
        self.again = self.block  # a shared submodule
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # tied weights
        self.scale = nn.Parameter(torch.ones(()))
        self.register_buffer('window', torch.arange(3.), persistent=False)
        self.register_parameter('unused', None)

    def __deepcopy__(self, memo):
        raise AssertionError('FSDP does not support deepcopy')


def _names(module):
    return ([n for n, _ in module.named_parameters()], [n for n, _ in module.named_buffers()],
            list(module.state_dict()))


def test_shadow_lists_the_models_tensors_in_its_order():
    model = Refuses()
    shadow = ShardedShadow.of(model)
    assert _names(shadow) == _names(model)
    assert len(list(shadow.parameters())) == len(list(model.parameters())) == 6
    assert 'window' not in shadow.state_dict() and 'window' in dict(shadow.named_buffers())
    assert shadow.again is shadow.block and shadow.head.weight is shadow.embed.weight
    assert shadow.unused is None
    for (name, p), q in zip(model.state_dict(keep_vars=True).items(),
                            shadow.state_dict(keep_vars=True).values()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name  # clones
    assert [p.requires_grad for p in shadow.parameters()] == [True] * 6


def test_deepcopy_of_the_installed_root_gives_the_shadow_and_ema_works_on_it():
    model = Refuses()
    with pytest.raises(AssertionError, match='does not support deepcopy'):
        copy.deepcopy(model)
    install_sharded_deepcopy(model)
    ema = ExponentialMovingAverage(model, momentum=0.5)
    assert type(ema.module) is ShardedShadow and not any(p.requires_grad for p in ema.parameters())
    ema.update_parameters(model)
    with torch.no_grad():
        model.scale.add_(2.0)
    ema.update_parameters(model)
    assert float(ema.module.scale) == 2.0  # 1 + 0.5 * (3 - 1)
    again = copy.deepcopy(ema)  # the shadow copies itself too (mmengine's hooks may)
    assert type(again.module) is ShardedShadow and float(again.module.scale) == 2.0
    # an ordinary full state dict loads (mmengine's load_from path)
    state = {k: v.clone() + 1 if v.is_floating_point() else v
             for k, v in ema.state_dict().items()}
    again.load_state_dict(state)
    assert float(again.module.scale) == 3.0
    with pytest.raises(RuntimeError, match='swaps its weights into the sharded model'):
        ema(torch.zeros(2, dtype=torch.long))
