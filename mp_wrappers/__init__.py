"""mp_wrappers: apex-grade mixed precision for mmengine, on CPU and CUDA, without NVIDIA apex.

Importing the package registers its optimizer wrappers, optimizers, hooks, loops and distributed
strategies in mmengine's registries under the ``mp_wrappers`` scope
(``type='mp_wrappers.FP16OptimWrapper'``). The demo workloads of the shipped configs (digits CNN,
byte-level LM) are not part of the package: they live in the repository's ``projects/`` folder and
register under the same scope when a config imports them (``projects/README.md``).

Importing the package also installs a ``weights_only`` loader for mmengine checkpoints (see
:mod:`mp_wrappers.checkpoint`; ``MP_WRAPPERS_SECURE_CHECKPOINT_LOADER=0`` turns that off), so that
``--resume`` and ``load_from`` work on torch >= 2.6 without unpickling arbitrary code, and makes
mmengine's local checkpoint writes atomic (see :mod:`mp_wrappers.atomic_io`;
``MP_WRAPPERS_ATOMIC_CHECKPOINTS=0`` turns that off), so a process killed while saving never leaves a
truncated checkpoint under its final name.
"""
from . import atomic_io, checkpoint, ops
from .autocast import disable_casts, float_function, half_function, promote_function
from .casting import cast_model
from .ddp import MixedPrecisionDistributedDataParallel
from .ema import MixedPrecisionEMAHook
from .hooks import MixedPrecisionHook
from .lifecycle import WrapperLifecycleHook
from .loops import MixedPrecisionTestLoop, MixedPrecisionValLoop
from .optim import (FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedOptimizer,
                    FusedSGD)
from .policy import Properties, resolve_properties
from .scaler import DynamicLossScaler, LossScaler, StaticLossScaler
from .wrappers import ApexOptimWrapper, FP16OptimWrapper, MixedPrecisionOptimWrapper

__version__ = '0.1.0'
__all__ = [
    'atomic_io', 'checkpoint', 'ops', 'cast_model', 'LossScaler', 'StaticLossScaler', 'DynamicLossScaler',
    'MixedPrecisionOptimWrapper', 'FP16OptimWrapper', 'ApexOptimWrapper', 'Properties',
    'resolve_properties', 'half_function', 'float_function', 'promote_function', 'disable_casts',
    'MixedPrecisionDistributedDataParallel', 'FusedOptimizer', 'FusedAdam', 'FusedSGD',
    'FusedLAMB', 'FusedAdagrad', 'FusedNovoGrad', 'MixedPrecisionHook', '__version__',
    'MixedPrecisionEMAHook', 'WrapperLifecycleHook',
    'MixedPrecisionValLoop', 'MixedPrecisionTestLoop',
]

checkpoint._install_from_env()
atomic_io._install_from_env()
