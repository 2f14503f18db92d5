"""The bad-input catalogue: one table of invalid configurations and calls, each refused clearly.

Every row is (id, call, expected exception or warning type, regex). The regex must match the message
and, by construction of the rows, names the option, echoes the value and says what is allowed. A row
passes only when the call raises that type (or warns with it) with such a message: never a crash
of the process, never a silent acceptance. Frozen parameters are not a bad input: they are trained
around (see ``test_frozen_parameters_are_left_exactly_alone``).
"""
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp_wrappers
from mp_wrappers import (ApexOptimWrapper, DynamicLossScaler, FP16OptimWrapper,
                         MixedPrecisionDistributedDataParallel, StaticLossScaler, cast_model)
from mp_wrappers.optim import FusedAdagrad, FusedAdam, FusedLAMB, FusedSGD
from mp_wrappers.wrappers.checkpoint_format import CheckpointMismatchWarning
from mp_wrappers.ops import multi_tensor_axpby, multi_tensor_l2norm, multi_tensor_scale, new_found_inf

pytestmark = pytest.mark.filterwarnings('ignore:ApexOptimWrapper.*without native fp16:UserWarning')


def _model(dtype=None):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    return cast_model(m, dtype) if dtype is not None else m


def _sgd(model=None):
    return torch.optim.SGD((model or _model()).parameters(), lr=0.1)


def _fp16(**kw):
    return FP16OptimWrapper(_sgd(_model(torch.float16)), **kw)


def _apex(**kw):
    kw.setdefault('verbosity', 0)
    return ApexOptimWrapper(_sgd(), **kw)


def _trained_state(make, model_dtype=None, steps=1):
    """state_dict() of a wrapper after ``steps`` steps (masters and scaler state filled in)."""
    model = _model(model_dtype)
    wrapper = make(model)
    for _ in range(steps):
        with wrapper.optim_context(model):
            x = torch.randn(2, 3, dtype=model_dtype or torch.float32)
            loss = model(x).float().sum()
        for k in range(getattr(wrapper, 'num_losses', 1)):
            if k:
                with wrapper.optim_context(model):
                    loss = model(x).float().sum()
            wrapper.backward(loss, loss_id=k)
        wrapper.step()
        wrapper.zero_grad()
    return wrapper.state_dict()


def _load_into(make, state, model_dtype=None, initialize=True):
    model = _model(model_dtype)
    wrapper = make(model)
    if initialize and isinstance(wrapper, ApexOptimWrapper):
        wrapper.initialize(model)
    wrapper.load_state_dict(state)


def _o2(model, **kw):
    return ApexOptimWrapper(_sgd(model), opt_level='O2', dtype='bfloat16', verbosity=0, **kw)


def _o3(model, **kw):
    return ApexOptimWrapper(_sgd(model), opt_level='O3', dtype='bfloat16', verbosity=0, **kw)


def _fp16w(model):
    return FP16OptimWrapper(_sgd(model), verbose=False)


def _other_model_state():
    model = nn.Sequential(nn.Linear(3, 2))
    w = FP16OptimWrapper(_sgd(model), verbose=False)
    return w.state_dict()


def _backward_bad_loss_id(loss_id, num_losses=1):
    model = _model()
    w = ApexOptimWrapper(_sgd(model), opt_level='O0', num_losses=num_losses, verbosity=0)
    with w.optim_context(model):
        loss = model(torch.randn(2, 3)).sum()
    w.backward(loss, loss_id=loss_id)


def _o1_with_half_model():
    model = _model(torch.bfloat16)
    w = ApexOptimWrapper(_sgd(model), opt_level='O1', dtype='bfloat16', verbosity=0)
    with w.optim_context(model):
        pass


def _o2_backward_before_initialize():
    model = _model()
    w = ApexOptimWrapper(_sgd(model), opt_level='O2', dtype='bfloat16', verbosity=0)
    w.backward(model(torch.randn(2, 3)).sum())


def _second_model():
    model = _model()
    w = ApexOptimWrapper(_sgd(model), opt_level='O2', dtype='bfloat16', verbosity=0)
    w.initialize(model)
    w.initialize(_model())


