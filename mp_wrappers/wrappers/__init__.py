"""mmengine optimizer wrappers (registered in ``mp_wrappers.registry.OPTIM_WRAPPERS``)."""
from .apex import ApexOptimWrapper
from .base import MixedPrecisionOptimWrapper
from .fp16 import FP16OptimWrapper

__all__ = ['MixedPrecisionOptimWrapper', 'FP16OptimWrapper', 'ApexOptimWrapper']
