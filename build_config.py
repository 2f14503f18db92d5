"""The one place for how ``mp_wrappers._C`` is built: compiler flags, defines, CUDA decision, arch list.

``setup.py`` builds with these, and ``tools/check_cuda_compile.sh`` compiles every ``.cu`` file with
exactly the same flags and defines (``python build_config.py nvcc-args --arch sm_90`` prints them), so
a compile check can never pass with flags the real build does not use. See docs/cuda.md.

The decision logic is written as pure functions of their inputs (environment, torch's CUDA version,
what the toolkit looks like on disk, nvcc's output) so tests/kernels/test_build_config.py checks every row of
the decision table on a machine without a GPU or a toolkit. Only :func:`probe` and the command-line
entry point look at the real machine.

This file is not part of the installed package; it only runs at build time and in checks.
"""
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ['CXX_FLAGS', 'CXX_OPT_LEVELS', 'NVCC_FLAGS', 'DEFAULT_CUDA_ARCHS', 'CudaDecision',
           'ToolkitProbe', 'cxx_flags', 'cxx_opt_level', 'nvcc_flags', 'define_macros',
           'torch_cxx_std', 'cxx_std_from_source', 'is_toolkit_root', 'toolkit_root_candidates',
           'nvcc_release', 'supported_archs', 'default_arch_list', 'decide_cuda', 'probe',
           'nvcc_compile_args']

# -fopenmp must reach the link too, or at::parallel_for silently runs on one thread;
# -fno-math-errno lets gcc vectorise sqrt (Adam is 4x slower without it);
# -ffp-contract=off keeps gcc from fusing a*b+c into an FMA on its own: kernels must round like
# the torch references and give the same bits on every ISA (they call V::fmadd where they want one).
# -g0 undoes the -g of Python's own CFLAGS, which setuptools puts first: debug info took 40% of the
# build's compile time (g++ 12, a 2-core Zen 3: cpu/multi_tensor_sgd8bit.cpp 65 s -> 40 s) and
# changes no generated code (gcc guarantees -g does not); nobody steps through the kernels' template
# instances in a debugger, and a backtrace still names the functions (the symbol table stays).
CXX_FLAGS = ['-O3', '-g0', '-fopenmp', '-fno-math-errno', '-ffp-contract=off',
             '-fvisibility=hidden']
LINK_FLAGS = ['-fopenmp']

# No --use_fast_math: it turns on -ftz=true, -prec-div=false and -prec-sqrt=false for every fp32
# operation. Flush-to-zero makes an inverse loss scale of 2**-127 (legal: fp32 grads, a scale of
# 2**127) exactly 0, so unscaling zeroes every gradient, and flushes subnormal Adam moments; the
# approximate division and sqrt break agreement with the references. The three IEEE settings are
# nvcc's defaults, spelled out so that nobody "optimises" them back (the kernels are memory-bound:
# IEEE division and sqrt cost nothing measurable). -fmad=false is -ffp-contract=off's twin: nvcc
# would otherwise contract a*b+c into an FMA, rounding differently from the references and from the
# CPU kernels; the kernels call fmaf() where they want one.
NVCC_FLAGS = ['-O3', '-ftz=false', '-prec-div=true', '-prec-sqrt=true', '-fmad=false',
              '--expt-relaxed-constexpr', '-lineinfo']

# Built when TORCH_CUDA_ARCH_LIST is unset and no GPU is visible (a build node, a docker build):
# Ampere (A100), Hopper (H100/H200), Blackwell data-centre and consumer parts, plus PTX of the newest
# so later GPUs JIT-compile it. Archs the toolkit does not know are dropped (CUDA 12.0-12.7 have no
# 10.0/12.0). With a GPU visible, torch builds for the visible GPUs, as it always does.
DEFAULT_CUDA_ARCHS = ('8.0', '9.0', '10.0', '12.0')

# Where a toolkit usually lives when nothing else names one.
_STANDARD_ROOTS = ('/usr/local/cuda',)

# torch's default C++ standard by release, for a torch whose cpp_extension source cannot be read
# (it is read first: see torch_cxx_std). torch's cpp_extension moved to C++20 in March 2026
# (pytorch/pytorch#176659; 2.13 adds -std=c++20 on this machine) and the 2.14 headers require it;
# older releases build with C++17.
_CXX_STD_FALLBACK = ((2, 12), 'c++20', 'c++17')


