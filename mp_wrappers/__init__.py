"""mp_wrappers: apex-grade mixed precision for mmengine, on CPU and CUDA, without NVIDIA apex."""
from . import ops

__version__ = '0.1.0'
__all__ = ['ops', '__version__']
