"""What the installed torch can do, for the features that need a newer torch than the oldest we support.

mp_wrappers supports torch >= 2.1 (``TORCH_MIN``; the tested range is in docs/compatibility.md).
A few features rest on newer torch APIs. Each is detected here by the API itself (an attribute or an
import), never by comparing version strings, so a backport or a nightly answers correctly. Everything
else works on every supported torch; a gated feature used where its API is missing raises one line
that names the feature, the torch it needs, the torch found and what to do::

    mp_wrappers.compat.FeatureUnavailableError: FSDP2 (fully_shard) needs torch >= 2.6 (found
    2.1.2): torch.distributed.fsdp.fully_shard is missing; install torch>=2.6, or use FSDP1 through
    mp_wrappers.MixedPrecisionFSDPStrategy

This module imports only torch, so any layer may use it.
"""
import dataclasses
import functools
import getpass
import inspect
import os
import re
import tempfile
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

__all__ = ['TORCH_MIN', 'TORCH_NEWEST_TESTED', 'Feature', 'FEATURES', 'FeatureUnavailableError',
           'has', 'require', 'torch_version_tuple',
           'register_load_state_dict_pre_hook', 'autocast_enabled', 'autocast_dtype', 'require_dtype_on',
           'is_compiling', 'isolate_inductor_cache']

#: The oldest torch mp_wrappers supports (setup.py cannot pin torch: see tools/install.sh).
TORCH_MIN: Tuple[int, int] = (2, 1)
#: The newest torch the compatibility matrix ran green on (docs/compatibility.md).
TORCH_NEWEST_TESTED = '2.14.1'


class FeatureUnavailableError(RuntimeError):
    """A feature was used on a torch that lacks the API it needs (see :data:`FEATURES`)."""


