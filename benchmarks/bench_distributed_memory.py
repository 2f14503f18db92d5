"""Per-rank persistent bytes per parameter under DDP, FSDP1 and FSDP2, measured from the tensors.

For each layout, N gloo processes (CPU) train a stack of Linear layers with ApexOptimWrapper O2 bf16
and FusedAdam for two steps; just before the second optimizer step every rank adds up the bytes of
the distinct storages it holds in: model parameters (the local shards under FSDP), their gradients,
our fp32 masters, the optimizer state and the wrapper's gradient stash. The figure is that sum divided
by the number of parameters of the whole model. Expected for O2 + Adam: 2 (half weights) + 2 (half
grads) + 4 (masters) + 8 (m, v) = 16 B/param on one process or under DDP; under FSDP the fp32 shards
are the masters and gradients are reduced to fp32 shards: 16/N, plus the half copy of the layer
being computed, which FSDP frees after use (reported as the largest layer's 2 B/param of the model).

Lean master modes under FSDP2 (``--lean split kahan stochastic``): a bf16 model sharded as it is
(no FSDP cast, no fp32 copy anywhere), ``master_weights=<mode>``: 2 (bf16 shard) + 2 (bf16 grad) +
8 (m, v) + the mode's extra state (``split``: 2, the uint16 low half; ``kahan``: 2, the bf16
compensation; ``stochastic``: 0), all divided by N.

Usage: python benchmarks/bench_distributed_memory.py [--ranks 1 2 4] [--width 512] [--layers 8]
       [--lean split kahan stochastic]
"""
import argparse
import os
import socket
import tempfile
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

CATEGORIES = ('params', 'grads', 'masters', 'optimizer', 'stash')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _local(t):
    from mp_wrappers.sharding import local_tensor
    return local_tensor(t)


def _bytes(tensors, seen) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _measure(model: nn.Module, wrapper) -> Dict[str, int]:
    seen: set = set()
    params = list(model.parameters())
    masters = wrapper._master_params()
    out = dict(params=_bytes(params, seen), grads=_bytes([p.grad for p in params], seen),
               masters=_bytes([m for m, _ in masters.half_pairs()], seen))
    state = [v for st in wrapper.optimizer.state.values() for v in st.values()
             if torch.is_tensor(v)]
    out['optimizer'] = _bytes(state, seen)
    out['stash'] = _bytes(list(wrapper._stash._buffers.values()), seen)
    return out


def _worker(rank: int, world: int, port: int, layout: str, width: int, layers: int,
            out_dir: str) -> None:
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group('gloo', rank=rank, world_size=world)
    try:
        from mp_wrappers import ApexOptimWrapper, FusedAdam, MixedPrecisionDistributedDataParallel
        model = _model(width, layers)
        total = sum(p.numel() for p in model.parameters())
        if layout == 'ddp':
            net = MixedPrecisionDistributedDataParallel(model, dtype='bfloat16')
        elif layout == 'fsdp1':
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import MixedPrecision
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            net = model = FSDP(model, device_id=torch.device('cpu'), use_orig_params=True,
                               auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                               mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                              reduce_dtype=torch.float32))
        elif layout == 'fsdp2':
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model:
                fully_shard(layer, mp_policy=policy)
            net = fully_shard(model, mp_policy=policy)
        elif layout.startswith('fsdp2_'):
            # lean master modes: a bf16 model sharded as it is (no FSDP cast), no fp32 masters
            from torch.distributed.fsdp import fully_shard

            from mp_wrappers import cast_model
            cast_model(model, torch.bfloat16)
            for layer in model:
                fully_shard(layer)
            net = fully_shard(model)
        else:
            net = model
        lean = layout.split('_', 1)[1] if layout.startswith('fsdp2_') else None
        wrapper = ApexOptimWrapper(FusedAdam(model.parameters(), lr=1e-3), opt_level='O2',
                                   dtype='bfloat16', verbosity=0,
                                   **({'master_weights': lean} if lean else {}))
        g = torch.Generator().manual_seed(rank)
        result: Dict[str, int] = {}
        for step in range(2):
            x = torch.randn(16, width, generator=g)
            with wrapper.optim_context(net):
                loss = F.mse_loss(net(x).float(), torch.zeros(16, width))
            wrapper.backward(loss)
            if step == 1:
                result = _measure(model, wrapper)
            wrapper.step()
            wrapper.zero_grad()
        result['total_params'] = total
        result['largest_layer'] = max(sum(p.numel() for p in m.parameters(recurse=False))
                                      for m in _model(width, layers).modules())
        torch.save(result, os.path.join(out_dir, f'{layout}_{world}_{rank}.pt'))
    finally:
        dist.destroy_process_group()


def _run(layout: str, world: int, width: int, layers: int, out_dir: str) -> List[dict]:
    mp.spawn(_worker, args=(world, _free_port(), layout, width, layers, out_dir), nprocs=world,
             join=True)
    return [torch.load(os.path.join(out_dir, f'{layout}_{world}_{r}.pt'), weights_only=True)
            for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--ranks', type=int, nargs='+', default=[1, 2, 4])
    parser.add_argument('--width', type=int, default=512)
    parser.add_argument('--layers', type=int, default=8)
    parser.add_argument('--lean', nargs='*', default=['split', 'kahan', 'stochastic'],
                        help="lean master modes measured under FSDP2 (master_weights=...)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(('one process', 1, _run('single', 1, args.width, args.layers, tmp)))
        for n in args.ranks:
            if n > 1:
                rows.append(('DDP', n, _run('ddp', n, args.width, args.layers, tmp)))
        for layout in ('fsdp1', 'fsdp2'):
            for n in args.ranks:
                rows.append((layout.upper(), n, _run(layout, n, args.width, args.layers, tmp)))
        for mode in args.lean:
            for n in args.ranks:
                rows.append((f'FSDP2 {mode}', n, _run(f'fsdp2_{mode}', n, args.width, args.layers,
                                                      tmp)))
    total = rows[0][2][0]['total_params']
    largest = rows[0][2][0]['largest_layer']
    print(f'O2 bf16 + FusedAdam, {args.layers} x Linear({args.width}): {total} params; '
          f'largest layer {largest} ({largest / total:.3f} of the model)')
    print('| layout | ranks | ' + ' | '.join(CATEGORIES) + ' | total B/param (max over ranks) '
          '| target (16/N + 2; lean: (12 + extra)/N) |')
    print('|---|---|' + '---|' * len(CATEGORIES) + '---|---|')
    for name, n, results in rows:
        worst = max(results, key=lambda r: sum(r[c] for c in CATEGORIES))
        cells = ' | '.join(f'{worst[c] / total:.2f}' for c in CATEGORIES)
        per_param = sum(worst[c] for c in CATEGORIES) / total
        lean = {'split': 14, 'kahan': 14, 'stochastic': 12}.get(name.split()[-1])
        ref = (lean / n if lean else 16 / n + 2) if name.startswith('FSDP') else 16
        print(f'| {name} | {n} | {cells} | {per_param:.2f} | {ref:.2f} |')


if __name__ == '__main__':
    main()
