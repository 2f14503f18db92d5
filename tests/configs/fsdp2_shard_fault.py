# configs/digits/cnn_fsdp2_apex_O2_bf16.py with inf planted into rank 1's local gradient shard at
# iterations 6, 50 and 70 (tests/_reliability_hooks.py; tests/ must be on PYTHONPATH).
_base_ = ['../../configs/digits/cnn_fsdp2_apex_O2_bf16.py']
custom_imports = dict(imports=['mp_wrappers', 'projects.digits', '_reliability_hooks'],
                      allow_failed_imports=False)
custom_hooks = [dict(type='mp_wrappers.MixedPrecisionHook', skip_aware_schedules=True),
                dict(type='RelTestShardFaultHook', iters=[6, 50, 70], rank=1)]
# mmengine's EMAHook: its averaged model is sharded like the model (Note [EMA of a sharded model])
custom_hooks.append(dict(type='EMAHook', momentum=0.1))
