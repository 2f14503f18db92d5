"""Pure-PyTorch references of every ``torch.ops.mp_wrappers`` op.

Each function has exactly the signature of the op schema in ``csrc/bindings.cpp`` and is the
executable definition of its semantics: the fallback when the extension is unavailable and the oracle
the tests compare kernels with. Clarity over speed, but no host synchronisation: flags and counters
stay tensors so the references can be used in the same places as the kernels.

Grouped by kind, re-exported here: the dispatcher (:func:`mp_wrappers.ops._dispatch.implementation`)
and the tests look every reference up by its op name in this one namespace.
"""
from .lean import (LEAN_STORAGES, bf16_join, bf16_split, multi_tensor_adam_lean_,
                   multi_tensor_sgd_lean_, round_stochastic, stochastic_bits)
from .multi_tensor import (multi_tensor_axpby_, multi_tensor_l2norm, multi_tensor_scale_,
                           multi_tensor_unscale_l2norm, update_scale_hysteresis_)
from .optimizers import (multi_tensor_adagrad_, multi_tensor_adam_, multi_tensor_lamb_,
                         multi_tensor_novograd_, multi_tensor_sgd_)
from . import slots
from .quant import (multi_tensor_adam8bit_, multi_tensor_adam8bit_lean_, multi_tensor_sgd8bit_,
                    multi_tensor_sgd8bit_lean_)

__all__ = [
    'multi_tensor_scale_', 'multi_tensor_l2norm', 'multi_tensor_unscale_l2norm',
    'multi_tensor_axpby_', 'update_scale_hysteresis_',
    # fused optimizer updates
    'multi_tensor_adam_', 'multi_tensor_sgd_', 'multi_tensor_lamb_', 'multi_tensor_adagrad_',
    'multi_tensor_novograd_',
    # lean bf16 storage (Note [lean bf16 storage] in .lean)
    'multi_tensor_adam_lean_', 'multi_tensor_sgd_lean_', 'LEAN_STORAGES', 'bf16_join', 'bf16_split',
    'stochastic_bits', 'round_stochastic',
    # block-wise 8-bit optimizer states (Note [8-bit optimizer states] in .quant)
    'multi_tensor_adam8bit_', 'multi_tensor_adam8bit_lean_', 'multi_tensor_sgd8bit_',
    'multi_tensor_sgd8bit_lean_',
]