# ---- flags ------------------------------------------------------------------------------------------

def cxx_flags(std: str, opt: str = '-O3') -> List[str]:
    """Host-compiler flags for every C++ source, in torch's C++ standard ``std`` ('c++17'), at the
    optimisation level ``opt`` (:func:`cxx_opt_level`)."""
    return [opt if f == '-O3' else f for f in CXX_FLAGS] + [f'-std={std}']


# MP_WRAPPERS_CXX_OPT: the C++ sources' optimisation level. -O3, the default, is what users get and
# what the main test lane tests. -O1 compiles the CPU kernels in ~45% of the time (g++ 12, the
# 2-core Zen 3: cpu/multi_tensor_adam8bit.cpp 75 -> 32 s CPU) for checks of how the code meets
# another torch rather than of its code generation: CI's compatibility lanes build with it. Every
# level computes the same bits (no fast math, no contraction: the kernels' FMAs are written out),
# and the lanes' tests compare with the references as the main lane's do.
CXX_OPT_LEVELS = ('-O1', '-O2', '-O3')


def cxx_opt_level(env: Mapping[str, str]) -> str:
    """The level MP_WRAPPERS_CXX_OPT in ``env`` asks for ('-O3' when unset or empty).

    Raises:
        ValueError: any other value, with the line that names it and what is allowed.
    """
    value = env.get('MP_WRAPPERS_CXX_OPT') or '-O3'
    if value not in CXX_OPT_LEVELS:
        raise ValueError(f'mp_wrappers build: MP_WRAPPERS_CXX_OPT={value!r}: expected one of '
                         f'{", ".join(CXX_OPT_LEVELS)} (default -O3, what users get)')
    return value


def nvcc_flags(std: str) -> List[str]:
    """nvcc flags for every .cu source (torch adds its own COMMON_NVCC_FLAGS and arch flags)."""
    return NVCC_FLAGS + [f'-std={std}']


def define_macros(with_cuda: bool) -> List[Tuple[str, str]]:
    """Preprocessor defines of the build; ``MP_WRAPPERS_WITH_CUDA`` marks a build with CUDA kernels."""
    return [('MP_WRAPPERS_WITH_CUDA', '1')] if with_cuda else []


def cxx_std_from_source(cpp_extension_source: str) -> Optional[str]:
    """The ``-std=`` that torch's BuildExtension adds when an extension names none, read from its source.

    torch builds extensions in its own standard (``cpp_flag = cpp_flag_prefix + 'c++20'`` in
    ``append_std17_if_no_std_present`` since 2026; ``'c++17'`` before). None if not found.
    """
    m = re.search(r"cpp_flag\s*=\s*cpp_flag_prefix\s*\+\s*['\"](c\+\+\d+)['\"]", cpp_extension_source)
    return m.group(1) if m else None


def _version_tuple(version: str) -> Tuple[int, int]:
    m = re.match(r'(\d+)\.(\d+)', version)
    if not m:
        raise ValueError(f'cannot read a version from {version!r}')
    return int(m.group(1)), int(m.group(2))


def torch_cxx_std(torch_version: str, cpp_extension_source: Optional[str] = None) -> str:
    """torch's own C++ standard: what its cpp_extension adds, else by release (2.12+: c++20).

    Args:
        torch_version: ``torch.__version__``, e.g. '2.14.1+cu130'.
        cpp_extension_source: the text of ``torch/utils/cpp_extension.py``, if readable.
    """
    found = cxx_std_from_source(cpp_extension_source) if cpp_extension_source else None
    if found:
        return found
    since, new, old = _CXX_STD_FALLBACK
    return new if _version_tuple(torch_version) >= since else old


# ---- the CUDA toolkit -------------------------------------------------------------------------------

def is_toolkit_root(root: Optional[str], exists: Callable[[str], bool] = os.path.exists,
                    globber: Callable[[str], List[str]] = glob.glob) -> bool:
    """Whether ``root`` is a CUDA toolkit one can build and link against.

    An nvcc wrapper script's folder (``/usr/local/bin`` -> ``/usr/local``) has a ``bin/nvcc`` but no
    headers or runtime library: linking then fails with ``cannot find -lcudart``.
    """
    if not root:
        return False
    if not (exists(os.path.join(root, 'bin', 'nvcc')) and
            exists(os.path.join(root, 'include', 'cuda.h'))):
        return False
    return any(globber(os.path.join(root, sub, 'libcudart*'))
               for sub in ('lib64', 'lib', os.path.join('targets', '*', 'lib')))


