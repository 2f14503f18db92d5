# A tiny, fast, deterministic iteration-based run for the reliability tests (tests/base/test_atomic_io.py,
# tests/runner/test_multiprocess.py, tests/workflows/test_scale_collapse.py). Nothing here is tuned for accuracy:
# the model is 4 channels wide and each run is a few seconds, most of it interpreter start-up.
model = dict(type='mp_wrappers.DigitsCNN', num_classes=10, width=4, dtype=None)
default_scope = 'mmengine'
custom_imports = dict(imports=['mp_wrappers', 'projects.digits'], allow_failed_imports=False)
train_dataloader = dict(
    batch_size=16,
    num_workers=0,
    dataset=dict(type='mp_wrappers.DigitsDataset', split='train'),
    sampler=dict(type='DefaultSampler', shuffle=True),
    collate_fn=dict(type='default_collate'))
# Iteration-based, so a resume lands mid-epoch and mmengine replays the data order exactly (it skips
# the already-trained batches of the seeded sampler).
train_cfg = dict(type='IterBasedTrainLoop', max_iters=16, val_interval=10**9)
optim_wrapper = dict(type='OptimWrapper', optimizer=dict(type='SGD', lr=0.05, momentum=0.9))
param_scheduler = [dict(type='LinearLR', start_factor=0.2, by_epoch=False, begin=0, end=6)]
default_hooks = dict(
    runtime_info=dict(type='RuntimeInfoHook'),
    timer=dict(type='IterTimerHook'),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    logger=dict(type='LoggerHook', interval=1),
    param_scheduler=dict(type='ParamSchedulerHook'),
    # Every 2 iterations (a multiple of the accumulation counts used), keeping all of them.
    checkpoint=dict(type='CheckpointHook', interval=2, by_epoch=False, max_keep_ckpts=-1,
                    save_last=True),
)
env_cfg = dict(cudnn_benchmark=False, mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
               dist_cfg=dict(backend='nccl'))
torch_num_threads = 1
log_processor = dict(window_size=1, by_epoch=False)
log_level = 'INFO'
load_from = None
resume = False
randomness = dict(seed=0, deterministic=True)
