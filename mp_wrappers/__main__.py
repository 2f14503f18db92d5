"""``python -m mp_wrappers``: the doctor. What is installed, what the hardware runs natively, what
``dtype='auto'`` picks, and a self-test of every compiled op against its reference.

The output is plain text meant to be pasted into a bug report. The exit status is 0 when everything
that is present works, 1 when something is broken: the extension failed to load (other than being
disabled on purpose), or an op disagreed with its reference. ``--no-selftest`` skips the self-test.
"""
import argparse
import platform
import sys
from typing import List, Optional

import torch

from . import __version__, compat, hardware
from .selftest import run_selftest


def _versions() -> List[str]:
    try:
        import mmengine
        mmengine_version = mmengine.__version__
    except Exception as exc:  # the doctor must report, not crash
        mmengine_version = f'not importable ({type(exc).__name__}: {exc})'
    from .ops import _extension
    ext = _extension.extension()
    compiler = getattr(ext, 'compiler', None) if ext is not None else None
    torch_compiler = next((line.strip().lstrip('- ') for line in torch.__config__.show().splitlines()
                           if 'C++ Version' in line or 'GCC' in line), 'unknown')
    return [
        f'python       {platform.python_version()} ({platform.platform()})',
        f'torch        {torch.__version__} (CUDA {torch.version.cuda or "none"}; built with '
        f'{torch_compiler})',
        f'mmengine     {mmengine_version}',
        f'mp_wrappers  {__version__} ({__file__.rsplit("/", 2)[0]})',
        f'extension    compiled with {compiler or "unknown (older build)"}',
        _gated_line(),
    ]


def _gated_line() -> str:
    """Which features need a newer torch than this one (docs/compatibility.md)."""
    missing = [f'{name} (torch >= {f.min_torch})' for name, f in compat.FEATURES.items()
               if not compat.has(name)]
    return ('gated        ' + (', '.join(missing) + ': need a newer torch' if missing
                               else f'none (every feature available on torch {torch.__version__})'))


def _extension_lines(info: dict) -> List[str]:
    backend = info['backend']
    lines = [f'backend      cpu: {backend["cpu"]}, cuda: {backend["cuda"]}']
    if not backend['extension']:
        lines.append(f'             extension not loaded: {info.get("why_missing")}; the '
                     'pure-PyTorch references run (correct, slower). Rebuild with '
                     '`pip install --no-build-isolation -e .`')
        return lines
    widest = info.get('cpu_kernels_widest')
    forced = info.get('cpu_isa_forced')
    lines.append(f'cpu kernels  {info["cpu_kernels"]} in use; widest this CPU runs: {widest}'
                 + (f' (MP_WRAPPERS_CPU_ISA={forced})' if forced else ''))
    if info.get('cuda_why_missing'):
        lines.append(f'cuda kernels {info["cuda_why_missing"]}')
    else:
        lines.append('cuda kernels built and a GPU is present')
    return lines


def _quantized_lines(info: dict) -> List[str]:
    """``FusedAdam(state_dtype='int8')``: the kernels that run it (or CUDA's refusal), bytes per
    param."""
    cpu = info['cpu']
    lines = [f'cpu          {cpu} kernel' if cpu != 'reference' else
             'cpu          no compiled kernel: the pure-PyTorch reference runs (same bits, slower)',
             'cuda         cuda kernel' if info['cuda'] else
             'cuda         this build has no CUDA kernels: CUDA params with state_dtype=\'int8\' are '
             "refused (NotImplementedError) at the first step, before any update; set "
             "optim_wrapper.optimizer.state_dtype='float32' there",
             f"sgd          FusedSGD(state_dtype='int8'): {info['sgd_cpu']} on cpu, "
             + ('cuda kernel' if info['sgd_cuda'] else 'no CUDA kernel (CUDA params refused)')
             + "; fp32 / half params, and bf16 params with a lean master_weights ('split', "
             "'kahan', 'stochastic'), the storage stepped in the same pass"]
    lines.append(f'bytes/param  (fp32 moments -> int8 moments, blocks of {info["block_size"]}; '
                 'grads not counted)')
    for what, (fp32, int8) in info['bytes_per_param'].items():
        lines.append(f'             {what}: {fp32:.2f} -> {int8:.2f}')
    return lines


def _device_lines(rep: dict) -> List[str]:
    lines = []
    for d in rep['devices']:
        native = ', '.join(d['native']) or 'none'
        lines.append(f'{d["device"]:<12} {d["name"]} ({d["isa"]}); native low precision: {native}')
        if d['features']:
            lines.append(f'             flags: {" ".join(d["features"])}')
        for note in d['notes']:
            lines.append(f'             {note}')
        lines.append(f"             dtype='auto' -> {rep['auto'][d['device']]}")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m mp_wrappers', description=__doc__.split('\n')[0])
    parser.add_argument('--no-selftest', action='store_true', help='skip the op self-test')
    args = parser.parse_args(argv)

    broken: List[str] = []
    print('== mp_wrappers doctor ==')
    print('\n-- versions')
    print('\n'.join(_versions()))
    rep = hardware.report()
    info = rep['extension']
    print('\n-- extension')
    print('\n'.join(_extension_lines(info)))
    error = info['backend']['error']
    if not info['backend']['extension'] and 'MP_WRAPPERS_DISABLE_EXTENSION' not in str(error):
        broken.append(f'the C++ extension failed to load: {error}')
    print('\n-- devices')
    print('\n'.join(_device_lines(rep)))
    print("\n-- 8-bit optimizer states (FusedAdam / FusedSGD(state_dtype='int8'))")
    print('\n'.join(_quantized_lines(rep['quantized_states'])))

    if not args.no_selftest:
        print('\n-- self-test (every op against its pure-PyTorch reference)')
        results, uncovered, seconds = run_selftest()
        if not results:
            print('skipped: no compiled ops to test (the references are what runs)')
        groups = {}
        for r in results:
            groups.setdefault((r.device, r.isa), []).append(r)
        for (device, isa), rs in groups.items():
            ok = sum(r.ok for r in rs)
            where = device + (f' [{isa}]' if isa else '')
            print(f'{where:<20} {ok}/{len(rs)} ops agree')
            for r in rs:
                if not r.ok:
                    print(f'  FAIL {r.op}: {r.error}')
                    broken.append(f'{r.op} on {where}: {r.error}')
        if uncovered:
            print(f'not covered by the self-test: {", ".join(uncovered)}')
        if results:
            print(f'({seconds:.1f} s)')

    print('\n-- verdict')
    if broken:
        print(f'BROKEN ({len(broken)}):')
        for b in broken:
            print(f'  - {b}')
        return 1
    print('OK')
    return 0


if __name__ == '__main__':
    sys.exit(main())
