# tests/configs/fsdp_shard_fault.py as a user's own config for a toolbox's train script: no hook of
# ours listed (mp_wrappers.MixedPrecisionHook is optional; tools/train.py would add it), only the
# one-rank fault (tests/_reliability_hooks.py; tests/ must be on PYTHONPATH).
_base_ = ['./fsdp_shard_fault.py']
custom_hooks = [dict(type='RelTestShardFaultHook', iters=[10, 40], rank=1)]
custom_hooks.append(dict(type='EMAHook', momentum=0.1))  # mmengine's, as in fsdp_shard_fault.py
