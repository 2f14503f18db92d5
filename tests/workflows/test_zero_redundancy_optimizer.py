"""mmengine's ``ZeroRedundancyOptimizer`` under our wrappers, through the Runner.

ZeRO steps its own inner optimizer over the model's parameters, so fp32 master weights (O2,
``FP16OptimWrapper``) would be given the gradients and never stepped: the model would not train.
That combination is refused at build time with what to use instead; O1 and O3 (no masters) train
exactly like the same run without ZeRO. A one-process gloo group stands in for the ranks.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmengine.runner import Runner
from torch import nn
from torch.utils.data import Dataset

import mp_wrappers  # noqa: F401  (registers the wrappers)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason='torch.distributed is not built')


class _Data(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return dict(inputs=torch.randn(4, generator=g), labels=torch.tensor(i % 2))


class _Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, inputs, labels=None, mode='tensor'):
        out = self.net(inputs)
        return dict(loss=F.cross_entropy(out.float(), labels)) if mode == 'loss' else out


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group('gloo', init_method=f'file://{tmp_path}/store', rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


_RUNS = [0]


def _train(tmp_path, optim_wrapper, launcher='toolbox'):
    """``launcher``: Note [two launchers] (tests/_workflow.py); what tools/train.py adds to a
    config here is MixedPrecisionHook."""
    _RUNS[0] += 1
    hooks = [dict(type='mp_wrappers.MixedPrecisionHook')] if launcher == 'tools_train' else []
    runner = Runner(
        model=_Net(), work_dir=str(tmp_path / str(_RUNS[0])), experiment_name=f'zero_{_RUNS[0]}',
        train_dataloader=dict(dataset=_Data(), batch_size=4, num_workers=0,
                              sampler=dict(type='DefaultSampler', shuffle=False),
                              collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=3), optim_wrapper=optim_wrapper,
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=1000)),
        custom_hooks=hooks, default_scope='mmengine', log_level='WARNING')
    threads = torch.get_num_threads()
    try:
        runner.train()
    finally:
        torch.set_num_threads(threads)
    return runner.model


def _zero(lr=0.5):
    return dict(type='ZeroRedundancyOptimizer', optimizer_type='SGD', lr=lr)


@pytest.mark.parametrize('wrapper', [
    dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16'),
    dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='float16'),
    dict(type='mp_wrappers.FP16OptimWrapper'),
])
def test_masters_with_zero_are_refused_with_what_to_use(tmp_path, one_rank_group, wrapper):
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer.*opt_level='O1'.*'O3'.*plain "
                                         r'optimizer'):
        _train(tmp_path, dict(wrapper, optimizer=_zero()))


@pytest.mark.parametrize('level', ['O1', 'O3'])
def test_levels_without_masters_train_with_zero_like_without(tmp_path, one_rank_group, level,
                                                             launcher):
    cfg = dict(type='mp_wrappers.ApexOptimWrapper', opt_level=level, dtype='bfloat16',
               verbosity=0)
    init = _Net().state_dict()
    with_zero = _train(tmp_path, dict(cfg, optimizer=_zero()), launcher)
    plain = _train(tmp_path, dict(cfg, optimizer=dict(type='SGD', lr=0.5)), launcher)
    for (name, a), b in zip(with_zero.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
        assert not torch.equal(a.float(), init[name].to(a.dtype).float()), f'{name} did not train'