def _mixed_device_params():
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(3, device='meta'))
    return FP16OptimWrapper(torch.optim.SGD([a, b], lr=0.1))


def _integer_params():
    return FP16OptimWrapper(torch.optim.SGD([torch.zeros(3, dtype=torch.int64)], lr=0.1))


def _empty_group():
    return FP16OptimWrapper(torch.optim.SGD([{'params': []}], lr=0.1))


def _fused_sparse_grad():
    p = nn.Parameter(torch.zeros(4, 2))
    p.grad = torch.zeros(4, 2).to_sparse()
    mp_wrappers.FusedAdam([p]).step()


def _fused_master_step_wrong_length():
    opt = mp_wrappers.FusedAdam([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))])
    opt.fused_master_step([[torch.zeros(2)]], None)


def _fused_state_version():
    opt = mp_wrappers.FusedAdam([nn.Parameter(torch.zeros(2))])
    state = opt.state_dict()
    state['mp_wrappers_fused_optimizer_version'] = 99
    opt.load_state_dict(state)


def _f(n, device='cpu'):
    return [torch.zeros(n, device=device)]


I, N = float('inf'), float('nan')
F16, BF16 = torch.float16, torch.bfloat16

# (id, call, expected type, regex). Regexes name the option, the value and what is allowed.
CATALOGUE = [
    # ---- wrapper options shared by all wrappers ----
    ('optimizer-not-an-optimizer', lambda: FP16OptimWrapper('SGD'), TypeError,
     r"optimizer must be a torch\.optim\.Optimizer, got str"),
    ('accumulative_counts-zero', lambda: _fp16(accumulative_counts=0), ValueError,
     r'accumulative_counts must be an integer >= 1, got 0'),
    ('accumulative_counts-float', lambda: _fp16(accumulative_counts=2.0), ValueError,
     r'accumulative_counts must be an integer >= 1, got 2\.0'),
    ('clip_grad-not-a-dict', lambda: _fp16(clip_grad=1.0), TypeError,
     r'clip_grad must be a dict such as dict\(max_norm=1\.0\) or None, got 1\.0'),
    ('clip_grad-unknown-type', lambda: _fp16(clip_grad=dict(type='l3', max_norm=1.0)), ValueError,
     r'type of clip_grad should be "norm" or "value" but got l3'),
    # A negative max_norm would flip every gradient; the others would fail inside the first step.
    ('clip_grad-negative-max_norm', lambda: _fp16(clip_grad=dict(max_norm=-1.0)), ValueError,
     r"clip_grad max_norm must be a number > 0 \(float\('inf'\) clips nothing\), got -1\.0"),
    ('clip_grad-string-max_norm', lambda: _fp16(clip_grad=dict(max_norm='1')), ValueError,
     r"clip_grad max_norm must be a number > 0 .*got '1'"),
    ('clip_grad-bytes-max_norm', lambda: _fp16(clip_grad=dict(max_norm=b'1.0')), ValueError,
     r"clip_grad max_norm must be a number > 0 .*got b'1\.0'"),
    ('betas-set', lambda: FusedAdam(_model().parameters(), betas={0.9, 0.5}), ValueError,
     r'FusedAdam: Invalid betas: \{.*\}; expected a pair \(beta1, beta2\)'),
    ('clip_grad-misspelt-key', lambda: _fp16(clip_grad=dict(max_nrm=1.0)), ValueError,
     r"clip_grad has unknown keys \['max_nrm'\] for type='norm'; allowed: \['max_norm', "
     r"'norm_type', 'error_if_nonfinite', 'foreach'\]"),
    ('clip_grad-without-max_norm', lambda: _fp16(clip_grad=dict(norm_type=2)), ValueError,
     r"clip_grad needs max_norm \(a positive number\) for type='norm', got \{'norm_type': 2\}"),
    ('clip_grad-norm_type-word', lambda: _fp16(clip_grad=dict(max_norm=1.0, norm_type='fro')),
     ValueError, r"clip_grad norm_type must be a number > 0 .*got 'fro'"),
    ('clip_grad-negative-clip_value', lambda: _fp16(clip_grad=dict(type='value', clip_value=-0.5)),
     ValueError, r'clip_grad clip_value must be a number > 0 .*got -0\.5'),
    ('on_scale_collapse-unknown', lambda: _fp16(on_scale_collapse='explode'), ValueError,
     r"on_scale_collapse='explode' is not allowed; expected one of \('warn', 'raise', 'ignore'\)"),
    ('collapse_patience-None', lambda: _fp16(collapse_patience=None), ValueError,
     r'collapse_patience must be an integer >= 1, got None'),
    ('collapse_patience-zero', lambda: _fp16(collapse_patience=0), ValueError,
     r'collapse_patience must be an integer >= 1, got 0'),
    ('log_interval-negative', lambda: _fp16(log_interval=-5), ValueError,
     r'log_interval must be an integer >= 1, got -5'),
    ('sync_found_inf-string', lambda: _fp16(sync_found_inf='yes'), ValueError,
     r"sync_found_inf must be True, False or None, got 'yes'"),
    ('unknown-option', lambda: _fp16(loss_scael=128.0), TypeError, r"unexpected keyword argument 'loss_scael'"),
    # ---- FP16OptimWrapper scaling options ----
    ('dynamic_loss_scale-string', lambda: _fp16(dynamic_loss_scale='yes'), TypeError,
     r"dynamic_loss_scale must be True or False, got 'yes'"),
    ('static_loss_scale-zero', lambda: _fp16(static_loss_scale=0), ValueError,
     r'static_loss_scale must be a positive finite number, got 0\.0'),
    ('static_loss_scale-inf', lambda: _fp16(static_loss_scale=I), ValueError,
     r'static_loss_scale must be a positive finite number, got inf'),
    ('static_loss_scale-string', lambda: _fp16(static_loss_scale='128'), TypeError,
     r"static_loss_scale must be a positive finite number, got '128'"),
    ('dynamic_loss_args-with-static', lambda: _fp16(dynamic_loss_args=dict(init_scale=8.)),
     ValueError, r'dynamic_loss_args is only used with dynamic_loss_scale=True; got '
                 r"dynamic_loss_args=\{'init_scale': 8\.0\}"),
    ('dynamic_loss_args-not-a-dict', lambda: _fp16(dynamic_loss_scale=True, dynamic_loss_args=[8]),
     TypeError, r'dynamic_loss_args must be a dict or None, got \[8\]'),
    ('dynamic_loss_args-unknown-key',
     lambda: _fp16(dynamic_loss_scale=True, dynamic_loss_args=dict(scale_windw=10)), ValueError,
     r"dynamic_loss_args has unknown keys \['scale_windw'\]; allowed: \[.*'scale_window'.*\]"),
    ('scale_factor-one', lambda: _fp16(dynamic_loss_scale=True,
                                       dynamic_loss_args=dict(scale_factor=1.0)),
     ValueError, r'scale_factor must be > 1, got 1\.0'),
    ('min-above-max', lambda: _fp16(dynamic_loss_scale=True, dynamic_loss_args=dict(
        min_loss_scale=8., max_loss_scale=2.)), ValueError,
     r'min_loss_scale=8\.0 is greater than max_loss_scale=2\.0'),
    ('hysteresis-zero', lambda: _fp16(dynamic_loss_scale=True, dynamic_loss_args=dict(hysteresis=0)),
     ValueError, r'hysteresis must be an integer >= 1, got 0'),
    # ---- ApexOptimWrapper options ----
    ('opt_level-digit-zero', lambda: _apex(opt_level='02'), RuntimeError,
     r"Unexpected optimization level '02'\. Options are \"O0\", \"O1\", \"O2\", \"O3\"\..*letter"),
    ('opt_level-O4', lambda: _apex(opt_level='O4'), RuntimeError,
     r"Unexpected optimization level 'O4'\. Options are \"O0\", \"O1\", \"O2\", \"O3\""),
    ('dtype-float8', lambda: _apex(dtype='float8'), ValueError, r"dtype.*'float8'.*bfloat16"),
    # None would leave an O2 model uncast (fp32, silently) and O1 on torch's autocast default.
    ('dtype-None', lambda: _apex(opt_level='O2', dtype=None), ValueError,
     r"dtype=None is not supported; allowed: 'float16', 'bfloat16', 'float32', 'auto'"),
    ('loss_scale-word', lambda: _apex(loss_scale='big'), ValueError,
     r"loss_scale.*'big'.*dynamic"),
    ('loss_scale-negative', lambda: _apex(loss_scale=-1.0), ValueError,
     r'loss_scale.*-1\.0.*positive'),
    ('num_losses-zero', lambda: _apex(num_losses=0), ValueError,
     r'num_losses must be an integer >= 1, got 0'),
    ('num_losses-float', lambda: _apex(num_losses=2.0), ValueError,
     r'num_losses must be an integer >= 1, got 2\.0'),
    ('verbosity-negative', lambda: _apex(verbosity=-1), ValueError,
     r'verbosity must be an integer >= 0 \(0: quiet, 1: the level and scale messages\), got -1'),
    ('verbose-instead-of-verbosity', lambda: _apex(verbose=True), TypeError,
     r"ApexOptimWrapper takes verbosity=0 or 1 \(apex's option\), not verbose=True"),
    ('patch_torch_functions-with-O2', lambda: _apex(opt_level='O2', patch_torch_functions=True),
     RuntimeError, r'patch_torch_functions.*O1'),
    ('cast_model_type-with-O1', lambda: _apex(opt_level='O1', cast_model_type=F16), RuntimeError,
     r'O1 inserts casts around Torch functions rather than model weights'),
    ('cast_model_type-True', lambda: _apex(opt_level='O2', cast_model_type=True), ValueError,
     r"cast_model_type=True is not supported; allowed: 'float16', 'bfloat16', 'float32', None "
     r"\(the level's default\) or False \(no cast\)"),
    ('keep_batchnorm_fp32-word', lambda: _apex(opt_level='O2', keep_batchnorm_fp32='maybe'),
     ValueError, r"keep_batchnorm_fp32.*'maybe'.*True.*False"),
    ('master_weights-with-O1', lambda: _apex(opt_level='O1', master_weights=False), RuntimeError,
     r'master_weights.*O1'),
    ('enabled-string', lambda: _apex(enabled='yes'), ValueError,
     r"enabled='yes' must be True or False"),
    ('static-min-above-max', lambda: _apex(opt_level='O0', dtype='bfloat16', min_loss_scale=8.,
                                           max_loss_scale=2.), ValueError,
     r'min_loss_scale=8\.0 is greater than max_loss_scale=2\.0'),
    # The dynamic scaler's options are checked even where the scale is static (bf16, a number).
    ('static-hysteresis-negative', lambda: _apex(opt_level='O2', dtype='bfloat16', hysteresis=-1),
     ValueError, r'hysteresis must be an integer >= 1, got -1'),
    ('static-min_loss_scale-word', lambda: _apex(loss_scale=128.0, min_loss_scale='x'),
     TypeError, r"min_loss_scale must be a positive finite number, got 'x'"),
    ('static-init_scale-nan', lambda: _apex(opt_level='O2', dtype='bfloat16',
                                            init_scale=float('nan')), ValueError,
     r'init_scale must be a positive finite number, got nan'),
    ('init_scale-zero', lambda: _apex(init_scale=0.0), ValueError,
     r'init_scale must be a positive finite number, got 0\.0'),
    ('scale_window-zero', lambda: _apex(scale_window=0), ValueError,
     r'scale_window must be an integer >= 1, got 0'),
    ('loss_id-out-of-range', lambda: _backward_bad_loss_id(1), ValueError,
     r'loss_id=1 is out of range: this wrapper has num_losses=1, so loss_id must be an integer in '
     r'\[0, 0\]'),
    ('loss_id-string', lambda: _backward_bad_loss_id('0', 2), ValueError,
     r"loss_id='0' is out of range: .*num_losses=2.*\[0, 1\]"),
    ('O1-with-half-model', _o1_with_half_model, ValueError,
     r'opt_level O1 expects fp32 model weights, but parameter 0 of the optimizer is torch\.bfloat16'),
    ('O2-backward-before-initialize', _o2_backward_before_initialize, RuntimeError,
     r"ApexOptimWrapper\(opt_level='O2'\) has not prepared the model yet: run the forward inside "
     r'optim_context\(model\) or call initialize\(model\)'),
    ('second-model', _second_model, RuntimeError, r'initialized with another model'),
    # Under fp32 masters the optimizer never sees a bf16 param: its bf16 storage would be dead.
    ('bf16_storage-under-O2-masters', lambda: ApexOptimWrapper(
        FusedAdam(_model().parameters(), bf16_storage='kahan'), opt_level='O2', dtype='bfloat16',
        verbosity=0), ValueError,
     r"ApexOptimWrapper keeps fp32 master weights, so FusedAdam never steps a bf16 param and its "
     r"bf16_storage='kahan' would be ignored\. Drop bf16_storage, or .*master_weights='split'"),
    ('bf16_storage-under-FP16OptimWrapper', lambda: FP16OptimWrapper(
        FusedAdam(_model().parameters(), bf16_storage='split'), dtype='bfloat16'), ValueError,
     r"FP16OptimWrapper keeps fp32 master weights, so FusedAdam never steps a bf16 param"),
    ('bf16-states-under-O2-masters', lambda: ApexOptimWrapper(
        FusedAdam(_model().parameters(), state_dtype='bfloat16'), opt_level='O2',
        dtype='bfloat16', verbosity=0), ValueError,
     r"FusedAdam\(state_dtype='bfloat16'\) needs a bf16 storage, which ApexOptimWrapper's fp32 "
     r"master weights leave unused: use state_dtype='float32'"),
    # ---- fused optimizer hyperparameters ----
    # A True/False option given as a string: 'False' would have meant True.
    ('adam_w_mode-string', lambda: FusedAdam(_model().parameters(), adam_w_mode='False'),
     ValueError, r"FusedAdam: adam_w_mode='False' must be True or False"),
    ('amsgrad-string', lambda: FusedAdam(_model().parameters(), amsgrad='False'), ValueError,
     r"FusedAdam: amsgrad='False' must be True or False"),
    ('nesterov-string', lambda: FusedSGD(_model().parameters(), lr=0.1, nesterov='False'),
     ValueError, r"FusedSGD: nesterov='False' must be True or False"),
    ('group-bias_correction-string',
     lambda: FusedLAMB([dict(params=_model().parameters(), bias_correction='no')]), ValueError,
     r"FusedLAMB: bias_correction='no' must be True or False"),
    ('adagrad_w_mode-float', lambda: FusedAdagrad(_model().parameters(), adagrad_w_mode=0.5),
     ValueError, r'FusedAdagrad: adagrad_w_mode=0\.5 must be True or False'),
    ('capturable-string', lambda: FusedAdam(_model().parameters(), capturable='yes'), ValueError,
     r"FusedAdam: capturable='yes' must be True or False"),
    ('overflow_report-string', lambda: _fp16(overflow_report='False'), ValueError,
     r"overflow_report='False' must be True or False"),
    ('verbose-string', lambda: _fp16(verbose='False'), ValueError,
     r"verbose='False' must be True or False"),
    ('betas-None', lambda: FusedAdam(_model().parameters(), betas=None), ValueError,
     r'FusedAdam: Invalid betas: None; expected a pair \(beta1, beta2\)'),
    ('lr-inf', lambda: FusedAdam(_model().parameters(), lr=float('inf')), ValueError,
     r'FusedAdam: Invalid learning rate: inf; expected a number lr >= 0 and finite'),
    ('tensor-lr-inf', lambda: FusedAdam(_model().parameters(), lr=torch.tensor([float('inf')])),
     ValueError, r'FusedAdam: Invalid learning rate: the tensor lr holds inf; expected lr >= 0 '
                 r'and finite'),
    ('momentum-inf', lambda: FusedSGD(_model().parameters(), lr=0.1, momentum=float('inf')),
     ValueError, r'FusedSGD: Invalid momentum value: inf; expected momentum >= 0 and finite'),
    ('weight_decay-inf', lambda: FusedAdam(_model().parameters(), weight_decay=float('inf')),
     ValueError, r'FusedAdam: Invalid weight_decay value: inf; expected weight_decay >= 0 and '
                 r'finite'),
    # ---- parameters ----
    ('params-on-mixed-devices', _mixed_device_params, ValueError,
     r"several devices \(\['cpu', 'meta'\]\); mixed-precision wrappers need them on one device"),
    ('params-not-floating-point', _integer_params, TypeError,
     r'parameter 0 has dtype torch\.int64; only floating-point parameters can be optimized'),
    ('empty-parameter-list', _empty_group, ValueError, r'the optimizer has no parameters to train'),
    # ---- state dicts ----
    ('state-not-a-dict', lambda: _fp16().load_state_dict([1, 2]), TypeError,
     r'state_dict must be a dict, got list'),
    ('state-missing-keys', lambda: _fp16().load_state_dict({'foo': 1}), KeyError,
     r"optimizer state_dict needs 'state' and 'param_groups'; got keys \['foo'\]"),
    ('state-from-another-model', lambda: _load_into(_fp16w, _other_model_state(), F16), ValueError,
     r'param group 0: the checkpoint has 2 parameters but the optimizer has 4'),
    ('state-from-another-wrapper', lambda: _load_into(_o2, _trained_state(_fp16w, F16), None),
     CheckpointMismatchWarning, r"written by FP16OptimWrapper .*into ApexOptimWrapper .*differs in "
                                r"wrapper='FP16OptimWrapper' \(now wrapper='ApexOptimWrapper'\)"),
    ('state-from-another-opt-level', lambda: _load_into(_o3, _trained_state(_o2)),
     CheckpointMismatchWarning, r"differs in opt_level='O2' \(now opt_level='O3'\)"),
    ('state-wrong-number-of-loss-scalers',
     lambda: _load_into(_o2, _trained_state(lambda m: _o2(m, num_losses=2))), UserWarning,
     r'holds 2 loss scaler states but this wrapper has num_losses=1; loading the first 1'),
    ('state-newer-version', lambda: _fp16().load_state_dict(
        dict(_fp16().state_dict(), mp_wrappers=dict(version=99))), ValueError,
     r"state_dict\['mp_wrappers'\] has version 99; this mp_wrappers reads versions <= 1"),
    # ---- scalers ----
    ('static-scaler-nan', lambda: StaticLossScaler(N), ValueError,
     r'static_loss_scale must be a positive finite number, got nan'),
    ('dynamic-scaler-window-float', lambda: DynamicLossScaler(scale_window=1.5), ValueError,
     r'scale_window must be an integer >= 1, got 1\.5'),
    ('scaler-state-unknown-layout', lambda: DynamicLossScaler().load_state_dict({'foo': 1}),
     KeyError, r"loss scaler state has none of the known layouts.*got keys \['foo'\]"),
    ('scaler-state-negative-scale', lambda: DynamicLossScaler().load_state_dict(
        {'loss_scale': -4.0}), ValueError,
     r'loss_scale in the loaded state must be a positive finite number, got -4\.0'),
    ('scaler-set-zero', lambda: setattr(StaticLossScaler(2.), 'loss_scale', 0), ValueError,
     r'loss_scale must be a positive finite number, got 0\.0'),
    # ---- fused optimizers ----
    ('FusedAdam-negative-lr', lambda: mp_wrappers.FusedAdam(_model().parameters(), lr=-1.0),
     ValueError, r'FusedAdam: Invalid learning rate: -1\.0; expected a number lr >= 0'),
    ('FusedAdam-beta-one', lambda: mp_wrappers.FusedAdam(_model().parameters(), betas=(1.0, 0.9)),
     ValueError, r'FusedAdam.*beta.*1\.0'),
    ('FusedAdam-amsgrad', lambda: mp_wrappers.FusedAdam(_model().parameters(), amsgrad=True),
     ValueError, r'FusedAdam: amsgrad=True is not supported.*use amsgrad=False'),
    ('FusedSGD-nesterov-no-momentum', lambda: mp_wrappers.FusedSGD(_model().parameters(), lr=0.1,
                                                                    nesterov=True),
     ValueError, r'FusedSGD: nesterov=True requires momentum > 0 and dampening == 0'),
    ('FusedLAMB-amsgrad', lambda: mp_wrappers.FusedLAMB(_model().parameters(), amsgrad=True),
     ValueError, r'FusedLAMB: amsgrad=True is not supported; use amsgrad=False'),
    ('FusedAdagrad-negative-eps', lambda: mp_wrappers.FusedAdagrad(_model().parameters(), eps=-1.),
     ValueError, r'FusedAdagrad.*eps.*-1\.0'),
    ('FusedNovoGrad-norm_type', lambda: mp_wrappers.FusedNovoGrad(_model().parameters(),
                                                                   norm_type=3),
     ValueError, r'FusedNovoGrad.*norm_type.*3.*(0|2)'),
    ('FusedAdam-empty', lambda: mp_wrappers.FusedAdam([]), ValueError, r'empty parameter list'),
    ('FusedAdam-sparse-grad', _fused_sparse_grad, RuntimeError,
     r'FusedAdam does not support sparse gradients'),
    ('fused_master_step-wrong-length', _fused_master_step_wrong_length, ValueError,
     r'FusedAdam\.fused_master_step: grads\[0\] has 1 entries but param group 0 has 2'),
    ('FusedAdam-state-version', _fused_state_version, ValueError,
     r'FusedAdam\.load_state_dict: state layout version 99 is not supported'),
    # ---- ops ----
    ('scale-length-mismatch', lambda: multi_tensor_scale(_f(3) * 2, _f(3), 1.0, new_found_inf()),
     ValueError, r'multi_tensor_scale: outputs has 1 tensors but inputs has 2'),
    ('scale-numel-mismatch', lambda: multi_tensor_scale(_f(3), _f(4), 1.0, new_found_inf()),
     ValueError, r'multi_tensor_scale: outputs\[0\] has 4 elements but inputs\[0\] has 3'),
    ('scale-mixed-devices', lambda: multi_tensor_scale(_f(3), _f(3, 'meta'), 1.0, new_found_inf()),
     ValueError, r'multi_tensor_scale: outputs\[0\] is on meta but the other tensors are on cpu'),
    ('axpby-arg_to_check', lambda: multi_tensor_axpby(_f(2), _f(2), _f(2), 1., 1., arg_to_check=2),
     ValueError, r'arg_to_check=2; allowed: -1 \(x and y\), 0 \(x\), 1 \(y\)'),
    ('l2norm-not-a-list', lambda: multi_tensor_l2norm(torch.zeros(3)), TypeError,
     r'multi_tensor_l2norm: tensors must be a list of tensors, got a Tensor of shape \(3,\); wrap it '
     r'in a list'),
    ('scale-integer-tensors', lambda: multi_tensor_scale([torch.zeros(3, dtype=torch.int32)],
                                                         _f(3), 1.0, new_found_inf()),
     TypeError, r'inputs\[0\] has dtype torch\.int32; expected float32'),
    ('scale-bad-scale', lambda: multi_tensor_scale(_f(3), _f(3), 'x', new_found_inf()), TypeError,
     r"scale must be a float or a 1-element tensor, got 'x'"),
    # ---- casting and DDP ----
    ('cast_model-int8', lambda: cast_model(_model(), torch.int8), ValueError,
     r"cast_model\(dtype\)=torch\.int8 is not supported; allowed: 'float16', 'bfloat16', 'float32'"),
    ('ddp-dtype-word', lambda: MixedPrecisionDistributedDataParallel(_model(), dtype='half8'),
     ValueError, r"dtype.*'half8'.*float16.*bfloat16"),
]


