"""Compile every CUDA source exactly as setup.py's build would, and report registers and spills.

Run through ``tools/check_cuda_compile.sh`` (CI does). Needs nvcc, not a GPU and not a CUDA build of
torch. Each ``.cu`` file under mp_wrappers/csrc/cuda (found by glob, so new and renamed files are
checked too) is compiled once with the flags and defines of build_config.py, which setup.py builds
with, for sm_70, sm_80, sm_90 and the toolkit's newest arch (those the toolkit supports; the others
are reported as skipped, with the reason), with ``-Xptxas -v``. Files run in parallel (``--jobs``,
default 2). Exit status 1 if any file fails to compile; spills are reported, and are an error with
``--fail-on-spill``.

Device code is what the check is for (registers, spills, every arch), so most files are compiled to
a fatbin (``nvcc -fatbin``: the front end still parses the whole file, host functions included,
then cicc and ptxas per arch) and skip nvcc's host half (cudafe++ and the host compiler on its
output: a third of a file's CPU time, ~50 of ~150 s for multi_tensor_adam8bit.cu on the 2-core Zen
3). The host half is the same for every file (torch's headers through nvcc and the host compiler
in torch's C++ standard), so one file (HOST_COMPILED, the one with the most host code) is compiled
whole, as setup.py does; the host code of every file is also compiled by g++ in the host-execution
builds (docs/cuda.md).
"""
import argparse
import concurrent.futures
import dataclasses
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import build_config  # noqa: E402

REQUESTED = ('sm_70', 'sm_80', 'sm_90', 'newest')
# Compiled whole (host half too, to an object file); the others device-only (module docstring).
HOST_COMPILED = 'mp_wrappers/csrc/cuda/multi_tensor_adam8bit.cu'


@dataclasses.dataclass
class ArchReport:
    kernels: int = 0
    max_registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    max_stack: int = 0


def parse_ptxas(output: str) -> Dict[str, ArchReport]:
    """Per-arch totals from ``-Xptxas -v`` output (a kernel's lines follow its 'Compiling entry')."""
    reports: Dict[str, ArchReport] = {}
    current: Optional[ArchReport] = None
    for line in output.splitlines():
        m = re.search(r"Compiling entry function '.*' for '(sm_\d+a?)'", line)
        if m:
            current = reports.setdefault(m.group(1), ArchReport())
            current.kernels += 1
            continue
        if current is None:
            continue
        m = re.search(r'(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads',
                      line)
        if m:
            current.max_stack = max(current.max_stack, int(m.group(1)))
            current.spill_stores += int(m.group(2))
            current.spill_loads += int(m.group(3))
            continue
        m = re.search(r'Used (\d+) registers', line)
        if m:
            current.max_registers = max(current.max_registers, int(m.group(1)))
    return reports


def choose_archs(supported: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(archs to build, 'sm_70: why' lines) for REQUESTED, given the toolkit's real archs ('9.0')."""
    have = {f"sm_{a.replace('.', '')}": a for a in supported}
    newest = f"sm_{supported[-1].replace('.', '')}" if supported else None
    archs, skipped = [], []
    for want in REQUESTED:
        arch = newest if want == 'newest' else want
        if arch is None:
            skipped.append(f'{want}: nvcc --list-gpu-arch listed nothing')
        elif arch not in have:
            skipped.append(f'{arch}: not supported by this nvcc (it supports '
                           f"{', '.join(sorted(have, key=lambda s: int(s[3:])))})")
        elif arch not in archs:
            archs.append(arch)
    return archs, skipped


def host_compiled(files: Sequence[str]) -> str:
    """The file whose host half is compiled too: HOST_COMPILED, or the first file if it is not among
    them (a rename, or a list given on the command line), so the host half is never left out."""
    return HOST_COMPILED if HOST_COMPILED in files else files[0]


def compile_one(nvcc: str, path: str, archs: Sequence[str], args: Sequence[str], out_dir: str,
                whole: bool):
    """nvcc on one file: to an object file (``whole``) or to a device-only fatbin."""
    out = os.path.join(out_dir, os.path.basename(path) + ('.o' if whole else '.fatbin'))
    cmd = [nvcc, '-c' if whole else '-fatbin', path, '-o', out, *args, '-Xptxas', '-v']
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    output = proc.stdout.read()
    proc.stdout.close()
    # CPU time of nvcc and its children: on a shared machine the wall time says little.
    _, status, usage = os.wait4(proc.pid, 0)
    rc = proc.returncode = os.waitstatus_to_exitcode(status)
    return path, rc, output, time.monotonic() - start, usage.ru_utime + usage.ru_stime


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('files', nargs='*', help='.cu files (default: every one under csrc/cuda)')
    parser.add_argument('--jobs', type=int, default=int(os.environ.get('JOBS', '2')))
    parser.add_argument('--fail-on-spill', action='store_true')
    parser.add_argument('--nvcc', default=os.environ.get('NVCC', 'nvcc'))
    opts = parser.parse_args(argv)

    listing = subprocess.run([opts.nvcc, '--list-gpu-arch'], capture_output=True, text=True).stdout
    release = build_config.nvcc_release(
        subprocess.run([opts.nvcc, '--version'], capture_output=True, text=True).stdout)
    archs, skipped = choose_archs(build_config.supported_archs(listing))
    files = opts.files or sorted(glob.glob(os.path.join('mp_wrappers', 'csrc', 'cuda', '**', '*.cu'),
                                           root_dir=REPO, recursive=True))
    if not files:
        print('check_cuda_compile: no .cu files found under mp_wrappers/csrc/cuda')
        return 1
    args = build_config.nvcc_compile_args(archs)
    print(f'check_cuda_compile: nvcc {release}, {len(files)} files, archs {" ".join(archs)}, '
          f'{opts.jobs} jobs')
    for line in skipped:
        print(f'  skipped {line}')
    print('  flags: ' + ' '.join(a for a in args if not a.startswith('-I')))
    whole = host_compiled(files)
    print(f'  device code of every file; host half of {whole} only (module docstring)')

    status, cpu_total = 0, 0.0
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as out_dir, \
            concurrent.futures.ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        # The whole compile first: it is the longest, so it does not end the run alone.
        ordered = [whole] + [f for f in files if f != whole]
        futures = [pool.submit(compile_one, opts.nvcc, f, archs, args, out_dir, f == whole)
                   for f in ordered]
        for fut in concurrent.futures.as_completed(futures):
            path, rc, output, seconds, cpu = fut.result()
            half = 'device and host' if path == whole else 'device only'
            cpu_total += cpu
            if rc != 0:
                status = 1
                print(f'FAIL  {path} ({seconds:.0f} s)\n{output[-4000:]}', flush=True)
                continue
            reports = parse_ptxas(output)
            spilled = False
            for arch in archs:
                r = reports.get(arch, ArchReport())
                spill = r.spill_stores + r.spill_loads
                spilled |= spill > 0
                print(f'ok    {path} {arch}: {r.kernels} kernels, max {r.max_registers} registers, '
                      f'max stack {r.max_stack} B, spill stores {r.spill_stores} B, '
                      f'spill loads {r.spill_loads} B{"  <-- SPILLS" if spill else ""}')
            if spilled and opts.fail_on_spill:
                status = 1
            print(f'      {path} ({half}): {seconds:.0f} s wall, {cpu:.0f} s CPU')
    print(f'check_cuda_compile: {"FAILED" if status else "passed"} in '
          f'{time.monotonic() - start:.0f} s wall, {cpu_total:.0f} s CPU (nvcc and children)')
    return status


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