def _importable(module: str, attr: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            mod = __import__(module, fromlist=[attr])
        except ImportError:
            return False
        return hasattr(mod, attr)
    return probe


def _attrs(obj: object, *names: str) -> Callable[[], bool]:
    return lambda: all(hasattr(obj, n) for n in names)


def _cpu_fp16() -> bool:
    # Behaviour, not an attribute: torch 2.1 has the same API but no fp16 CPU kernel for matmul
    # and convolution ("addmm_impl_cpu_" not implemented for 'Half') and refuses fp16 CPU autocast
    # on entry ("AutocastCPU only support Bfloat16"); both came with torch 2.2.
    try:
        a = torch.ones(2, 2, dtype=torch.float16)
        torch.addmm(a, a, a)
        with torch.autocast(device_type='cpu', dtype=torch.float16):
            pass
    except RuntimeError:
        return False
    return True


_PROBE_LIBRARIES: list = []


@functools.lru_cache(maxsize=None)
def _functionalizes_list_mutation() -> bool:
    # Our fused ops update lists of tensors in place (schema `Tensor(a!)[]`). torch.compile traces
    # a custom op that mutates its inputs through auto_functionalize, which took mutated Tensor[]
    # arguments only in a later release: torch 2.4.1 refuses them ("Found a custom (non-ATen)
    # operator whose output has alias annotations"), 2.6.0 takes them. Asked of a probe op with
    # that schema, in a namespace of its own, so that this module needs no extension.
    try:
        from torch._higher_order_ops.auto_functionalize import can_auto_functionalize
        lib = torch.library.Library('mp_wrappers_compat_probe', 'FRAGMENT')
        lib.define('list_update_(Tensor(a!)[] xs) -> ()')
        _PROBE_LIBRARIES.append(lib)  # a Library deregisters its ops when collected
        return bool(can_auto_functionalize(torch.ops.mp_wrappers_compat_probe.list_update_.default))
    except (ImportError, AttributeError, RuntimeError):
        return False


def _bucket_by_step_identity(x: torch.Tensor) -> torch.Tensor:
    step = torch.zeros(1)  # a tensor made inside the graph, like a first step's counter
    seen = []
    for t in (step, step):
        if not any(s is t for s in seen):
            seen.append(t)
    return x + len(seen)


@functools.lru_cache(maxsize=None)
def _dynamo_traces_fused_steps() -> bool:
    # Behaviour, not an API: the fused optimizers group their tensors by which step counter they
    # share, found with `is` (mp_wrappers.optim.buckets.identity; id() of a tensor made in the graph
    # does not trace before torch 2.13). One tiny compile (no code generated), once.
    try:
        compiled = torch.compile(_bucket_by_step_identity, fullgraph=True, backend='eager')
        compiled(torch.ones(1))
    except Exception:  # dynamo's Unsupported and friends; any failure means no
        return False
    return True


def _compiles_fused_steps() -> bool:
    return _functionalizes_list_mutation() and _dynamo_traces_fused_steps()


@dataclasses.dataclass(frozen=True)
class Feature:
    """A feature that needs a newer torch than :data:`TORCH_MIN`.

    Attributes:
        title: What the user turned on, as they would name it ("FSDP2 (fully_shard)").
        min_torch: The first torch release with ``api`` ("2.6").
        api: The torch API whose presence decides it.
        instead: What works on an older torch, or '' (appended to the error line).
        probe: Returns whether ``api`` is present in the installed torch.
    """

    title: str
    min_torch: str
    api: str
    instead: str
    probe: Callable[[], bool]


FEATURES: Dict[str, Feature] = {
    # The lean 'split' master keeps each fp32 master's low 16 bits in a uint16 tensor.
    'uint16': Feature(
        "master_weights='split' (bf16 weights + uint16 low halves)", '2.3', 'torch.uint16',
        "master_weights='kahan' or 'stochastic', or O2's fp32 masters (master_weights=True), work "
        'on any torch', _attrs(torch, 'uint16')),
    # Fake (meta) kernels of our ops, for torch.compile and meta tensors; eager mode needs none.
    'fake_kernels': Feature(
        'torch.compile / meta tensors through the torch.ops.mp_wrappers ops', '2.4',
        'torch.library.register_fake', 'eager mode (no torch.compile) works on any torch',
        _attrs(torch.library, 'register_fake')),
    # torch.compile of a fused step (FusedAdam & co. under torch.compile, compile_step=...): our ops
    # update lists of tensors in place, which the compiler must functionalize.
    'compile_list_ops': Feature(
        'torch.compile of the fused steps (ops that update lists of tensors in place)', '2.6',
        'auto_functionalize of custom ops mutating a Tensor[] (torch 2.4.1 lacks it; 2.6.0 has '
        'it) and dynamo tracing the grouping of params by their step counters',
        'eager fused steps work on any torch', _compiles_fused_steps),
    # FSDP2: per-parameter sharding with DTensors (public in torch.distributed.fsdp since 2.6).
    'fsdp2': Feature(
        'FSDP2 (fully_shard, mp_wrappers.FullyShardedModel)', '2.6',
        'torch.distributed.fsdp.fully_shard',
        'FSDP1 through mp_wrappers.MixedPrecisionFSDPStrategy works from torch 2.1',
        _importable('torch.distributed.fsdp', 'fully_shard')),
    # fp16 compute on CPU: models cast to fp16 (O2/O3, FP16OptimWrapper) and fp16 autocast (O1,
    # fp16=True evaluation). Elementwise fp16 work (our ops, optimizer steps) runs on any torch.
    'cpu_fp16': Feature(
        "dtype='float16' on CPU (fp16 matmul/convolution kernels and fp16 CPU autocast)", '2.2',
        "fp16 CPU kernels of addmm/conv and torch.autocast(device_type='cpu', dtype=torch.float16)",
        "use dtype='bfloat16' or 'auto' on CPU (fp16 on CUDA works on any torch)",
        _cpu_fp16),
    # FSDP1 (FullyShardedDataParallel) on CPU with gloo: FSDP creates its streams through the
    # device's module, torch.cpu.Stream(priority=...); torch 2.1's CPU Stream takes no arguments
    # ("Stream() takes no arguments" in FSDP's lazy init). On CUDA, FSDP1 works on any torch.
    'fsdp_cpu': Feature(
        'FSDP1 on CPU (mp_wrappers.MixedPrecisionFSDPStrategy without CUDA)', '2.4',
        'torch.cpu.Stream(priority=...)', 'FSDP1 on CUDA and DDP on CPU work on any torch',
        lambda: 'priority' in inspect.signature(torch.cpu.Stream).parameters),
    # FSDP2 on CPU: its copy-in/out records events on the device stream, torch.cpu.Stream.record_event,
    # missing in torch 2.6 ("'Stream' object has no attribute 'record_event'"); present in 2.13 (the
    # releases between were not tried, hence 2.13 as the version to install).
    'fsdp2_cpu': Feature(
        'FSDP2 on CPU (mp_wrappers.FullyShardedModel without CUDA)', '2.13',
        'torch.cpu.Stream.record_event', 'FSDP2 on CUDA works from torch 2.6; DDP on CPU on any torch',
        lambda: hasattr(torch.cpu.Stream, 'record_event')),
    # The weights_only checkpoint loader allow-lists mmengine's globals for the duration of a load.
    'safe_globals': Feature(
        "the weights_only checkpoint loader (mp_wrappers.checkpoint)", '2.5',
        'torch.serialization.safe_globals',
        "torch < 2.6 loads mmengine checkpoints with mmengine's own loader (torch.load's default "
        'there is weights_only=False: load only checkpoints you trust)',
        _attrs(torch.serialization, 'safe_globals', 'get_safe_globals',
               'get_unsafe_globals_in_checkpoint')),
}


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)`` (torch >= 2.4), or its per-device older form."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no argument; is_autocast_enabled() is CUDA's
        return torch.is_autocast_cpu_enabled() if device_type == 'cpu' else torch.is_autocast_enabled()


