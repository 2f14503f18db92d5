"""Host execution of the CUDA kernels: a test build of the same ``.cu`` sources for the CPU.

The CUDA entry points in ``mp_wrappers/csrc/cuda/*.cu`` (every ``.cu`` file there, no list to keep)
are compiled by the host compiler against a small emulation of the CUDA programming model
(``csrc/include/mp_wrappers/cuda_host/emulation.h``: a block's threads are fibers with real
barriers, warp shuffles, atomics, IEEE intrinsics) and registered as CPU kernels of their own op
namespace, ``torch.ops.mp_wrappers_cuda_host_<variant>``, with exactly the schemas of
``torch.ops.mp_wrappers``. Calling one runs the real entry-point logic (checks, launch planning, dtype
dispatch, launches) on CPU tensors, so tests can compare it with the references.

Test code, not part of the package (the wheel does not ship it): only ``tools/cuda_host_check.sh``,
``tools/cuda_mutants.py``, the ``tests/kernels/test_cuda_host*.py`` tests (which skip unless a
variant is built, or ``MP_WRAPPERS_CUDA_ON_HOST=1`` lets them build it) and
``benchmarks/bench_cuda_traffic.py`` import it, with ``tests/`` on ``sys.path``. Variants:

* ``real``: the production launch geometry (64K chunks, 512 threads, 320 blocks per launch);
* ``tiny``: ``TinyGeometry`` (448-element chunks, 64 threads, 7 blocks per launch), so that small
  lists already need many chunks and launches;
* ``asan``: ``tiny`` built with AddressSanitizer and UndefinedBehaviorSanitizer; the Python process
  must start with ``LD_PRELOAD`` of libasan and libstdc++ (``sanitizer_preload()``).

``real`` and ``tiny`` are built with ``--coverage`` (gcov data next to the objects in
``build/cuda_host/<variant>``, read by ``tools/cuda_host_coverage.py``).

``MP_WRAPPERS_CUDA_HOST_MODULE=<path of a module file>`` makes ``load`` import that file as the module
of every variant asked for, without building (``tools/cuda_mutants.py`` links one per mutant).
"""
import glob
import importlib.util
import os
import subprocess
from types import ModuleType
from typing import Dict, List, Optional

import torch

__all__ = ['VARIANTS', 'build', 'build_dir', 'is_built', 'load', 'sanitizer_preload',
           'schema_names']

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CSRC = os.path.join(_ROOT, 'mp_wrappers', 'csrc')

VARIANTS: Dict[str, Dict[str, object]] = {
    'real': dict(geometry='RealGeometry', coverage=True, sanitize=False),
    'tiny': dict(geometry='TinyGeometry', coverage=True, sanitize=False),
    'asan': dict(geometry='TinyGeometry', coverage=False, sanitize=True),
}

_loaded: Dict[str, ModuleType] = {}
_libraries: Dict[str, torch.library.Library] = {}


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f'cuda_host: variant={variant!r}; allowed: {sorted(VARIANTS)}')


def build_dir(variant: str) -> str:
    """The build folder of ``variant`` (objects, gcov notes and data, the module)."""
    _check_variant(variant)
    return os.path.join(_ROOT, 'build', 'cuda_host', variant)


def module_name(variant: str) -> str:
    """The module and op-namespace name of ``variant``."""
    _check_variant(variant)
    return f'mp_wrappers_cuda_host_{variant}'


def is_built(variant: str) -> bool:
    """Whether the module of ``variant`` exists in its build folder."""
    return bool(glob.glob(os.path.join(build_dir(variant), module_name(variant) + '*.so')))


def sanitizer_preload() -> str:
    """The ``LD_PRELOAD`` value a Python process needs to import the ``asan`` variant.

    libasan, then libstdc++. ASan finds the real ``__cxa_throw`` behind its interceptor once, at
    start-up (``dlsym(RTLD_NEXT)``); the interpreter does not link libstdc++ (torch brings it in
    later, by ``dlopen``), so without it preloaded the interceptor has no target and the first C++
    exception (a ``TORCH_CHECK`` refusing an argument) dies with "CHECK failed ...
    real___cxa_throw != 0" instead of reaching Python as a RuntimeError.
    """
    libs = []
    for lib in ('libasan.so', 'libstdc++.so'):
        out = subprocess.run(['g++', f'-print-file-name={lib}'], capture_output=True, text=True,
                             check=True).stdout.strip()
        libs.append(os.path.realpath(out))
    return ' '.join(libs)


def kernel_sources() -> List[str]:
    """Every CUDA kernel file: the convention is simply ``mp_wrappers/csrc/cuda/*.cu``."""
    return sorted(glob.glob(os.path.join(_CSRC, 'cuda', '*.cu')))