def _wrapper_targets(script_text: str) -> List[str]:
    """Absolute paths to an ``nvcc`` that a wrapper script hands over to (``exec /x/bin/nvcc "$@"``)."""
    return re.findall(r'(/[^\s\'";|&]*/bin/nvcc)\b', script_text)


def toolkit_root_candidates(env: Mapping[str, str], nvcc_on_path: Optional[str],
                            realpath: Callable[[str], str] = os.path.realpath,
                            read_text: Callable[[str], Optional[str]] = None,
                            dryrun_top: Optional[str] = None) -> List[Tuple[str, str]]:
    """Places the toolkit may be, best first, each with how it was found.

    Order: ``CUDA_HOME``/``CUDA_PATH`` (the user's word; no other candidate is offered then, so a
    wrong one is reported rather than silently replaced), nvcc on PATH with symlinks resolved, the
    nvcc a wrapper script execs, the ``TOP`` nvcc itself reports, ``/usr/local/cuda``.
    """
    read_text = read_text or _read_small_text
    for var in ('CUDA_HOME', 'CUDA_PATH'):
        if env.get(var):
            return [(env[var], f'{var}={env[var]}')]
    out: List[Tuple[str, str]] = []
    if nvcc_on_path:
        real = realpath(nvcc_on_path)
        out.append((os.path.dirname(os.path.dirname(real)), f'nvcc on PATH ({nvcc_on_path})'))
        text = read_text(real)
        for target in _wrapper_targets(text or ''):
            out.append((os.path.dirname(os.path.dirname(realpath(target))),
                        f'the nvcc that {nvcc_on_path} runs ({target})'))
    if dryrun_top:
        out.append((os.path.normpath(dryrun_top), f'nvcc --dryrun TOP={dryrun_top}'))
    for root in _STANDARD_ROOTS:
        out.append((realpath(root), root))
    seen, unique = set(), []
    for root, how in out:
        if root not in seen:
            seen.add(root)
            unique.append((root, how))
    return unique


def _read_small_text(path: str) -> Optional[str]:
    """A wrapper script's text; None for a binary (the real nvcc) or anything unreadable."""
    try:
        if os.path.getsize(path) > 64 * 1024:
            return None
        with open(path, 'rb') as f:
            data = f.read()
        return None if b'\0' in data else data.decode('utf-8', 'replace')
    except OSError:
        return None


def nvcc_release(version_output: str) -> Optional[str]:
    """'13.0' from ``nvcc --version`` (``Cuda compilation tools, release 13.0, V13.0.88``)."""
    m = re.search(r'release (\d+\.\d+)', version_output)
    return m.group(1) if m else None


def supported_archs(list_gpu_arch_output: str) -> List[str]:
    """Real architectures an nvcc compiles for, from ``nvcc --list-gpu-arch`` ('compute_90' -> '9.0')."""
    out = []
    for m in re.finditer(r'compute_(\d+)(?![a-z\d])', list_gpu_arch_output):
        n = int(m.group(1))
        out.append(f'{n // 10}.{n % 10}')
    return sorted(set(out), key=lambda a: _version_tuple(a))


