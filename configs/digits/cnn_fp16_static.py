# fp16 model with a fixed loss scale of 128. Short schedule: fp16 convolutions are slow on CPU.
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_6e.py',
          './_base_/default_runtime.py']
model = dict(dtype='float16')
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.FP16OptimWrapper',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True),
    dynamic_loss_scale=False,
    static_loss_scale=128.0)
