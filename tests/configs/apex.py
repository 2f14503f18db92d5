# ApexOptimWrapper over an fp32 model; the tests pick the level, dtype and accumulation with
# --cfg-options (optim_wrapper.opt_level=O2 optim_wrapper.dtype=bfloat16 ...).
_base_ = ['./_base_/tiny_iter.py']
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.ApexOptimWrapper',
    optimizer=dict(type='mp_wrappers.FusedAdam', lr=2e-3, weight_decay=1e-4),
    opt_level='O2',
    dtype='float16',
    scale_window=3,
    init_scale=2.**14,
    accumulative_counts=2,
    verbosity=0)