def default_arch_list(toolkit_archs: Optional[Sequence[str]]) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for a build with no GPU visible: DEFAULT_CUDA_ARCHS the toolkit
    supports (all of them if its list is unknown), the newest also as PTX."""
    archs = [a for a in DEFAULT_CUDA_ARCHS if toolkit_archs is None or a in toolkit_archs]
    if not archs:
        raise ValueError(f'the CUDA toolkit supports none of the default archs '
                         f'{list(DEFAULT_CUDA_ARCHS)} (it lists {list(toolkit_archs or [])}); set '
                         'TORCH_CUDA_ARCH_LIST, e.g. TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX"')
    archs[-1] += '+PTX'
    return ';'.join(archs)


@dataclasses.dataclass(frozen=True)
class ToolkitProbe:
    """What the machine looks like, as far as the CUDA decision is concerned (all plain data)."""

    switch: str  # MP_WRAPPERS_CUDA: 'auto', '0' or '1'
    torch_version: str
    torch_cuda: Optional[str]  # torch.version.cuda; None for a CPU build of torch
    candidates: Tuple[Tuple[str, str], ...]  # (root, how it was found), best first
    valid_roots: Tuple[str, ...]  # the candidates that are real toolkits
    toolkit_release: Optional[str]  # of the first valid root: '13.0'
    toolkit_archs: Optional[Tuple[str, ...]]  # what its nvcc compiles for
    arch_list_env: Optional[str]  # TORCH_CUDA_ARCH_LIST
    visible_gpus: int  # torch.cuda.device_count(), 0 on a build node


@dataclasses.dataclass(frozen=True)
class CudaDecision:
    """Whether to compile the CUDA kernels, and the one line that says why."""

    build: bool
    reason: str
    error: bool = False  # MP_WRAPPERS_CUDA=1 and no CUDA build possible: the build must stop
    cuda_home: Optional[str] = None
    arch_list: Optional[str] = None  # TORCH_CUDA_ARCH_LIST to set, None to leave torch's choice

    @property
    def line(self) -> str:
        if self.error:
            return f'mp_wrappers build: MP_WRAPPERS_CUDA=1 but {self.reason}'
        if self.build:
            return f'mp_wrappers build: CUDA kernels on: {self.reason}'
        return f'mp_wrappers build: CUDA kernels off (CPU-only build): {self.reason}'


def decide_cuda(p: ToolkitProbe) -> CudaDecision:
    """The CUDA build decision table (docs/cuda.md), one row per ``if``.

    Every reason not to build gives a working CPU-only build, except under ``MP_WRAPPERS_CUDA=1``,
    where it is an error naming the same reason.
    """
    if p.switch not in ('auto', '0', '1'):
        return CudaDecision(False, f'MP_WRAPPERS_CUDA={p.switch!r}: expected 0, 1 or auto',
                            error=True)

    def no(reason: str) -> CudaDecision:
        return CudaDecision(False, reason, error=p.switch == '1')

    if p.switch == '0':
        return CudaDecision(False, 'MP_WRAPPERS_CUDA=0')
    if p.torch_cuda is None:
        return no(f'torch {p.torch_version} is a CPU build (torch.version.cuda is None)')
    if not p.valid_roots:
        looked = '; '.join(f'{root} ({how})' for root, how in p.candidates) or 'nowhere'
        return no(f'no CUDA toolkit found (need bin/nvcc, include/cuda.h and lib64/libcudart*; '
                  f'looked at: {looked})')
    root = p.valid_roots[0]
    if p.toolkit_release is None:
        return no(f'cannot read the CUDA release from {root}/bin/nvcc --version')
    if _version_tuple(p.toolkit_release)[0] != _version_tuple(p.torch_cuda)[0]:
        return no(f'the CUDA toolkit at {root} is {p.toolkit_release} but torch {p.torch_version} '
                  f'was built with CUDA {p.torch_cuda}; their major versions must match')
    arch_list = None
    if p.arch_list_env:
        archs = f'TORCH_CUDA_ARCH_LIST={p.arch_list_env}'
    elif p.visible_gpus > 0:
        archs = f"the {p.visible_gpus} visible GPU(s)' archs (torch's choice)"
    else:
        try:
            arch_list = default_arch_list(p.toolkit_archs)
        except ValueError as exc:
            return no(str(exc))
        archs = f'no GPU visible, default TORCH_CUDA_ARCH_LIST={arch_list}'
    return CudaDecision(True, f'CUDA {p.toolkit_release} at {root}, torch {p.torch_version}, {archs}',
                        cuda_home=root, arch_list=arch_list)


# ---- the real machine -------------------------------------------------------------------------------

def _run(cmd: Sequence[str]) -> str:
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ''


def _dryrun_top(nvcc: str) -> Optional[str]:
    """The toolkit root nvcc itself uses (``#$ TOP=...`` of a dry run; compiles nothing)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, 'probe.cu')
        open(src, 'w').close()
        out = subprocess.run([nvcc, '--dryrun', '-c', src, '-o', os.path.join(tmp, 'p.o')],
                             capture_output=True, text=True, timeout=60)
    m = re.search(r'^#\$ TOP=(.+)$', out.stdout + out.stderr, re.M)
    return m.group(1).strip() if m else None


def probe(env: Optional[Mapping[str, str]] = None) -> ToolkitProbe:
    """Look at this machine: torch, the toolkit, the environment. Imports torch (not cpp_extension)."""
    import torch
    env = os.environ if env is None else env
    nvcc = shutil.which('nvcc', path=env.get('PATH'))
    top = None
    if nvcc and not (env.get('CUDA_HOME') or env.get('CUDA_PATH')):
        try:
            top = _dryrun_top(nvcc)
        except (OSError, subprocess.SubprocessError):
            top = None
    candidates = tuple(toolkit_root_candidates(env, nvcc, dryrun_top=top))
    valid = tuple(root for root, _ in candidates if is_toolkit_root(root))
    release = archs = None
    if valid:
        root_nvcc = os.path.join(valid[0], 'bin', 'nvcc')
        release = nvcc_release(_run([root_nvcc, '--version']))
        listed = supported_archs(_run([root_nvcc, '--list-gpu-arch']))
        archs = tuple(listed) if listed else None
    gpus = 0
    if torch.version.cuda is not None:
        try:
            gpus = torch.cuda.device_count()
        except Exception:  # a broken driver on a build node is "no GPU", not a build failure
            gpus = 0
    return ToolkitProbe(switch=env.get('MP_WRAPPERS_CUDA', 'auto').lower(),
                        torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                        candidates=candidates, valid_roots=valid, toolkit_release=release,
                        toolkit_archs=archs, arch_list_env=env.get('TORCH_CUDA_ARCH_LIST') or None,
                        visible_gpus=gpus)


def torch_std() -> str:
    """The C++ standard of the installed torch."""
    import torch
    path = os.path.join(os.path.dirname(torch.__file__), 'utils', 'cpp_extension.py')
    try:
        with open(path, encoding='utf-8') as f:
            source = f.read()
    except OSError:
        source = None
    return torch_cxx_std(torch.__version__, source)


def nvcc_compile_args(arch: Sequence[str], here: str = os.path.dirname(os.path.abspath(__file__))
                      ) -> List[str]:
    """The nvcc arguments setup.py's build gives a .cu file, for the archs in ``arch`` ('sm_90').

    Ours (NVCC_FLAGS, the C++ standard, the defines, the include dir) plus what torch's
    BuildExtension adds to every .cu file (its COMMON_NVCC_FLAGS, -fPIC, the extension defines,
    include paths and the C++ ABI flag). ``-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE`` is the one addition:
    a CPU torch ships no c10/cuda/impl/cuda_cmake_macros.h, and a compile check must run against it.
    """
    import torch
    from torch.utils import cpp_extension
    args = list(nvcc_flags(torch_std()))
    args += [f'-D{k}={v}' for k, v in define_macros(True)]
    args += ['-DTORCH_API_INCLUDE_EXTENSION_H', '-DTORCH_EXTENSION_NAME=_C',
             f'-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}']
    args += list(cpp_extension.COMMON_NVCC_FLAGS) + ['--compiler-options', '-fPIC']
    args += ['-I' + os.path.join(here, 'mp_wrappers', 'csrc', 'include')]
    args += ['-I' + p for p in cpp_extension.include_paths()]
    if torch.version.cuda is None:
        args.append('-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE')
    for a in arch:
        n = a.replace('sm_', '')
        args.append(f'-gencode=arch=compute_{n},code=sm_{n}')
    return args


def _main(argv: Sequence[str]) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest='cmd', required=True)
    a = sub.add_parser('nvcc-args', help="print setup.py's nvcc arguments, one per line")
    a.add_argument('--arch', action='append', default=[], help="sm_90 (repeatable)")
    sub.add_parser('decide', help='print the CUDA build decision line')
    args = parser.parse_args(argv)
    if args.cmd == 'nvcc-args':
        print('\n'.join(nvcc_compile_args(args.arch)))
    else:
        print(decide_cuda(probe()).line)
    return 0


if __name__ == '__main__':
    sys.exit(_main(sys.argv[1:]))
