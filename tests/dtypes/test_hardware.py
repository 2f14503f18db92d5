"""mp_wrappers.hardware: the capability probe, with its inputs faked for each CPU and GPU class."""
import pytest
import torch

from mp_wrappers import hardware
from mp_wrappers.hardware import auto_dtype, cpu_capability, cpu_flags, cuda_capability

AVX2 = {'sse4_2', 'avx', 'avx2', 'fma', 'f16c'}
AVX512 = AVX2 | {'avx512f', 'avx512bw', 'avx512vl', 'avx512dq'}

# (id, flags, arch, torch_isa, onednn_max_isa, native formats, isa, auto dtype)
CPU_CLASSES = [
    ('epyc-avx2-only', AVX2, 'x86_64', 'AVX2', '', (), 'avx2', torch.float32),
    ('skylake-avx512-no-bf16', AVX512, 'x86_64', 'AVX512', '', (), 'avx512', torch.float32),
    ('zen4-avx512-bf16', AVX512 | {'avx512_bf16'}, 'x86_64', 'AVX512', '', ('bfloat16',),
     'avx512', torch.bfloat16),
    ('sapphire-rapids-amx', AVX512 | {'avx512_bf16', 'avx512_fp16', 'amx_tile', 'amx_bf16'},
     'x86_64', 'AVX512', '', ('bfloat16', 'float16'), 'avx512', torch.bfloat16),
    ('fp16-only-avx512', AVX512 | {'avx512_fp16'}, 'x86_64', 'AVX512', '', ('float16',), 'avx512',
     torch.float16),
    ('avx512-bf16-but-aten-avx2', AVX512 | {'avx512_bf16'}, 'x86_64', 'AVX2', '', (), 'avx512',
     torch.float32),
    ('avx512-bf16-but-onednn-avx2', AVX512 | {'avx512_bf16'}, 'x86_64', 'AVX512', 'AVX2', (),
     'avx512', torch.float32),
    ('avx512-bf16-onednn-bf16-cap', AVX512 | {'avx512_bf16', 'avx512_fp16'}, 'x86_64', 'AVX512',
     'AVX512_CORE_BF16', ('bfloat16',), 'avx512', torch.bfloat16),
    ('old-x86-sse', {'sse4_2'}, 'x86_64', 'DEFAULT', '', (), 'baseline', torch.float32),
    ('graviton3-sve-bf16', {'asimd', 'asimdhp', 'bf16', 'sve', 'svebf16'}, 'aarch64', 'SVE256',
     '', ('bfloat16', 'float16'), 'sve', torch.bfloat16),
    ('graviton2-neon-fp16', {'asimd', 'asimdhp'}, 'aarch64', 'DEFAULT', '', ('float16',), 'neon',
     torch.float16),
    ('power9', set(), 'ppc64le', 'VSX', '', (), 'vsx', torch.float32),
]


@pytest.mark.parametrize('flags,arch,torch_isa,onednn,native,isa,auto',
                         [c[1:] for c in CPU_CLASSES], ids=[c[0] for c in CPU_CLASSES])
def test_cpu_classes(flags, arch, torch_isa, onednn, native, isa, auto):
    cap = cpu_capability(flags, arch=arch, torch_isa=torch_isa, onednn_max_isa=onednn,
                         name='fake CPU')
    assert cap.native == native
    assert cap.isa == isa
    assert cap.device == 'cpu' and cap.name == 'fake CPU'
    assert len(cap.notes) >= 1
    resolved = auto_dtype(capability=cap)
    assert resolved.dtype == auto
    assert f"resolved to {str(auto).replace('torch.', '')} on cpu" in resolved.reason
    for dtype in (torch.bfloat16, torch.float16):
        reason = hardware.slowdown_reason(dtype, capability=cap)
        if str(dtype).replace('torch.', '') in native:
            assert reason is None
        else:
            assert 'has no native instructions: expect slower than fp32' in reason
            assert f"dtype='{str(auto).replace('torch.', '')}'" in reason
    assert hardware.slowdown_reason(torch.float32, capability=cap) is None


def test_avx2_bf16_warning_states_the_reason_and_no_false_speedup():
    cap = cpu_capability(AVX2, arch='x86_64', torch_isa='AVX2', onednn_max_isa='', name='AMD EPYC')
    reason = hardware.slowdown_reason(torch.bfloat16, capability=cap)
    assert reason.startswith('bf16 on this CPU (AMD EPYC, avx2) has no native instructions: '
                             'expect slower than fp32')
    assert 'faster' not in reason
    fp32 = auto_dtype(capability=cap)
    assert 'resolved to float32' in fp32.reason and 'no native bfloat16 or float16' in fp32.reason
    notes = ' '.join(cap.notes)
    assert 'avx512_bf16' in notes and 'not native' in notes


