# O3: pure half precision (LayerNorm and softmax in half, no masters): the 'speed of light' level,
# expected to train worse.
# bfloat16 (the CPU default): fp32's exponent range, so no loss scaling and no skipped steps.
_base_ = ['./_base_/charlm_data.py', './_base_/charlm_model.py', './_base_/schedule_1k.py',
          './_base_/default_runtime.py']
optim_wrapper = dict(
    type='mp_wrappers.ApexOptimWrapper', opt_level='O3', dtype='bfloat16',
    optimizer=dict(type='AdamW', lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01),
    clip_grad=dict(max_norm=1.0))
