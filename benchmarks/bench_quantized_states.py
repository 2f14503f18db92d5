"""8-bit optimizer states on the CPU: step time, resident bytes and bandwidth (not a test).

25M parameters in ~200 tensors (``bench_optimizers.shapes``), 1 and 2 threads. Pipelines, timed in
interleaved rounds (``bench_optimizers.time_interleaved``: load from other processes hits all alike;
compare ratios within one table, not across runs):

* ``torch AdamW fused, fp32 states``: ``torch.optim.AdamW(fused=True)``, the reference point;
* ``FusedAdam fp32 states`` and ``FusedAdam int8 states``: ``step()`` on fp32 params;
* ``O2 bf16, fp32 states`` / ``O2 bf16, int8 states``: ``FusedAdam.fused_master_step`` with bf16
  grads scaled by a loss scale and a bf16 model copy (the ApexOptimWrapper O2 update, its
  overflow-check pass left out: it is the same for both).

Bytes per parameter counted for the bandwidth column (the state tensors of params under 4096
elements stay fp32, ~0.3% of the parameters here, ignored): fp32 Adam 28 (read p, g, m, v; write p,
m, v); int8 16 + 4 * 4/256 (p and g 4 each read, p 4 written, 1 B per moment read and written, an
absmax per 256 elements per moment); O2 fp32 states 30, O2 int8 states 16 + 16/256 (g 2, model 2).
The roofline is the in-place read-modify-write bandwidth of ``a.mul_`` over a DRAM-sized buffer,
sampled in the same rounds. Resident bytes per parameter after a step count params, model copies,
grads and every optimizer-state tensor.

Run: ``PYTHONPATH=. python benchmarks/bench_quantized_states.py [--threads 1 2] [--iters 15]``, and
with ``MP_WRAPPERS_CPU_ISA=avx2`` for the AVX2 kernel. Output is Markdown.
"""
import argparse
import pathlib
import platform
import sys
from typing import Callable, Dict, List, Tuple

import torch
from torch import Tensor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import bench_optimizers as bo  # noqa: E402
import mp_wrappers  # noqa: E402
from mp_wrappers.optim import FusedAdam  # noqa: E402

BYTES = {'fp32': 28, 'int8': 16 + 16 / 256, 'o2-fp32': 30, 'o2-int8': 16 + 16 / 256}


def _resident(tensors: List[Tensor], opt: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for t in tensors + [v for st in opt.state.values() for v in st.values()
                        if isinstance(v, Tensor)]:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def fp32_step(sizes, state_dtype: str):
    params, grads = bo.make_fp32(sizes, torch.device('cpu'))
    for p, g in zip(params, grads):
        p.grad = g
    if state_dtype == 'torch':
        opt = torch.optim.AdamW(params, lr=bo.LR, betas=bo.BETAS, eps=bo.EPS, weight_decay=bo.WD,
                                fused=True)
    else:
        opt = FusedAdam(params, lr=bo.LR, betas=bo.BETAS, eps=bo.EPS, weight_decay=bo.WD,
                        state_dtype=state_dtype)
    return opt.step, (lambda: _resident(params + grads, opt))


def o2_step(sizes, state_dtype: str):
    st = bo.O2State(sizes, torch.device('cpu'), torch.bfloat16)
    opt = FusedAdam(st.masters, lr=bo.LR, betas=bo.BETAS, eps=bo.EPS, weight_decay=bo.WD,
                    state_dtype=state_dtype)
    grads, model = [st.grads], [st.model]
    found_inf = torch.zeros(1)

    def step() -> None:
        opt.fused_master_step(grads, model, grad_scale=st.scale, found_inf=found_inf)

    return step, (lambda: _resident(st.masters + st.model + st.grads, opt))


PIPELINES: Dict[str, Tuple[Callable, str, str]] = {
    'torch AdamW fused, fp32 states': (fp32_step, 'torch', 'fp32'),
    'FusedAdam fp32 states': (fp32_step, 'float32', 'fp32'),
    'FusedAdam int8 states': (fp32_step, 'int8', 'int8'),
    'O2 bf16, fp32 states': (o2_step, 'float32', 'o2-fp32'),
    'O2 bf16, int8 states': (o2_step, 'int8', 'o2-int8'),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--threads', type=int, nargs='+', default=[1, 2])
    ap.add_argument('--iters', type=int, default=15)
    ap.add_argument('--quick', action='store_true', help='~0.8M params (smoke test)')
    args = ap.parse_args()
    sizes = bo.shapes(args.quick)
    numel = sum(torch.Size(s).numel() for s in sizes)
    nbytes, why = bo.sample_bytes(numel)
    print(f'# 8-bit optimizer states, {numel / 1e6:.1f}M params in {len(sizes)} tensors')
    print(f'- {platform.processor() or platform.machine()}, torch {torch.__version__}, '
          f'backend {mp_wrappers.ops.backend()["cpu"]}; bandwidth sample {nbytes / 1e6:.0f} MB '
          f'({why})')
    built = {name: make(sizes, sd) for name, (make, sd, _) in PIPELINES.items()}
    for name, (step, _) in built.items():
        step()  # first step: creates the state, so resident bytes are measured after one
    sample = bo.InPlaceSample(torch.device('cpu'), nbytes)
    for threads in args.threads:
        torch.set_num_threads(threads)
        fns = {name: (step, bo._nothing) for name, (step, _) in built.items()}
        fns['a.mul_ (roofline)'] = (sample.step, bo._nothing)
        times = bo.time_interleaved(fns, torch.device('cpu'), args.iters, warmup=2)
        roof = sample.gbs(times.pop('a.mul_ (roofline)')[0])
        base = times['torch AdamW fused, fp32 states'][0]
        print(f'\n## {threads} thread(s); in-place roofline {roof:.1f} GB/s\n')
        print('| pipeline | min ms | median ms | x torch fused | B/param moved | GB/s | '
              'of roofline | resident B/param |')
        print('|---|---|---|---|---|---|---|---|')
        for name, (t_min, t_med) in times.items():
            moved = BYTES[PIPELINES[name][2]]
            gbs = moved * numel / t_min / 1e9
            resident = built[name][1]() / numel
            print(f'| {name} | {t_min * 1e3:.2f} | {t_med * 1e3:.2f} | {t_min / base:.2f} | '
                  f'{moved:.2f} | {gbs:.1f} | {gbs / roof:.0%} | {resident:.2f} |')


if __name__ == '__main__':
    main()
