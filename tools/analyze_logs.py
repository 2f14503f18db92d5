"""Plot training curves from mmengine's ``vis_data/scalars.json`` (loss, lr, amp_scale, accuracy, ...).

Examples:
    python tools/analyze_logs.py plot work_dirs/cnn_fp16_dynamic/20261121_101500/vis_data/scalars.json \\
        --keys loss amp_scale --out curve.png
    # compare runs: one colour per file, one panel per key
    python tools/analyze_logs.py plot work_dirs/a/*/vis_data/scalars.json \\
        work_dirs/b/*/vis_data/scalars.json --keys loss accuracy --out compare.png

Each panel draws one key over training iterations. Loss-scale keys (``amp_scale``, ``amp_scale_<k>``)
use a log axis, since the scale moves by factors of 2. Skipped optimizer steps (where ``amp_skipped``
grew between two log lines) are marked as short vertical ticks at the bottom of every panel, in the
file's colour. Validation rows (``accuracy``, ``val_loss``, ...) carry no iteration of their own: they
are drawn at the iteration of the training row logged just before them.
"""
import argparse
import json
import math
import os.path as osp
import sys
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ['load_scalars', 'plot_curves', 'main']

Row = Dict[str, float]


def load_scalars(path: str) -> List[Row]:
    """Read a ``scalars.json`` (one JSON object per line), adding ``_x``: the iteration of each row.

    Args:
        path: The file mmengine's ``LocalVisBackend`` wrote.

    Returns:
        The rows, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not a JSON object.
    """
    if not osp.isfile(path):
        raise FileNotFoundError(f'{path}: no such file; expected <work_dir>/<timestamp>/vis_data/'
                                'scalars.json written by mmengine (LocalVisBackend)')
    rows: List[Row] = []
    last_iter = 0.0
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)  # python's json reads the Infinity/NaN mmengine writes
            except json.JSONDecodeError as exc:
                raise ValueError(f'{path}:{n}: not a JSON line ({exc})') from None
            if not isinstance(row, dict):
                raise ValueError(f'{path}:{n}: expected a JSON object, got {type(row).__name__}')
            # Training rows have 'iter'; validation rows only 'step' (the epoch when by_epoch).
            if 'iter' in row:
                last_iter = float(row['iter'])
            row['_x'] = last_iter
            rows.append(row)
    return rows


def _available(rows: Sequence[Row]) -> List[str]:
    return sorted({k for r in rows for k in r if not k.startswith('_')} - {'iter', 'epoch', 'step'})


def _series(rows: Sequence[Row], key: str) -> Tuple[List[float], List[float]]:
    xs, ys = [], []
    for r in rows:
        if key in r and isinstance(r[key], (int, float)):
            xs.append(r['_x'])
            ys.append(float(r[key]))
    return xs, ys


def _skipped_at(rows: Sequence[Row]) -> List[float]:
    """Iterations of the log lines after which ``amp_skipped`` had grown (one tick per skip)."""
    ticks, prev = [], 0.0
    for r in rows:
        if 'amp_skipped' in r:
            grew = int(round(float(r['amp_skipped']) - prev))
            ticks += [r['_x']] * max(grew, 0)
            prev = float(r['amp_skipped'])
    return ticks


def _label(path: str, paths: Sequence[str]) -> str:
    # <work_dir>/<timestamp>/vis_data/scalars.json -> <work_dir name>/<timestamp>
    parts = osp.normpath(osp.abspath(path)).split(osp.sep)
    if len(parts) >= 4 and parts[-2] == 'vis_data':
        return f'{parts[-4]}/{parts[-3]}'
    return path if len(paths) > 1 else osp.basename(path)


def plot_curves(json_paths: Sequence[str], keys: Sequence[str], out: str,
                title: Optional[str] = None) -> str:
    """Draw ``keys`` from one or several ``scalars.json`` files into a PNG (or any matplotlib format).

    Args:
        json_paths: The scalars files; each gets a colour.
        keys: Keys to plot, one panel each (``loss``, ``lr``, ``amp_scale``, ``accuracy``, ...).
        out: The output image path.
        title: Figure title. Defaults to none.

    Returns:
        ``out``.

    Raises:
        FileNotFoundError: a file is missing.
        KeyError: a key is in none of the rows of a file; the message lists the keys it has.
    """
    if not json_paths:
        raise ValueError('give at least one scalars.json file')
    if not keys:
        raise ValueError('give at least one key with --keys (e.g. --keys loss amp_scale)')
    runs = [(p, load_scalars(p)) for p in json_paths]
    for path, rows in runs:
        missing = [k for k in keys if not _series(rows, k)[0]]
        if missing:
            raise KeyError(f'{path} has no values for key(s) {", ".join(map(repr, missing))}; '
                           f'available keys: {", ".join(_available(rows)) or "none"}')

    import matplotlib
    matplotlib.use('Agg')  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, sharex=True, squeeze=False,
                             figsize=(8, 2.6 * len(keys) + 0.6))
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    any_skips = False
    for i, (path, rows) in enumerate(runs):
        color = colors[i % len(colors)]
        label = _label(path, json_paths)
        skips = _skipped_at(rows)
        any_skips = any_skips or bool(skips)
        for ax, key in zip(axes[:, 0], keys):
            xs, ys = _series(rows, key)
            finite = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
            is_scale = key.startswith('amp_scale')
            # A loss scale changes by factors of 2: a step curve shows when it changed.
            style = dict(drawstyle='steps-post') if is_scale else {}
            marker = 'o' if len(finite) < 30 else None
            ax.plot([x for x, _ in finite], [y for _, y in finite], color=color, label=label,
                    marker=marker, markersize=3, **style)
            if len(finite) < len(xs):  # inf/nan losses: mark where they were logged
                bad = [x for x, y in zip(xs, ys) if not math.isfinite(y)]
                ax.plot(bad, [0.0] * len(bad), linestyle='none', marker='x', color=color,
                        transform=ax.get_xaxis_transform(), clip_on=False)
            if skips:
                ax.plot(skips, [0.0] * len(skips), linestyle='none', marker='|', markersize=14,
                        color=color, alpha=0.7, transform=ax.get_xaxis_transform(), clip_on=False)
            if is_scale:
                ax.set_yscale('log', base=2)
            ax.set_ylabel(key)
            ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel('iteration')
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if any_skips:
        from matplotlib.lines import Line2D
        handles.append(Line2D([], [], linestyle='none', marker='|', markersize=12, color='gray'))
        labels.append('skipped step (overflow)')
    axes[0, 0].legend(handles, labels, fontsize='small', loc='best')
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Analyse mmengine training logs (scalars.json)')
    sub = parser.add_subparsers(dest='command', required=True)
    plot = sub.add_parser('plot', help='plot keys over iterations')
    plot.add_argument('json', nargs='+', help='vis_data/scalars.json file(s); several compare runs')
    plot.add_argument('--keys', nargs='+', default=['loss'],
                      help='keys to plot, one panel each (default: loss)')
    plot.add_argument('--out', required=True, help='output image, e.g. curve.png')
    plot.add_argument('--title', default=None, help='figure title')
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        out = plot_curves(args.json, args.keys, args.out, title=args.title)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        # KeyError's str() adds quotes around the message.
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        print(f'analyze_logs.py: error: {msg}', file=sys.stderr)
        return 2
    print(f'saved {out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