def schema_names() -> List[str]:
    """Names of the ``torch.ops.mp_wrappers`` ops (their schemas come from ``mp_wrappers._C``)."""
    return sorted(name.split('::', 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith('mp_wrappers::'))


def _define_namespace(ns: str) -> None:
    """Define every mp_wrappers schema again in namespace ``ns`` (once per process)."""
    if ns in _libraries:
        return
    from mp_wrappers.ops import _extension
    if _extension.extension() is None:
        raise RuntimeError('cuda_host: mp_wrappers._C is not built, so the op schemas are unknown; '
                           'build it first (pip install --no-build-isolation -e .)')
    lib = torch.library.Library(ns, 'DEF')
    for name in schema_names():
        schema = torch._C._get_schema('mp_wrappers::' + name, '')
        lib.define(str(schema).split('::', 1)[1])
    _libraries[ns] = lib


def _wrapper_sources(variant: str) -> List[str]:
    """One C++ file per kernel file, each ``#include``-ing the ``.cu`` (same lines, and gcov
    reports them against the ``.cu`` path)."""
    src_dir = os.path.join(build_dir(variant), 'src')
    os.makedirs(src_dir, exist_ok=True)
    out = []
    for cu in kernel_sources():
        path = os.path.join(src_dir, os.path.splitext(os.path.basename(cu))[0] + '.cpp')
        text = f'// generated by tests/cuda_host.py\n#include "{cu}"\n'
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, 'w') as f:
                f.write(text)
        out.append(path)
    # Files of kernels that were removed must not stay in the build.
    for stale in set(glob.glob(os.path.join(src_dir, '*.cpp'))) - set(out):
        os.remove(stale)
    return out


def build(variant: str, verbose: bool = False) -> ModuleType:
    """Build (incrementally) and import the module of ``variant``; returns it.

    Its ops are ``getattr(torch.ops, module.namespace)``.
    """
    _check_variant(variant)
    if variant in _loaded:
        return _loaded[variant]
    from torch.utils import cpp_extension
    cfg = VARIANTS[variant]
    name = module_name(variant)
    _define_namespace(name)
    flags = ['-DMP_WRAPPERS_CUDA_HOST=1', f'-DMP_WRAPPERS_CUDA_HOST_NS={name}',
             f'-DMP_WRAPPERS_CUDA_GEOMETRY={cfg["geometry"]}',
             # IEEE arithmetic as in the kernels' __*_rn intrinsics: no contraction into FMAs.
             '-ffp-contract=off', '-Wno-unused-function']
    ldflags = ['-lpthread']
    if cfg['coverage']:
        # gcov needs no debug info (its own notes map lines): -g0 builds 20% faster.
        flags += ['-O0', '-g0', '--coverage', '-fprofile-update=atomic']
        ldflags += ['--coverage']
    if cfg['sanitize']:
        san = ['-fsanitize=address,undefined', '-fno-sanitize-recover=undefined',
               '-fno-omit-frame-pointer']
        # -O0 as the gcov variants: it builds 2.5x faster than -O1 (and at -O0 no access is
        # optimised away before the sanitizer sees it). -g1: line tables only, so that a report
        # names the source lines; full -g took a fifth longer to build (g++ 12, 23.1 s against
        # 18.2 s for multi_tensor_sgd.cu).
        flags += ['-O0', '-g1'] + san
        ldflags += san
    sources = [os.path.join(_CSRC, 'cuda_host', 'module.cpp')] + _wrapper_sources(variant)
    os.makedirs(build_dir(variant), exist_ok=True)
    module = cpp_extension.load(
        name=name, sources=sources, extra_cflags=flags, extra_ldflags=ldflags,
        extra_include_paths=[os.path.join(_CSRC, 'include')], build_directory=build_dir(variant),
        verbose=verbose, is_python_module=True)
    _loaded[variant] = module
    return module


PREBUILT_ENV = 'MP_WRAPPERS_CUDA_HOST_MODULE'


def _load_prebuilt(variant: str, path: str) -> ModuleType:
    """Import the module file at ``path`` (built elsewhere) as the module of ``variant``."""
    name = module_name(variant)
    if not os.path.basename(path).startswith(name):
        raise ValueError(f'cuda_host: {PREBUILT_ENV}={path!r} is not a {name} module file')
    _define_namespace(name)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _loaded[variant] = module
    return module


def load(variant: str) -> Optional[ModuleType]:
    """The module of ``variant`` when it is built (or may be built: ``MP_WRAPPERS_CUDA_ON_HOST=1``),
    else None."""
    if variant in _loaded:
        return _loaded[variant]
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        return _load_prebuilt(variant, prebuilt)
    if not (is_built(variant) or os.environ.get('MP_WRAPPERS_CUDA_ON_HOST', '0') == '1'):
        return None
    return build(variant)
