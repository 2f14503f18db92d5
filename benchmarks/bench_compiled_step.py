"""Compiled optimizer steps: mp_wrappers' FusedAdam eager and under torch.compile, against torch's AdamW.

An fp32 AdamW step (weight decay 0.01) over ``--tensors`` params of equal size, at a few total sizes
(``--sizes``, in parameters). Pipelines:

* ``FusedAdam eager``: ``opt.step()``, one fused op per bucket.
* ``FusedAdam compiled``: ``torch.compile(opt.step, fullgraph=True)`` (inductor): the same op, called
  from the compiled graph (Note [dispatch decided at registration] in mp_wrappers/ops/_registration.py).
* ``AdamW foreach`` / ``AdamW fused``: torch's eager multi-tensor and fused implementations.
* ``AdamW compiled``: ``torch.compile(opt.step)`` of torch's default AdamW, inductor's generated
  kernel (what torch's docs recommend for compiled optimizers; not ``fullgraph``: torch breaks the
  graph on purpose around an optimizer's step).
* With ``--device cuda`` also ``FusedAdam CUDA graphs``: ``torch.compile(opt.step, fullgraph=True,
  mode='reduce-overhead')`` of a ``capturable=True`` FusedAdam (the lr on the device), replayed as a
  CUDA graph; the line after the table says whether inductor skipped the CUDA graphs, and why.
  Every step is followed by ``torch.cuda.synchronize()`` before the clock is read.

Every pipeline starts from the same params and grads; after its first step its params are compared
with ``AdamW foreach``'s (max abs difference printed). Then each is timed: ``--iters`` rounds after warm-up, one step of each pipeline per round
(so load from other processes hits all alike). The table gives the fastest and the median step, and
the ratio of each pipeline's fastest time to the best peer's (the fastest torch pipeline of the same
size, measured in the same run): below 1 is faster than torch's best. Compile times are printed
too (the first two calls of a compiled step: the first creates the state, the second compiles again
with it; tracing and code generation). Output is Markdown.

Run: ``python benchmarks/bench_compiled_step.py [--sizes 65536 1048576 8388608] [--tensors 16]
[--threads 1] [--iters 30] [--device cpu|cuda]``.
"""
import argparse
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

# Run from a checkout without installing: the package sits next to this folder.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import mp_wrappers  # noqa: E402
from mp_wrappers.optim import FusedAdam  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
TORCH_PIPELINES = ('AdamW foreach', 'AdamW fused', 'AdamW compiled')


def make_params(total: int, tensors: int, device: str, seed: int = 0
                ) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, total // tensors)
    params = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(n, generator=g).to(device))
        p.grad = (torch.randn(n, generator=g) * 1e-2).to(device)
        params.append(p)
    return params


def synchronized(step: Callable[[], None], device: str) -> Callable[[], None]:
    if device != 'cuda':
        return step

    def step_and_wait():
        step()
        torch.cuda.synchronize()
    return step_and_wait


def build(total: int, tensors: int, device: str
          ) -> Dict[str, Tuple[Callable[[], None], list]]:
    """name -> (one step, its params); every pipeline starts from the same params and grads."""
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    pipelines = [
        ('FusedAdam eager', lambda ps: FusedAdam(ps, **kw), None),
        ('FusedAdam compiled', lambda ps: FusedAdam(ps, **kw), {}),
        ('AdamW foreach', lambda ps: torch.optim.AdamW(ps, **kw, foreach=True), None),
        ('AdamW fused', lambda ps: torch.optim.AdamW(ps, **kw, fused=True), None),
        ('AdamW compiled', lambda ps: torch.optim.AdamW(ps, **kw), {})]
    if device == 'cuda':
        pipelines.insert(2, ('FusedAdam CUDA graphs',
                             lambda ps: FusedAdam(ps, **kw, capturable=True),
                             dict(mode='reduce-overhead')))
    try:
        mp_wrappers.compat.require('compile_list_ops')
    except mp_wrappers.compat.FeatureUnavailableError as e:
        print(f'FusedAdam compiled pipelines left out: {e}\n')
        pipelines = [p for p in pipelines if not (p[0].startswith('FusedAdam') and p[2] is not None)]
    out = {}
    for name, make, compile_kw in pipelines:
        params = make_params(total, tensors, device)
        opt = make(params)
        step = opt.step
        if compile_kw is not None:
            # torch's optimizers break the graph on purpose around their step (so that AOT sees an
            # inference graph, torch/optim/optimizer.py _use_grad): fullgraph only for ours.
            step = torch.compile(step, fullgraph=isinstance(opt, FusedAdam), **compile_kw)
        out[name] = (synchronized(step, device), params)
    return out


