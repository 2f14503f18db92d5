"""Train one config under several apex opt levels and dtypes and compare them in one table.

Examples:
    python tools/compare_precision.py configs/digits/cnn_fp32.py --iters 900 --dtypes bfloat16
    python tools/compare_precision.py configs/charlm/lm_fp32.py --iters 1000 \\
        --levels O0 O1 O2 O3 --dtypes bfloat16 --out work_dirs/compare/charlm.md

Every (level, dtype) pair trains the same config, with the same seed, schedule and data order, with
its ``optim_wrapper`` replaced by ``mp_wrappers.ApexOptimWrapper(opt_level=level, dtype=dtype)`` (the
config's optimizer, ``clip_grad`` and ``accumulative_counts`` are kept; a ``dtype`` in the model config
is reset to None so the opt level alone decides the precision). O0 is the fp32 baseline and runs once
whatever ``--dtypes`` says. Each run is a separate Python process, so no global state (threads,
deterministic flags, allocator caches, message hubs, peak-memory counters) leaks between runs.

The table has, per run:

* **time/iter**: mean wall time of the training iterations (forward, backward, step, hooks), from the
  first tenth of the iterations on (warm-up: allocator, oneDNN kernel selection) and excluding
  validation and data loading.
* **peak memory**: on CUDA ``torch.cuda.max_memory_allocated()`` during training. On CPU the growth of
  the process's peak resident set size (``ru_maxrss``) from the start of training to its end: it
  counts parameters, optimizer state and the largest iteration's activations that were not already
  resident, but also the allocator's caching, so compare it between rows rather than read it as an
  exact tensor byte count. (``tracemalloc`` does not see torch's C++ allocations.)
* **final train loss**: mean of the last 10 iterations' losses (one iteration is noisy).
* the validation metrics of the final evaluation, and **skipped** optimizer steps (overflows).

``--iters N`` trains N iterations with mmengine's ``IterBasedTrainLoop`` (epoch-based schedulers are
converted with ``convert_to_iter_based=True``, so their epochs become ``len(train_dataloader)``
iterations) and validates once at the end; without it the config's own loop runs.

``--masters MODE ...`` adds O2 bf16 runs with ``master_weights=MODE`` (``split``, ``kahan``,
``stochastic``; a ``-bf16state`` suffix also sets the optimizer's ``state_dtype='bfloat16'``). They need
``mp_wrappers.FusedAdam``/``FusedSGD`` (``--cfg-options optim_wrapper.optimizer.type=mp_wrappers.FusedAdam``
gives every run the same optimizer). Every row then also has **B/param**: the bytes of the distinct
tensors that persist between steps (model params, the optimizer's params, i.e. fp32 masters, and
every optimizer state tensor, gradients excluded) after training, divided by the model's parameter
count; and **time vs O2**, the ms/iter ratio to the plain O2 row of the same invocation.

``--state-dtypes S ...`` trains every (level, dtype) run once per optimizer state dtype ``S``
(``float32`` or ``int8``: the optimizer's ``state_dtype``, so the config's optimizer must be
``mp_wrappers.FusedAdam`` or ``mp_wrappers.FusedSGD``, docs/quantized_states.md; bf16 moments
need lean masters and come with
``--masters MODE-bf16state``; another optimizer is refused before any run starts); without it each
run keeps the config's optimizer as it is (``--cfg-options optim_wrapper.optimizer.state_dtype=int8``
selects 8-bit states for every run as well). The **states** column shows what each run's optimizer
actually kept, measured after training: the dtype of most of the optimizer-state elements (``int8``
for 8-bit codes; params under ``min_8bit_size`` keep fp32 moments), ``-`` for a stateless
optimizer. Every row then has **B/param** too.
"""
import argparse
import datetime
import json
import math
import os
import os.path as osp
import platform
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

__all__ = ['plan_runs', 'check_state_dtypes', 'build_run_config', 'measured_state_dtype', 'format_table',
           'persistent_bytes_per_param', 'main']

LEVELS = ('O0', 'O1', 'O2', 'O3')
DTYPES = ('float16', 'bfloat16')
MASTER_MODES = ('split', 'kahan', 'stochastic')
STATE_DTYPES = ('float32', 'int8')  # bf16 moments need lean masters: --masters MODE-bf16state
_BF16_STATE = '-bf16state'


