"""``fp32_modules``: submodules kept fp32 inside a half-precision model, and the hint that names them.

The model mimics mmaction2's recognizers: the head's ``loss`` runs its forward and then computes a
training accuracy with numpy (``cls_scores.detach().cpu().numpy()``), inside the model's forward,
where numpy meets whatever dtype the head computed in. numpy has no bfloat16.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from torch import nn

from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper, cast_model
from mp_wrappers.casting import Fp32Modules, check_module_patterns, match_modules
from mp_wrappers.half_errors import half_hint
from mp_wrappers.registry import MODELS

from _workflow import make_runner, train

# Note [two launchers]: the Runner tests run as tools/train.py and as a toolbox script would.
TWO_LAUNCHERS = pytest.mark.usefixtures('launcher')


class NumpyAccuracyHead(nn.Module):
    """mmaction2's BaseHead in small: the accuracy goes through numpy."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_cls = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc_cls(x)

    def loss(self, feats, labels):
        scores = self(feats)
        top1 = (np.argmax(scores.detach().cpu().numpy(), 1) == labels.cpu().numpy()).mean()
        return dict(loss_cls=F.cross_entropy(scores.float(), labels),
                    top1_acc=torch.tensor(float(top1)))


@MODELS.register_module(force=True)
class Recognizer(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.cls_head = NumpyAccuracyHead()

    def forward(self, inputs, labels=None, mode='tensor'):
        feats = self.backbone(inputs)
        if mode == 'loss':
            return self.cls_head.loss(feats, labels)
        return self.cls_head(feats)


def _runner(tmp_path, wrapper, fp32_modules=None, iters=6):
    extra = {} if fp32_modules is None else dict(fp32_modules=fp32_modules)
    return make_runner(tmp_path, wrapper, 'bfloat16', iters=iters,
                       model=dict(type='mp_wrappers.Recognizer'), extra_wrapper=extra)


@TWO_LAUNCHERS
@pytest.mark.parametrize('wrapper', ['O1', 'O2', 'O3', 'FP16cast'])
def test_numpy_in_a_half_head_fails_at_the_first_iteration_naming_the_key(tmp_path, wrapper):
    runner = _runner(tmp_path, wrapper)
    with pytest.raises(TypeError) as info:
        train(runner)
    message = str(info.value)
    assert 'unsupported ScalarType BFloat16' in message
    assert ("inside NumpyAccuracyHead 'cls_head'" in message
            and "adding fp32_modules=['cls_head'] to the optim_wrapper config" in message)
    assert runner.optim_wrapper.loss_scalers[0].steps == 0  # before the first optimizer step


@TWO_LAUNCHERS
@pytest.mark.parametrize('wrapper', ['O1', 'O2', 'O3', 'FP16cast'])
def test_fp32_modules_trains_the_head_in_fp32(tmp_path, wrapper):
    seen = []
    runner = _runner(tmp_path / 'mp', wrapper, fp32_modules=['cls_head'])
    runner.model.cls_head.fc_cls.register_forward_hook(
        lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    train(runner)
    model = runner.model
    assert {d for pair in seen for d in pair} == {torch.float32}  # inputs and outputs
    assert all(p.dtype == torch.float32 for p in model.cls_head.parameters())
    backbone = torch.bfloat16 if wrapper != 'O1' else torch.float32
    assert model.backbone[0].weight.dtype == backbone
    hub = runner.message_hub
    assert len(hub.get_scalar('train/top1_acc').data[0]) == 6
    ref = train(make_runner(tmp_path / 'fp32', 'fp32', iters=6,
                            model=dict(type='mp_wrappers.Recognizer')))
    a = hub.get_scalar('train/loss').data[0]
    b = ref.message_hub.get_scalar('train/loss').data[0]
    assert a[-1] < a[0] and abs(a[-1] - b[-1]) < 0.05 * b[-1], (a, b)


def test_a_pattern_that_matches_nothing_is_refused_with_the_names(tmp_path):
    runner = _runner(tmp_path, 'O2', fp32_modules=['head'])
    with pytest.raises(ValueError, match=r"fp32_modules=\['head'\] matches no submodule of "
                                         r"Recognizer .*'backbone', 'cls_head'"):
        train(runner)


@pytest.mark.parametrize('value', ['cls_head', [''], [3], dict(a=1)])
def test_fp32_modules_must_be_a_list_of_patterns(value):
    with pytest.raises(TypeError, match=r'fp32_modules=.* is not allowed; expected a list of '
                                        'module name or class name patterns'):
        check_module_patterns(value, 'fp32_modules')
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match='fp32_modules='):
        ApexOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), opt_level='O2',
                         dtype='bfloat16', fp32_modules=value)


