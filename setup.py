"""Build script for mp_wrappers and its C++/CUDA extension ``mp_wrappers._C``.

Install with ``pip install --no-build-isolation -e .`` so the extension is built against the torch that
is already installed (see README). CPU kernels are always compiled. CUDA kernels are compiled when torch
has CUDA support and a toolkit of the same major version is found (build_config.decide_cuda; one printed
line says which and why); ``MP_WRAPPERS_CUDA=0`` forces them off, ``MP_WRAPPERS_CUDA=1`` makes any reason
not to build them an error. Flags, defines and the default arch list live in build_config.py
(docs/cuda.md).
"""
import glob
import os
import sys

from setuptools import find_packages, setup

# build_config.py (next to this file) holds every flag and the CUDA decision, shared with
# tools/check_cuda_compile.sh; an isolated or PEP 517 build does not put this folder on sys.path.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build_config  # noqa: E402

try:
    import torch  # noqa: F401
except ImportError:  # pragma: no cover - the message is the point
    sys.exit('mp_wrappers builds against an installed torch. Install it first '
             '(on a CPU machine: pip install torch==2.13.0), then run '
             'pip install --no-build-isolation -e .')

CSRC = os.path.join('mp_wrappers', 'csrc')


def _cuda_decision() -> 'build_config.CudaDecision':
    """Decide before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, at import."""
    decision = build_config.decide_cuda(build_config.probe())
    print(decision.line, flush=True)  # the one line that says whether and why (docs/cuda.md)
    if decision.error:
        sys.exit(decision.line)
    if decision.build:
        # The real toolkit root, not the folder of an nvcc wrapper script that torch would guess.
        os.environ['CUDA_HOME'] = decision.cuda_home
        if decision.arch_list:  # no GPU visible: torch's own detection would die (IndexError)
            os.environ['TORCH_CUDA_ARCH_LIST'] = decision.arch_list
    return decision


CUDA = _cuda_decision()
from torch.utils import cpp_extension  # noqa: E402  (after CUDA_HOME is settled)


def _extension():
    with_cuda = CUDA.build
    std = build_config.torch_std()  # torch's own standard: its 2.14 headers need C++20
    sources = [os.path.join(CSRC, 'bindings.cpp'), os.path.join(CSRC, 'slot_check.cpp')]
    sources += sorted(glob.glob(os.path.join(CSRC, 'cpu', '*.cpp')))
    try:  # MP_WRAPPERS_CXX_OPT (build_config.py): -O3 unless a check asks for a faster build
        opt = build_config.cxx_opt_level(os.environ)
    except ValueError as exc:
        sys.exit(str(exc))
    if opt != '-O3':
        print(f'mp_wrappers build: C++ sources at {opt} (MP_WRAPPERS_CXX_OPT), not -O3', flush=True)
    extra = {'cxx': build_config.cxx_flags(std, opt)}
    if with_cuda:
        sources += sorted(glob.glob(os.path.join(CSRC, 'cuda', '*.cu')))
        extra['nvcc'] = build_config.nvcc_flags(std)
        ext_cls = cpp_extension.CUDAExtension
    else:
        ext_cls = cpp_extension.CppExtension
    return ext_cls(
        name='mp_wrappers._C',
        sources=sources,
        include_dirs=[os.path.join(HERE, CSRC, 'include')],
        define_macros=build_config.define_macros(with_cuda),
        extra_compile_args=extra,
        extra_link_args=build_config.LINK_FLAGS,
    )


# The supported range (docs/compatibility.md, tools/compat_matrix.sh). torch has a lower bound only:
# the build runs against the torch already installed (tools/install.sh installs a pinned one first
# and refuses one older than 2.1), pip keeps any torch >= 2.1 (a CUDA build, or one newer than the
# newest we tested, which tools/install.sh warns about) and never resolves torch on its own then.
# mmengine: 0.10.4-0.10.7, or its maintained fork onedl-mmengine (0.10.8+, same import name
# `mmengine`): the fork is required in place of mmengine when it is the one installed, so pip does
# not install mmengine over it.
TORCH_REQUIREMENT = 'torch>=2.1'
MMENGINE_REQUIREMENT = 'mmengine>=0.10.4,<0.11'
MMENGINE_FORK_REQUIREMENT = 'onedl-mmengine>=0.10.8,<0.11'


def _requirements():
    from importlib import metadata
    try:
        metadata.version('onedl-mmengine')
        mmengine = MMENGINE_FORK_REQUIREMENT
    except metadata.PackageNotFoundError:
        mmengine = MMENGINE_REQUIREMENT
    return [TORCH_REQUIREMENT, mmengine, 'numpy']


setup(
    name='mp_wrappers',
    version='0.1.0',
    description='Apex-grade mixed precision (loss scaling, fp32 master weights, fused optimizers) '
                'for mmengine, on CPU and CUDA, without NVIDIA apex.',
    # The wheel is the library: the mp_wrappers package and its extension. Tests (tests/, the CUDA
    # host-execution harness among them), the configs' demo workloads (projects/), benchmarks/,
    # tools/ and configs/ stay in the repository; tests/repo/test_packaging.py checks the file list.
    packages=find_packages(include=['mp_wrappers', 'mp_wrappers.*'],
                           exclude=['tests', 'tests.*', 'projects', 'projects.*']),
    include_package_data=False,  # no C++ sources or other files beside the modules
    python_requires='>=3.9',
    install_requires=_requirements(),
    extras_require={'test': ['pytest', 'scikit-learn', 'expecttest', 'hypothesis', 'tensorboard'],
                    'examples': ['scikit-learn', 'matplotlib']},
    ext_modules=[_extension()],
    cmdclass={'build_ext': cpp_extension.BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
