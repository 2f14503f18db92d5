"""Steps of a few optimizer pipelines for a profiler to look into (not a test, not a benchmark).

Made for Nsight Compute on a GPU session (``tools/gpu_check.sh`` step ``profile-quantized``):

    ncu --clock-control none --nvtx --nvtx-include 'profiled/' --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        python benchmarks/profile_cuda_step.py --device cuda

Each pipeline is built as ``bench_quantized_states.py`` builds it (the same shapes, the same
steps), warmed up with ``--warmup`` steps, then stepped ``--steps`` times inside an NVTX range named
``profiled`` (on CUDA), one pipeline after the other: ``--nvtx-include 'profiled/'`` profiles the
kernels of those steps only. The 8-bit Adam kernel is ``adam8bit_kernel``, our fp32 Adam kernel
``elementwise_kernel`` (the generic fused-optimizer kernel), torch's fused AdamW kernel has
``FusedAdam`` in its functor's name. The wall time per step is printed too (synchronised), so that
a run without a profiler compares the pipelines. ``--kernel-table`` also records the profiled steps
with ``torch.profiler`` and prints each kernel's device time per step and their sum against the
wall time: where Nsight Compute cannot reach the GPU's counters, this still says whether a step is
bound by its kernels or by the host. ``--device cpu`` runs the same for a smoke test.
"""
import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_optimizers as bo  # noqa: E402
from bench_quantized_states import PIPELINES  # noqa: E402

DEFAULT = ('FusedAdam int8 states', 'FusedAdam fp32 states', 'torch AdamW fused, fp32 states')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--device', default='cuda')
    ap.add_argument('--pipelines', nargs='+', default=list(DEFAULT),
                    help=f'names from bench_quantized_states.PIPELINES (default: {DEFAULT})')
    ap.add_argument('--width', type=int, default=640)
    ap.add_argument('--layers', type=int, default=22)
    ap.add_argument('--warmup', type=int, default=2)
    ap.add_argument('--steps', type=int, default=1)
    ap.add_argument('--kernel-table', action='store_true',
                    help='print each kernel\'s device time per step (torch.profiler)')
    ap.add_argument('--host-profile', type=int, default=0, metavar='STEPS',
                    help='also run STEPS steps under cProfile and print the functions that take '
                         'the most host time per step (where a step\'s Python and launches go)')
    args = ap.parse_args()
    if args.host_profile < 0:
        ap.error(f'--host-profile: {args.host_profile}; allowed: a number of steps >= 0')
    unknown = [n for n in args.pipelines if n not in PIPELINES]
    if unknown:
        ap.error(f'--pipelines: unknown {unknown}; allowed: {sorted(PIPELINES)}')
    device = torch.device(args.device)
    sizes = bo.shapes(False, args.width, args.layers)
    numel = sum(torch.Size(s).numel() for s in sizes)
    print(f'{numel / 1e6:.1f}M params in {len(sizes)} tensors on {device}', flush=True)
    for name in args.pipelines:
        build, spec, _ = PIPELINES[name]
        step, _ = build(sizes, spec, device)
        for _ in range(args.warmup):
            step()
        bo.sync(device)
        cuda = device.type == 'cuda'
        start = time.perf_counter()
        if cuda:
            torch.cuda.nvtx.range_push('profiled')
        for _ in range(args.steps):
            step()
        bo.sync(device)
        if cuda:
            torch.cuda.nvtx.range_pop()
        print(f'{name}: {(time.perf_counter() - start) / args.steps * 1e3:.2f} ms/step; host '
              f'{host_time(step, device, args.steps) * 1e3:.2f} ms/step to the return of step() '
              '(fastest)', flush=True)
        if args.kernel_table:
            print_kernel_table(step, device, args.steps)
        if args.host_profile > 0:
            print_host_profile(step, device, args.host_profile)
        del step
        if device.type == 'cuda':
            torch.cuda.empty_cache()


def host_time(step, device: torch.device, steps: int) -> float:
    """The fastest of ``steps`` steps timed to the return of ``step()``, each after a synchronize:
    on CUDA the host's share of a step (the launches queue), on the CPU the whole step."""
    best = float('inf')
    for _ in range(max(steps, 5)):
        bo.sync(device)
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    bo.sync(device)
    return best


def print_kernel_table(step, device: torch.device, steps: int) -> None:
    """Each kernel's device time per step, their sum, and the wall time of the same steps."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU]
    if device.type == 'cuda':
        activities.append(ProfilerActivity.CUDA)
    host = []  # each step to its return: the host's share, while the kernels queue asynchronously
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            step()
            host.append(time.perf_counter() - t)
        bo.sync(device)
        wall = (time.perf_counter() - start) / steps
    kernels = {}
    for ev in prof.events():
        # Not the profiler's own ranges on the GPU's timeline (Optimizer.step#...: a whole step)
        annotation = getattr(ev, 'is_user_annotation', False)
        if ev.device_type == torch.autograd.DeviceType.CUDA and not annotation:
            total, calls = kernels.get(ev.name, (0.0, 0))
            kernels[ev.name] = (total + ev.time_range.elapsed_us(), calls + 1)
    device_us = sum(t for t, _ in kernels.values()) / steps
    for name, (total, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        print(f'    {total / steps / 1e3:8.3f} ms  {calls / steps:5.1f} launches  {name[:110]}')
    print(f'    kernels {device_us / 1e3:.3f} ms/step of {wall * 1e3:.3f} ms wall '
          f'({len(kernels)} kernels); host {min(host) * 1e3:.3f} ms/step to the return of step() '
          '(fastest, under the profiler)', flush=True)


def print_host_profile(step, device: torch.device, steps: int, top: int = 15) -> None:
    """The functions with the most own host time over ``steps`` steps under cProfile, per step.
    On CUDA the kernels queue asynchronously, so this is the Python and launch work that sets a
    step's wall time when the host is the bottleneck; on the CPU the kernels' time shows under the
    op calls."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    bo.sync(device)
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    bo.sync(device)
    stats = pstats.Stats(prof)
    total = stats.total_tt / steps
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    print(f'    host profile: {total * 1e3:.3f} ms/step under cProfile ({steps} steps); '
          f'own time per step, calls per step:')
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in rows:
        where = f'{pathlib.Path(file).name}:{line}' if line else file
        print(f'    {tottime / steps * 1e3:8.3f} ms  {ncalls / steps:7.1f}  {func[:60]}  ({where}; '
              f'cumulative {cumtime / steps * 1e3:.3f} ms)')
    sys.stdout.flush()


if __name__ == '__main__':
    main()
