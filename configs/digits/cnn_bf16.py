# DEFAULT config: the model in the precision this machine computes natively, with fp32 master
# weights in FP16OptimWrapper. dtype='auto' (mp_wrappers.hardware.auto_dtype) is bf16 on CPUs with
# AMX-BF16 or AMD's AVX512-BF16 and on GPUs from sm_80 (BatchNorm kept fp32; bf16 has fp32's exponent
# range, so no loss scaling), fp16 with dynamic loss scaling where only fp16 is native, and fp32 on
# CPUs where no half format is faster than fp32: AVX2-only (bf16 ~8x slower) and Intel without AMX
# (bf16 1.35-1.9x slower). The wrapper logs
# what 'auto' resolved to and why. Force bf16 with --cfg-options model.dtype=bfloat16
# optim_wrapper.dtype=bfloat16.
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_20e.py',
          './_base_/default_runtime.py']
model = dict(dtype='auto')
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.FP16OptimWrapper',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True),
    dtype='auto')
