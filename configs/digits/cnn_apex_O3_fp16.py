# O3: everything in half, BatchNorm too, no master weights: the speed baseline.
# float16 with a dynamic loss scale. fp16 convolutions run far slower than fp32 on CPUs without
# AVX512-FP16/AMX (REFERENCE.md section 8), so this config uses the short 6-epoch schedule of
# cnn_fp16_*.py; on a GPU give it the full schedule with --cfg-options train_cfg.max_epochs=20.
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_20e.py',
          './_base_/default_runtime.py']
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.ApexOptimWrapper', opt_level='O3', dtype='float16',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True))
train_cfg = dict(max_epochs=6, val_interval=3)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=50),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, end=6, T_max=6, eta_min=1e-4),
]
default_hooks = dict(checkpoint=dict(interval=3))
