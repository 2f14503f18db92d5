# O2: the wrapper casts the model to half with BatchNorm kept fp32 and steps fp32 master weights.
# bfloat16 (the CPU default): fp32's exponent range, so no loss scaling unless asked for.
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_20e.py',
          './_base_/default_runtime.py']
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True))
