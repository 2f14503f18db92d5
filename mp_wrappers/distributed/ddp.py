"""A DistributedDataParallel wrapper that casts the model *before* DDP sees it.

DDP's reducer fixes its gradient buckets' dtype from the parameters it is built with. Casting the
parameters afterwards (what apex O2/O3 did inside ``amp.initialize``, and mmengine's ApexOptimWrapper
does in ``optim_context``) silently stops gradient all-reduce: ranks drift apart with no error. With
this wrapper mmengine builds DDP over an already-cast model, and ``ApexOptimWrapper`` checks the cast
matches its opt level.
"""
from typing import List, Optional, Union

import torch
from mmengine.model import MMDistributedDataParallel
from torch import nn

from ..casting import cast_model, check_module_patterns, match_modules, parse_dtype
from ..registry import MODEL_WRAPPERS

__all__ = ['MixedPrecisionDistributedDataParallel']


@MODEL_WRAPPERS.register_module()
class MixedPrecisionDistributedDataParallel(MMDistributedDataParallel):
    """``MMDistributedDataParallel`` over a model cast to fp16/bf16 first (norm layers kept fp32).

    On CPU (gloo) ``device_ids`` is forced to None, as DDP requires for CPU modules.

    Args:
        module (nn.Module): The model (mmengine passes it).
        dtype (str | torch.dtype): ``'float16'`` or ``'bfloat16'``.
        keep_batchnorm_fp32 (bool): Keep normalisation layers fp32 (apex O2). Defaults to True.
        fp32_modules (list[str], optional): Submodules kept fp32: the optimizer wrapper's
            ``fp32_modules``, which must be given here too when this wrapper casts the model.
        **kwargs: Passed on to ``MMDistributedDataParallel`` / ``DistributedDataParallel``.

    Examples:
        >>> model_wrapper_cfg = dict(
        ...     type='mp_wrappers.MixedPrecisionDistributedDataParallel', dtype='float16',
        ...     keep_batchnorm_fp32=True)
        >>> optim_wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2',
        ...                      optimizer=dict(type='SGD', lr=0.1))
    """

    def __init__(self, module: nn.Module, dtype: Union[str, torch.dtype] = 'float16',
                 keep_batchnorm_fp32: bool = True, fp32_modules: Optional[List[str]] = None,
                 **kwargs) -> None:
        half = parse_dtype(dtype, 'dtype', allowed=('float16', 'bfloat16', 'float32'))
        patterns = check_module_patterns(fp32_modules, 'fp32_modules')
        keep = [name for name, _ in match_modules(module, patterns)]
        cast_model(module, half, keep_norm_fp32=keep_batchnorm_fp32, keep_fp32_modules=keep)
        if next(module.parameters()).device.type == 'cpu':
            kwargs['device_ids'] = None
        super().__init__(module=module, **kwargs)
