"""8-bit optimizer states on the CPU: step time against peers, resident bytes and bandwidth (not a
test).

25M parameters in ~200 tensors (``bench_optimizers.shapes``), 1 and 2 threads. Pipelines:

* peers: ``torch AdamW fused, fp32 states`` (``torch.optim.AdamW(fused=True)``), and, when they are
  importable, bitsandbytes ``AdamW8bit`` and torchao ``AdamW8bit`` (block 256 both). Install them
  in a venv of their own, never system-wide (mmengine imports bitsandbytes when it finds it, which
  changes what the tests see): ``python -m venv --system-site-packages /tmp/peers &&
  /tmp/peers/bin/pip install --no-deps bitsandbytes torchao`` (no deps: torch stays the system's),
  then run this script with ``/tmp/peers/bin/python``;
* ``FusedAdam fp32 states`` and ``FusedAdam int8 states``: ``step()`` on fp32 params;
* ``O2 bf16, fp32 states`` / ``O2 bf16, int8 states``: ``FusedAdam.fused_master_step`` with bf16
  grads scaled by a loss scale and a bf16 model copy (the ApexOptimWrapper O2 update, its
  overflow-check pass left out: it is the same for both);
* ``<mode> bf16, fp32 / int8 states`` for mode ``split``, ``kahan``, ``stochastic``: ``step()`` on
  bf16 params with bf16 grads and ``bf16_storage=mode`` (what ApexOptimWrapper O2 bf16 with
  ``master_weights=mode`` runs; bf16 needs no loss scale), the lean masters without an fp32 copy;
* on CUDA only, ``..., CUDA graph``: torch's fused AdamW and ``FusedAdam`` (fp32 and int8 states),
  ``capturable=True``, one ``step()`` captured as a CUDA graph and replayed: a step without its
  host work, as ``compile_step`` with ``mode='reduce-overhead'`` runs it. Their ``x best peer`` is
  against torch's graphed step (the other rows' against torch's eager one).

Timing: interleaved rounds, one step of every pipeline per round, so that load from other processes
(this machine is shared) hits all alike; the 8-bit peers, 20-50x slower, take part in the first
``--peer-iters`` rounds only. Each step is timed by the wall clock and by the CPU time of the
process (``time.process_time``: the time the step's threads actually ran, which load from other
processes barely changes; with 2 threads it is the sum over both). Reported: medians, and ratios of
medians against the best peer of the same run (``x best peer``: the fastest peer, torch's fused
fp32 AdamW here; ``8-bit peer / this``: how many times faster than the faster 8-bit peer).

Bytes per parameter counted for the bandwidth column (the state tensors of params under 4096
elements stay fp32, ~0.3% of the parameters here, ignored): fp32 Adam 28 (read p, g, m, v; write p,
m, v); int8 16 + 4 * 4/256 (p and g 4 each read, p 4 written, 1 B per moment read and written, an
absmax per 256 elements per moment); O2 fp32 states 30, O2 int8 states 16 + 16/256 (g 2, model 2);
lean masters with int8 states: p 2 read and written, g 2, 'split'/'kahan' aux 2 read and written,
moments as above: 14 + 16/256 ('stochastic' 10 + 16/256), with fp32 states 24 (20).
The roofline is the in-place read-modify-write bandwidth of ``a.mul_`` over a DRAM-sized buffer,
sampled in the same rounds. Resident bytes per parameter after a step count params, model copies,
grads and every optimizer-state tensor (a tensor subclass by its inner tensors).

``--ceiling`` (CPU) adds what the arithmetic alone allows. Each pipeline also steps two models
small enough to stay in the last-level cache: 8 tensors of 16K and of 64K elements, 128K and 512K
params, at most 8.4 MB at 16 resident B/param. Rounds interleave the pipelines; a sample is one
untimed step (it brings the model back into the cache) and 20 timed ones. The median difference
of the two step times over the difference of their sizes is the pipeline's cost per param with
its data in cache, without the per-step and per-tensor host work (the same for both models).
(The in-cache models run a few hundred steps, the large one ~20-30 per thread count: the 8-bit
kernels' rare paths for subnormal codes could differ between them; the bound assumes that a line
served from the cache is never slower than one streamed from DRAM.)
``compute ceiling`` is the share of the roofline a step would reach if its DRAM traffic cost
nothing beyond that: (bytes per param / roofline) / (in-cache time per param). Below 90%,
90% of the roofline is out of reach on this core for that arithmetic, however the memory
traffic is scheduled.

Run: ``PYTHONPATH=. python benchmarks/bench_quantized_states.py [--threads 1 2] [--iters 15]``, and
with ``MP_WRAPPERS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2`` for the AVX2 kernels (ours and torch's).
``--device cuda --threads 1`` times the same pipelines on a GPU (``tools/gpu_check.sh`` step
``bench-quantized``, which gives ``--peer-iters`` the value of ``--iters``: on CUDA the peers are
not slow); ``--width/--layers`` size the model as in ``bench_optimizers.py``. Output is Markdown.
"""
import argparse
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import bench_optimizers as bo  # noqa: E402
import mp_wrappers  # noqa: E402
from mp_wrappers.optim import FusedAdam  # noqa: E402