def test_a_half_model_built_by_hand_cannot_keep_a_module_fp32_after_the_fact():
    model = Recognizer()
    cast_model(model, torch.bfloat16)
    wrapper = FP16OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), fp32_modules=['cls_head'])
    with pytest.raises(RuntimeError, match=r"fp32_modules names NumpyAccuracyHead 'cls_head', "
                                           r"but its parameter 'fc_cls.weight' is already "
                                           r'torch.bfloat16'):
        with wrapper.optim_context(model):
            pass


def test_match_modules_by_name_glob_and_class_outermost_only():
    model = Recognizer()
    assert [n for n, _ in match_modules(model, ['cls_head'])] == ['cls_head']
    assert [n for n, _ in match_modules(model, ['*Head'])] == ['cls_head']
    assert [n for n, _ in match_modules(model, ['backbone.*'])] == ['backbone.0', 'backbone.1',
                                                                    'backbone.2']
    assert [n for n, _ in match_modules(model, ['backbone', 'Linear'])] == ['backbone',
                                                                            'cls_head.fc_cls']
    assert match_modules(model, []) == []


def test_fp32_modules_turn_autocast_off_and_back_on_even_when_they_raise():
    inner = nn.Linear(4, 4)
    after = nn.Linear(4, 4)
    hooks = Fp32Modules([inner], 'cpu')
    x = torch.randn(2, 4)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert inner(x.bfloat16()).dtype == torch.float32
        assert after(x).dtype == torch.bfloat16
        with pytest.raises(RuntimeError):
            inner(torch.randn(2, 5))  # the shapes do not fit: raises inside the fp32 module
        assert torch.is_autocast_cpu_enabled()
        assert after(x).dtype == torch.bfloat16
    hooks.remove()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert inner(x).dtype == torch.bfloat16


def test_other_errors_get_no_hint():
    model = Recognizer()
    assert half_hint(ValueError('unsupported ScalarType BFloat16'), model, 'optim_wrapper') is None
    assert half_hint(TypeError('something else'), model, 'optim_wrapper') is None


def test_tools_train_casts_before_ddp_with_the_same_fp32_modules():
    """Under DDP the model is cast before wrapping (tools/train.py's model_wrapper_cfg): the
    fp32_modules travel with it, and the cast keeps them fp32."""
    from mmengine.config import Config

    from mp_wrappers.launch import _apex_model_wrapper_cfg
    cfg = Config(dict(optim_wrapper=dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2',
                                         dtype='bfloat16', fp32_modules=['cls_head'])))
    _apex_model_wrapper_cfg(cfg)
    assert cfg.model_wrapper_cfg.type == 'mp_wrappers.MixedPrecisionDistributedDataParallel'
    assert cfg.model_wrapper_cfg.fp32_modules == ['cls_head']
    model = Recognizer()
    cast_model(model, torch.bfloat16, keep_fp32_modules=[n for n, _ in match_modules(
        model, cfg.model_wrapper_cfg.fp32_modules)])
    assert model.backbone[0].weight.dtype == torch.bfloat16
    assert model.cls_head.fc_cls.weight.dtype == torch.float32


@pytest.mark.parametrize('dtype,expected', [('bfloat16', 'bfloat16'), ('float16', 'float16'),
                                            ('auto', None), (None, None)])
def test_tools_train_casts_before_ddp_for_a_casting_fp16_wrapper(dtype, expected):
    from mmengine.config import Config

    from mp_wrappers.launch import _apex_model_wrapper_cfg
    optim = dict(type='mp_wrappers.FP16OptimWrapper', fp32_modules=['cls_head'])
    if dtype is not None:
        optim['dtype'] = dtype
    cfg = Config(dict(optim_wrapper=optim))
    _apex_model_wrapper_cfg(cfg)
    if expected is None:
        assert cfg.get('model_wrapper_cfg', None) is None
    else:
        assert cfg.model_wrapper_cfg.dtype == expected
        assert cfg.model_wrapper_cfg.keep_batchnorm_fp32 is True
        assert cfg.model_wrapper_cfg.fp32_modules == ['cls_head']


@pytest.mark.parametrize('wrapper', ['O2', 'O3', 'FP16cast'])
def test_a_module_kept_fp32_with_a_norm_layer_inside_stays_fp32_throughout(tmp_path, wrapper):
    """The backbone (Linear, BatchNorm, ReLU) kept fp32: its BatchNorm hands fp32 on."""
    seen = []
    runner = _runner(tmp_path, wrapper, fp32_modules=['backbone', 'cls_head'], iters=2)
    runner.model.backbone[1].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    train(runner)
    assert set(seen) == {torch.float32}
    assert all(p.dtype == torch.float32 for p in runner.model.parameters())
