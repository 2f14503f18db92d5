# fp16 model with a dynamic loss scale (apex FP16_Optimizer style). fp16 convolutions are slow on CPU,
# so this config runs a short schedule; on GPU raise train_cfg.max_epochs with --cfg-options.
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_6e.py',
          './_base_/default_runtime.py']
model = dict(dtype='float16')
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.FP16OptimWrapper',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True),
    dynamic_loss_scale=True,
    dynamic_loss_args=dict(init_scale=2.**16, scale_window=2000))
