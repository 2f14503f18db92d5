# configs/digits/cnn_fsdp_apex_O2_bf16.py (FSDP1) with inf planted into rank 1's local gradient
# shard at iterations 10 and 40 (tests/_reliability_hooks.py; tests/ must be on PYTHONPATH).
_base_ = ['../../configs/digits/cnn_fsdp_apex_O2_bf16.py']
custom_imports = dict(imports=['mp_wrappers', 'projects.digits', '_reliability_hooks'],
                      allow_failed_imports=False)
custom_hooks = [dict(type='mp_wrappers.MixedPrecisionHook', skip_aware_schedules=True),
                dict(type='RelTestShardFaultHook', iters=[10, 40], rank=1)]
# mmengine's EMAHook: its averaged model holds each rank's pieces (Note [EMA of a sharded model])
custom_hooks.append(dict(type='EMAHook', momentum=0.1))
