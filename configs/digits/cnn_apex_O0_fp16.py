# O0: the fp32 baseline through the same wrapper (steps with inf/nan grads are still skipped).
# float16 with a dynamic loss scale. fp16 convolutions run far slower than fp32 on CPUs without
# AVX512-FP16/AMX (docs/semantics.md section 8), so this config uses the short 6-epoch schedule
# (_base_/schedule_6e.py says how to run the full one on a GPU).
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_6e.py',
          './_base_/default_runtime.py']
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.ApexOptimWrapper', opt_level='O0', dtype='float16',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True))
