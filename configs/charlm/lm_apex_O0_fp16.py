# O0: pure fp32 through ApexOptimWrapper; dtype='float16' only changes the default loss scale to
# 'dynamic' (mmengine's rule), which in fp32 never overflows. Kept with the same smoke-test budget
# as the other fp16 configs so the fp16 family is complete; on a GPU raise train_cfg.max_iters.
_base_ = ['./_base_/charlm_data.py', './_base_/charlm_model.py', './_base_/schedule_1k.py',
          './_base_/default_runtime.py']
optim_wrapper = dict(
    type='mp_wrappers.ApexOptimWrapper', opt_level='O0', dtype='float16',
    optimizer=dict(type='AdamW', lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01),
    clip_grad=dict(max_norm=1.0))
train_cfg = dict(max_iters=20, val_interval=20)
param_scheduler = [dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=20)]
default_hooks = dict(logger=dict(interval=5), checkpoint=dict(interval=20))
