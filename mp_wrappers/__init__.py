"""mp_wrappers: apex-grade mixed precision for mmengine, on CPU and CUDA, without NVIDIA apex."""
from . import ops
from .optim import (FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedOptimizer,
                    FusedSGD)

__version__ = '0.1.0'
__all__ = ['ops', 'FusedOptimizer', 'FusedAdam', 'FusedSGD', 'FusedLAMB', 'FusedAdagrad',
           'FusedNovoGrad', '__version__']
