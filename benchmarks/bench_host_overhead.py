"""Host overhead of a fused optimizer step: the Python around the kernels, on many tiny tensors.

With many tensors of a few elements each the kernels' time is negligible, and a step's time is its
host work per param: gathering the params into op calls, the checks, the calls themselves. On a GPU
this host time is what a step costs whenever it exceeds the kernels' time (an H100 run of 108M
params in 222 tensors measured fp32 FusedAdam at 2.96 ms per step against torch fused AdamW's
1.84 ms, with a 1.02 ms roofline: host bound), and it does not shrink with the model's size.

Peers, in this one process, over the same tensors, stepped in turn each round so that load from
other processes hits all alike:

* ``FusedAdam`` against ``torch.optim.AdamW(fused=True)`` and ``(foreach=True)``;
* ``FusedSGD(momentum=0.9)`` against ``torch.optim.SGD(momentum=0.9, fused=True)`` and
  ``(foreach=True)``;
* ``FusedLAMB``, which torch lacks, against the AdamW peers (it also takes a global grad norm).

A peer the installed torch cannot build or step on the device is reported as such. Each round times
``step()`` alone: grads stay in place (``--fresh-grads`` gives every param a new grad tensor before
each step, as ``zero_grad(set_to_none=True)`` and a backward do, outside the timing). On a GPU the
time runs to the return of ``step()`` (the kernels run asynchronously); each round synchronizes
outside the timing. Prints Markdown: the fastest and median step, the host time per param of the
fastest, and the ratio of the fastest to the best torch peer of the same update in this run.

Run: ``python benchmarks/bench_host_overhead.py [--tensors 222] [--numel 16] [--threads 1]
[--rounds 300] [--device cpu|cuda] [--fresh-grads]``.
"""
import argparse
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

# Run from a checkout without installing: the package sits next to this folder.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import mp_wrappers  # noqa: E402
from mp_wrappers.optim import FusedAdam, FusedLAMB, FusedSGD  # noqa: E402

Make = Callable[[List[Tensor]], torch.optim.Optimizer]
ADAMW = dict(lr=1e-3, weight_decay=0.01)
SGD = dict(lr=1e-2, momentum=0.9)

#: (name, family, ours, build): a family's torch peers are the rows ours are compared with.
PIPELINES: Sequence[Tuple[str, str, bool, Make]] = (
    ('FusedAdam', 'adamw', True, lambda ps: FusedAdam(ps, **ADAMW)),
    ('torch AdamW fused', 'adamw', False, lambda ps: torch.optim.AdamW(ps, fused=True, **ADAMW)),
    ('torch AdamW foreach', 'adamw', False,
     lambda ps: torch.optim.AdamW(ps, foreach=True, **ADAMW)),
    ('FusedSGD', 'sgd', True, lambda ps: FusedSGD(ps, **SGD)),
    ('torch SGD fused', 'sgd', False, lambda ps: torch.optim.SGD(ps, fused=True, **SGD)),
    ('torch SGD foreach', 'sgd', False, lambda ps: torch.optim.SGD(ps, foreach=True, **SGD)),
    ('FusedLAMB', 'adamw', True, lambda ps: FusedLAMB(ps, lr=1e-3, weight_decay=0.01)),
)


def make_params(n: int, numel: int, device: torch.device) -> List[Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen).to(device)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(numel, generator=gen).to(device)
    return params


def build(make: Make, params: List[Tensor], warmup: int,
          device: torch.device) -> Tuple[Optional[torch.optim.Optimizer], str]:
    """The optimizer after ``warmup`` steps, or None and why the installed torch cannot run it."""
    try:
        opt = make(params)
        for _ in range(warmup):
            opt.step()
        if device.type == 'cuda':
            torch.cuda.synchronize(device)
        return opt, ''
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        return None, f'{type(err).__name__}: {str(err).splitlines()[0][:90]}'


