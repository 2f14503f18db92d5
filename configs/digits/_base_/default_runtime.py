# Keep mmengine's scope and name our classes with the `mp_wrappers.` prefix, so that this plugin works
# inside any OpenMMLab repo without taking over its default scope. The digits dataset, CNN and metric
# are a demo project outside the package (projects/digits): it registers them under the same scope and
# imports from the repository root (tools/train.py puts it on sys.path; elsewhere set PYTHONPATH to
# it, see projects/README.md).
default_scope = 'mmengine'
custom_imports = dict(imports=['mp_wrappers', 'projects.digits'], allow_failed_imports=False)

default_hooks = dict(
    runtime_info=dict(type='RuntimeInfoHook'),
    timer=dict(type='IterTimerHook'),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    logger=dict(type='LoggerHook', interval=15),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', interval=5, max_keep_ckpts=2, save_last=True),
)
# amp_* log fields (loss scale, skipped steps, gradient norm), the precision summary and skip-aware
# parameter schedules; it does nothing with a plain fp32 OptimWrapper. tools/train.py would add it
# anyway for our wrappers; listing it keeps the config self-describing.
custom_hooks = [dict(type='mp_wrappers.MixedPrecisionHook', skip_aware_schedules=True)]
# Every visualizer backend receives the log scalars (amp_* included): LocalVisBackend writes
# <work_dir>/<timestamp>/vis_data/scalars.json. For TensorBoard (needs `pip install tensorboard`):
# visualizer = dict(type='Visualizer', vis_backends=[dict(type='LocalVisBackend'),
#                                                    dict(type='TensorboardVisBackend')])
env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    # nccl on GPU; without CUDA, mp_wrappers.launch.prepare_distributed starts a gloo group instead.
    dist_cfg=dict(backend='nccl'),
)
# Intra-op CPU threads (read by mp_wrappers.launch.configure_torch_threads in tools/train.py; None
# keeps torch's default). 8x8 convolutions gain little from a second thread, and OpenMP threads
# slow down badly when the cores are shared: measured 0.019 s/iter with 1 thread vs 0.61 s/iter with
# 2 on a busy 2-core machine. Irrelevant on GPU.
torch_num_threads = 1
log_processor = dict(window_size=15, by_epoch=True)
log_level = 'INFO'
load_from = None
resume = False
randomness = dict(seed=0, deterministic=True)
