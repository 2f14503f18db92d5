# bf16 with gradient accumulation: batch 8 x 4 accumulation steps = the effective batch 32 of cnn_bf16.
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_20e.py',
          './_base_/default_runtime.py']
model = dict(dtype='bfloat16')
train_dataloader = dict(batch_size=8)
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.FP16OptimWrapper',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True),
    dynamic_loss_scale=False,
    static_loss_scale=1.0,
    accumulative_counts=4)
# 180 iterations per epoch at batch 8; 8 epochs keep the run short. The warmup counts iterations,
# of which 4 make one optimizer step, hence 200 for the same 50 steps as cnn_bf16.
train_cfg = dict(max_epochs=8, val_interval=4)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=200),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, end=8, T_max=8, eta_min=1e-4),
]
default_hooks = dict(logger=dict(interval=20), checkpoint=dict(interval=4))