def parse_master_mode(mode: str) -> Tuple[str, Optional[str]]:
    """``'kahan-bf16state'`` -> ``('kahan', 'bfloat16')``; ``'split'`` -> ``('split', None)``.

    Raises:
        ValueError: an unknown mode, naming the allowed ones.
    """
    base = mode[:-len(_BF16_STATE)] if mode.endswith(_BF16_STATE) else mode
    if base not in MASTER_MODES:
        raise ValueError(f'--masters: {mode!r} is not a master mode; allowed: '
                         f'{", ".join(MASTER_MODES)}, each optionally with {_BF16_STATE!r}')
    return base, ('bfloat16' if base != mode else None)
_LOSS_WINDOW = 10


def plan_runs(levels: Sequence[str], dtypes: Sequence[str]) -> List[Tuple[str, str]]:
    """The ``(level, dtype)`` pairs to train: O0 once (as float32), the others per dtype.

    Raises:
        ValueError: an unknown level or dtype, naming the allowed values.
    """
    for level in levels:
        if level not in LEVELS:
            raise ValueError(f'--levels: {level!r} is not an opt level; allowed: '
                             f'{", ".join(LEVELS)} (the letter O, not zero)')
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ValueError(f'--dtypes: {dtype!r} is not supported; allowed: {", ".join(DTYPES)}')
    runs: List[Tuple[str, str]] = []
    for level in dict.fromkeys(levels):
        if level == 'O0':
            runs.append(('O0', 'float32'))
        else:
            runs += [(level, d) for d in dict.fromkeys(dtypes)]
    return runs


def check_state_dtypes(states: Sequence[str]) -> List[str]:
    """The ``--state-dtypes`` values, deduplicated.

    Raises:
        ValueError: an unknown state dtype, naming the allowed ones.
    """
    for state in states:
        if state not in STATE_DTYPES:
            raise ValueError(f'--state-dtypes: {state!r} is not an optimizer state dtype; '
                             f'allowed: {", ".join(STATE_DTYPES)}')
    return list(dict.fromkeys(states))


def run_name(level: str, dtype: str, master: Optional[str] = None,
             state: Optional[str] = None) -> str:
    """``O2_bfloat16``, ``O2_bfloat16_kahan``, ``O2_bfloat16_int8state``: a run's folder name."""
    return f'{level}_{dtype}' + (f'_{master}' if master else '') + (f'_{state}state' if state else '')


def _set_state_dtype(optimizer: dict, state: str) -> None:
    kind = optimizer.get('type')
    name = kind if isinstance(kind, str) else getattr(kind, '__module__', '') + '.'
    if not name.startswith('mp_wrappers.'):
        raise ValueError(f'--state-dtypes {state}: the optimizer {kind!r} has no state_dtype; it '
                         'needs one of ours, e.g. --cfg-options optim_wrapper.optimizer.type='
                         'mp_wrappers.FusedAdam (or mp_wrappers.FusedSGD)')
    optimizer['state_dtype'] = state


