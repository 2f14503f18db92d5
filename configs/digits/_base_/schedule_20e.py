# 20 epochs x 45 iterations at batch 32.
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=20, val_interval=5)
val_cfg = dict(type='ValLoop')
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True))
param_scheduler = [
    # Warm up over the first 50 iterations, then cosine-decay per epoch to the end.
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=50),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, end=20, T_max=20, eta_min=1e-4),
]