def time_rounds(opts: Dict[str, Tuple[torch.optim.Optimizer, List[Tensor]]], rounds: int,
                fresh_grads: bool, device: torch.device) -> Dict[str, List[float]]:
    """Seconds of each optimizer's ``step()`` in each round, the optimizers in turn per round."""
    times: Dict[str, List[float]] = {name: [] for name in opts}
    for _ in range(rounds):
        for name, (opt, params) in opts.items():
            if fresh_grads:
                for p in params:
                    p.grad = torch.empty_like(p).copy_(p.grad)
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
            if device.type == 'cuda':
                torch.cuda.synchronize(device)
    return times


def machine(device: torch.device, threads: int) -> str:
    if device.type == 'cuda':
        return f'{torch.cuda.get_device_name(device)}; host {platform.processor() or "?"}'
    from mp_wrappers import hardware
    cap = hardware.device_capability('cpu')
    ext = hardware.extension_info()
    return (f'CPU {cap.name}: {cap.isa}; our kernels {ext.get("cpu_kernels")}; torch dispatches '
            f'to {torch.backends.cpu.get_cpu_capability()}; {threads} thread(s)')


def report(times: Dict[str, List[float]], failed: Dict[str, str], n: int) -> None:
    fastest = {name: min(ts) for name, ts in times.items()}
    best_peer: Dict[str, Tuple[str, float]] = {}
    for name, family, ours, _ in PIPELINES:
        if not ours and name in fastest and (family not in best_peer
                                             or fastest[name] < best_peer[family][1]):
            best_peer[family] = (name, fastest[name])
    print('| optimizer | fastest ms | median ms | us/param (fastest) | vs best torch peer |')
    print('|---|---|---|---|---|')
    for name, family, ours, _ in PIPELINES:
        if name in failed:
            print(f'| {name} | n/a | n/a | n/a | {failed[name]} |')
            continue
        ratio = ''
        if ours and family in best_peer:
            peer, t = best_peer[family]
            ratio = f'{fastest[name] / t:.2f}x ({peer})'
        print(f'| {name} | {fastest[name] * 1e3:.3f} | {statistics.median(times[name]) * 1e3:.3f}'
              f' | {fastest[name] / n * 1e6:.2f} | {ratio} |')


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, List[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--tensors', type=int, default=222, help='number of params')
    parser.add_argument('--numel', type=int, default=16, help='elements per param')
    parser.add_argument('--threads', type=int, default=1, help='torch intra-op threads')
    parser.add_argument('--rounds', type=int, default=300, help='timed rounds')
    parser.add_argument('--warmup', type=int, default=5, help='untimed steps of each optimizer')
    parser.add_argument('--device', default='cpu', help='cpu or cuda')
    parser.add_argument('--fresh-grads', action='store_true',
                        help='a new grad tensor per param before every step (outside the timing)')
    args = parser.parse_args(argv)
    for name in ('tensors', 'numel', 'threads', 'rounds'):
        if getattr(args, name) < 1:
            parser.error(f'--{name.replace("_", "-")} must be >= 1, got {getattr(args, name)}')
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    load_before = os.getloadavg()
    opts, failed = {}, {}
    for name, _, _, make in PIPELINES:
        params = make_params(args.tensors, args.numel, device)
        opt, why = build(make, params, args.warmup, device)
        if opt is None:
            failed[name] = why
        else:
            opts[name] = (opt, params)
    times = time_rounds(opts, args.rounds, args.fresh_grads, device)
    load_after = os.getloadavg()
    print('# Host overhead of an optimizer step\n')
    print(f'- torch {torch.__version__}, mp_wrappers {mp_wrappers.__version__}, backend '
          f'{mp_wrappers.ops.backend()}, device {device}')
    print(f'- {machine(device, args.threads)}')
    print(f'- {args.tensors} fp32 params of {args.numel} elements; {args.rounds} timed rounds, '
          f'optimizers interleaved{"; fresh grads every step" if args.fresh_grads else ""}')
    print('- load average ' + ', '.join(f'{x:.1f}' for x in load_before) + ' before, '
          + ', '.join(f'{x:.1f}' for x in load_after) + ' after\n')
    report(times, failed, args.tensors)
    return times


if __name__ == '__main__':
    main()
