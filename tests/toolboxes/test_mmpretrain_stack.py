"""An mmpretrain 1.2 classifier trained through our wrapper (the matrix's `mmpretrain` stack).

mmpretrain is not a dependency: these tests skip where it is not installed. tools/compat_matrix.sh
installs mmpretrain 1.2.0 (with mmcv's pure-Python part, MMCV_WITH_OPS=0) on the oldest supported
stack (torch 2.1.2 + mmengine 0.10.4), where OpenMMLab toolbox users sit, and runs this file there.
"""
import pytest
import torch

mmpretrain = pytest.importorskip('mmpretrain')

from mmengine.registry import DefaultScope  # noqa: E402
from mmpretrain.registry import MODELS  # noqa: E402
from mmpretrain.structures import DataSample  # noqa: E402

import mp_wrappers  # noqa: E402
from mp_wrappers import ApexOptimWrapper, FusedAdam  # noqa: E402

# ImageClassifier with mmpretrain's own data preprocessor, loss and data samples: a CIFAR ResNet-18
# on 32x32 images, small enough for a CPU test.
MODEL = dict(
    type='ImageClassifier',
    data_preprocessor=dict(type='ClsDataPreprocessor', num_classes=4, mean=[125.3, 123.0, 113.9],
                           std=[63.0, 62.1, 66.7], to_rgb=False),
    backbone=dict(type='ResNet_CIFAR', depth=18, num_stages=4, out_indices=(3,), style='pytorch'),
    neck=dict(type='GlobalAveragePooling'),
    head=dict(type='LinearClsHead', num_classes=4, in_channels=512,
              loss=dict(type='CrossEntropyLoss', loss_weight=1.0)))


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    images = [torch.randint(0, 256, (3, 32, 32), generator=g, dtype=torch.uint8) for _ in range(4)]
    samples = [DataSample().set_gt_label(i % 4) for i in range(4)]
    return dict(inputs=images, data_samples=samples)


@pytest.mark.parametrize('opt_level', ['O1', 'O2'])
def test_classifier_trains_in_bf16_and_checkpoints_fp32(opt_level):
    torch.manual_seed(0)
    # Another test's Runner may have left mmengine's default scope current: build in mmpretrain's.
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        model = MODELS.build(MODEL)
    wrapper = ApexOptimWrapper(optimizer=FusedAdam(model.parameters(), lr=1e-3),
                               opt_level=opt_level, dtype='bfloat16', verbosity=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = []
    for it in range(4):
        log_vars = model.train_step(_batch(it % 2), wrapper)  # mmengine's BaseModel.train_step
        losses.append(float(log_vars['loss']))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    if opt_level == 'O2':  # the model computes in bf16, norm layers stay fp32
        assert model.backbone.conv1.weight.dtype == torch.bfloat16
        assert model.backbone.norm1.weight.dtype == torch.float32
    state = model.state_dict()
    assert all(v.dtype == before[k].dtype for k, v in state.items()), 'checkpoints stay fp32'
    assert any(not torch.equal(v, before[k]) for k, v in state.items() if v.is_floating_point())
    # The wrapper's checkpoint state round-trips through a second wrapper.
    again = ApexOptimWrapper(optimizer=FusedAdam(model.parameters(), lr=1e-3), opt_level=opt_level,
                             dtype='bfloat16', verbosity=0)
    again.load_state_dict(wrapper.state_dict())
    assert again.state_dict()['apex_amp'] == wrapper.state_dict()['apex_amp']


def test_versions_are_the_stack_the_matrix_installs():
    import mmengine
    assert mmpretrain.__version__.startswith('1.2'), mmpretrain.__version__
    assert mp_wrappers.compat.torch_version_tuple() >= mp_wrappers.compat.TORCH_MIN
    assert mmengine.__version__ >= '0.10.4'
