"""The build's decisions (build_config.py) as pure functions of faked inputs: no GPU, no toolkit needed.

Each row of the CUDA decision table in docs/cuda.md has a case here, as do the three build failures a
new user met (issue 12, item 9): torch's arch detection dying with no GPU visible, CUDA_HOME guessed
from an nvcc wrapper script, and a forced -std=c++17 against torch 2.14's C++20 headers.
"""
import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location('build_config', os.path.join(REPO, 'build_config.py'))
bc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bc)

# `nvcc --list-gpu-arch` and `nvcc --version` of CUDA 13.0 (this machine's toolkit) and of a 12.4.
LIST_13_0 = ('compute_75\ncompute_80\ncompute_86\ncompute_87\ncompute_88\ncompute_89\ncompute_90\n'
             'compute_100\ncompute_110\ncompute_103\ncompute_120\ncompute_121\n')
LIST_12_4 = 'compute_50\ncompute_52\ncompute_60\ncompute_70\ncompute_75\ncompute_80\ncompute_90\n'
VERSION_13_0 = ('nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, '
                'V13.0.88\nBuild cuda_13.0.r13.0/compiler.36424714_0\n')


# ---- the C++ standard -------------------------------------------------------------------------------

def test_cxx_std_is_read_from_torchs_cpp_extension():
    assert bc.cxx_std_from_source("            cpp_flag = cpp_flag_prefix + 'c++20'\n") == 'c++20'
    assert bc.cxx_std_from_source('cpp_flag = cpp_flag_prefix + "c++17"') == 'c++17'
    assert bc.cxx_std_from_source('nothing here') is None
    # The source wins over the release table; the table covers an unreadable source.
    assert bc.torch_cxx_std('2.11.0+cu130', "cpp_flag = cpp_flag_prefix + 'c++20'") == 'c++20'
    assert bc.torch_cxx_std('2.14.1+cu130', None) == 'c++20'
    assert bc.torch_cxx_std('2.8.0', None) == 'c++17'
    with pytest.raises(ValueError, match="'nightly'"):
        bc.torch_cxx_std('nightly', None)


def test_installed_torch_standard_is_what_its_build_extension_adds():
    from torch.utils import cpp_extension
    with open(cpp_extension.__file__, encoding='utf-8') as f:
        source = f.read()
    std = bc.torch_std()
    assert f"cpp_flag_prefix + '{std}'" in source
    assert f'-std={std}' in bc.cxx_flags(std) and f'-std={std}' in bc.nvcc_flags(std)
    assert not any(f.startswith('-std=') for f in bc.CXX_FLAGS + bc.NVCC_FLAGS)


# ---- flags ------------------------------------------------------------------------------------------

def test_nvcc_flags_keep_ieee_fp32():
    # --use_fast_math flushes subnormals (an inverse loss scale of 2**-127 becomes 0).
    flags = bc.nvcc_flags('c++20')
    assert '--use_fast_math' not in flags and '-use_fast_math' not in flags
    for flag in ('-ftz=false', '-prec-div=true', '-prec-sqrt=true', '-fmad=false'):
        assert flag in flags
    assert '-ffp-contract=off' in bc.cxx_flags('c++20')
    assert bc.define_macros(True) == [('MP_WRAPPERS_WITH_CUDA', '1')]
    assert bc.define_macros(False) == []


def test_compile_check_uses_the_builds_flags():
    args = bc.nvcc_compile_args(['sm_80', 'sm_90'])
    for flag in bc.nvcc_flags(bc.torch_std()):
        assert flag in args
    assert '-DMP_WRAPPERS_WITH_CUDA=1' in args
    assert '-gencode=arch=compute_80,code=sm_80' in args
    assert '-gencode=arch=compute_90,code=sm_90' in args
    assert '--use_fast_math' not in args


# ---- the toolkit ------------------------------------------------------------------------------------

def _toolkit(root, lib='lib64'):
    for rel in ('bin/nvcc', 'include/cuda.h', f'{lib}/libcudart.so.13'):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b'\x7fELF\0' if rel == 'bin/nvcc' else b'')
    return root


