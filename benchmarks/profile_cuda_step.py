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
a run without a profiler compares the pipelines. ``--device cpu`` runs the same for a smoke test.
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
    args = ap.parse_args()
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
        print(f'{name}: {(time.perf_counter() - start) / args.steps * 1e3:.2f} ms/step', flush=True)
        del step
        if device.type == 'cuda':
            torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
