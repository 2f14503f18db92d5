"""Which precisions this machine computes natively: a cheap, cached capability probe.

The probe reads what the hardware and the libraries say, never times anything:

* **CPU**: the instruction-set flags from ``/proc/cpuinfo`` (Linux) and from
  ``torch.cpu.get_capabilities()`` (cpuinfo, any OS), the ISA torch's own kernels were dispatched to
  (``torch.backends.cpu.get_cpu_capability()``), and ``ONEDNN_MAX_CPU_ISA``, which caps what oneDNN
  (torch's matmul/convolution backend on CPU) may use. A half format is *native* when the CPU has
  matrix/vector instructions for it that oneDNN uses *and they run faster than fp32*: bf16 with
  ``avx512_bf16`` or ``amx_bf16``, fp16 with ``avx512_fp16`` or ``amx_fp16`` (x86); bf16 with
  ``bf16``/``svebf16``, fp16 with ``asimdhp``/``fp16_arith`` (ARM). Without them oneDNN converts
  every half operand to fp32 and back, and half runs slower than fp32 (measured on an AVX2-only
  EPYC: the digits CNN 8x slower in bf16). On **Intel** CPUs the vector instructions alone bring no
  speed-up: an AVX512-BF16 dot product does no more multiply-adds per cycle than fp32 FMA, and
  oneDNN has no fast fp16 backward for AVX512-FP16; only AMX does. Measured on a Xeon VM with
  avx512_bf16 and avx512_fp16 but no AMX (2026-11-23, 1 thread): bf16 4x Linear(2048) fwd+bwd 1.7x
  slower than fp32, a 32->64 3x3 convolution 1.35-1.7x slower, the digits CNN 1.43x slower; fp16
  convolution backward ~100x slower. So there a half format is native only with its AMX flag
  (``instructions`` still lists it, and the warning for an explicit dtype says why it is slow).
* **CUDA**: the compute capability: fp16 on every GPU we build for, bf16 from sm_80, fp8 from sm_89.
* **The last-level cache** (:func:`last_level_cache_bytes`, Linux sysfs): benchmarks size their
  memory-bandwidth samples beyond it.

What to make of a :class:`DeviceCapability` (``dtype='auto'``, warnings) is
:mod:`mp_wrappers.hardware.policy`'s business; this module imports only torch and the standard
library, so that every layer may ask it.

Every probe takes its inputs as arguments (``flags=``, ``torch_isa=``...) so tests can fake any
machine; the argument-free calls read the real machine once per process (``functools.lru_cache``;
tests that fake the machine replace :func:`_probe_cpu` / :func:`_probe_cuda` of this module).
"""
import dataclasses
import functools
import os
import platform
from typing import FrozenSet, Iterable, List, Mapping, Optional, Tuple, Union

import torch

__all__ = ['DeviceCapability', 'FORMAT_NAMES', 'cpu_flags', 'cpu_capability', 'cuda_capability',
           'device_capability', 'last_level_cache_bytes']


# torch.cpu.get_capabilities() names -> the Linux /proc/cpuinfo names we use throughout.
_TORCH_FLAG_NAMES = {
    'avx512_f': 'avx512f', 'avx512_bw': 'avx512bw', 'avx512_vl': 'avx512vl',
    'avx512_dq': 'avx512dq', 'avx512_cd': 'avx512cd', 'fma3': 'fma',
    'neon': 'asimd', 'fp16_arith': 'asimdhp', 'sve_bf16': 'svebf16',
}
# The flags the report shows (the rest of /proc/cpuinfo says nothing about precision).
_SHOWN_FLAGS = ('avx2', 'fma', 'f16c', 'avx512f', 'avx512bw', 'avx512vl', 'avx512_bf16',
                'avx512_fp16', 'amx_tile', 'amx_bf16', 'amx_fp16', 'avx_ne_convert', 'asimd',
                'asimdhp', 'bf16', 'sve', 'sve2', 'svebf16')
_X86_BF16 = ('avx512_bf16', 'amx_bf16')
_X86_FP16 = ('avx512_fp16', 'amx_fp16')
_ARM_BF16 = ('bf16', 'svebf16')
_ARM_FP16 = ('asimdhp',)
# ONEDNN_MAX_CPU_ISA values (lower case) that still allow AVX-512 bf16 / fp16 instructions.
_ONEDNN_BF16_ISAS = ('avx512_core_bf16', 'avx512_core_fp16', 'avx512_core_amx',
                     'avx512_core_amx_fp16', 'avx10_1_512', 'avx10_1_512_amx',
                     'avx10_1_512_amx_fp16', 'all', 'default')
_ONEDNN_FP16_ISAS = ('avx512_core_fp16', 'avx512_core_amx_fp16', 'avx10_1_512',
                     'avx10_1_512_amx', 'avx10_1_512_amx_fp16', 'all', 'default')