def test_is_toolkit_root(tmp_path):
    assert bc.is_toolkit_root(str(_toolkit(tmp_path / 'cuda-13.0')))
    assert bc.is_toolkit_root(str(_toolkit(tmp_path / 'pip-cuda', lib='targets/x86_64-linux/lib')))
    wrapper_home = tmp_path / 'usr-local'
    (wrapper_home / 'bin').mkdir(parents=True)
    (wrapper_home / 'bin' / 'nvcc').write_text('#!/bin/sh\nexec /x/bin/nvcc "$@"\n')
    assert not bc.is_toolkit_root(str(wrapper_home))  # linking there: cannot find -lcudart
    assert not bc.is_toolkit_root(None) and not bc.is_toolkit_root('')


def test_toolkit_root_is_found_behind_an_nvcc_wrapper_script(tmp_path):
    real = _toolkit(tmp_path / 'cuda-13.0')
    wrapper = tmp_path / 'local' / 'bin' / 'nvcc'
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nexec {real}/bin/nvcc "$@"\n')
    cands = bc.toolkit_root_candidates({}, str(wrapper))
    roots = [r for r, _ in cands]
    assert roots[0] == str(tmp_path / 'local')  # where torch looks: not a toolkit
    assert str(real) in roots
    valid = [r for r in roots if bc.is_toolkit_root(r)]
    assert valid[0] == str(real)
    assert 'runs' in dict(cands)[str(real)]


def test_toolkit_root_follows_symlinks_and_dryrun_top(tmp_path):
    real = _toolkit(tmp_path / 'cuda-13.0')
    link = tmp_path / 'bin' / 'nvcc'
    link.parent.mkdir()
    link.symlink_to(real / 'bin' / 'nvcc')
    roots = [r for r, _ in bc.toolkit_root_candidates({}, str(link))]
    assert roots[0] == str(real)
    roots = [r for r, _ in bc.toolkit_root_candidates({}, None, dryrun_top=f'{real}/bin/..')]
    assert roots[0] == str(real)


def test_an_explicit_cuda_home_is_the_only_candidate(tmp_path):
    cands = bc.toolkit_root_candidates({'CUDA_HOME': '/opt/x'}, '/usr/bin/nvcc')
    assert cands == [('/opt/x', 'CUDA_HOME=/opt/x')]
    assert bc.toolkit_root_candidates({'CUDA_PATH': '/opt/y'}, None)[0][0] == '/opt/y'


def test_nvcc_outputs_are_parsed():
    assert bc.nvcc_release(VERSION_13_0) == '13.0'
    assert bc.nvcc_release('garbage') is None
    archs = bc.supported_archs(LIST_13_0)
    assert archs[0] == '7.5' and archs[-1] == '12.1' and '10.3' in archs and '7.0' not in archs
    assert bc.supported_archs(LIST_12_4)[-1] == '9.0'


def test_default_arch_list_follows_the_toolkit():
    assert bc.default_arch_list(bc.supported_archs(LIST_13_0)) == '8.0;9.0;10.0;12.0+PTX'
    assert bc.default_arch_list(bc.supported_archs(LIST_12_4)) == '8.0;9.0+PTX'
    assert bc.default_arch_list(None) == '8.0;9.0;10.0;12.0+PTX'
    with pytest.raises(ValueError, match='TORCH_CUDA_ARCH_LIST'):
        bc.default_arch_list(['5.0', '6.0'])


# ---- the decision table -----------------------------------------------------------------------------

GOOD = bc.ToolkitProbe(switch='auto', torch_version='2.14.1+cu130', torch_cuda='13.0',
                       candidates=(('/usr/local', 'nvcc on PATH (/usr/local/bin/nvcc)'),
                                   ('/usr/local/cuda-13.0', 'the nvcc that /usr/local/bin/nvcc runs')),
                       valid_roots=('/usr/local/cuda-13.0',), toolkit_release='13.0',
                       toolkit_archs=tuple(bc.supported_archs(LIST_13_0)), arch_list_env=None,
                       visible_gpus=0)


def _probe(**changes):
    return dataclasses.replace(GOOD, **changes)


NOT_BUILT = [
    ('cpu-torch', dict(torch_cuda=None, torch_version='2.13.0+cpu'), 'is a CPU build'),
    ('no-toolkit', dict(valid_roots=()), r'no CUDA toolkit found .*looked at: /usr/local \(nvcc on PATH'),
    ('major-mismatch', dict(toolkit_release='12.4'),
     'toolkit at /usr/local/cuda-13.0 is 12.4 but torch 2.14.1\\+cu130 was built with CUDA 13.0'),
    ('unreadable-release', dict(toolkit_release=None), 'cannot read the CUDA release'),
    ('no-default-arch', dict(toolkit_archs=('5.0', '6.0')), 'supports none of the default archs'),
]