def build_run_config(cfg: Any, level: str, dtype: str, iters: Optional[int], work_dir: str,
                     master: Optional[str] = None, state: Optional[str] = None) -> Any:
    """Rewrite a loaded mmengine ``Config`` for one comparison run (in place; returned).

    Args:
        cfg: The config.
        level: ``'O0'`` .. ``'O3'``.
        dtype: ``'float32'`` (O0), ``'float16'`` or ``'bfloat16'``.
        iters: Iteration budget, or None for the config's own loop.
        work_dir: Where this run writes logs.
        master: None, or a ``--masters`` mode (O2 bf16 with ``master_weights`` set).
        state: None (the config's optimizer as it is), or a ``--state-dtypes`` value set as the
            optimizer's ``state_dtype``.

    Raises:
        ValueError: no single ``optim_wrapper`` with an ``optimizer``; a bad ``iters``; a
            ``state`` for an optimizer that is not one of ours.
    """
    old = cfg.get('optim_wrapper', None)
    if not isinstance(old, dict) or 'optimizer' not in old:
        raise ValueError('compare_precision needs a config whose optim_wrapper is a single wrapper '
                         "dict with an 'optimizer' (multi-optimizer configs are not supported)")
    wrapper = dict(type='mp_wrappers.ApexOptimWrapper', opt_level=level,
                   dtype='bfloat16' if dtype == 'float32' else dtype,
                   optimizer=dict(old['optimizer']), verbosity=0)
    if master is not None:
        mode, state_dtype = parse_master_mode(master)
        wrapper['master_weights'] = mode
        if state_dtype is not None:
            wrapper['optimizer']['state_dtype'] = state_dtype
    if state is not None:
        _set_state_dtype(wrapper['optimizer'], state)
    for key in ('clip_grad', 'accumulative_counts'):
        if old.get(key) is not None:
            wrapper[key] = old[key]
    cfg.optim_wrapper = wrapper
    if isinstance(cfg.get('model'), dict) and cfg.model.get('dtype') is not None:
        cfg.model.dtype = None  # the opt level decides; a pre-cast model would defeat O0/O1
    if iters is not None:
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
            raise ValueError(f'--iters={iters!r} must be a positive integer')
        cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=iters, val_interval=iters)
        cfg.train_dataloader.sampler = dict(type='InfiniteSampler', shuffle=True)
        schedulers = cfg.get('param_scheduler', None) or []
        if isinstance(schedulers, dict):
            schedulers = [schedulers]
        for sched in schedulers:
            if sched.get('by_epoch', True):
                sched['convert_to_iter_based'] = True
        if cfg.get('log_processor') is not None:
            cfg.log_processor.by_epoch = False
    # No checkpoints: nothing to resume, and saving would be timed.
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=10 ** 9, by_epoch=False,
                                        save_last=False)
    cfg.custom_hooks = list(cfg.get('custom_hooks', None) or []) + [
        dict(type='CompareProbeHook', progress_file=osp.join(work_dir, 'progress'))]
    cfg.work_dir = work_dir
    cfg.experiment_name = 'compare_' + run_name(level, dtype, master, state)
    return cfg


def measured_state_dtype(optimizer: Any) -> Optional[str]:
    """The dtype of most of the optimizer-state elements: ``'int8'`` for 8-bit codes (stored as
    uint8), else the dtype's name (``'float32'``, ``'bfloat16'``); None without state tensors.

    Scalars (step counters) and the per-block absmax scales of 8-bit moments are not counted: they
    are bookkeeping, not the moments.
    """
    import torch
    counts: Dict[str, int] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or key.endswith('_absmax'):
                continue
            name = 'int8' if value.dtype == torch.uint8 else str(value.dtype).replace('torch.', '')
            counts[name] = counts.get(name, 0) + value.numel()
    return max(counts, key=counts.get) if counts else None


