"""Build script for mp_wrappers and its C++/CUDA extension ``mp_wrappers._C``.

Install with ``pip install --no-build-isolation -e .`` so the extension is built against the torch that
is already installed (see README). CPU kernels are always compiled. CUDA kernels are compiled when torch
has CUDA support and a toolkit is found; ``MP_WRAPPERS_CUDA=0`` forces them off, ``MP_WRAPPERS_CUDA=1``
makes a missing toolkit an error instead of a silent CPU-only build.
"""
import glob
import os
import sys

from setuptools import find_packages, setup

try:
    import torch  # noqa: F401
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - the message is the point
    sys.exit('mp_wrappers builds against an installed torch. Install it first '
             '(on a CPU machine: pip install torch==2.13.0), then run '
             'pip install --no-build-isolation -e .')

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join('mp_wrappers', 'csrc')


def _want_cuda() -> bool:
    switch = os.environ.get('MP_WRAPPERS_CUDA', 'auto').lower()
    if switch not in ('auto', '0', '1'):
        sys.exit(f'MP_WRAPPERS_CUDA={switch!r}: expected 0, 1 or auto')
    # cpp_extension.CUDA_HOME is None when torch itself has no CUDA (it refuses to build a
    # CUDAExtension against a CPU torch), so this one test covers both toolkit and torch.
    available = cpp_extension.CUDA_HOME is not None
    if switch == '1' and not available:
        sys.exit('MP_WRAPPERS_CUDA=1 but no CUDA build is possible: torch.version.cuda='
                 f'{torch.version.cuda}, CUDA_HOME={cpp_extension.CUDA_HOME}')
    return available and switch != '0'


def _extension():
    with_cuda = _want_cuda()
    sources = [os.path.join(CSRC, 'bindings.cpp')]
    sources += sorted(glob.glob(os.path.join(CSRC, 'cpu', '*.cpp')))
    # -fopenmp must reach the link too, or at::parallel_for silently runs on one thread;
    # -fno-math-errno lets gcc vectorise sqrt (Adam is 4x slower without it);
    # -ffp-contract=off keeps gcc from fusing a*b+c into an FMA on its own: kernels must round like
    # the torch references and give the same bits on every ISA (they call V::fmadd where they want one).
    cxx = ['-O3', '-std=c++17', '-fopenmp', '-fno-math-errno', '-ffp-contract=off',
           '-fvisibility=hidden']
    extra = {'cxx': cxx}
    macros = []
    if with_cuda:
        sources += sorted(glob.glob(os.path.join(CSRC, 'cuda', '*.cu')))
        extra['nvcc'] = ['-O3', '--use_fast_math', '--expt-relaxed-constexpr', '-lineinfo']
        macros.append(('MP_WRAPPERS_WITH_CUDA', '1'))
        ext_cls = cpp_extension.CUDAExtension
    else:
        ext_cls = cpp_extension.CppExtension
    return ext_cls(
        name='mp_wrappers._C',
        sources=sources,
        include_dirs=[os.path.join(HERE, CSRC, 'include')],
        define_macros=macros,
        extra_compile_args=extra,
        extra_link_args=['-fopenmp'],
    )


setup(
    name='mp_wrappers',
    version='0.1.0',
    description='Apex-grade mixed precision (loss scaling, fp32 master weights, fused optimizers) '
                'for mmengine, on CPU and CUDA, without NVIDIA apex.',
    packages=find_packages(include=['mp_wrappers', 'mp_wrappers.*']),
    python_requires='>=3.9',
    # torch is not listed on purpose: pip would resolve it to the newest CUDA build. The README
    # installs the pinned torch first; a machine with a CUDA torch keeps its own.
    install_requires=['mmengine>=0.10.4', 'numpy'],
    extras_require={'test': ['pytest', 'scikit-learn', 'expecttest', 'hypothesis', 'tensorboard'],
                    'examples': ['scikit-learn', 'matplotlib']},
    ext_modules=[_extension()],
    cmdclass={'build_ext': cpp_extension.BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
