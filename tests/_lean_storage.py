"""Bf16 params stored the lean way (Note [lean bf16 storage] in mp_wrappers/ops/reference/lean.py),
made from fp32 values for the 8-bit lean op tests: the params and their aux state, each guarded
(_guards.py)."""
from typing import List, Sequence, Tuple

import torch

from _guards import guarded
from mp_wrappers.ops.reference.lean import bf16_split

LEAN_STORAGES = ['split', 'kahan', 'stochastic']


def lean_stored(masters: Sequence[torch.Tensor], storage: str
                ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(params, aux) holding ``masters`` the ``storage`` way: 'split', the bf16 high halves and the
    uint16 low halves (exactly the fp32 values); 'kahan', the rounded bf16 params and their bf16
    compensations; 'stochastic', the rounded params and no aux."""
    if storage == 'split':
        halves = [bf16_split(m) for m in masters]
        return [guarded(h) for h, _ in halves], [guarded(lo) for _, lo in halves]
    params = [guarded(m.bfloat16()) for m in masters]
    aux = ([guarded((m - p.float()).bfloat16()) for m, p in zip(masters, params)]
           if storage == 'kahan' else [])
    return params, aux