def autocast_dtype(device_type: str) -> torch.dtype:
    """``torch.get_autocast_dtype(device_type)`` (torch >= 2.4), or its per-device older form."""
    if hasattr(torch, 'get_autocast_dtype'):
        return torch.get_autocast_dtype(device_type)
    return torch.get_autocast_cpu_dtype() if device_type == 'cpu' else torch.get_autocast_gpu_dtype()


def is_compiling() -> bool:
    """Whether ``torch.compile`` is tracing the caller: ``torch.compiler.is_compiling()`` (torch >=
    2.3), or its older home ``torch._dynamo.is_compiling()``."""
    compiler = getattr(torch, 'compiler', None)
    if compiler is not None and hasattr(compiler, 'is_compiling'):
        return compiler.is_compiling()
    return torch._dynamo.is_compiling()


def mark_static_addresses(tensors: Iterable[Optional[torch.Tensor]]) -> None:
    """Tell inductor's CUDA graphs (``torch.compile(mode='reduce-overhead')``) that these CUDA
    tensors keep their address from step to step (``torch._dynamo.mark_static_address``).

    A graph that updates an input in place (a param, a moment, the loss scale) is otherwise not
    recorded at all ("skipping cudagraphs due to mutated inputs"), and an input it only reads is
    copied into the graph's own buffer at every replay. ``guard=True``: the address is guarded, so
    a tensor replaced by another (a state dict loaded into new tensors) compiles the step again.
    With ``guard=False`` some torch configurations (``inline_inbuilt_nn_modules=False``, inductor's
    ``freezing``) turn a marked tensor into a constant of the graph and would keep using the
    replaced one. Mark only tensors that live as long as the training: never a gradient or an lr
    that a scheduler replaces every step (each new address would compile again). Eager only (dynamo
    refuses the call inside a graph); CPU tensors are left alone, so a CPU run never imports dynamo
    for it.
    """
    cuda = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda
            and getattr(t, '_dynamo_static_input_type', None) is None]
    if not cuda or is_compiling():
        return
    from torch import _dynamo
    mark = getattr(_dynamo, 'mark_static_address', None)
    if mark is None:  # torch without it has no CUDA-graph trees to tell
        return
    for t in cuda:
        mark(t, guard=True)


def register_load_state_dict_pre_hook(module: torch.nn.Module, hook: Callable):
    """``module.register_load_state_dict_pre_hook(hook)``; on torch < 2.2, whose public method is
    missing, the private one it wraps (same hook signature, ``with_module=True``)."""
    public = getattr(module, 'register_load_state_dict_pre_hook', None)
    if public is not None:
        return public(hook)
    return module._register_load_state_dict_pre_hook(hook, with_module=True)


