"""Benchmark of the multi-tensor building blocks against the torch ops they replace (CPU or CUDA).

~25M parameters in ~200 tensors of mixed sizes (a ResNet-50-like gradient list):

* unscale: ``mp_wrappers.multi_tensor_scale_`` in place with the inf/nan check vs
  ``torch._amp_foreach_non_finite_check_and_unscale_`` (what GradScaler.unscale_ runs);
* L2 norm: ``mp_wrappers.multi_tensor_l2norm`` (total + per tensor, one pass) vs
  ``torch._foreach_norm`` plus the total from stacking the per-tensor norms;

* unscale + L2 norm in one pass: ``mp_wrappers.multi_tensor_unscale_l2norm`` (what the wrappers' fused
  step runs) vs the two torch ops above in a row;

for fp32, fp16 and bf16 tensors, on 1 and 2 threads (CPU) or on the GPU (``--device cuda``: times
are CUDA-synchronised, the copy sample is 4x the GPU's L2 cache or 1 GiB, whichever is larger). The
machine's copy bandwidth (read + write counted) is measured in the same run over a DRAM-sized
working set (4x the last-level cache, ``hardware.last_level_cache_bytes``), so GB/s figures can be
read against it. The ops' own tensors
(~100 MB in fp32, ~50 MB in half) fit a large last-level cache (260 MiB on this project's VM): there
they run from the cache after warm-up, and "of copy BW" above 1 says so, not that a kernel beat
memory. Prints a Markdown table; ratio = our time / torch's time (below 1 is faster).

Usage: python benchmarks/bench_multi_tensor.py [--reps 15] [--device cpu|cuda]
"""
import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, List

import torch

# Run from a checkout: the package next to this script wins over any installed copy.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mp_wrappers.ops as mops  # noqa: E402
from mp_wrappers import hardware  # noqa: E402

N_TENSORS = 196
TARGET_PARAMS = 25_300_000


