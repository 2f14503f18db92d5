# Keep mmengine's scope and name our classes with the `mp_wrappers.` prefix. The byte-level LM is a
# demo project outside the package (projects/charlm), imported from the repository root (see
# configs/digits/_base_/default_runtime.py and projects/README.md).
default_scope = 'mmengine'
custom_imports = dict(imports=['mp_wrappers', 'projects.charlm'], allow_failed_imports=False)

default_hooks = dict(
    runtime_info=dict(type='RuntimeInfoHook'),
    timer=dict(type='IterTimerHook'),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    logger=dict(type='LoggerHook', interval=50),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', interval=500, by_epoch=False, max_keep_ckpts=1,
                    save_last=True),
)
# amp_* log fields, precision summary, skip-aware schedules (a no-op for the fp32 OptimWrapper).
custom_hooks = [dict(type='mp_wrappers.MixedPrecisionHook')]
# TensorBoard too (needs `pip install tensorboard`):
# visualizer = dict(type='Visualizer', vis_backends=[dict(type='LocalVisBackend'),
#                                                    dict(type='TensorboardVisBackend')])
env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    dist_cfg=dict(backend='nccl'),
)
# One intra-op thread: on a 2-core machine shared with other jobs, a second OpenMP thread mostly
# waits (see configs/digits/_base_/default_runtime.py). Set None on a dedicated machine or GPU.
torch_num_threads = 1
log_processor = dict(window_size=50, by_epoch=False)
log_level = 'INFO'
load_from = None
resume = False
randomness = dict(seed=0, deterministic=False)
