# FP16OptimWrapper over an fp16 model, dynamic scale with a short window so the scale moves.
_base_ = ['./_base_/tiny_iter.py']
model = dict(dtype='float16')
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.FP16OptimWrapper',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4),
    dynamic_loss_scale=True,
    dynamic_loss_args=dict(init_scale=2.**14, scale_window=3))