def _ids():
    ids = [row[0] for row in CATALOGUE]
    assert len(ids) == len(set(ids)), 'duplicate row ids'
    return ids


def test_catalogue_size():
    assert len(CATALOGUE) >= 40, len(CATALOGUE)


@pytest.mark.parametrize('row', CATALOGUE, ids=_ids())
def test_bad_input_is_refused_clearly(row):
    name, call, expected, pattern = row
    if issubclass(expected, Warning):
        with pytest.warns(expected) as record:
            call()
        messages = [str(w.message) for w in record if issubclass(w.category, expected)]
        assert any(re.search(pattern, m) for m in messages), (name, messages)
        return
    with pytest.raises(expected) as info:
        call()
    message = str(info.value.args[0]) if isinstance(info.value, KeyError) else str(info.value)
    assert re.search(pattern, message), f'{name}: {message!r} does not match {pattern!r}'


@pytest.mark.parametrize('make', [
    lambda: _fp16(clip_grad=dict(type='value', clip_value=0.5)),
    lambda: _fp16(clip_grad=dict(max_norm=35, norm_type=2)),
    lambda: _fp16(clip_grad=dict(max_norm=1.0, norm_type=float('inf'), foreach=False)),
    # What torch and mmengine take: inf (log grad_norm, clip nothing), 'inf', numpy, 0-d tensors.
    lambda: _fp16(clip_grad=dict(max_norm=float('inf'))),
    lambda: _fp16(clip_grad=dict(type='value', clip_value=float('inf'))),
    lambda: _fp16(clip_grad=dict(max_norm=1.0, norm_type='inf')),
    lambda: _fp16(clip_grad=dict(max_norm=np.float32(1.0), norm_type=np.int64(2))),
    lambda: _fp16(clip_grad=dict(max_norm=torch.tensor(1.0))),
    lambda: FusedLAMB(_model().parameters(), max_grad_norm=float('inf')),  # clips nothing
    lambda: FusedAdam(_model().parameters(), betas=[0.8, 0.9]),  # a config's list
    lambda: FusedAdam(_model().parameters(), betas=np.array([0.8, 0.9])),
    # Flags as bool() took them before, but for strings: numpy bools, 1/0, None (False).
    lambda: FusedSGD(_model().parameters(), lr=0.1, momentum=0.9, nesterov=np.True_),
    lambda: FusedAdam(_model().parameters(), bias_correction=1, set_grad_none=None),
    lambda: _fp16(verbose=np.False_, overflow_report=None),
    # dtype=None where nothing is cast (O0, enabled=False): refused at O1-O3 only.
    lambda: _apex(opt_level='O0', dtype=None),
    lambda: _apex(opt_level='O2', dtype=None, enabled=False),
    # enabled=False is a plain OptimWrapper: the optimizer's own bf16 storage steps the params.
    lambda: ApexOptimWrapper(FusedAdam(_model().parameters(), bf16_storage='kahan'),
                             opt_level='O2', dtype='bfloat16', enabled=False, hysteresis=-1),
], ids=['clip-value', 'clip-norm-int', 'clip-inf-norm', 'clip-inf', 'clip-value-inf',
        'clip-norm-type-word-inf', 'clip-numpy', 'clip-tensor', 'lamb-no-clip', 'betas-list',
        'betas-numpy', 'flag-numpy', 'flag-int-and-None', 'wrapper-flags-numpy-and-None',
        'dtype-None-O0', 'dtype-None-disabled', 'disabled-with-bf16-storage'])