def persistent_bytes_per_param(model: Any, optimizer: Any) -> float:
    """Bytes of the distinct tensors kept between steps per model parameter, measured.

    Counts the model's parameters, the optimizer's params (fp32 masters where a wrapper swapped
    them in) and every tensor in the optimizer state (moments, low halves, compensations, step
    counters); gradients are not counted. Tensors sharing storage are counted once.
    """
    import torch
    seen: Dict[Tuple[int, int], int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            seen[(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())] = \
                t.untyped_storage().nbytes()

    params = list(model.parameters())
    for p in params:
        add(p)
    for group in optimizer.param_groups:
        for p in group['params']:
            add(p)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return sum(seen.values()) / sum(p.numel() for p in params)


# ---- the child process: one run ------------------------------------------------------------------
def _probe_hook_class():
    import resource

    import torch
    from mmengine.hooks import Hook
    from mmengine.registry import HOOKS

    @HOOKS.register_module(force=True)
    class CompareProbeHook(Hook):
        """Times training iterations, tracks peak memory and keeps the last validation metrics."""

        priority = 'VERY_LOW'

        def __init__(self, progress_file: str) -> None:
            self.progress_file = progress_file
            self.iter_times: List[float] = []
            self.metrics: Dict[str, float] = {}
            self._t0 = 0.0
            self.rss0_kb = 0
            self.peak_bytes: Optional[int] = None

        def before_train(self, runner) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.rss0_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
            self._t0 = time.perf_counter()

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # time the work, not its launch
            self.iter_times.append(time.perf_counter() - self._t0)
            it = runner.iter + 1
            if it % 5 == 0 or it == runner.max_iters:
                with open(self.progress_file, 'w') as f:
                    f.write(f'{it} {runner.max_iters}')

        def after_train(self, runner) -> None:
            if torch.cuda.is_available():
                self.peak_bytes = int(torch.cuda.max_memory_allocated())
            else:
                rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                self.peak_bytes = int(max(rss1 - self.rss0_kb, 0) * 1024)  # Linux: kilobytes

        def after_val_epoch(self, runner, metrics=None) -> None:
            self.metrics = {k: float(v) for k, v in (metrics or {}).items()}

    return CompareProbeHook


def _run_one(config: str, level: str, dtype: str, iters: Optional[int], work_dir: str,
             result_path: str, cfg_options: Optional[dict], master: Optional[str] = None,
             state: Optional[str] = None) -> None:
    import torch
    from mmengine.config import Config
    from mmengine.runner import Runner

    import mp_wrappers  # noqa: F401  (registries, secure checkpoint loader)
    from mp_wrappers.launch import configure_torch_threads
    from mp_wrappers.train_config import add_mixed_precision_hook

    probe_cls = _probe_hook_class()
    cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    os.makedirs(work_dir, exist_ok=True)
    build_run_config(cfg, level, dtype, iters, work_dir, master, state)
    add_mixed_precision_hook(cfg)
    threads = configure_torch_threads(cfg)
    runner = Runner.from_cfg(cfg)
    runner.train()
    probe = next(h for h in runner.hooks if isinstance(h, probe_cls))
    wrapper = runner.optim_wrapper
    losses = runner.message_hub.get_scalar('train/loss').data[0][-_LOSS_WINDOW:]
    warmup = max(1, len(probe.iter_times) // 10)
    timed = probe.iter_times[warmup:] or probe.iter_times
    result = dict(
        level=level, dtype=dtype, master=master, states=state, iters=len(probe.iter_times),
        state_dtype=measured_state_dtype(wrapper.optimizer),
        bytes_per_param=persistent_bytes_per_param(runner.model, wrapper.optimizer),
        time_per_iter=sum(timed) / len(timed),
        peak_memory_bytes=probe.peak_bytes,
        memory_kind='cuda_max_allocated' if torch.cuda.is_available() else 'cpu_peak_rss_growth',
        final_train_loss=float(sum(losses) / len(losses)),
        metrics=probe.metrics,
        skipped=int(sum(s.skipped_steps for s in wrapper.loss_scalers)),
        loss_scale=float(wrapper.loss_scale),
        threads=threads if threads is not None else torch.get_num_threads())
    with open(result_path, 'w') as f:
        json.dump(result, f)


# ---- the parent: runs, progress, table --------------------------------------------------------------
def _fmt(value: Optional[float], digits: int = 4) -> str:
    if value is None:
        return '-'
    return f'{value:.{digits}f}'


def _reference_run(results: Sequence[Dict[str, Any]], level: str) -> Optional[Dict[str, Any]]:
    """The successful run of ``level`` that others are compared with: plain masters, and fp32
    optimizer states where a ``--state-dtypes`` run of them exists."""
    runs = [r for r in results if r['level'] == level and not r.get('master') and 'error' not in r]
    return next((r for r in runs if r.get('states') in (None, 'float32')), runs[0] if runs else None)


def _label(r: Dict[str, Any]) -> str:
    """``O2 bfloat16``, ``O2 bfloat16 int8 states``: a run in the fidelity bar's lines."""
    return f"{r['level']} {r['dtype']}" + (f" {r['states']} states" if r.get('states') else '')


def format_table(results: Sequence[Dict[str, Any]]) -> str:
    """One Markdown table: a row per run (failed runs say so), O0 speed-up and metric deltas."""
    metric_names: List[str] = []
    for r in results:
        for k in r.get('metrics', {}):
            if k not in metric_names:
                metric_names.append(k)
    base = _reference_run(results, 'O0')
    o2 = _reference_run(results, 'O2')
    with_bpp = any('bytes_per_param' in r for r in results)
    mem_kind = next((r['memory_kind'] for r in results if 'memory_kind' in r), 'cpu_peak_rss_growth')
    mem_head = 'peak mem (MiB, CUDA)' if mem_kind == 'cuda_max_allocated' else \
        'peak RSS growth (MiB)'
    head = ['level', 'dtype', 'states', 'ms/iter', 'speed-up vs O0', mem_head, 'final train loss',
            *[f'val {m}' for m in metric_names], 'skipped steps']
    if with_bpp:
        head[3:3] = ['B/param']
        head[5:5] = ['time vs O2']
    if base:
        head[-1:-1] = [f'Δ {m} vs O0' for m in metric_names]
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '|'.join('---' for _ in head) + '|']
    for r in results:
        if 'error' in r:
            cells = [r['level'], r['dtype'], r.get('states') or '-', f"failed: {r['error']}"]
            cells += [''] * (len(head) - 4)
            lines.append('| ' + ' | '.join(cells) + ' |')
            continue
        mem = r['peak_memory_bytes']
        level = r['level'] + (f" master_weights={r['master']}" if r.get('master') else '')
        cells = [level, r['dtype'], r.get('state_dtype') or '-', _fmt(1e3 * r['time_per_iter'], 1),
                 _fmt(base['time_per_iter'] / r['time_per_iter'], 2) + 'x' if base else '-',
                 _fmt(mem / 2 ** 20, 1) if mem is not None else '-',
                 _fmt(r['final_train_loss'])]
        cells += [_fmt(r['metrics'].get(m)) for m in metric_names]
        if base:
            for m in metric_names:
                v, b = r['metrics'].get(m), base['metrics'].get(m)
                if v is None or b is None:
                    cells.append('-')
                elif abs(b) > 0 and 'acc' not in m:
                    cells.append(f'{100 * (v - b) / abs(b):+.2f}%')
                else:  # accuracy is already a percentage: report points
                    cells.append(f'{v - b:+.2f}')
        cells.append(str(r['skipped']))
        if with_bpp:
            cells[3:3] = [_fmt(r.get('bytes_per_param'), 2)]
            cells[5:5] = [_fmt(r['time_per_iter'] / o2['time_per_iter'], 2) + 'x' if o2 else '-']
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def parse_bar(items: Sequence[str]) -> Dict[str, float]:
    """``['accuracy=1', 'val_ce=2']`` -> {'accuracy': 1.0, 'val_ce': 2.0}, with clear errors."""
    bars = {}
    for item in items:
        name, sep, value = item.partition('=')
        try:
            tol = float(value)
        except ValueError:
            tol = -1.0
        if not sep or not name or not tol >= 0:
            raise ValueError(f'--bar {item!r}: expected METRIC=TOLERANCE with a tolerance >= 0, '
                             "e.g. --bar accuracy=1 (points) or --bar val_ce=2 (percent)")
        bars[name] = tol
    return bars


def check_bar(results: Sequence[Dict[str, Any]], bars: Dict[str, float],
              levels: Sequence[str] = ('O1', 'O2')) -> Tuple[bool, List[str]]:
    """Whether every run at ``levels`` is within ``bars`` of the O0 run, and a line per check.

    A metric with 'acc' in its name is a percentage and may drop at most TOLERANCE points; any other
    metric is a loss and may rise at most TOLERANCE percent of the O0 value (improvements pass). A
    missing O0 run, a failed run or a missing metric fails the bar: it cannot be shown to be met.
    """
    base = _reference_run(results, 'O0')
    if base is None:
        return False, ['fidelity bar: no successful O0 run to compare with']
    ok, lines = True, []
    for r in results:
        if r['level'] not in levels or r.get('master'):
            continue
        run = _label(r)
        if 'error' in r:
            ok = False
            lines.append(f"fidelity bar: {run}: MISSED (the run failed: {r['error']})")
            continue
        for name, tol in bars.items():
            v, b = r['metrics'].get(name), base['metrics'].get(name)
            if v is None or b is None:
                ok = False
                lines.append(f'fidelity bar: {run}: MISSED (no metric {name!r}; the runs have '
                             f"{sorted(set(r['metrics']) | set(base['metrics']))})")
                continue
            if 'acc' in name:
                delta, unit, met = v - b, 'points', v - b >= -tol
            else:
                delta = 100 * (v - b) / abs(b) if b else math.inf
                unit, met = '%', delta <= tol
            ok &= met
            lines.append(f"fidelity bar: {run}: {name} {v:.4f} vs O0 {b:.4f} ({delta:+.2f} {unit}, "
                         f"allowed {'-' if 'acc' in name else '+'}{tol:g}): "
                         f"{'met' if met else 'MISSED'}")
    return ok, lines


def _machine() -> str:
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        out = subprocess.run(['lscpu'], capture_output=True, text=True, timeout=10).stdout
        name = next((ln.split(':', 1)[1].strip() for ln in out.splitlines()
                     if ln.startswith('Model name')), platform.processor())
    except (OSError, subprocess.SubprocessError):
        name = platform.processor() or 'unknown CPU'
    return f'{name}, {os.cpu_count()} CPUs'


def _progress():
    try:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)
    except ImportError:  # rich comes with mmengine; degrade to plain lines without it
        return None
    return Progress(TextColumn('{task.description}'), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=False)


