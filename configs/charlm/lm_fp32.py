# fp32 baseline: plain mmengine OptimWrapper, AdamW, gradient clipping at 1.0.
_base_ = ['./_base_/charlm_data.py', './_base_/charlm_model.py', './_base_/schedule_1k.py',
          './_base_/default_runtime.py']
