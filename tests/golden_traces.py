"""Golden training traces: what every wrapper x level x optimizer x master mode x accumulation/clip
combination computes, step by step, to the bit.

Recorded once before a refactoring (``python tests/golden_traces.py --record``) and replayed by
``tests/wrappers/test_golden_traces.py``: a commit that moves code must keep every digest; a commit that changes
numerics on purpose says so and re-records the file alone.

Why the traces are the same on every CPU: the loss is built from element-wise operations only,
``sum(c * p * p) / 2 + sum(d * p)`` over the parameters, so every gradient element is
``scale * (c * p + d)`` computed by single IEEE operations (no reductions, no matmuls whose blocking
depends on the ISA); our kernels give the same bits on every ISA flavour (the kernel tests check it);
the random coefficients come from integers (``randint``), which torch's CPU generator draws the same
everywhere. Checked: the file replays with ATen and our kernels forced to AVX2
(``ATEN_CPU_CAPABILITY=avx2 MP_WRAPPERS_CPU_ISA=avx2``) and with our kernels at ``baseline``; only
ATen's scalar ``default`` capability (no CPU we support runs it) rounds torch's own SGD/AdamW
differently. Overflows are injected as an ``inf`` (step 3) and a ``nan`` (step 6) in ``d``.

Each step records a digest of every model parameter, of the fp32 master copies and of the bytes
``torch.save`` writes for the wrapper's ``state_dict`` (optimizer state, loss scale, skip counters,
the checkpoint format itself), plus the loss scale and whether the step was skipped in clear.
"""
import argparse
import hashlib
import importlib
import io
import itertools
import json
import os
from typing import Dict, List

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = os.path.join(HERE, 'golden_traces.json')
MICRO_STEPS = 8
INJECT = {3: float('inf'), 6: float('nan')}

# name -> (wrapper kind, dtype, extra wrapper kwargs)
WRAPPERS = {
    'FP16-fp16-dynamic': ('FP16', 'float16', dict(dynamic_loss_scale=True)),
    'FP16-fp16-static': ('FP16', 'float16', dict(dynamic_loss_scale=False, static_loss_scale=128.)),
    'FP16-bf16': ('FP16', 'bfloat16', {}),
    'FP16cast-fp16': ('FP16cast', 'float16', dict(dynamic_loss_scale=True)),
    'O0': ('Apex', 'float16', dict(opt_level='O0')),
    'O1-fp16': ('Apex', 'float16', dict(opt_level='O1')),
    'O1-bf16': ('Apex', 'bfloat16', dict(opt_level='O1')),
    'O2-fp16': ('Apex', 'float16', dict(opt_level='O2')),
    'O2-fp16-window2': ('Apex', 'float16', dict(opt_level='O2', scale_window=2, init_scale=2.**20)),
    'O2-bf16': ('Apex', 'bfloat16', dict(opt_level='O2')),
    'O3-fp16': ('Apex', 'float16', dict(opt_level='O3')),
    'O3-bf16': ('Apex', 'bfloat16', dict(opt_level='O3')),
}

# name -> (module path, class name, kwargs)
OPTIMIZERS = {
    'SGD': ('torch.optim', 'SGD', dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    'AdamW': ('torch.optim', 'AdamW', dict(lr=1e-2, weight_decay=1e-2)),
    'FusedAdam': ('mp_wrappers', 'FusedAdam', dict(lr=1e-2, weight_decay=1e-2)),
    'FusedSGD': ('mp_wrappers', 'FusedSGD', dict(lr=0.05, momentum=0.9, weight_decay=1e-3,
                                                 nesterov=True)),
    'FusedLAMB': ('mp_wrappers', 'FusedLAMB', dict(lr=1e-2, weight_decay=1e-2)),
    'FusedNovoGrad': ('mp_wrappers', 'FusedNovoGrad', dict(lr=1e-2, weight_decay=1e-3)),
    'FusedAdagrad': ('mp_wrappers', 'FusedAdagrad', dict(lr=1e-2, weight_decay=1e-3)),
}

VARIANTS = {'plain': {}, 'accum2': dict(accumulative_counts=2), 'clip': dict(clip_grad=dict(max_norm=0.5)),
            'accum2-clip': dict(accumulative_counts=2, clip_grad=dict(max_norm=0.5))}

# Lean masters (O2 bf16 only): master_weights mode -> optimizer kwargs added.
LEAN = {'split': {}, 'kahan': {}, 'stochastic': dict(seed=7), 'kahan-bf16-state': dict(state_dtype='bfloat16')}
LEAN_OPTIMIZERS = ('FusedAdam', 'FusedSGD')  # the optimizers with a fused lean update


def scenarios() -> List[str]:
    """Every wrapper x optimizer; all variants for the optimizers the suite leans on most."""
    names = []
    for wrapper, optimizer in itertools.product(WRAPPERS, OPTIMIZERS):
        variants = VARIANTS if optimizer in ('AdamW', 'FusedAdam', 'FusedSGD') else ('plain', 'accum2-clip')
        names += [f'{wrapper}/{optimizer}/{v}' for v in variants]
    for mode, optimizer in itertools.product(LEAN, LEAN_OPTIMIZERS):
        names += [f'O2-bf16-{mode}/{optimizer}/{v}' for v in ('plain', 'accum2-clip')]
    return names


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3), nn.LayerNorm(3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-64, 65, p.shape, generator=g).float() / 128)
    return model


