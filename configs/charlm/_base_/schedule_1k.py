# 1000 iterations (32k windows, ~3 passes over the 10282 training windows) with AdamW, 50 warm-up
# iterations, cosine decay to 10% of the peak. Measured on a shared 2-core CPU with 1 thread:
# ~0.05 s/iter with bf16 autocast (O1), ~0.12 s/iter in fp32.
train_cfg = dict(type='IterBasedTrainLoop', max_iters=1000, val_interval=500)
val_cfg = dict(type='ValLoop')
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01),
    clip_grad=dict(max_norm=1.0))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=50),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=50, end=1000, T_max=950, eta_min=3e-4),
]