def test_valid_forms_next_to_the_refused_ones_are_accepted(make):
    make()


def test_frozen_parameters_are_left_exactly_alone():
    """requires_grad=False params in the optimizer are trained around, not refused: they get no
    gradient, so no master gradient and no update, under every wrapper and both step paths."""
    for make in (lambda m: FP16OptimWrapper(mp_wrappers.FusedAdam(m.parameters()), verbose=False),
                 lambda m: FP16OptimWrapper(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                            verbose=False, dynamic_loss_scale=True),
                 lambda m: ApexOptimWrapper(torch.optim.Adam(m.parameters()), opt_level='O2',
                                            dtype='bfloat16', verbosity=0)):
        model = _model(torch.bfloat16)
        model[0].weight.requires_grad_(False)
        frozen = model[0].weight.detach().clone()
        trained = model[1].weight.detach().clone()
        wrapper = make(model)
        for _ in range(2):
            with wrapper.optim_context(model):
                loss = model(torch.randn(2, 3).bfloat16()).float().sum()
            wrapper.update_params(loss)
            assert not wrapper.last_step_skipped
        assert torch.equal(model[0].weight, frozen)
        assert not torch.equal(model[1].weight, trained)
        # The frozen master stays frozen: it never gets a gradient from the stash either.
        assert [m.requires_grad for m in wrapper.master_params()] == \
            [p.requires_grad for p in model.parameters()]