def _start(args: argparse.Namespace, level: str, dtype: str, run_dir: str,
           master: Optional[str] = None,
           state: Optional[str] = None) -> Tuple[subprocess.Popen, str, str]:
    """Start the child process of one run; returns it, its progress file and its result file."""
    os.makedirs(run_dir, exist_ok=True)
    result_path = osp.join(run_dir, 'result.json')
    progress_file = osp.join(run_dir, 'progress')
    for path in (result_path, progress_file):
        if osp.exists(path):
            os.remove(path)  # a stale file from an earlier comparison must not pass for this run
    cmd = [sys.executable, osp.abspath(__file__), args.config, '--run-one', level, dtype,
           '--work-dir', run_dir]
    if args.iters is not None:
        cmd += ['--iters', str(args.iters)]
    if master is not None:
        cmd += ['--master-one', master]
    if state is not None:
        cmd += ['--state-one', state]
    if args.cfg_options:
        cmd += ['--cfg-options', *args.raw_cfg_options]
    env = dict(os.environ)
    env['PYTHONPATH'] = _ROOT + os.pathsep + env.get('PYTHONPATH', '')
    with open(osp.join(run_dir, 'run.log'), 'w') as log:  # the child keeps its own handle
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, progress_file, result_path


def _result(proc: subprocess.Popen, level: str, dtype: str, run_dir: str,
            result_path: str, master: Optional[str] = None,
            state: Optional[str] = None) -> Dict[str, Any]:
    if proc.returncode == 0 and osp.exists(result_path):
        with open(result_path) as f:
            return json.load(f)
    return dict(level=level, dtype=dtype, master=master, states=state,
                error=f'exit code {proc.returncode}, see {osp.join(run_dir, "run.log")}')


