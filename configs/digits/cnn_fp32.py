# fp32 baseline: plain mmengine OptimWrapper, SGD with Nesterov momentum.
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_20e.py',
          './_base_/default_runtime.py']
