"""mp_wrappers: apex-grade mixed precision for mmengine, on CPU and CUDA, without NVIDIA apex.

Importing the package registers its optimizer wrappers, optimizers, example workloads and hooks in
mmengine's registries under the ``mp_wrappers`` scope (``type='mp_wrappers.FP16OptimWrapper'``).
"""
from . import ops
from .autocast import disable_casts, float_function, half_function, promote_function
from .casting import cast_model
from .ddp import MixedPrecisionDistributedDataParallel
from .optim import (FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedOptimizer,
                    FusedSGD)
from .policy import Properties, resolve_properties
from .scaler import DynamicLossScaler, LossScaler, StaticLossScaler
from .wrappers import ApexOptimWrapper, FP16OptimWrapper, MixedPrecisionOptimWrapper

__version__ = '0.1.0'
__all__ = [
    'ops', 'cast_model', 'LossScaler', 'StaticLossScaler', 'DynamicLossScaler',
    'MixedPrecisionOptimWrapper', 'FP16OptimWrapper', 'ApexOptimWrapper', 'Properties',
    'resolve_properties', 'half_function', 'float_function', 'promote_function', 'disable_casts',
    'MixedPrecisionDistributedDataParallel', 'FusedOptimizer', 'FusedAdam', 'FusedSGD',
    'FusedLAMB', 'FusedAdagrad', 'FusedNovoGrad', '__version__',
]
