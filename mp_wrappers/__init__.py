"""mp_wrappers: apex-grade mixed precision for mmengine, on CPU and CUDA, without NVIDIA apex.

Importing the package also installs a ``weights_only`` loader for mmengine checkpoints (see
:mod:`mp_wrappers.checkpoint`; ``MP_WRAPPERS_SECURE_CHECKPOINT_LOADER=0`` turns that off), so that
``--resume`` and ``load_from`` work on torch >= 2.6 without unpickling arbitrary code.
"""
from . import checkpoint, ops

__version__ = '0.1.0'
__all__ = ['checkpoint', 'ops', '__version__']

checkpoint._install_from_env()