def _run_all(args: argparse.Namespace,
             runs: List[Tuple[str, str, Optional[str], Optional[str]]]) -> List[Dict[str, Any]]:
    results = []
    progress = None if args.no_progress else _progress()
    if progress is not None:
        progress.start()
    try:
        overall = progress.add_task('all runs', total=len(runs)) if progress else None
        for level, dtype, master, state in runs:
            run_dir = osp.join(args.work_dir, run_name(level, dtype, master, state))
            what = f'{level} {dtype}' + (f' {state} states' if state else '')
            task = progress.add_task(what, total=args.iters) if progress else None
            if progress is None:
                print(f'compare_precision: training {what} ...', flush=True)
            proc, progress_file, result_path = _start(args, level, dtype, run_dir, master, state)
            while proc.poll() is None:
                time.sleep(0.5)
                if progress is not None and osp.exists(progress_file):
                    try:
                        with open(progress_file) as f:
                            done, total = map(int, f.read().split())
                        progress.update(task, completed=done, total=total)
                    except ValueError:
                        pass  # caught the file mid-write
            results.append(_result(proc, level, dtype, run_dir, result_path, master, state))
            if progress is not None:
                progress.update(task, completed=progress.tasks[task].total or 1)
                progress.advance(overall)
    finally:
        if progress is not None:
            progress.stop()
    return results


def _check_config_takes_state_dtype(args: argparse.Namespace) -> None:
    from mmengine.config import Config
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    build_run_config(cfg, 'O2', 'bfloat16', None, args.work_dir, state=args.state_dtypes[0])