@pytest.mark.parametrize('name,changes,reason', NOT_BUILT, ids=[c[0] for c in NOT_BUILT])
def test_no_cuda_build_gives_one_line_and_cpu_build(name, changes, reason):
    d = bc.decide_cuda(_probe(**changes))
    assert not d.build and not d.error
    assert d.line.startswith('mp_wrappers build: CUDA kernels off (CPU-only build): ')
    assert '\n' not in d.line
    assert __import__('re').search(reason, d.line), d.line
    # MP_WRAPPERS_CUDA=1 turns the same reason into an error.
    forced = bc.decide_cuda(_probe(switch='1', **changes))
    assert forced.error and not forced.build
    assert forced.line.startswith('mp_wrappers build: MP_WRAPPERS_CUDA=1 but ')
    assert __import__('re').search(reason, forced.line)


def test_switch_values():
    off = bc.decide_cuda(_probe(switch='0'))
    assert not off.build and not off.error and 'MP_WRAPPERS_CUDA=0' in off.line
    bad = bc.decide_cuda(_probe(switch='yes'))
    assert bad.error and "MP_WRAPPERS_CUDA='yes': expected 0, 1 or auto" in bad.line
    assert bc.decide_cuda(_probe(switch='1')).build


def test_build_with_no_gpu_uses_the_default_arch_list():
    d = bc.decide_cuda(GOOD)
    assert d.build and d.cuda_home == '/usr/local/cuda-13.0'
    assert d.arch_list == '8.0;9.0;10.0;12.0+PTX'
    assert d.line == ('mp_wrappers build: CUDA kernels on: CUDA 13.0 at /usr/local/cuda-13.0, torch '
                      '2.14.1+cu130, no GPU visible, default TORCH_CUDA_ARCH_LIST=8.0;9.0;10.0;12.0+PTX')


def test_user_arch_list_and_visible_gpus_are_left_to_torch():
    d = bc.decide_cuda(_probe(arch_list_env='9.0'))
    assert d.build and d.arch_list is None and 'TORCH_CUDA_ARCH_LIST=9.0' in d.line
    d = bc.decide_cuda(_probe(visible_gpus=2))
    assert d.build and d.arch_list is None and '2 visible GPU' in d.line
    # Minor versions may differ (torch cu130 with a 13.1 toolkit).
    assert bc.decide_cuda(_probe(toolkit_release='13.1')).build


# ---- through setup.py -------------------------------------------------------------------------------