def _coefficients(model: nn.Module, micro_step: int):
    """Per-parameter (c, d), drawn from integers so every CPU gets the same values."""
    g = torch.Generator().manual_seed(1000 + micro_step)
    out = []
    for i, p in enumerate(model.parameters()):
        c = torch.randint(0, 9, p.shape, generator=g).float() / 16
        d = torch.randint(-32, 33, p.shape, generator=g).float() / 64
        if micro_step in INJECT and i == 1:
            d.view(-1)[0] = INJECT[micro_step]
        out.append((c, d))
    return out


def _digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f'{t.dtype}{tuple(t.shape)}'.encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _bytes_digest(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()[:16]


def _build(name: str):
    from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper, cast_model
    wrapper_name, optimizer_name, variant = name.split('/')
    lean = None
    for mode in LEAN:
        if wrapper_name == f'O2-bf16-{mode}':
            lean, wrapper_name = mode, 'O2-bf16'
    kind, dtype, wkw = WRAPPERS[wrapper_name]
    module, cls, okw = OPTIMIZERS[optimizer_name]
    okw = dict(okw)
    wkw = dict(wkw, **VARIANTS[variant])
    torch.manual_seed(0)
    model = _model()
    if kind == 'FP16':
        model = cast_model(model, getattr(torch, dtype))
    if lean is not None:
        okw.update(LEAN[lean])
        wkw['master_weights'] = lean.split('-')[0]
    optimizer = getattr(importlib.import_module(module), cls)(model.parameters(), **okw)
    if kind == 'Apex':
        wrapper = ApexOptimWrapper(optimizer, dtype=dtype, verbosity=0, **wkw)
    else:
        wrapper = FP16OptimWrapper(optimizer, dtype=dtype, verbose=False, **wkw)
    return model, wrapper


def trace(name: str) -> List[Dict[str, object]]:
    """Train scenario ``name`` for MICRO_STEPS micro-steps; one record per optimizer update."""
    model, wrapper = _build(name)
    records = []
    for micro in range(1, MICRO_STEPS + 1):
        with wrapper.optim_context(model):
            coefficients = _coefficients(model, micro)
            loss = sum((c * p.float() * p.float()).sum() / 2 + (d * p.float()).sum()
                       for p, (c, d) in zip(model.parameters(), coefficients))
        wrapper.update_params(loss)
        if not wrapper.should_update():
            continue
        masters = wrapper.master_params() if getattr(wrapper, 'master_weights', False) else []
        records.append(dict(
            micro_step=micro,
            loss_scale=float(wrapper.loss_scale) if wrapper.loss_scale is not None else None,
            skipped=bool(wrapper.last_step_skipped),
            model=[_digest(p) for p in model.parameters()],
            masters=[_digest(p) for p in masters],
            state_dict=_bytes_digest(wrapper.state_dict()),
        ))
    return records


def fingerprint() -> Dict[str, str]:
    return dict(torch='.'.join(torch.__version__.split('+')[0].split('.')[:2]))


def record(path: str = TRACES) -> None:
    import warnings
    warnings.simplefilter('ignore')  # the fp16-on-CPU speed warnings, once per scenario
    traces = {name: trace(name) for name in scenarios()}
    with open(path, 'w') as f:
        json.dump(dict(fingerprint=fingerprint(), traces=traces), f, indent=0, sort_keys=True)
        f.write('\n')
    print(f'recorded {len(traces)} traces to {path}')


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--record', action='store_true', help=f'write {os.path.basename(TRACES)}')
    args = parser.parse_args()
    if args.record:
        record()
    else:
        parser.print_help()
