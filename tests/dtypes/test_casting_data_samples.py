"""O2/O3 cast only what feeds the network: data samples and the data preprocessor keep their dtype.

A tiny detector-shaped mmengine model with a real ``ImgDataPreprocessor`` (ImageNet mean/std) and
``BaseDataElement`` data samples holding ``InstanceData`` ground-truth boxes (513.7, which bf16
rounds to 514) and metas trains through mmengine's Runner under ``ApexOptimWrapper`` O2/O3. The
network must receive the batch normalised in fp32 and then cast to the half dtype, while the boxes,
labels and metas reach the loss exactly as the dataset made them, and the preprocessor's mean/std
buffers stay fp32 (apex cast only the model's inputs).
"""
import pytest
import mp_wrappers  # noqa: F401  (registers mp_wrappers.ApexOptimWrapper)
import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmengine.runner import Runner
from mmengine.structures import BaseDataElement, InstanceData
from torch import nn
from torch.utils.data import Dataset

MEAN = [123.675, 116.28, 103.53]
STD = [58.395, 57.12, 57.375]
BOX = [513.7, 20.3, 600.1, 80.9]


class _DetData(Dataset):
    def __init__(self, n: int = 8) -> None:
        g = torch.Generator().manual_seed(3)
        self.images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        sample = BaseDataElement(metainfo=dict(img_shape=(8, 8), scale_factor=(1.7, 1.3),
                                               img_id=i))
        sample.gt_instances = InstanceData(bboxes=torch.tensor([BOX]), labels=torch.tensor([1]))
        return dict(inputs=self.images[i], data_samples=sample)


class _TinyDetector(BaseModel):
    def __init__(self) -> None:
        super().__init__(data_preprocessor=dict(type='ImgDataPreprocessor', mean=MEAN, std=STD))
        self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.box_head = nn.Linear(4, 4)
        self.seen = []

    def forward(self, inputs, data_samples=None, mode='tensor'):
        boxes = self.box_head(self.backbone(inputs))
        if mode != 'loss':
            return boxes
        gt = torch.stack([s.gt_instances.bboxes[0] for s in data_samples])
        self.seen.append(dict(
            inputs=inputs.detach().clone(), gt=gt.clone(),
            labels=[s.gt_instances.labels.clone() for s in data_samples],
            metas=[dict(s.metainfo) for s in data_samples],
            mean=self.data_preprocessor.mean.clone(), std=self.data_preprocessor.std.clone()))
        return dict(loss=F.smooth_l1_loss(boxes.float(), gt / 1000.))


@pytest.mark.parametrize('level', ['O2', 'O3'])
def test_data_samples_and_preprocessor_keep_their_dtype(tmp_path, level):
    dataset = _DetData()
    runner = Runner(
        model=_TinyDetector(), work_dir=str(tmp_path), experiment_name=f'test_samples_{level}',
        train_dataloader=dict(dataset=dataset, batch_size=4, num_workers=0,
                              sampler=dict(type='DefaultSampler', shuffle=False),
                              collate_fn=dict(type='pseudo_collate')),
        train_cfg=dict(by_epoch=False, max_iters=2, val_interval=1000),
        optim_wrapper=dict(type='mp_wrappers.ApexOptimWrapper', opt_level=level, dtype='bfloat16',
                           verbosity=0, optimizer=dict(type='SGD', lr=0.01)),
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=1000)),
        default_scope='mmengine', log_level='WARNING')
    threads = torch.get_num_threads()
    try:
        runner.train()
    finally:
        torch.set_num_threads(threads)
    model = runner.model
    assert model.backbone[0].weight.dtype == torch.bfloat16  # the network did train in bf16
    mean = torch.tensor(MEAN).view(-1, 1, 1)
    std = torch.tensor(STD).view(-1, 1, 1)
    assert model.data_preprocessor.mean.dtype == torch.float32
    assert torch.equal(model.data_preprocessor.mean, mean)
    assert torch.equal(model.data_preprocessor.std, std)
    assert len(model.seen) == 2
    for it, seen in enumerate(model.seen):
        images = dataset.images[4 * it:4 * it + 4].float()
        # Normalised in fp32 by the preprocessor, then cast once, at the network.
        assert seen['inputs'].dtype == torch.bfloat16
        assert torch.equal(seen['inputs'], ((images - mean) / std).to(torch.bfloat16))
        assert torch.equal(seen['mean'], mean) and torch.equal(seen['std'], std)
        # Targets and metas exactly as the dataset made them.
        assert seen['gt'].dtype == torch.float32
        assert torch.equal(seen['gt'], torch.tensor([BOX] * 4))
        assert all(lab.dtype == torch.int64 and lab.tolist() == [1] for lab in seen['labels'])
        assert [m['scale_factor'] for m in seen['metas']] == [(1.7, 1.3)] * 4