def first_steps(pipes) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Take two steps of each pipeline: (seconds of those two steps, the compilation of a compiled
    one: the first creates the state, the second finds it; max abs difference of the params after
    the first step against AdamW foreach, all from the same state)."""
    seconds, diffs = {}, {}
    for name, (step, _) in pipes.items():
        start = time.perf_counter()
        step()
        seconds[name] = time.perf_counter() - start
    ref = pipes['AdamW foreach'][1]
    with torch.no_grad():
        for name, (_, params) in pipes.items():
            diffs[name] = max(float((p - q).abs().max()) for p, q in zip(params, ref))
    for name, (step, _) in pipes.items():
        start = time.perf_counter()
        step()
        seconds[name] += time.perf_counter() - start
    return seconds, diffs


def time_all(pipes, iters: int, warmup: int = 3) -> Dict[str, List[float]]:
    for step, _ in pipes.values():
        for _ in range(warmup):
            step()
    times: Dict[str, List[float]] = {name: [] for name in pipes}
    for _ in range(iters):
        for name, (step, _) in pipes.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--sizes', type=int, nargs='+', default=[65536, 1048576, 8388608])
    ap.add_argument('--tensors', type=int, default=16)
    ap.add_argument('--threads', type=int, default=1)
    ap.add_argument('--iters', type=int, default=30)
    ap.add_argument('--device', choices=['cpu', 'cuda'], default='cpu')
    args = ap.parse_args()
    if args.device == 'cuda' and not torch.cuda.is_available():
        ap.error('--device cuda: torch sees no CUDA device')
    torch.set_num_threads(args.threads)
    # Run with ATEN_CPU_CAPABILITY=avx2 for the AVX2 kernels: its graphs in a cache of their own
    # (Note [inductor's cache and ATEN_CPU_CAPABILITY] in mp_wrappers/compat.py).
    mp_wrappers.compat.isolate_inductor_cache()
    if args.device == 'cuda':
        torch._logging.set_logs(perf_hints=True)  # inductor says why it skips CUDA graphs
    where = (torch.cuda.get_device_name(0) if args.device == 'cuda'
             else platform.processor() or platform.machine())
    print(f'torch {torch.__version__}, mp_wrappers kernels '
          f'{mp_wrappers.ops.backend()[args.device]}, {where}, {args.threads} thread(s), '
          f'load average {os.getloadavg()[0]:.1f} (start)\n')
    print('| params | tensors | pipeline | compile s | min ms | median ms | ratio to best peer '
          '(min) | max abs diff |')
    print('|---|---|---|---|---|---|---|---|')
    for total in args.sizes:
        pipes = build(total, args.tensors, args.device)
        compile_seconds, diffs = first_steps(pipes)
        times = time_all(pipes, args.iters)
        best_peer = min(min(times[name]) for name in TORCH_PIPELINES)
        for name, ts in times.items():
            compiled = name.endswith('compiled')
            print(f'| {total} | {args.tensors} | {name} | '
                  f'{f"{compile_seconds[name]:.1f}" if compiled else "-"} | '
                  f'{min(ts) * 1e3:.3f} | {statistics.median(ts) * 1e3:.3f} | '
                  f'{min(ts) / best_peer:.2f} | {diffs[name]:.1e} |')
        torch._dynamo.reset()
    if args.device == 'cuda':
        from torch._dynamo.utils import counters
        skips = dict(counters['inductor'].items())
        print(f"\ninductor counters: {skips}; CUDA graphs skipped: "
              f"{skips.get('cudagraph_skips', 0)} time(s)")
    print(f'\nload average {os.getloadavg()[0]:.1f} (end)')


if __name__ == '__main__':
    main()
