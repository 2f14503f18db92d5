# The short schedule of the fp16 configs: fp16 convolutions run far slower than fp32 on CPUs without
# AVX512-FP16/AMX (docs/semantics.md section 8). On a GPU use schedule_20e.py instead (or
# --cfg-options train_cfg.max_epochs=20 param_scheduler.1.end=20 param_scheduler.1.T_max=20).
_base_ = ['./schedule_20e.py']
train_cfg = dict(max_epochs=6, val_interval=3)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=50),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, end=6, T_max=6, eta_min=1e-4),
]
