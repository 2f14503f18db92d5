# O2: the wrapper casts the model to half with BatchNorm kept fp32 and steps fp32 master weights.
# float16 with a dynamic loss scale. fp16 convolutions run far slower than fp32 on CPUs without
# AVX512-FP16/AMX (docs/semantics.md section 8), so this config uses the short 6-epoch schedule
# (_base_/schedule_6e.py says how to run the full one on a GPU).
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_6e.py',
          './_base_/default_runtime.py']
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='float16',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True))
