# O3: pure half precision (LayerNorm and softmax in half, no masters): the 'speed of light' level,
# expected to train worse.
# float16 with a dynamic loss scale. fp16 matmuls run ~100x slower than fp32 on CPUs without
# AVX512-FP16/AMX (docs/semantics.md section 8), so on CPU this config runs a smoke-test budget; it is meant
# for GPUs: python tools/train.py configs/charlm/lm_apex_O3_fp16.py --cfg-options train_cfg.max_iters=1000
_base_ = ['./_base_/charlm_data.py', './_base_/charlm_model.py', './_base_/schedule_1k.py',
          './_base_/default_runtime.py']
optim_wrapper = dict(
    type='mp_wrappers.ApexOptimWrapper', opt_level='O3', dtype='float16',
    # eps=1e-4: O3 steps Adam on fp16 state, where the default 1e-8 rounds to 0 and parameters with
    # zero gradients (unused byte embeddings) become 0/0 = nan after the first step.
    optimizer=dict(type='AdamW', lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-4),
    clip_grad=dict(max_norm=1.0))
train_cfg = dict(max_iters=20, val_interval=20)
param_scheduler = [dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=20)]
default_hooks = dict(logger=dict(interval=5), checkpoint=dict(interval=20))
