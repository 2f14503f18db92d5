"""Optimizer-step time of each master mode against the fused O2 step, measured in one process.

The O2 step is ``multi_tensor_adam`` / ``multi_tensor_sgd`` on fp32 masters with bf16 grads and a bf16
model copy (what ``ApexOptimWrapper(opt_level='O2', dtype='bfloat16')`` runs with FusedAdam/FusedSGD);
the lean modes are ``multi_tensor_adam_lean`` / ``multi_tensor_sgd_lean`` on the bf16 model itself.
Runs are interleaved (O2, split, kahan, ... , O2, split, ...) and the median of each is reported, so
a shared machine's load hits every mode alike; ratios are time / O2 time from the same run.

    python benchmarks/bench_master_modes.py [--numel 4000000] [--tensors 40] [--repeats 15]
"""
import argparse
import statistics
import time

import torch

from mp_wrappers.ops import (backend, multi_tensor_adam, multi_tensor_adam_lean, multi_tensor_sgd,
                             multi_tensor_sgd_lean)


def _lists(numel, tensors, dtype=torch.float32):
    n = numel // tensors
    return [torch.randn(n).to(dtype) for _ in range(tensors)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--numel', type=int, default=4_000_000)
    parser.add_argument('--tensors', type=int, default=40)
    parser.add_argument('--repeats', type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    grads = _lists(args.numel, args.tensors, torch.bfloat16)
    adam_hp = (1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)
    sgd_hp = (0.01, 0.9, 0.0, 1e-4, False, False)

    def o2(opt):
        masters, model = _lists(args.numel, args.tensors), _lists(args.numel, args.tensors,
                                                                    torch.bfloat16)
        m, step = _lists(args.numel, args.tensors), torch.zeros(1)
        v = [x.abs() for x in _lists(args.numel, args.tensors)]
        if opt == 'adam':
            return lambda: multi_tensor_adam(masters, grads, m, v, model, step, *adam_hp)
        return lambda: multi_tensor_sgd(masters, grads, m, model, step, *sgd_hp)

    def lean(opt, storage, state_dtype):
        params = _lists(args.numel, args.tensors, torch.bfloat16)
        aux = {'split': [torch.zeros_like(p, dtype=torch.uint16) for p in params],
               'kahan': [torch.zeros_like(p) for p in params], 'stochastic': []}[storage]
        m = _lists(args.numel, args.tensors, state_dtype)
        v = [x.abs() for x in _lists(args.numel, args.tensors, state_dtype)]
        step = torch.zeros(1)
        if opt == 'adam':
            return lambda: multi_tensor_adam_lean(params, aux, grads, m, v, step, *adam_hp,
                                                  storage=storage)
        return lambda: multi_tensor_sgd_lean(params, aux, grads, m, step, *sgd_hp,
                                             storage=storage)

    print(f'backend {backend()}, {args.numel} params in {args.tensors} tensors, '
          f'{torch.get_num_threads()} threads, median of {args.repeats} interleaved runs')
    for opt in ('adam', 'sgd'):
        cases = {'O2 (fp32 master)': o2(opt)}
        for storage in ('split', 'kahan', 'stochastic'):
            cases[storage] = lean(opt, storage, torch.float32)
            cases[f'{storage}, bf16 state'] = lean(opt, storage, torch.bfloat16)
        times = {k: [] for k in cases}
        for fn in cases.values():
            fn()  # warm-up: page in every buffer
        for _ in range(args.repeats):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times['O2 (fp32 master)'])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f'{opt:5s} {name:24s} {1e3 * med:8.2f} ms   {med / base:5.2f}x O2')


if __name__ == '__main__':
    main()
