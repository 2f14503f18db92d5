"""Multi-tensor and fused-optimizer ops: compiled kernels with pure-PyTorch references.

``torch.ops.mp_wrappers.<name>`` are the dispatcher ops (CPU and, when built, CUDA kernels);
:mod:`mp_wrappers.ops.reference` holds a reference of each with the same signature; the functions
here validate their inputs and pick one of the two (:func:`backend` says which).
"""
from ._extension import backend
from .multi_tensor import (multi_tensor_axpby, multi_tensor_l2norm, multi_tensor_scale,
                           multi_tensor_unscale_l2norm, new_found_inf, update_scale_hysteresis_)
from .lean import multi_tensor_adam_lean, multi_tensor_sgd_lean
from .optimizers import (multi_tensor_adagrad, multi_tensor_adam, multi_tensor_lamb,
                         multi_tensor_novograd, multi_tensor_sgd)
from .quantized_states import (multi_tensor_adam8bit, multi_tensor_adam8bit_lean,
                               multi_tensor_sgd8bit, multi_tensor_sgd8bit_lean)

__all__ = ['backend', 'multi_tensor_scale', 'multi_tensor_l2norm', 'multi_tensor_unscale_l2norm',
           'multi_tensor_axpby', 'update_scale_hysteresis_', 'new_found_inf',
           'multi_tensor_adam', 'multi_tensor_sgd', 'multi_tensor_lamb', 'multi_tensor_adagrad',
           'multi_tensor_novograd', 'multi_tensor_adam_lean', 'multi_tensor_sgd_lean',
           'multi_tensor_adam8bit', 'multi_tensor_adam8bit_lean', 'multi_tensor_sgd8bit',
           'multi_tensor_sgd8bit_lean']