BYTES = {'fp32': 28, 'int8': 16 + 16 / 256, 'o2-fp32': 30, 'o2-int8': 16 + 16 / 256,
         'lean-fp32': 24, 'lean-int8': 14 + 16 / 256, 'sr-fp32': 20, 'sr-int8': 10 + 16 / 256}
LEAN_MODES = ('split', 'kahan', 'stochastic')
TORCH = 'torch AdamW fused, fp32 states'
PEERS_8BIT = ('bitsandbytes AdamW8bit', 'torchao AdamW8bit')


def _nbytes(t: Tensor) -> int:
    if hasattr(t, '__tensor_flatten__') and type(t) is not torch.Tensor:  # torchao's subclasses
        return sum(_nbytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def _resident(tensors: List[Tensor], opt: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for t in tensors + [v for st in opt.state.values() for v in st.values()
                        if isinstance(v, Tensor)]:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += _nbytes(t)
    return total


def _peer_8bit(name: str) -> Optional[Callable]:
    """The optimizer class of an 8-bit peer, or None when it is not installed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            if name.startswith('bitsandbytes'):
                import bitsandbytes
                return lambda ps, **kw: bitsandbytes.optim.AdamW8bit(ps, min_8bit_size=4096, **kw)
            from torchao.optim import AdamW8bit
            return lambda ps, **kw: AdamW8bit(ps, block_size=256, **kw)
    except Exception:  # noqa: BLE001 - any import failure means: not a peer in this run
        return None


def fp32_step(sizes, state_dtype: str, device: torch.device):
    params, grads = bo.make_fp32(sizes, device)
    for p, g in zip(params, grads):
        p.grad = g
    kw = dict(lr=bo.LR, betas=bo.BETAS, eps=bo.EPS, weight_decay=bo.WD)
    if state_dtype == 'torch':
        opt = torch.optim.AdamW(params, fused=True, **kw)
    elif state_dtype in PEERS_8BIT:
        opt = _peer_8bit(state_dtype)(params, **kw)
    else:
        opt = FusedAdam(params, state_dtype=state_dtype, **kw)
    return opt.step, (lambda: _resident(params + grads, opt))


def o2_step(sizes, state_dtype: str, device: torch.device):
    st = bo.O2State(sizes, device, torch.bfloat16)
    opt = FusedAdam(st.masters, lr=bo.LR, betas=bo.BETAS, eps=bo.EPS, weight_decay=bo.WD,
                    state_dtype=state_dtype)
    grads, model = [st.grads], [st.model]
    found_inf = torch.zeros(1, device=device)

    def step() -> None:
        opt.fused_master_step(grads, model, grad_scale=st.scale, found_inf=found_inf)

    return step, (lambda: _resident(st.masters + st.model + st.grads, opt))


def lean_step(sizes, spec: Tuple[str, str], device: torch.device):
    mode, state_dtype = spec
    params32, grads32 = bo.make_fp32(sizes, device)
    params = [torch.nn.Parameter(p.detach().bfloat16()) for p in params32]
    grads = [g.bfloat16() for g in grads32]
    for p, g in zip(params, grads):
        p.grad = g
    opt = FusedAdam(params, lr=bo.LR, betas=bo.BETAS, eps=bo.EPS, weight_decay=bo.WD,
                    state_dtype=state_dtype, bf16_storage=mode)
    return opt.step, (lambda: _resident(params + grads, opt))


def graphed_step(sizes, state_dtype: str, device: torch.device):
    """One ``step()`` with ``capturable=True``, captured as a CUDA graph; returns its replay. Two
    eager steps first, on a side stream as torch's CUDA-graph recipe warms up: they make the state
    and the tensor lr outside the graph, which then updates them in place at fixed addresses."""
    params, grads = bo.make_fp32(sizes, device)
    for p, g in zip(params, grads):
        p.grad = g
    kw = dict(lr=bo.LR, betas=bo.BETAS, eps=bo.EPS, weight_decay=bo.WD, capturable=True)
    if state_dtype == 'torch':
        opt = torch.optim.AdamW(params, fused=True, **kw)
    else:
        opt = FusedAdam(params, state_dtype=state_dtype, **kw)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            opt.step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph.replay, (lambda: _resident(params + grads, opt))


TORCH_GRAPH = 'torch AdamW fused, fp32 states, CUDA graph'
GRAPHED = (TORCH_GRAPH, 'FusedAdam fp32 states, CUDA graph', 'FusedAdam int8 states, CUDA graph')

PIPELINES: Dict[str, Tuple[Callable, object, str]] = {
    TORCH: (fp32_step, 'torch', 'fp32'),
    PEERS_8BIT[0]: (fp32_step, PEERS_8BIT[0], 'int8'),
    PEERS_8BIT[1]: (fp32_step, PEERS_8BIT[1], 'int8'),
    'FusedAdam fp32 states': (fp32_step, 'float32', 'fp32'),
    'FusedAdam int8 states': (fp32_step, 'int8', 'int8'),
    'O2 bf16, fp32 states': (o2_step, 'float32', 'o2-fp32'),
    'O2 bf16, int8 states': (o2_step, 'int8', 'o2-int8'),
    **{f'{mode} bf16, {sd} states': (lean_step, (mode, sd),
                                     ('sr-' if mode == 'stochastic' else 'lean-') +
                                     ('int8' if sd == 'int8' else 'fp32'))
       for mode in LEAN_MODES for sd in ('float32', 'int8')},
    TORCH_GRAPH: (graphed_step, 'torch', 'fp32'),
    GRAPHED[1]: (graphed_step, 'float32', 'fp32'),
    GRAPHED[2]: (graphed_step, 'int8', 'int8'),
}


def time_rounds(fns: Dict[str, Callable[[], None]], iters: int, peer_iters: int,
                device: torch.device) -> Dict[str, Tuple[float, float]]:
    """name -> (median wall seconds, median CPU seconds) per step, from interleaved rounds; the
    8-bit peers run in the first ``peer_iters`` rounds only. On CUDA the wall time runs until the
    device has finished the step (a synchronize); the CPU time then includes the host spinning in
    that synchronize, so it is about the wall time, not the host's share."""
    for fn in fns.values():
        fn()  # warm-up
    bo.sync(device)
    wall: Dict[str, List[float]] = {name: [] for name in fns}
    cpu: Dict[str, List[float]] = {name: [] for name in fns}
    for r in range(iters):
        for name, fn in fns.items():
            if name in PEERS_8BIT and r >= peer_iters:
                continue
            w, c = time.perf_counter(), time.process_time()
            fn()
            bo.sync(device)
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in fns}


CEILING_TENSORS = 8
CEILING_SIZES = (16 * 1024, 64 * 1024)  # elements per tensor: 128K and 512K params, in cache
CEILING_STEPS = 20  # steps per timed sample: one step of the small model takes ~0.1 ms


def build_in_cache(names: List[str], device: torch.device) -> Dict[str, Tuple[Callable, Callable]]:
    """name -> (one step of the small model, one step of the large one), for ``--ceiling``. The
    8-bit peers, 20-50x slower, are left out: their ceiling is not the question."""
    out = {}
    for name in names:
        if name in PEERS_8BIT:
            continue
        steps = []
        for n in CEILING_SIZES:
            step, _ = PIPELINES[name][0]([(n,)] * CEILING_TENSORS, PIPELINES[name][1], device)
            step()  # creates the state
            steps.append(step)
        out[name] = (steps[0], steps[1])
    return out


def time_in_cache(step: Callable[[], None]) -> float:
    """Seconds per step over CEILING_STEPS steps, after one untimed step: the other models of a
    round have evicted this one from the cache, and the untimed step brings it back."""
    step()
    start = time.perf_counter()
    for _ in range(CEILING_STEPS):
        step()
    return (time.perf_counter() - start) / CEILING_STEPS


def ceiling_table(in_cache, threads: int, args, roof: float) -> None:
    """In-cache seconds per param of each pipeline and the roofline share that allows."""
    torch.set_num_threads(threads)
    samples: Dict[str, List[float]] = {name: [] for name in in_cache}
    for _ in range(args.iters):  # interleaved rounds, as time_rounds
        for name, (small, large) in in_cache.items():
            samples[name].append(time_in_cache(large) - time_in_cache(small))
    extra = CEILING_TENSORS * (CEILING_SIZES[1] - CEILING_SIZES[0])
    print(f'\n### {threads} thread(s): the arithmetic in cache (roofline {roof:.1f} GB/s from the '
          f'table above)\n')
    print('| pipeline | in-cache ns/param | DRAM-bound ns/param at the roofline | compute ceiling '
          '(of roofline) |')
    print('|---|---|---|---|')
    for name in in_cache:
        per_param = statistics.median(samples[name]) / extra
        dram = BYTES[PIPELINES[name][2]] / (roof * 1e9)
        ceiling = f'{dram / per_param:.0%}' if per_param > 0 else 'n/a (noise: no difference)'
        print(f'| {name} | {per_param * 1e9:.3f} | {dram * 1e9:.3f} | {ceiling} |')


def _load() -> str:
    return ', '.join(f'{x:.1f}' for x in os.getloadavg())


def _times(ratio: float) -> str:
    return f'{ratio:.0f}x' if ratio >= 10 else f'{ratio:.2f}x'


def table(built, sample, threads: int, args, numel: int) -> float:
    """Prints the table of one thread count; returns the roofline measured in its rounds, GB/s."""
    torch.set_num_threads(threads)
    fns = {name: step for name, (step, _) in built.items()}
    fns['a.mul_ (roofline)'] = sample.step
    load_before = _load()
    times = time_rounds(fns, args.iters, args.peer_iters, args.device)
    roof = sample.gbs(times.pop('a.mul_ (roofline)')[0])
    peers = [n for n in times if n == TORCH or n in PEERS_8BIT]  # the graphed rows: TORCH_GRAPH
    best = min(peers, key=lambda n: times[n][0])
    best8 = min((n for n in peers if n in PEERS_8BIT), key=lambda n: times[n][0], default=None)
    where = (f'{torch.cuda.get_device_name(args.device)} ({threads} host thread(s))'
             if args.device.type == 'cuda' else f'{threads} thread(s)')
    print(f'\n## {where}; load average {load_before} before, {_load()} after; '
          f'in-place roofline {roof:.1f} GB/s\n')
    print(f'Best peer: {best}' + (f'; best 8-bit peer: {best8}' if best8 else
                                  '; 8-bit peers: not installed') + '\n')
    print('| pipeline | median ms | CPU ms | x best peer | x best peer (CPU) | 8-bit peer / this'
          ' (wall / CPU) | B/param moved | GB/s | of roofline | resident B/param |')
    print('|---|---|---|---|---|---|---|---|---|---|')
    for name, (wall, cpu) in times.items():
        moved = BYTES[PIPELINES[name][2]]
        gbs = moved * numel / wall / 1e9
        faster = (f'{_times(times[best8][0] / wall)} / {_times(times[best8][1] / cpu)}'
                  if best8 and name not in PEERS_8BIT else '')
        base = TORCH_GRAPH if name in GRAPHED and TORCH_GRAPH in times else best
        print(f'| {name} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {wall / times[base][0]:.2f} | '
              f'{cpu / times[base][1]:.2f} | {faster} | {moved:.2f} | {gbs:.1f} | '
              f'{gbs / roof:.0%} | {built[name][1]() / numel:.2f} |')
    return roof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--threads', type=int, nargs='+', default=[1, 2])
    ap.add_argument('--iters', type=int, default=15)
    ap.add_argument('--peer-iters', type=int, default=3,
                    help='rounds the (slow) 8-bit peers take part in')
    ap.add_argument('--no-peers', action='store_true', help='leave bitsandbytes and torchao out')
    ap.add_argument('--quick', action='store_true', help='~0.8M params (smoke test)')
    ap.add_argument('--only', nargs='+', default=None,
                    help='substrings of the pipelines to run (torch fused fp32 always runs)')
    ap.add_argument('--device', default='cpu', help="'cpu' (default) or 'cuda'")
    ap.add_argument('--width', type=int, default=0, help='model width d (default: preset)')
    ap.add_argument('--layers', type=int, default=0, help='layers (default: preset)')
    ap.add_argument('--ceiling', action='store_true',
                    help='(CPU) also time each pipeline in cache: the roofline share its '
                         'arithmetic allows')
    args = ap.parse_args()
    args.device = torch.device(args.device)
    if args.device.type == 'cuda' and not torch.cuda.is_available():
        ap.error(f'--device {args.device}: this torch sees no CUDA device')
    if args.ceiling and args.device.type != 'cpu':
        ap.error(f'--ceiling measures CPU caches; --device {args.device} is not the CPU')
    sizes = bo.shapes(args.quick, args.width, args.layers)
    numel = sum(torch.Size(s).numel() for s in sizes)
    nbytes, why = bo.sample_bytes(numel)
    names = [n for n in PIPELINES
             if (n not in PEERS_8BIT or (not args.no_peers and _peer_8bit(n) is not None))
             and (n not in GRAPHED or args.device.type == 'cuda')
             and (n == TORCH or not args.only or any(o in n for o in args.only))]
    versions = {'bitsandbytes': None, 'torchao': None}
    for mod in versions:
        if any(n.startswith(mod) for n in names):
            versions[mod] = __import__(mod).__version__
    print(f'# 8-bit optimizer states, {numel / 1e6:.1f}M params in {len(sizes)} tensors')
    kernels = mp_wrappers.ops.backend()[args.device.type]
    print(f'- {platform.processor() or platform.machine()}, torch {torch.__version__} '
          f'(ATen CPU capability {torch.backends.cpu.get_cpu_capability()}), device '
          f'{args.device}, mp_wrappers kernels {kernels}; peers: '
          + ', '.join(f'{m} {v}' for m, v in versions.items() if v) + (
              '' if any(versions.values()) else 'torch only'))
    print(f'- {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, {os.cpu_count()} CPUs, '
          f'bandwidth sample {nbytes / 1e6:.0f} MB ({why}); {args.iters} rounds '
          f'({args.peer_iters} with the 8-bit peers)')
    built = {}
    for name in names:
        try:
            built[name] = PIPELINES[name][0](sizes, PIPELINES[name][1], args.device)
        except Exception as e:  # noqa: BLE001 - a capture that fails is a finding, not the run's end
            if name not in GRAPHED:
                raise
            print(f'- {name}: not measured, the capture failed: {type(e).__name__}: {e}')
    for step, _ in built.values():
        step()  # first step: creates the state, so resident bytes are measured after one
    sample = bo.InPlaceSample(args.device, nbytes)
    in_cache = build_in_cache(list(built), args.device) if args.ceiling else {}
    for threads in args.threads:
        roof = table(built, sample, threads, args, numel)
        if in_cache:
            ceiling_table(in_cache, threads, args, roof)


if __name__ == '__main__':
    main()