#: The names :attr:`DeviceCapability.native` uses for the formats torch calls dtypes.
FORMAT_NAMES = {torch.float32: 'float32', torch.float16: 'float16', torch.bfloat16: 'bfloat16'}
# Intel CPUs with the vector half instructions but not the AMX ones (module docstring).
_INTEL_NO_AMX = {
    'bfloat16': ('on Intel cores AVX512-BF16 does no more multiply-adds per cycle than fp32 FMA '
                 '(measured on a Xeon without AMX: bf16 matmuls 1.7x and convolutions 1.35-1.7x '
                 'slower than fp32)'),
    'float16': ('oneDNN has no fast fp16 backward pass for AVX512-FP16 (measured on a Xeon without '
                'AMX: a convolution\'s backward ~100x slower than fp32)'),
}


@dataclasses.dataclass(frozen=True)
class DeviceCapability:
    """What one device computes natively.

    Attributes:
        device: ``'cpu'`` or ``'cuda:<index>'``.
        name: The processor's name as the system reports it.
        isa: The CPU's widest vector ISA (``'avx512'``, ``'avx2'``, ``'sve'``, ``'neon'``,
            ``'baseline'``) or the GPU's compute capability (``'sm_90'``).
        features: The precision-relevant flags found (CPU) or ``()``.
        native: Low-precision formats with native compute, widest first (e.g. ``(bfloat16,
            float16)``); fp32 is always native and not listed. On CUDA ``'float8'`` may appear.
        notes: Why a format is or is not native, one sentence each (the doctor prints them).
        instructions: Formats the CPU has instructions for that are nevertheless not native
            (no faster than fp32 there: Intel without AMX), with the flags found.
    """

    device: str
    name: str
    isa: str
    features: Tuple[str, ...]
    native: Tuple[str, ...]
    notes: Tuple[str, ...]
    instructions: Tuple[Tuple[str, str], ...] = ()

    def is_native(self, dtype: torch.dtype) -> bool:
        """Whether ``dtype`` computes natively here (fp32 always does)."""
        return dtype == torch.float32 or FORMAT_NAMES.get(dtype) in self.native


# ---- CPU -------------------------------------------------------------------------------------------
def _read_proc_cpuinfo() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            return f.read()
    except OSError:  # not Linux, or a sandbox without /proc
        return ''


def _torch_cpu_capabilities() -> Mapping[str, object]:
    get = getattr(getattr(torch, 'cpu', None), 'get_capabilities', None)
    if get is None:  # torch < 2.8
        return {}
    try:
        return get()
    except Exception:  # cpuinfo failed to initialise (exotic VMs): /proc/cpuinfo still answers
        return {}


def cpu_flags(cpuinfo: Optional[str] = None,
              torch_caps: Optional[Mapping[str, object]] = None) -> FrozenSet[str]:
    """The CPU's feature flags, from ``/proc/cpuinfo`` and torch's cpuinfo, in Linux's spelling.

    Args:
        cpuinfo: Text of ``/proc/cpuinfo`` (default: read it; empty off Linux).
        torch_caps: ``torch.cpu.get_capabilities()`` (default: ask torch).

    Returns:
        The union of both sources (either may be missing on a given OS).
    """
    if cpuinfo is None:
        cpuinfo = _read_proc_cpuinfo()
    if torch_caps is None:
        torch_caps = _torch_cpu_capabilities()
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(':')
        if key.strip() in ('flags', 'Features'):  # x86 / ARM
            flags.update(value.split())
            break  # every core lists the same flags
    for name, value in torch_caps.items():
        if value is True:
            flags.add(_TORCH_FLAG_NAMES.get(name, name))
    return frozenset(flags)