def _sizes() -> List[int]:
    """Deterministic mixed sizes: log-uniform between 256 and ~2.4M, scaled to ~25.3M in total."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.exp(torch.empty(N_TENSORS).uniform_(5.5, 14.7, generator=gen))
    raw = raw * (TARGET_PARAMS / raw.sum())
    return [max(1, int(v)) for v in raw.tolist()]


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median wall time of fn() in seconds, after warm-up (the device's queue drained around each
    run, so a GPU time is the kernels' time, not the launch's)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cache_bytes(device: torch.device) -> int:
    if device.type == 'cuda':
        return getattr(torch.cuda.get_device_properties(device), 'L2_cache_size', 0)
    return hardware.last_level_cache_bytes() or 0


def _copy_working_set(device: torch.device) -> int:
    """Bytes (source + destination) of the copy sample: 4x the last-level cache, so it streams
    from DRAM (a copy that fits the cache measures the cache); 1 GiB when the cache is unknown."""
    llc = _cache_bytes(device)
    return max(4 * llc if llc else 1 << 30, (1 << 30) if device.type == 'cuda' else 512 << 20)


def _copy_bandwidth(reps: int, nbytes: int, device: torch.device) -> float:
    src = torch.ones(nbytes // 8, device=device)
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), reps, device)
    return 2 * src.numel() * src.element_size() / t / 1e9


def _cpu_model() -> str:
    try:
        out = subprocess.run(['lscpu'], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith('Model name:'):
                return line.split(':', 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or 'unknown CPU'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--reps', type=int, default=15)
    parser.add_argument('--device', default='cpu', choices=('cpu', 'cuda'))
    args = parser.parse_args()

    device = torch.device(args.device)
    backend = mops.backend()
    assert backend['extension'], f'the C++ extension is not loaded: {backend["error"]}'
    if device.type == 'cuda':
        assert backend['cuda'] == 'cuda', f'no CUDA kernels in this build: {backend}'
        machine = (f'{torch.cuda.get_device_name(device)}, torch {torch.__version__} (CUDA '
                   f'{torch.version.cuda}); kernels: ours (CUDA)')
    else:
        machine = (f'{_cpu_model()}, {torch.get_num_threads()} threads available; torch '
                   f'{torch.__version__}; kernels {backend["cpu"]}')
    sizes = _sizes()
    n = sum(sizes)
    print(f'# {device.type.upper()}: multi-tensor ops\n\nmachine: {machine}; '
          f'{datetime.date.today()}\n\n{n / 1e6:.1f}M params in {len(sizes)} tensors '
          f'(sizes {min(sizes)}..{max(sizes)}), median of {args.reps} runs\n')
    copy_bytes = _copy_working_set(device)
    llc = _cache_bytes(device)
    print(f'copy sample: {copy_bytes / 2**20:.0f} MiB (source + destination), at least 4x the '
          'last-level cache (' + (f'{llc / 2**20:.0f} MiB' if llc else 'unknown')
          + '): DRAM bandwidth')
    if llc and 4 * n < llc:
        print(f'note: the ops\' tensors ({4 * n / 1e6:.0f} MB in fp32) fit the last-level cache and '
              'run from it after warm-up: "of copy BW" above 1 is the cache, not a faster kernel')
    print()
    rows = []
    for threads in ((1, 2) if device.type == 'cpu' else ('-',)):
        if device.type == 'cpu':
            torch.set_num_threads(threads)
        copy_gbs = _copy_bandwidth(args.reps, copy_bytes, device)
        rows.append(f'| copy ({copy_bytes / 2**20:.0f} MiB, read+write) | fp32 | {threads} | | | | '
                    f'{copy_gbs:.1f} | |')
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            gen = torch.Generator().manual_seed(1)
            grads = [torch.randn(s, generator=gen).to(device, dtype) for s in sizes]
            nbytes = n * grads[0].element_size()
            flag = mops.new_found_inf(device)
            # Alternate x2 and x0.5 so repeated in-place scaling keeps the values (and their
            # timing: no drift into denormals) unchanged.
            scales = [torch.tensor([2.0], device=device), torch.tensor([0.5], device=device)]
            state = {'i': 0}

            def ours_scale():
                state['i'] ^= 1
                torch.ops.mp_wrappers.multi_tensor_scale_(grads, grads, scales[state['i']], flag)

            def torch_scale():
                state['i'] ^= 1
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, scales[state['i']])

            def ours_norm():
                return torch.ops.mp_wrappers.multi_tensor_l2norm(grads, True)

            def torch_norm():
                norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
                return torch.linalg.vector_norm(torch.stack(norms)), norms

            def ours_unscale_norm():
                state['i'] ^= 1
                return mops.multi_tensor_unscale_l2norm(grads, scales[state['i']], found_inf=flag)

            def torch_unscale_norm():
                torch_scale()
                return torch_norm()

            for name, ours, ref, moved in (
                    ('unscale in place + inf check', ours_scale, torch_scale, 2 * nbytes),
                    ('L2 norm, total + per tensor', ours_norm, torch_norm, nbytes),
                    ('inf check + L2 norm of the unscaled grads, one read (torch: the two above)',
                     ours_unscale_norm,
                     torch_unscale_norm, nbytes)):
                t_ours = _time(ours, args.reps, device)
                try:
                    t_ref = _time(ref, args.reps, device)
                    ref_ms, ratio = f'{t_ref * 1e3:.2f}', f'{t_ours / t_ref:.2f}'
                except RuntimeError as exc:  # torch has no kernel for this dtype
                    ref_ms, ratio = f'n/a ({str(exc).splitlines()[0][:40]})', ''
                ours_gbs = moved / t_ours / 1e9
                rows.append(f'| {name} | {str(dtype).replace("torch.", "")} | {threads} | '
                            f'{t_ours * 1e3:.2f} | {ref_ms} | {ratio} | {ours_gbs:.1f} | '
                            f'{ours_gbs / copy_gbs:.2f} |')
    print('| op | dtype | threads | ours ms | torch ms | ratio (time) | ours GB/s | '
          'of copy BW |')
    print('|---|---|---|---|---|---|---|---|')
    print('\n'.join(rows))


if __name__ == '__main__':
    main()