def test_library_caps_are_named_in_the_notes():
    cap = cpu_capability(AVX512 | {'avx512_bf16'}, arch='x86_64', torch_isa='AVX512',
                         onednn_max_isa='AVX2')
    assert any('ONEDNN_MAX_CPU_ISA=AVX2' in n for n in cap.notes)
    cap = cpu_capability(AVX512 | {'avx512_bf16'}, arch='x86_64', torch_isa='AVX2',
                         onednn_max_isa='')
    assert any('ATEN_CPU_CAPABILITY' in n for n in cap.notes)


@pytest.mark.parametrize('cc,native,auto', [
    ((6, 1), ('float16',), torch.float16),
    ((7, 0), ('float16',), torch.float16),
    ((7, 5), ('float16',), torch.float16),
    ((8, 0), ('bfloat16', 'float16'), torch.bfloat16),
    ((8, 6), ('bfloat16', 'float16'), torch.bfloat16),
    ((8, 9), ('bfloat16', 'float16', 'float8'), torch.bfloat16),
    ((9, 0), ('bfloat16', 'float16', 'float8'), torch.bfloat16),
    ((10, 0), ('bfloat16', 'float16', 'float8'), torch.bfloat16),
], ids=lambda v: str(v))
def test_cuda_classes(cc, native, auto):
    cap = cuda_capability(cc, index=1, name='fake GPU')
    assert cap.native == native and cap.device == 'cuda:1'
    assert cap.isa == f'sm_{cc[0] * 10 + cc[1]}'
    assert auto_dtype(capability=cap).dtype == auto
    bf16 = hardware.slowdown_reason(torch.bfloat16, capability=cap)
    assert (bf16 is None) == (cc >= (8, 0))
    if bf16 is not None:
        assert 'emulated before sm_80' in bf16 and "dtype='float16'" in bf16
    assert hardware.slowdown_reason(torch.float16, capability=cap) is None


def test_cpu_flags_merge_proc_cpuinfo_and_torch_names():
    cpuinfo = ('processor\t: 0\nmodel name\t: Fake CPU\nflags\t\t: fpu sse avx2 fma\n\n'
               'processor\t: 1\nflags\t\t: fpu sse avx2 fma\n')
    flags = cpu_flags(cpuinfo, {'avx512_f': True, 'avx512_bw': True, 'avx512_bf16': False,
                                'fma3': True, 'l2_cache_size': 1 << 20, 'architecture': 'x86_64'})
    assert {'avx2', 'fma', 'sse', 'avx512f', 'avx512bw'} <= flags
    assert 'avx512_bf16' not in flags and 'avx512_f' not in flags
    arm = cpu_flags('Features\t: fp asimd asimdhp\n', {'bf16': True, 'sve_bf16': True})
    assert {'asimd', 'asimdhp', 'bf16', 'svebf16'} <= arm
    assert cpu_flags('', {}) == frozenset()


def test_real_probe_is_cached_and_consistent():
    a = hardware.device_capability('cpu')
    assert a is hardware.device_capability(torch.device('cpu'))
    assert a.isa in ('avx512', 'avx2', 'baseline', 'sve', 'neon') or a.isa
    assert auto_dtype('cpu').dtype in (torch.float32, torch.float16, torch.bfloat16)
    # Our extension's own ISA detection agrees with the probe's reading of the flags.
    info = hardware.extension_info()
    if info.get('cpu_kernels_widest') is not None and a.isa in ('avx512', 'avx2'):
        assert info['cpu_kernels_widest'] == a.isa


def test_report_is_plain_data():
    rep = hardware.report()
    assert rep['devices'][0]['device'] == 'cpu'
    assert rep['auto']['cpu'] in ('float32', 'float16', 'bfloat16')
    assert 'backend' in rep['extension']


def test_resolve_dtype_names_the_allowed_values():
    assert hardware.resolve_dtype('bf16') == torch.bfloat16
    assert hardware.resolve_dtype('float32') == torch.float32
    with pytest.raises(ValueError, match="allowed: 'float16', 'bfloat16', 'float32'"):
        hardware.resolve_dtype('int8')


def _fake_cache(root, entries):
    for i, (level, kind, size) in enumerate(entries):
        d = root / f'index{i}'
        d.mkdir()
        (d / 'level').write_text(f'{level}\n')
        (d / 'type').write_text(f'{kind}\n')
        (d / 'size').write_text(f'{size}\n')
    return str(root)


