"""Line coverage of the CUDA kernel sources under host execution (tools/cuda_host_check.sh).

Runs gcov (JSON output) on the objects of the host-execution builds (build/cuda_host/<variant>),
merges the line counts of every variant, and reports the executable lines of the kernel sources
(mp_wrappers/csrc/cuda/*.cu and mp_wrappers/csrc/include/mp_wrappers/cuda/*.cuh) that ran at least
once. Prints `cuda host coverage: NN.N%` and, with --uncovered, every line that never ran.

Usage: python tools/cuda_host_coverage.py [--variants real,tiny] [--uncovered] [--min 95]
"""
import argparse
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_DIRS = [os.path.join(ROOT, 'mp_wrappers', 'csrc', 'cuda'),
               os.path.join(ROOT, 'mp_wrappers', 'csrc', 'include', 'mp_wrappers', 'cuda')]


def _is_kernel_source(path):
    path = os.path.realpath(path)
    return path.endswith(('.cu', '.cuh')) and any(
        os.path.dirname(path) == os.path.realpath(d) for d in KERNEL_DIRS)


def line_counts(variants):
    """{source: {line: count}} over the executable lines of the kernel sources."""
    counts = defaultdict(lambda: defaultdict(int))
    for variant in variants:
        objs = glob.glob(os.path.join(ROOT, 'build', 'cuda_host', variant, '*.o'))
        objs = [o for o in objs if os.path.exists(os.path.splitext(o)[0] + '.gcda')]
        if not objs:
            sys.exit(f'cuda host coverage: no gcov data for variant {variant!r} '
                     '(build and run its tests first)')
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(['gcov', '--json-format', '--object-directory',
                            os.path.dirname(objs[0])] + objs, cwd=tmp, check=True,
                           capture_output=True)
            for gz in glob.glob(os.path.join(tmp, '*.gcov.json.gz')):
                with gzip.open(gz, 'rt') as f:
                    data = json.load(f)
                for fdata in data['files']:
                    src = fdata['file']
                    if not os.path.isabs(src):
                        src = os.path.join(data.get('current_working_directory', ROOT), src)
                    if not _is_kernel_source(src):
                        continue
                    src = os.path.relpath(os.path.realpath(src), ROOT)
                    for line in fdata['lines']:
                        counts[src][line['line_number']] += line['count']
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--variants', default='real,tiny')
    parser.add_argument('--uncovered', action='store_true', help='list the lines never executed')
    parser.add_argument('--min', type=float, default=0.0, help='fail below this percentage')
    args = parser.parse_args()
    counts = line_counts(args.variants.split(','))
    total = sum(len(lines) for lines in counts.values())
    hit = sum(1 for lines in counts.values() for c in lines.values() if c > 0)
    for src in sorted(counts):
        lines = counts[src]
        n_hit = sum(1 for c in lines.values() if c > 0)
        print(f'  {src}: {n_hit}/{len(lines)}')
        if args.uncovered:
            text = open(os.path.join(ROOT, src)).read().splitlines()
            for ln in sorted(k for k, c in lines.items() if c == 0):
                print(f'    {ln}: {text[ln - 1].strip()}')
    pct = 100.0 * hit / total if total else 0.0
    print(f'cuda host coverage: {pct:.1f}%')
    if pct < args.min:
        print(f'cuda host coverage: below the required {args.min:.1f}%', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
