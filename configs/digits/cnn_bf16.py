# DEFAULT config: bf16 model (BatchNorm kept fp32) with fp32 master weights in FP16OptimWrapper.
# bf16 has fp32's exponent range, so gradients do not underflow and no loss scaling is needed.
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_20e.py',
          './_base_/default_runtime.py']
model = dict(dtype='bfloat16')
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.FP16OptimWrapper',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True),
    dynamic_loss_scale=False,
    static_loss_scale=1.0)
