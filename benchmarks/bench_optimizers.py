"""Optimizer-step benchmark: mp_wrappers' fused optimizers against what torch offers.

Two workloads on ~25M parameters in ~200 tensors (a 20-layer transformer-like stack; ``--quick``
uses ~0.8M in 42 tensors, for the pure-PyTorch references or a smoke test):

(a) fp32 AdamW step: ``FusedAdam`` vs ``torch.optim.AdamW(fused=True)`` and ``(foreach=True)``.
(b) O2-style step: fp16/bf16 model params, fp32 masters, half grads scaled by a loss scale.
    *fused*: one read-only pass over the half grads for the overflow flag (and the norm), then
    ``FusedAdam.fused_master_step`` (unscale, AdamW on the masters, rounded copy into the model, skip
    on the device) -- about 30 bytes per parameter.
    *composed from torch*: ``torch._amp_foreach_non_finite_check_and_unscale_`` on the half grads,
    ``g.float()`` into fp32 master grads, ``AdamW(fused=True)`` on the masters (skip through its
    ``found_inf``), masters copied back into the model -- about 44 bytes per parameter.

Every pipeline is first checked against the others on one step from the same state, then timed
with 1 and 2 threads: ``--iters`` rounds after warm-up, one step of each pipeline per round (so load
from other processes hits all alike), reporting the fastest and the median step. Memory traffic per
parameter over the fastest time gives GB/s, compared with the in-place read-modify-write bandwidth
(``a.mul_``), the roofline of these in-place updates (docs/semantics.md section 7), sampled in the same
rounds as the pipelines of each table. The sample streams a DRAM-sized working set: at least the
largest step's bytes (44 B/param x params) and 4x the last-level cache
(``hardware.last_level_cache_bytes``). A sample that fits the cache measures the cache: on this
project's VM (260 MiB L3) a 100 MB ``a.mul_`` ran at twice the DRAM bandwidth the steps stream from.
Output is Markdown.

Run: ``python benchmarks/bench_optimizers.py [--quick] [--threads 1 2] [--device cpu]``; on a GPU
``--device cuda --threads 1 --width 640 --layers 22`` (108M params, issue 13's 100M+ workload), where
the summary states issue 13's targets: fp32 FusedAdam <= 1.0x torch fused's time and >= 80% of the
copy bandwidth, the fused O2 step <= 0.7x the composed pipeline's time.
"""
import argparse
import pathlib
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

# Run from a checkout without installing: the package sits next to this folder.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import mp_wrappers  # noqa: E402
from mp_wrappers.ops import multi_tensor_unscale_l2norm  # noqa: E402
from mp_wrappers.optim import FusedAdam  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
SCALE = 2.0 ** 12
# Bytes moved per parameter by each pipeline (docs/semantics.md section 7).
BYTES_FP32_ADAM = 28          # read p, g, m, v; write p, m, v
BYTES_O2_FUSED = 2 + 28       # check pass over g16; g16 + p32/m/v read and written + p16 written
BYTES_O2_COMPOSED = 4 + 6 + 28 + 6  # unscale g16 in place; g16 -> g32; Adam; p32 -> p16


def shapes(quick: bool, width: int = 0, layers: int = 0) -> List[Tuple[int, ...]]:
    """Per layer: qkv, out, two MLP matrices, their biases and two norms' weight and bias
    (12 d^2 + 13 d parameters a layer; width/layers override the preset)."""
    d, n = (128, 4) if quick else (320, 20)
    d, layers = width or d, layers or n
    layer = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,),
             (d,)]
    return [s for _ in range(layers) for s in layer] + [(d,), (d,)]


def sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def timeit(fn: Callable[[], None], device: torch.device, iters: int, warmup: int) -> float:
    """Seconds of the fastest call (the least disturbed by other processes)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def time_interleaved(fns: Dict[str, Tuple[Callable[[], None], Callable[[], None]]],
                     device: torch.device, iters: int, warmup: int
                     ) -> Dict[str, Tuple[float, float]]:
    """name -> (min, median) seconds per call of ``fns[name][0]``; ``fns[name][1]`` runs untimed
    after each call (e.g. restoring inputs a pipeline consumes).

    The pipelines are timed in rounds, one call of each per round, so that a burst of load from
    other processes on a shared machine hits all of them alike instead of whichever happened to be
    running (timing one pipeline's steps back to back made 2-thread ratios swing by 3x here). The
    minimum is the least disturbed step; the median shows the spread.
    """
    for fn, after in fns.values():
        for _ in range(warmup):
            fn()
            after()
    sync(device)
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, (fn, after) in fns.items():
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
            after()
    sync(device)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def _nothing() -> None:
    pass


def sample_bytes(numel: int) -> Tuple[int, str]:
    """Working set of the bandwidth samples, and the reason for that size (printed).

    At least what the largest step streams (44 B/param x params), and 4x the last-level cache so
    that neither the sample nor the steps can run from it: the roofline of an in-place update is
    the in-place read-modify-write bandwidth at a DRAM-sized working set.
    """
    from mp_wrappers import hardware
    step = max(BYTES_FP32_ADAM, BYTES_O2_FUSED, BYTES_O2_COMPOSED) * numel
    llc = hardware.last_level_cache_bytes()
    floor = 4 * llc if llc else 1 << 30
    why = (f'the largest step streams {step / 1e6:.0f} MB; last-level cache '
           + (f'{llc / 2**20:.0f} MiB (sysfs), 4x = {floor / 1e6:.0f} MB' if llc else
              'unknown (no sysfs), 1 GiB assumed beyond it'))
    return max(step, floor), why


class InPlaceSample:
    """``a.mul_(c)`` over a DRAM-sized fp32 buffer: the in-place read-modify-write bandwidth."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.a = torch.ones(nbytes // 4, device=device)  # ones: no denormals as the product grows

    def step(self) -> None:
        self.a.mul_(1.0000001)

    def gbs(self, seconds: float) -> float:
        """GB/s for one step of ``seconds``, read + write bytes counted."""
        return 2 * 4 * self.a.numel() / seconds / 1e9


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Copy bandwidth in GB/s over a working set of ``nbytes`` (source + destination), read +
    write bytes counted; for reference only (the steps update in place)."""
    a = torch.ones(nbytes // 8, device=device)
    b = torch.empty_like(a)
    seconds = timeit(lambda: b.copy_(a), device, iters=5, warmup=1)
    return 2 * 4 * a.numel() / seconds / 1e9


def make_fp32(sizes: Sequence[Tuple[int, ...]], device: torch.device, seed: int = 0
              ) -> Tuple[List[Tensor], List[Tensor]]:
    gen = torch.Generator(device='cpu').manual_seed(seed)
    params = [torch.randn(s, generator=gen).mul_(0.02).to(device).requires_grad_() for s in sizes]
    grads = [torch.randn(s, generator=gen).mul_(1e-3).to(device) for s in sizes]
    return params, grads


# ---- (a) fp32 AdamW ----------------------------------------------------------------------------------

def fp32_pipelines(sizes, device) -> Dict[str, Tuple[List[Tensor], Callable[[], None]]]:
    """name -> (params, one step)."""
    out = {}
    for name in ('mp_wrappers FusedAdam', 'torch AdamW fused=True', 'torch AdamW foreach=True'):
        params, grads = make_fp32(sizes, device)
        for p, g in zip(params, grads):
            p.grad = g
        if name.startswith('mp_wrappers'):
            opt = FusedAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        elif 'fused' in name:
            opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                    fused=True)
        else:
            opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                    foreach=True)
        out[name] = (params, opt.step)
    return out


# ---- (b) O2 step ---------------------------------------------------------------------------------------

class O2State:
    """Half model params with scaled half grads, and their fp32 masters."""

    def __init__(self, sizes, device, half: torch.dtype) -> None:
        masters, grads = make_fp32(sizes, device)
        self.model = [m.detach().to(half) for m in masters]
        self.masters = [m.float().requires_grad_() for m in self.model]
        self.grads = [(g * SCALE).to(half) for g in grads]  # what backward of a scaled loss gives
        self.pristine_grads = [g.clone() for g in self.grads]
        self.scale = torch.full((1,), SCALE, device=device)
        self.inv_scale = torch.full((1,), 1.0 / SCALE, device=device)

    def restore_grads(self) -> None:
        """The composed pipeline unscales the half grads in place; the next step needs scaled ones
        (a real loop gets them from the next backward)."""
        torch._foreach_copy_(self.grads, self.pristine_grads)


def o2_fused(sizes, device, half) -> Tuple[O2State, Callable[[], None]]:
    st = O2State(sizes, device, half)
    opt = FusedAdam(st.masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    grads, model = [st.grads], [st.model]

    def step() -> None:
        # Read-only pass: overflow flag (and the global norm, free in the same pass, for clipping).
        _, _, found_inf = multi_tensor_unscale_l2norm(st.grads, st.inv_scale)
        opt.fused_master_step(grads, model, grad_scale=st.scale, found_inf=found_inf)

    return st, step


def o2_composed(sizes, device, half) -> Tuple[O2State, Callable[[], None]]:
    st = O2State(sizes, device, half)
    master_grads = [torch.empty_like(m) for m in st.masters]
    for m, g in zip(st.masters, master_grads):
        m.grad = g
    opt = torch.optim.AdamW(st.masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    # torch's CUDA unscale op has no bf16 kernel ("not implemented for 'BFloat16'"): there the
    # composed pipeline copies the half grads to the fp32 master grads first and unscales those
    # (the same bytes plus one fp32 read+write); elsewhere it unscales the half grads in place.
    unscale_masters = torch.device(device).type == 'cuda' and half == torch.bfloat16

    def step() -> None:
        found_inf = torch.zeros((), device=device)  # torch fused Adam wants a 0-dim flag
        if unscale_masters:
            torch._foreach_copy_(master_grads, st.grads)
            torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found_inf,
                                                             st.inv_scale)
        else:
            # GradScaler.unscale_ refuses fp16 grads, but the op itself handles them.
            torch._amp_foreach_non_finite_check_and_unscale_(st.grads, found_inf, st.inv_scale)
            torch._foreach_copy_(master_grads, st.grads)
        opt.found_inf = found_inf  # torch's fused Adam skips on the device through this attribute
        opt.step()
        del opt.found_inf
        torch._foreach_copy_(st.model, st.masters)

    return st, step


# ---- driver --------------------------------------------------------------------------------------------

def check_fp32(sizes, device) -> None:
    pipes = fp32_pipelines(sizes, device)
    results = {}
    for name, (params, step) in pipes.items():
        step()
        results[name] = params
    ref = results['torch AdamW fused=True']
    for name, params in results.items():
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f'(a) {name} disagrees with torch: {m}')


def check_o2(sizes, device, half) -> float:
    """Both O2 pipelines against torch fused AdamW on exactly unscaled fp32 grads.

    Returns the largest deviation of the composed pipeline: unscaling fp16 grads in fp16 flushes
    small ones into subnormals, which moves Adam's first steps by up to ``lr`` on those elements.
    """
    fused, fstep = o2_fused(sizes, device, half)
    composed, cstep = o2_composed(sizes, device, half)
    exact = [m.detach().clone().requires_grad_() for m in fused.masters]
    for m, g in zip(exact, fused.grads):
        m.grad = g.float() / SCALE
    torch.optim.AdamW(exact, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True).step()
    fstep()
    cstep()
    for a, b in zip(fused.masters, exact):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f'(b) fused masters disagree: {m}')
    for a, b in zip(fused.model, exact):
        # Model copies are masters rounded once: at most one half-precision ulp apart.
        torch.testing.assert_close(a.float(), b.to(half).float(), rtol=1e-2, atol=1e-6)
    worst = 0.0
    for a, b in zip(composed.masters, exact):
        torch.testing.assert_close(a, b, rtol=0, atol=2 * LR,
                                   msg=lambda m: f'(b) composed masters disagree: {m}')
        worst = max(worst, float((a - b).detach().abs().max()))
    return worst


def row(name: str, seconds: Tuple[float, float], bytes_per_param: int, numel: int, bw: float,
        baseline: float) -> str:
    best, median = seconds
    gbs = bytes_per_param * numel / best / 1e9
    return (f'| {name} | {best * 1e3:.2f} | {median * 1e3:.2f} | {baseline / best:.2f}x | '
            f'{bytes_per_param} | {gbs:.1f} | {100 * gbs / bw:.0f}% |')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true', help='small workload (~0.8M params)')
    parser.add_argument('--threads', type=int, nargs='+', default=[1, 2])
    parser.add_argument('--iters', type=int, default=None, help='timed steps (median reported)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--half', nargs='+', default=['bfloat16', 'float16'],
                        choices=['bfloat16', 'float16'])
    parser.add_argument('--width', type=int, default=0, help='model width d (default: preset)')
    parser.add_argument('--layers', type=int, default=0, help='layers (default: preset)')
    args = parser.parse_args()
    for name in ('width', 'layers'):
        if getattr(args, name) < 0:
            parser.error(f'--{name} must be >= 1 (0: the preset), got {getattr(args, name)}')
    device = torch.device(args.device)
    iters = args.iters or (5 if args.quick else 20)
    warmup = 2 if args.quick else 3
    sizes = shapes(args.quick, args.width, args.layers)
    numel = sum(torch.Size(s).numel() for s in sizes)

    print('# Optimizer step benchmark\n')
    print(f'- torch {torch.__version__}, mp_wrappers {mp_wrappers.__version__}, backend '
          f'{mp_wrappers.ops.backend()}')
    print(f'- {platform.processor() or platform.machine()}, device {device}')
    if device.type == 'cpu':
        from mp_wrappers import hardware
        cap = hardware.device_capability('cpu')
        ext = hardware.extension_info()
        print(f'- CPU {cap.name}: {cap.isa}; our kernels {ext.get("cpu_kernels")} (widest this CPU '
              f'runs: {ext.get("cpu_kernels_widest")}; MP_WRAPPERS_CPU_ISA narrows it); torch '
              f'dispatches to {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY)')
    print(f'- {numel / 1e6:.2f}M params in {len(sizes)} tensors; {iters} timed rounds, pipelines interleaved')
    check_fp32(sizes, device)
    deviations = {half: check_o2(sizes, device, getattr(torch, half)) for half in args.half}
    print('- correctness: on one step every pipeline agrees with torch fused AdamW given exactly '
          'unscaled fp32 grads; the composed O2 pipeline deviates by up to '
          + ', '.join(f'{v:.1e} ({k})' for k, v in deviations.items())
          + ' (it unscales in half precision)')

    nbytes, why = sample_bytes(numel)
    sample = InPlaceSample(device, nbytes)
    print(f'- bandwidth samples stream {nbytes / 1e6:.0f} MB (fp32 `a.mul_` in place; copy: source '
          f'+ destination), from DRAM: {why}. The in-place sample is timed in the same rounds as '
          "each table's pipelines; its fastest round is the table's roofline.")
    footprint = 20 * numel  # distinct bytes the composed O2 step touches (g16, g32, p32, m, v, p16)
    from mp_wrappers import hardware
    llc = hardware.last_level_cache_bytes() if device.type == 'cpu' else None
    if llc and footprint < llc:
        print(f'- note: the steps\' working set ({footprint / 1e6:.0f} MB) fits the '
              f'{llc / 2**20:.0f} MiB last-level cache, so they run from it: % of the DRAM '
              'in-place bandwidth above 100% is expected')
    print()

    header = ('| pipeline | ms/step (min) | ms/step (median) | speed-up vs torch baseline (min) | '
              'bytes/param | GB/s (min) | % of in-place bandwidth |\n|---|---|---|---|---|---|---|')
    summary = []
    inplace_name = 'in-place RMW sample'
    for threads in args.threads:
        if device.type == 'cpu':
            torch.set_num_threads(threads)
        copy = copy_bandwidth(device, nbytes)
        print(f'## {threads} thread(s)\n')
        print(f'Copy bandwidth {copy:.1f} GB/s (read + write, {nbytes / 1e6:.0f} MB working set).\n')
        print('### (a) fp32 AdamW\n')
        fns = {name: (step, _nothing) for name, (_, step) in fp32_pipelines(sizes, device).items()}
        fns[inplace_name] = (sample.step, _nothing)
        timings = time_interleaved(fns, device, iters, warmup)
        bw = sample.gbs(timings.pop(inplace_name)[0])
        print(f'In-place read-modify-write bandwidth, same rounds: {bw:.1f} GB/s. Roofline of an '
              f'fp32 Adam step: {BYTES_FP32_ADAM * numel / bw / 1e6:.2f} ms.\n')
        print(header)
        base = timings['torch AdamW fused=True'][0]
        for name, sec in timings.items():
            print(row(name, sec, BYTES_FP32_ADAM, numel, bw, base))
        ours = timings['mp_wrappers FusedAdam'][0]
        if device.type == 'cuda':  # issue 13's targets
            adam_gbs = BYTES_FP32_ADAM * numel / ours / 1e9
            summary.append(f'fp32 FusedAdam / torch fused time ratio {ours / base:.2f} (target '
                           f'<= 1.0), {100 * adam_gbs / copy:.0f}% of the copy bandwidth '
                           '(target >= 80%)')
        else:
            summary.append(f'{threads} thread(s): fp32 FusedAdam / torch fused time ratio '
                           f'{ours / base:.2f} (target <= 1.05)')
        for half in args.half:
            dtype = getattr(torch, half)
            print(f'\n### (b) O2 step, {half} model, fp32 masters, scaled {half} grads\n')
            composed_state, composed = o2_composed(sizes, device, dtype)
            _, fused = o2_fused(sizes, device, dtype)
            # The composed pipeline unscales the half grads in place; they are restored untimed
            # after each step (a real loop gets fresh ones from the next backward).
            t = time_interleaved({'composed': (composed, composed_state.restore_grads),
                                  'fused': (fused, _nothing),
                                  inplace_name: (sample.step, _nothing)}, device, iters, warmup)
            bw = sample.gbs(t.pop(inplace_name)[0])
            print(f'In-place read-modify-write bandwidth, same rounds: {bw:.1f} GB/s.\n')
            print(header)
            print(row('torch composed (unscale, cast, AdamW fused, copy back)', t['composed'],
                      BYTES_O2_COMPOSED, numel, bw, t['composed'][0]))
            print(row('mp_wrappers check pass + FusedAdam.fused_master_step', t['fused'],
                      BYTES_O2_FUSED, numel, bw, t['composed'][0]))
            fused_gbs = BYTES_O2_FUSED * numel / t['fused'][0] / 1e9
            if device.type == 'cuda':  # issue 13's target
                summary.append(f'O2 {half} fused step / composed time ratio '
                               f'{t["fused"][0] / t["composed"][0]:.2f} (target <= 0.7), '
                               f'{100 * fused_gbs / bw:.0f}% of the in-place bandwidth')
            else:
                summary.append(f'{threads} thread(s): O2 {half} fused step '
                               f'{t["composed"][0] / t["fused"][0]:.2f}x faster than composed '
                               f'(target >= 1.67x), {100 * fused_gbs / bw:.0f}% of the in-place '
                               'bandwidth (target >= 85%)')
        print()
    if device.type == 'cpu':
        kernels = (f'our kernels {mp_wrappers.ops.backend()["cpu"]}, torch dispatches to '
                   f'{torch.backends.cpu.get_cpu_capability()}')
    else:
        kernels = str(device)
    print(f'## Summary ({kernels})\n')
    print('\n'.join(f'- {line}' for line in summary))


if __name__ == '__main__':
    main()