def require_dtype_on(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse (one line) to compute in ``dtype`` on ``device`` where this torch has no kernels for it."""
    if dtype == torch.float16 and torch.device(device).type == 'cpu':
        require('cpu_fp16')


def torch_version_tuple(version: str = None) -> Tuple[int, int, int]:
    """``(2, 1, 2)`` from ``torch.__version__`` ('2.1.2+cu121', '2.15.0.dev20261101')."""
    m = re.match(r'(\d+)\.(\d+)(?:\.(\d+))?', version or torch.__version__)
    if not m:
        raise ValueError(f'cannot read a version from {version!r}')
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@functools.lru_cache(maxsize=None)
def has(feature: str) -> bool:
    """Whether the installed torch has what ``feature`` (a key of :data:`FEATURES`) needs."""
    try:
        f = FEATURES[feature]
    except KeyError:
        raise ValueError(f'unknown feature {feature!r}; known: {sorted(FEATURES)}') from None
    return bool(f.probe())


def require(feature: str) -> None:
    """Raise :class:`FeatureUnavailableError` (one line) unless the installed torch has ``feature``."""
    if has(feature):
        return
    f = FEATURES[feature]
    instead = f'; {f.instead}' if f.instead else ''
    raise FeatureUnavailableError(
        f'{f.title} needs torch >= {f.min_torch} (found {torch.__version__}): {f.api} is missing; '
        f'install torch>={f.min_torch}{instead}')


# Note [inductor's cache and ATEN_CPU_CAPABILITY]
#   Inductor picks the vector width of the C++ it generates from ATEN_CPU_CAPABILITY, but its graph
#   cache does not key on that variable (seen on torch 2.13.0). A graph generated in a process with
#   ATEN_CPU_CAPABILITY=avx2 (loops stepping 8 floats) and found in the cache by a process without
#   it is compiled with AVX-512's 16-float vectors, and its stores run past their buffers: a heap
#   overflow that crashes later in unrelated code (seen here as segfaults and aborts in dynamo's
#   traceback symbolization and in fake-tensor conversion). Running our kernels' AVX2 flavour
#   beside torch's (MP_WRAPPERS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2, as the benchmarks and the
#   golden traces do) is how one machine gets both kinds of graphs. A cache directory per value
#   keeps them apart.
#: The values of ATEN_CPU_CAPABILITY inductor honours, spelled exactly so (it warns about any other
#: and then generates for the machine's widest ISA, as without the variable).
_ATEN_CAPABILITIES = ('default', 'zvector', 'vsx', 'avx2', 'avx512')


def _default_inductor_cache_dir() -> str:
    """torch's default inductor cache directory (its own function where it has one)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        return default_cache_dir()
    except ImportError:  # older torch: the same formula, <tmp>/torchinductor_<user>
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):  # no passwd entry (some containers)
            user = f'uid_{os.getuid()}' if hasattr(os, 'getuid') else 'unknown_user'
        return os.path.join(tempfile.gettempdir(),
                            'torchinductor_' + re.sub(r'[\\/:*?"<>|]', '_', user))


def _same_path(a: str, b: str) -> bool:
    return os.path.normcase(os.path.abspath(a)) == os.path.normcase(os.path.abspath(b))


def isolate_inductor_cache(tag: str = '') -> Optional[str]:
    """Point ``TORCHINDUCTOR_CACHE_DIR`` at a directory of the current ``ATEN_CPU_CAPABILITY``
    (Note [inductor's cache and ATEN_CPU_CAPABILITY]). Process-wide: every later ``torch.compile``
    of this process, and of the processes it starts (they inherit the variable), uses it; graphs
    compiled before the call stay where they are.

    The directory a user set is kept, and so is one this function made with another ``tag``. Not a
    choice: torch's default (torch writes it into the variable on first use), a directory this
    function made without a tag or with the same one (a parent process's, for another value
    perhaps), and the empty string. Without ``tag``, a process without the variable (or with
    a value inductor ignores: it then generates for the widest ISA, as without it) keeps torch's
    default directory. With ``tag`` (the test suite's) that case gets a directory of its own too,
    so graphs another program left in the default directory are never read.

    Returns:
        The directory set, or None when nothing changed.
    """
    default = _default_inductor_cache_dir()
    current = os.environ.get('TORCHINDUCTOR_CACHE_DIR', '')
    # This function's own directories (a parent process's, inherited): untagged ones, and with a
    # tag those of the same tag. Another tag's directory is that program's choice, kept.
    ours = re.compile(re.escape(os.path.abspath(default))
                      + (f'(_{re.escape(tag)})?' if tag else '') + r'_aten_[a-z0-9]+')
    if current and not _same_path(current, default) and not ours.fullmatch(os.path.abspath(current)):
        return None
    value = os.environ.get('ATEN_CPU_CAPABILITY')
    capability = value if value in _ATEN_CAPABILITIES else None  # exactly as inductor matches it
    if capability is None and not tag:
        if current and not _same_path(current, default):  # a parent's directory: back to default
            os.environ['TORCHINDUCTOR_CACHE_DIR'] = default
            return default
        return None
    directory = '_'.join(x for x in (default, tag, f'aten_{capability or "unset"}') if x)
    os.environ['TORCHINDUCTOR_CACHE_DIR'] = directory
    return directory
