# O3: everything in half, BatchNorm too, no master weights: the speed baseline.
# bfloat16 (the CPU default): fp32's exponent range, so no loss scaling unless asked for.
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_20e.py',
          './_base_/default_runtime.py']
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.ApexOptimWrapper', opt_level='O3', dtype='bfloat16',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True))