@pytest.mark.parametrize('entries,expected', [
    # The project's Intel VM: L1d 48K, L1i 32K, L2 2M, L3 260M shared.
    ([(1, 'Data', '48K'), (1, 'Instruction', '32K'), (2, 'Unified', '2048K'),
      (3, 'Unified', '266240K')], 260 << 20),
    # No L3 (some ARM cores): the L2 is the last level; an instruction cache never counts.
    ([(1, 'Data', '64K'), (1, 'Instruction', '64K'), (2, 'Unified', '1M')], 1 << 20),
    ([(1, 'Instruction', '32K')], None),
    ([(3, 'Unified', '32M'), (3, 'Unified', '64M')], 64 << 20),
    ([(2, 'Unified', '2048K'), (3, 'Unified', 'garbage')], 2 << 20),
    ([(4, 'Unified', '1G'), (3, 'Unified', '96M')], 1 << 30),
    ([(2, 'Data', '1048576')], 1 << 20),
], ids=['intel-vm-l3', 'l2-last', 'instruction-only', 'two-l3-slices', 'unreadable-size',
        'l4', 'plain-bytes'])
def test_last_level_cache_from_sysfs(tmp_path, entries, expected):
    assert hardware.last_level_cache_bytes(_fake_cache(tmp_path, entries)) == expected


def test_last_level_cache_missing_sysfs_is_none(tmp_path):
    assert hardware.last_level_cache_bytes(str(tmp_path / 'absent')) is None
    (tmp_path / 'index0').mkdir()  # no level/type/size files
    assert hardware.last_level_cache_bytes(str(tmp_path)) is None


def test_last_level_cache_of_this_machine():
    size = hardware.last_level_cache_bytes()
    assert size is None or size >= 64 << 10


# (id, flags, vendor, native formats, auto dtype, formats with instructions that are not native)
VENDOR_CLASSES = [
    # This project's 2026-11-23 VM: bf16 matmuls 1.7x, the digits CNN 1.43x slower than fp32.
    ('xeon-avx512-bf16-fp16-no-amx', AVX512 | {'avx512_bf16', 'avx512_fp16'}, 'GenuineIntel', (),
     torch.float32, ('bfloat16', 'float16')),
    ('cooper-lake-avx512-bf16', AVX512 | {'avx512_bf16'}, 'GenuineIntel', (), torch.float32,
     ('bfloat16',)),
    ('sapphire-rapids-amx-bf16', AVX512 | {'avx512_bf16', 'avx512_fp16', 'amx_tile', 'amx_bf16'},
     'GenuineIntel', ('bfloat16',), torch.bfloat16, ('float16',)),
    ('granite-rapids-amx-fp16', AVX512 | {'avx512_bf16', 'avx512_fp16', 'amx_tile', 'amx_bf16',
                                          'amx_fp16'}, 'GenuineIntel', ('bfloat16', 'float16'),
     torch.bfloat16, ()),
    # The EPYC of 2026-11-21: the digits CNN 0.71x the fp32 time in bf16.
    ('zen4-avx512-bf16', AVX512 | {'avx512_bf16'}, 'AuthenticAMD', ('bfloat16',), torch.bfloat16,
     ()),
    ('intel-avx2-only', AVX2, 'GenuineIntel', (), torch.float32, ()),
]


@pytest.mark.parametrize('flags,vendor,native,auto,slow', [c[1:] for c in VENDOR_CLASSES],
                         ids=[c[0] for c in VENDOR_CLASSES])
def test_intel_half_formats_are_native_only_with_amx(flags, vendor, native, auto, slow):
    cap = cpu_capability(flags, arch='x86_64', torch_isa='AVX512', onednn_max_isa='',
                         name='fake CPU', vendor=vendor)
    assert cap.native == native
    assert tuple(fmt for fmt, _ in cap.instructions) == slow
    resolved = auto_dtype(capability=cap)
    assert resolved.dtype == auto
    if slow and auto == torch.float32:
        assert 'half-precision instructions run no faster than fp32' in resolved.reason
    for fmt in slow:
        reason = hardware.slowdown_reason(getattr(torch, fmt), capability=cap)
        amx = 'amx_bf16' if fmt == 'bfloat16' else 'amx_fp16'
        assert f'without {amx}' in reason and 'expect slower than fp32' in reason
        assert 'no native instructions' not in reason  # it has them: they are just not faster
        assert any(n.startswith(f'{fmt}: the CPU has') and 'not counted as native' in n
                   for n in cap.notes)


def test_vendor_is_read_from_proc_cpuinfo():
    assert hardware.probe._cpu_vendor('processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t: avx2\n') == \
        'GenuineIntel'
    assert hardware.probe._cpu_vendor('') == ''