def parse_args(argv=None) -> argparse.Namespace:
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser(
        description='Train a config under several apex opt levels/dtypes and compare them')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--iters', type=int, default=None,
                        help='iterations per run (IterBasedTrainLoop, validation at the end); '
                        "default: the config's own loop")
    parser.add_argument('--levels', nargs='+', default=list(LEVELS), help='opt levels (O0-O3)')
    parser.add_argument('--dtypes', nargs='+', default=['bfloat16'],
                        help='half types for O1-O3: float16 and/or bfloat16 (default bfloat16)')
    parser.add_argument('--out', default=None, help='write the Markdown table here')
    parser.add_argument('--work-dir', default=None,
                        help='runs write logs under WORK_DIR/<level>_<dtype> '
                        '(default: work_dirs/compare_<config name>)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings for every run')
    parser.add_argument('--no-progress', action='store_true', help='plain lines, no progress bar')
    parser.add_argument('--masters', nargs='+', default=[],
                        help='also train O2 bf16 with master_weights=MODE for each MODE: split, '
                        "kahan, stochastic, optionally suffixed '-bf16state' (bf16 optimizer state)")
    parser.add_argument('--state-dtypes', nargs='+', default=[], metavar='STATE',
                        help='train every level/dtype once per optimizer state_dtype: float32, '
                        "int8 (needs mp_wrappers.FusedAdam or FusedSGD); default: the config's "
                        'optimizer as it is')
    parser.add_argument('--run-one', nargs=2, metavar=('LEVEL', 'DTYPE'), help=argparse.SUPPRESS)
    parser.add_argument('--bar', nargs='+', default=[], metavar='METRIC=TOL',
                        help='fail (exit 1) unless every O1/O2 run is within TOL of O0: points '
                             "for accuracy metrics, percent for losses (e.g. accuracy=1, val_ce=2)")
    parser.add_argument('--master-one', default=None, help=argparse.SUPPRESS)
    parser.add_argument('--state-one', default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # Hand the raw option strings on to the child processes.
    raw = list(argv if argv is not None else sys.argv[1:])
    args.raw_cfg_options = []
    if '--cfg-options' in raw:
        for item in raw[raw.index('--cfg-options') + 1:]:
            if item.startswith('--'):
                break
            args.raw_cfg_options.append(item)
    if args.work_dir is None:
        args.work_dir = osp.join('work_dirs', 'compare_' + osp.splitext(osp.basename(args.config))[0])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run_one:
        level, dtype = args.run_one
        _run_one(args.config, level, dtype, args.iters, args.work_dir,
                 osp.join(args.work_dir, 'result.json'), args.cfg_options, args.master_one,
                 args.state_one)
        return 0
    if not osp.isfile(args.config):
        print(f'compare_precision.py: error: config {args.config!r} does not exist', file=sys.stderr)
        return 2
    try:
        bars = parse_bar(args.bar)
        states = check_state_dtypes(args.state_dtypes) or [None]
        runs = [(level, dtype, None, state) for level, dtype in plan_runs(args.levels, args.dtypes)
                for state in states]
        for master in args.masters:
            parse_master_mode(master)
            runs.append(('O2', 'bfloat16', master, None))
        if args.state_dtypes:  # refuse another optimizer here, not once per child process
            _check_config_takes_state_dtype(args)
    except ValueError as exc:
        print(f'compare_precision.py: error: {exc}', file=sys.stderr)
        return 2
    started = datetime.datetime.now()
    results = _run_all(args, runs)

    import torch
    budget = f'{args.iters} iterations' if args.iters else "the config's own schedule"
    header = (f'`{args.config}`, {budget} per run, seed from the config; '
              f'{_machine()}; torch {torch.__version__}; {started:%Y-%m-%d %H:%M}')
    table = format_table(results)
    print(header)
    print(table)
    if args.out:
        os.makedirs(osp.dirname(osp.abspath(args.out)), exist_ok=True)
        with open(args.out, 'w') as f:
            f.write(header + '\n\n' + table + '\n')
        with open(osp.splitext(args.out)[0] + '.json', 'w') as f:
            json.dump(dict(config=args.config, iters=args.iters, results=results), f, indent=1)
        print(f'wrote {args.out}')
    failed = any('error' in r for r in results)
    if bars:
        met, lines = check_bar(results, bars)
        print('\n'.join(lines))
        if args.out:
            with open(args.out, 'a') as f:
                f.write('\n' + '\n'.join(f'- {line}' for line in lines) + '\n')
        failed |= not met
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