@pytest.mark.skipif(torch.version.cuda is not None, reason='needs a CPU build of torch')
def test_setup_py_on_cpu_torch_prints_the_reason_and_forced_cuda_fails():
    env = dict(os.environ, MP_WRAPPERS_CUDA='auto')
    env.pop('MP_WRAPPERS_CXX_OPT', None)  # another level adds its own line
    ok = subprocess.run([sys.executable, 'setup.py', '--version'], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    lines = [ln for ln in ok.stdout.splitlines() if ln.startswith('mp_wrappers build:')]
    assert lines == [f'mp_wrappers build: CUDA kernels off (CPU-only build): torch {torch.__version__} '
                     'is a CPU build (torch.version.cuda is None)']
    env['MP_WRAPPERS_CUDA'] = '1'
    forced = subprocess.run([sys.executable, 'setup.py', '--version'], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert forced.returncode != 0
    assert 'MP_WRAPPERS_CUDA=1 but torch' in forced.stderr and 'is a CPU build' in forced.stderr



def test_cxx_opt_level_defaults_to_o3_and_names_a_bad_value():
    assert bc.cxx_opt_level({}) == bc.cxx_opt_level({'MP_WRAPPERS_CXX_OPT': ''}) == '-O3'
    assert bc.cxx_flags('c++20')[0] == '-O3' and '-O1' not in bc.cxx_flags('c++20')
    flags = bc.cxx_flags('c++20', bc.cxx_opt_level({'MP_WRAPPERS_CXX_OPT': '-O1'}))
    # only the level changes: the flags that keep the kernels' bits stay
    assert '-O1' in flags and '-O3' not in flags
    assert [f for f in flags if f != '-O1'] == [f for f in bc.cxx_flags('c++20') if f != '-O3']
    with pytest.raises(ValueError, match=r"MP_WRAPPERS_CXX_OPT='-Ofast': expected one of -O1, "
                                         r"-O2, -O3 \(default -O3"):
        bc.cxx_opt_level({'MP_WRAPPERS_CXX_OPT': '-Ofast'})
    # setup.py stops with that line before building anything
    env = dict(os.environ, MP_WRAPPERS_CUDA='0', MP_WRAPPERS_CXX_OPT='-O0')
    bad = subprocess.run([sys.executable, 'setup.py', '--version'], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "MP_WRAPPERS_CXX_OPT='-O0': expected one of" in bad.stderr


# ---- tools/check_cuda_compile.sh --------------------------------------------------------------------

_cspec = importlib.util.spec_from_file_location('check_cuda_compile',
                                                os.path.join(REPO, 'tools', 'check_cuda_compile.py'))
ccc = importlib.util.module_from_spec(_cspec)
_cspec.loader.exec_module(ccc)

PTXAS = """ptxas info    : 28 bytes gmem, 224 bytes cmem[4]
ptxas info    : Compiling entry function '_ZN2k1E' for 'sm_80'
ptxas info    : Function properties for _ZN2k1E
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 28 registers, used 0 barriers, 3848 bytes cmem[0], 8 bytes cmem[2]
ptxas info    : Compiling entry function '_ZN2k2E' for 'sm_80'
ptxas info    : Function properties for _ZN2k2E
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 3896 bytes cmem[0]
ptxas info    : Compiling entry function '_ZN2k1E' for 'sm_90'
ptxas info    : Function properties for _ZN2k1E
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers
"""


def test_compile_check_reads_registers_and_spills():
    r = ccc.parse_ptxas(PTXAS)
    assert (r['sm_80'].kernels, r['sm_80'].max_registers, r['sm_80'].spill_stores,
            r['sm_80'].spill_loads, r['sm_80'].max_stack) == (2, 255, 8, 12, 16)
    assert (r['sm_90'].kernels, r['sm_90'].max_registers, r['sm_90'].spill_stores) == (1, 32, 0)


def test_compile_check_arch_choice_says_what_it_skips():
    archs, skipped = ccc.choose_archs(bc.supported_archs(LIST_13_0))
    assert archs == ['sm_80', 'sm_90', 'sm_121']
    assert len(skipped) == 1 and skipped[0].startswith('sm_70: not supported by this nvcc')
    archs, skipped = ccc.choose_archs(bc.supported_archs(LIST_12_4))
    assert archs == ['sm_70', 'sm_80', 'sm_90'] and skipped == []


def test_compile_check_compiles_one_file_whole_and_the_others_device_only(tmp_path):
    files = ['mp_wrappers/csrc/cuda/a.cu', ccc.HOST_COMPILED, 'mp_wrappers/csrc/cuda/z.cu']
    assert ccc.host_compiled(files) == ccc.HOST_COMPILED
    assert os.path.isfile(os.path.join(REPO, ccc.HOST_COMPILED))  # a rename must move the constant
    # Without it (a rename, or files named on the command line) the first file takes the host half.
    assert ccc.host_compiled(files[::2]) == files[0]
    fake = tmp_path / 'nvcc'  # prints its arguments
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    for whole, mode, suffix in ((True, '-c', '.o'), (False, '-fatbin', '.fatbin')):
        path, rc, output, _, _ = ccc.compile_one(str(fake), files[0], ['sm_90'], ['-O3'],
                                                 str(tmp_path), whole)
        argv = output.split()
        assert rc == 0 and argv[:2] == [mode, files[0]], output
        assert argv[3] == str(tmp_path / f'a.cu{suffix}') and argv[-2:] == ['-Xptxas', '-v']


def test_compile_check_without_nvcc_says_skipped():
    env = dict(os.environ, NVCC='/nonexistent/nvcc')
    proc = subprocess.run(['bash', os.path.join(REPO, 'tools', 'check_cuda_compile.sh')], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == 'check_cuda_compile: skipped: no nvcc'
