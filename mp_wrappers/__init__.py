"""mp_wrappers: apex-grade mixed precision for mmengine, on CPU and CUDA, without NVIDIA apex.

Importing the package registers its optimizer wrappers, optimizers, example workloads and hooks in
mmengine's registries under the ``mp_wrappers`` scope (``type='mp_wrappers.FP16OptimWrapper'``).
"""
from . import ops
from .casting import cast_model
from .scaler import DynamicLossScaler, LossScaler, StaticLossScaler
from .wrappers import FP16OptimWrapper, MixedPrecisionOptimWrapper

__version__ = '0.1.0'
__all__ = ['ops', 'cast_model', 'LossScaler', 'StaticLossScaler', 'DynamicLossScaler',
           'MixedPrecisionOptimWrapper', 'FP16OptimWrapper', '__version__']
