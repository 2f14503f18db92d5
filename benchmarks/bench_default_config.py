"""The README's default config against its fp32 twin, in one process: is the default fast here?

Trains ``configs/digits/cnn_bf16.py`` (the default: ``dtype='auto'``) and ``configs/digits/cnn_fp32.py``
through mmengine's Runner, alternating (fp32, default, fp32, default, ...) so load from other
processes hits both alike, and prints seconds per training iteration (the median iteration of each
run after ``--warmup`` iterations; the fastest run of each config) and the ratio. ``--forced-bf16``
adds the default config with bf16 forced (what it was before ``dtype='auto'``).

The ratio is what matters: on a CPU with native bf16 the default should be faster than fp32, and
on a CPU without native half formats (AVX2-only) it must not be slower. Simulate an AVX2-only CPU on
an AVX-512 one by capping every library's ISA:
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MP_WRAPPERS_CPU_ISA=avx2`` (oneDNN's matmuls and
convolutions, torch's elementwise kernels, ours); the memory system stays the host's.

Run: ``python benchmarks/bench_default_config.py [--runs 2] [--iters 90] [--threads 1]``.
"""
import argparse
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mmengine.config import Config  # noqa: E402
from mmengine.hooks import Hook  # noqa: E402
from mmengine.runner import Runner  # noqa: E402

import mp_wrappers  # noqa: E402
from mp_wrappers import hardware  # noqa: E402
from mp_wrappers.train_config import add_mixed_precision_hook  # noqa: E402

CONFIGS = {
    'fp32 twin (cnn_fp32.py)': ('configs/digits/cnn_fp32.py', {}),
    'default (cnn_bf16.py, dtype=auto)': ('configs/digits/cnn_bf16.py', {}),
    'default with bf16 forced': ('configs/digits/cnn_bf16.py',
                                 {'model.dtype': 'bfloat16', 'optim_wrapper.dtype': 'bfloat16'}),
}


class IterTimer(Hook):
    """Wall time of every training iteration (data loading included, as a user sees it)."""

    def __init__(self) -> None:
        self.times: List[float] = []
        self._start = 0.0

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        self._start = time.perf_counter()

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.times.append(time.perf_counter() - self._start)


def run_once(name: str, iters: int, warmup: int, work_dir: str, index: int) -> float:
    path, options = CONFIGS[name]
    cfg = Config.fromfile(str(ROOT / path))
    cfg.merge_from_dict(options)
    cfg.work_dir = work_dir
    cfg.experiment_name = f'bench_default_{index}'
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=iters, val_interval=iters + 1)
    cfg.val_dataloader = cfg.val_cfg = cfg.val_evaluator = None
    cfg.default_hooks.checkpoint = None
    cfg.default_hooks.logger = dict(type='LoggerHook', interval=iters + 1)
    cfg.train_dataloader.sampler = dict(type='InfiniteSampler', shuffle=True)
    cfg.log_level = 'WARNING'
    add_mixed_precision_hook(cfg)
    runner = Runner.from_cfg(cfg)
    timer = IterTimer()
    runner.register_hook(timer, priority='VERY_LOW')
    runner.train()
    return statistics.median(timer.times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--runs', type=int, default=2, help='runs per config (fastest is kept)')
    parser.add_argument('--iters', type=int, default=90, help='training iterations per run')
    parser.add_argument('--warmup', type=int, default=10, help='iterations left out of the median')
    parser.add_argument('--threads', type=int, default=None, help='torch threads (default: torch)')
    parser.add_argument('--forced-bf16', action='store_true',
                        help='also time the default config with bf16 forced')
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = list(CONFIGS)[:3 if args.forced_bf16 else 2]
    cap = hardware.device_capability('cpu')
    auto = hardware.auto_dtype('cpu')
    caps = {k: os.environ[k] for k in ('ONEDNN_MAX_CPU_ISA', 'ATEN_CPU_CAPABILITY',
                                        'MP_WRAPPERS_CPU_ISA') if k in os.environ}
    print('# Default config vs its fp32 twin\n')
    print(f'- torch {torch.__version__}, mp_wrappers {mp_wrappers.__version__}, '
          f'{torch.get_num_threads()} thread(s), {platform.machine()}')
    print(f'- CPU: {cap.name} ({cap.isa}); native low precision: {", ".join(cap.native) or "none"}'
          f'; ISA caps: {caps or "none"}; torch dispatch {torch.backends.cpu.get_cpu_capability()}')
    print(f'- {auto.reason}')
    print(f'- {args.runs} run(s) per config, interleaved, {args.iters} iterations each, median '
          f'after {args.warmup}; fastest run kept\n')
    best: Dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        index = 0
        for _ in range(args.runs):
            for name in names:
                index += 1
                sec = run_once(name, args.iters, args.warmup, os.path.join(tmp, str(index)), index)
                best[name] = min(best.get(name, float('inf')), sec)
    base = best[names[0]]
    print('| config | s/iter | time vs fp32 twin |')
    print('|---|---|---|')
    for name in names:
        print(f'| {name} | {best[name]:.4f} | {best[name] / base:.2f}x |')
    ratio = best[names[1]] / base
    verdict = 'not slower' if ratio <= 1.05 else 'SLOWER'
    print(f'\nDefault / fp32 time ratio: {ratio:.2f} ({verdict} than fp32 on this CPU class)')


if __name__ == '__main__':
    main()