def _cpu_vendor(cpuinfo: str) -> str:
    """``vendor_id`` of /proc/cpuinfo (``'GenuineIntel'``, ``'AuthenticAMD'``...); '' if absent."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(':')
        if key.strip() == 'vendor_id':
            return value.strip()
    return ''


def _cpu_name(cpuinfo: str, torch_caps: Mapping[str, object]) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(':')
        if key.strip() in ('model name', 'Hardware', 'CPU part') and value.strip():
            return value.strip()
    return str(torch_caps.get('cpu_name', '') or platform.processor() or 'unknown CPU')


def cpu_capability(flags: Optional[Iterable[str]] = None, *, arch: Optional[str] = None,
                   torch_isa: Optional[str] = None, onednn_max_isa: Optional[str] = None,
                   name: Optional[str] = None, vendor: Optional[str] = None) -> DeviceCapability:
    """Describe a CPU; every input can be given (tests), else the real machine is read.

    Args:
        flags: Feature flags in Linux's spelling (default: :func:`cpu_flags`).
        arch: ``platform.machine()`` (``'x86_64'``, ``'aarch64'``...).
        torch_isa: ``torch.backends.cpu.get_cpu_capability()`` (``'AVX512'``, ``'AVX2'``,
            ``'DEFAULT'``, ``'SVE256'``...): ``ATEN_CPU_CAPABILITY`` lowers it.
        onednn_max_isa: ``ONEDNN_MAX_CPU_ISA`` (default: the environment variable; unset = all).
        name: The processor's name.
        vendor: ``vendor_id`` (``'GenuineIntel'``...; default: read with the real flags, '' when
            ``flags`` is given without it: no vendor-specific rule then).

    Returns:
        The :class:`DeviceCapability` of the CPU.
    """
    if flags is None:
        cpuinfo, caps = _read_proc_cpuinfo(), _torch_cpu_capabilities()
        flags = cpu_flags(cpuinfo, caps)
        if name is None:
            name = _cpu_name(cpuinfo, caps)
        if vendor is None:
            vendor = _cpu_vendor(cpuinfo)
    flags = frozenset(flags)
    arch = (arch if arch is not None else platform.machine()).lower()
    if torch_isa is None:
        torch_isa = torch.backends.cpu.get_cpu_capability()
    if onednn_max_isa is None:
        onednn_max_isa = os.environ.get('ONEDNN_MAX_CPU_ISA', os.environ.get('DNNL_MAX_CPU_ISA', ''))
    torch_isa = torch_isa.upper()
    if arch in ('x86_64', 'amd64', 'i386', 'i686', 'x86'):
        isa, native, notes, instructions = _x86_formats(flags, vendor or '', torch_isa,
                                                        onednn_max_isa)
    elif arch in ('aarch64', 'arm64'):
        isa, native, notes, instructions = _arm_formats(flags)
    else:
        isa, native, instructions = torch_isa.lower() or 'baseline', [], []
        notes = [f'bfloat16, float16: unknown on {arch or "this architecture"}; treated as '
                 'not native']
    shown = tuple(f for f in _SHOWN_FLAGS if f in flags)
    return DeviceCapability(device='cpu', name=name or 'unknown CPU', isa=isa, features=shown,
                            native=tuple(native), notes=tuple(notes),
                            instructions=tuple(instructions))


_Formats = Tuple[str, List[str], List[str], List[Tuple[str, str]]]


def _x86_formats(flags: FrozenSet[str], vendor: str, torch_isa: str,
                 onednn_max_isa: str) -> _Formats:
    """``(isa, native formats, notes, instructions)`` of an x86 CPU (see :class:`DeviceCapability`)."""
    if {'avx512f', 'avx512bw', 'avx512vl'} <= flags:
        isa = 'avx512'
    elif {'avx2', 'fma'} <= flags:
        isa = 'avx2'
    else:
        isa = 'baseline'
    onednn = onednn_max_isa.strip().lower() or 'all'
    # Library caps: oneDNN runs convolutions/matmuls, ATen the elementwise half work. Either one
    # held below AVX-512 converts every half operand in software.
    capped = None
    if torch_isa not in ('AVX512', 'ZVECTOR', 'VSX') and isa == 'avx512':
        capped = (f'torch dispatches its CPU kernels to {torch_isa} (ATEN_CPU_CAPABILITY), '
                  'below AVX-512')
    native, notes, instructions = [], [], []
    for fmt, hw_flags, onednn_ok in (('bfloat16', _X86_BF16, _ONEDNN_BF16_ISAS),
                                     ('float16', _X86_FP16, _ONEDNN_FP16_ISAS)):
        found = [f for f in hw_flags if f in flags]
        amx = hw_flags[1]
        if found and vendor == 'GenuineIntel' and amx not in flags:
            # See the module docstring: on Intel only AMX makes a half format faster than fp32.
            why = _INTEL_NO_AMX[fmt]
            notes.append(f'{fmt}: the CPU has {", ".join(found)} but no {amx}: {why}; not '
                         'counted as native')
            instructions.append((fmt, f'{", ".join(found)} without {amx}: {why}'))
            continue
        if not found:
            notes.append(f'{fmt}: not native (no {" / ".join(hw_flags)}); oneDNN converts '
                         'every operand to fp32 and back, slower than fp32')
        elif capped:
            notes.append(f'{fmt}: the CPU has {", ".join(found)} but {capped}: not native')
        elif onednn not in onednn_ok:
            notes.append(f'{fmt}: the CPU has {", ".join(found)} but ONEDNN_MAX_CPU_ISA='
                         f'{onednn_max_isa} keeps oneDNN from using it: not native')
        else:
            native.append(fmt)
            notes.append(f'{fmt}: native ({", ".join(found)})')
    return isa, native, notes, instructions


def _arm_formats(flags: FrozenSet[str]) -> _Formats:
    """``(isa, native formats, notes, instructions)`` of an ARM CPU (see :class:`DeviceCapability`)."""
    isa = 'sve' if 'sve' in flags else ('neon' if 'asimd' in flags else 'baseline')
    native, notes = [], []
    for fmt, hw_flags in (('bfloat16', _ARM_BF16), ('float16', _ARM_FP16)):
        found = [f for f in hw_flags if f in flags]
        if found:
            native.append(fmt)
            notes.append(f'{fmt}: native ({", ".join(found)})')
        else:
            notes.append(f'{fmt}: not native (no {" / ".join(hw_flags)})')
    return isa, native, notes, []


def _cache_size_bytes(text: str) -> Optional[int]:
    """``'266240K'``, ``'32M'``, ``'1024'`` (sysfs spellings) -> bytes; None if unreadable."""
    text = text.strip().upper()
    scale = {'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    return int(digits) * scale if digits.isdigit() else None


def last_level_cache_bytes(cache_dir: Optional[str] = None) -> Optional[int]:
    """Size of the CPU's last-level cache in bytes, from Linux sysfs; None where it is not listed.

    Benchmarks need it to size their bandwidth samples: a working set that fits the last-level
    cache measures the cache, not memory (this project's VM has a 260 MiB L3, so a 100 MB
    ``a.mul_`` sample ran at twice the DRAM bandwidth the optimizer steps actually stream from).

    Args:
        cache_dir: The ``cache`` folder of one CPU (default:
            ``/sys/devices/system/cpu/cpu0/cache``), holding ``index*/{level,type,size}``.

    Returns:
        The size of the highest-level data or unified cache listed (the whole cache, which on most
        CPUs all cores share), or None when sysfs lists none (not Linux, a sandbox without /sys).
    """
    if cache_dir is None:
        cache_dir = '/sys/devices/system/cpu/cpu0/cache'
    best_level, best_size = 0, None
    try:
        entries = sorted(os.listdir(cache_dir))
    except OSError:
        return None
    for entry in entries:
        if not entry.startswith('index'):
            continue
        try:
            with open(os.path.join(cache_dir, entry, 'level')) as f:
                level = int(f.read().strip())
            with open(os.path.join(cache_dir, entry, 'type')) as f:
                kind = f.read().strip()
            with open(os.path.join(cache_dir, entry, 'size')) as f:
                size = _cache_size_bytes(f.read())
        except (OSError, ValueError):
            continue
        if kind == 'Instruction' or size is None:
            continue
        if level > best_level or (level == best_level and size > (best_size or 0)):
            best_level, best_size = level, size
    return best_size


# ---- CUDA ------------------------------------------------------------------------------------------
def cuda_capability(compute_capability: Tuple[int, int], *, index: int = 0,
                    name: str = 'CUDA GPU') -> DeviceCapability:
    """Describe a GPU from its compute capability (``torch.cuda.get_device_capability()``).

    fp16 tensor cores exist on every architecture we build for (sm_70+; older GPUs still compute
    fp16 natively), bf16 from Ampere (sm_80), fp8 from Ada/Hopper (sm_89).
    """
    major, minor = compute_capability
    cc = major * 10 + minor
    native = ['float16']
    notes = ['float16: native (every CUDA GPU)']
    if cc >= 80:
        native.insert(0, 'bfloat16')
        notes.append(f'bfloat16: native (sm_{cc} >= sm_80)')
    else:
        notes.append(f'bfloat16: not native before sm_80 (this GPU is sm_{cc}): emulated, slow')
    if cc >= 89:
        native.append('float8')
        notes.append(f'float8: native (sm_{cc} >= sm_89)')
    return DeviceCapability(device=f'cuda:{index}', name=name, isa=f'sm_{cc}', features=(),
                            native=tuple(native), notes=tuple(notes))


@functools.lru_cache(maxsize=None)
def _probe_cpu() -> DeviceCapability:
    return cpu_capability()


@functools.lru_cache(maxsize=None)
def _probe_cuda(index: int) -> DeviceCapability:
    return cuda_capability(torch.cuda.get_device_capability(index), index=index,
                           name=torch.cuda.get_device_name(index))


def device_capability(device: Union[str, torch.device, None] = None) -> DeviceCapability:
    """The (cached) capability of a real device: ``'cpu'``, ``'cuda'``, ``'cuda:1'``...

    ``None`` means the device training would use: the current CUDA device when CUDA is available,
    else the CPU. Devices other than CPU and CUDA are reported with no native half format.
    """
    if device is None:
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    device = torch.device(device)
    if device.type == 'cpu':
        return _probe_cpu()
    if device.type == 'cuda':
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _probe_cuda(index)
    return DeviceCapability(device=str(device), name=device.type, isa='unknown', features=(),
                            native=(), notes=(f'{device.type}: not probed; fp32 assumed',))
