"""Model and input casting for mixed precision: norm layers kept fp32, recursive input casts.

Everything here works through ``nn.Module`` methods and removable hooks; nothing global is patched.
"""
import fnmatch
import inspect
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import compat

__all__ = ['HALF_DTYPES', 'parse_dtype', 'cast_model', 'cast_floating', 'is_norm_layer',
           'ForwardCaster', 'fp32_state_dict_hook', 'model_cast_dtype', 'loaded_full_precision',
           'forget_loaded_full_precision', 'owned_roots', 'match_modules', 'check_module_patterns',
           'Fp32Modules']

HALF_DTYPES = (torch.float16, torch.bfloat16)
_DTYPE_NAMES = {
    'float16': torch.float16, 'fp16': torch.float16, 'half': torch.float16,
    'bfloat16': torch.bfloat16, 'bf16': torch.bfloat16,
    'float32': torch.float32, 'fp32': torch.float32, 'float': torch.float32,
}
# BatchNorm's running statistics and affine parameters lose too much in half precision (apex's
# keep_batchnorm_fp32). GroupNorm/LayerNorm/InstanceNorm have the same reduction-in-half problem.
_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm,
               nn.modules.instancenorm._InstanceNorm, nn.SyncBatchNorm)


def parse_dtype(value: Union[str, torch.dtype, None], option: str = 'dtype',
                allowed=('float16', 'bfloat16'), allow_none: bool = True) -> Optional[torch.dtype]:
    """Turn ``'float16'``, ``'bf16'``, ``torch.bfloat16``... into a torch dtype, or raise naming ``option``.

    None passes through as None (an unset option) unless ``allow_none=False``, where it is refused
    like any other value outside ``allowed``."""
    if value is None and allow_none:
        return None
    allowed_dtypes = {_DTYPE_NAMES[a] for a in allowed}
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.replace('torch.', '') in _DTYPE_NAMES:
        dtype = _DTYPE_NAMES[value.replace('torch.', '')]
    else:
        dtype = None
    if dtype is None or dtype not in allowed_dtypes:
        raise ValueError(f'{option}={value!r} is not supported; allowed: '
                         f'{", ".join(repr(a) for a in allowed)}')
    return dtype


def is_norm_layer(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES)


def _norm_param_names(model: nn.Module):
    names = set()
    for prefix, module in model.named_modules():
        if is_norm_layer(module):
            for n, _ in module.named_parameters(recurse=False):
                names.add(f'{prefix}.{n}' if prefix else n)
            for n, _ in module.named_buffers(recurse=False):
                names.add(f'{prefix}.{n}' if prefix else n)
    return names


def cast_model(model: nn.Module, dtype: torch.dtype, keep_norm_fp32: bool = True,
               keep_fp32_modules: Sequence[str] = ()) -> nn.Module:
    """Cast floating parameters and buffers of ``model`` to ``dtype`` in place.

    With ``keep_norm_fp32`` the parameters and buffers of normalisation layers stay fp32, and those
    layers get a forward pre-hook that runs them in fp32 and a hook that casts their output back to
    ``dtype`` (apex's keep_batchnorm_fp32). The submodules named in ``keep_fp32_modules``
    (qualified names within ``model``, see :func:`match_modules`) keep all their parameters and
    buffers fp32; :class:`Fp32Modules` runs them. Parameters keep their identity (``param.data``
    is replaced), so optimizers built before the cast still point at them.
    """
    # A non-float dtype would fail deep inside torch ("data set to a tensor that requires gradients
    # must be floating point"), naming neither the option nor the fix.
    dtype = parse_dtype(dtype, 'cast_model(dtype)', allowed=('float16', 'bfloat16', 'float32'))
    keep = _norm_param_names(model) if keep_norm_fp32 else set()
    keep |= _preprocessor_state_names(model)
    keep |= _state_names_under(model, keep_fp32_modules)
    for name, p in model.named_parameters():
        if p.is_floating_point() and name not in keep and p.dtype != dtype:
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
    for name, b in model.named_buffers():
        if b.is_floating_point() and name not in keep and b.dtype != dtype:
            _set_buffer(model, name, b.to(dtype))
    # Remember what was done, so a later consumer (ApexOptimWrapper behind DDP) can check it.
    model._mp_wrappers_cast = (dtype, keep_norm_fp32)
    if dtype != torch.float32 and getattr(model, '_mp_wrappers_capture_hook', None) is None:
        model._mp_wrappers_capture_hook = compat.register_load_state_dict_pre_hook(
            model, _capture_full_precision)
    if keep_norm_fp32 and dtype != torch.float32:
        # Norm layers inside a module kept fp32 run in fp32 with the rest of it: their output must
        # stay fp32 for the next fp32 layer there.
        in_fp32_modules = {id(m) for prefix in keep_fp32_modules
                           for m in (model.get_submodule(prefix) if prefix else model).modules()}
        for module in model.modules():
            if (is_norm_layer(module) and id(module) not in in_fp32_modules
                    and not getattr(module, '_mp_wrappers_fp32_hooks', None)):
                handles = (
                    module.register_forward_pre_hook(_norm_inputs_to_fp32),
                    module.register_forward_hook(_make_output_cast(dtype)),
                )
                module._mp_wrappers_fp32_hooks = handles
    return model


# Note [full-precision values loaded into a half model]: a model cast before its weights are loaded
# (FP16OptimWrapper's models, distributed O2 cast before DDP wraps it) rounds an fp32 checkpoint as
# it loads it. This load_state_dict pre-hook keeps references to the loaded full-precision tensors of
# its half parameters, so that the wrapper's masters can start from them bit for bit when training
# starts (mp_wrappers/master.py, Note [masters lifecycle]); the wrapper then drops them.
_CAPTURED = '_mp_wrappers_loaded_full_precision'


def _capture_full_precision(module, state_dict, prefix, local_metadata, strict, missing_keys,
                            unexpected_keys, error_msgs) -> None:
    captured = module.__dict__.setdefault(_CAPTURED, {})
    for name, p in module.named_parameters():
        value = state_dict.get(prefix + name)
        if (isinstance(value, torch.Tensor) and p.dtype in HALF_DTYPES
                and value.dtype in (torch.float32, torch.float64) and value.shape == p.shape):
            captured[id(p)] = value.detach()


def loaded_full_precision(model: nn.Module):
    """``id(half param) -> full-precision tensor`` loaded into ``model`` since it was cast."""
    found = {}
    for module in model.modules():
        found.update(module.__dict__.get(_CAPTURED, {}))
    return found


def forget_loaded_full_precision(model: nn.Module) -> None:
    """Drop the references kept by the load pre-hook (the masters have taken the values)."""
    for module in model.modules():
        module.__dict__.pop(_CAPTURED, None)
def _preprocessor_state_names(model: nn.Module):
    """Parameters and buffers of mmengine data preprocessors (mean/std...): never cast.

    The preprocessor normalises the batch before the network sees it; rounding its mean and std to
    half (123.675 becomes 123.5 in bf16) would shift every input. Its output is cast at the network.
    """
    try:
        from mmengine.model import BaseDataPreprocessor
    except ImportError:  # pragma: no cover - mmengine is a dependency
        return set()
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, BaseDataPreprocessor):
            for n, _ in list(module.named_parameters()) + list(module.named_buffers()):
                names.add(f'{prefix}.{n}' if prefix else n)
    return names


def _state_names_under(model: nn.Module, prefixes: Sequence[str]) -> set:
    names = set()
    for prefix in prefixes:
        module = model.get_submodule(prefix) if prefix else model
        dot = f'{prefix}.' if prefix else ''
        names.update(dot + n for n, _ in module.named_parameters())
        names.update(dot + n for n, _ in module.named_buffers())
    return names


def check_module_patterns(patterns: Any, option: str) -> Tuple[str, ...]:
    """Validate a list of module globs (``fp32_modules``): a list or tuple of non-empty strings.

    Raises:
        TypeError: with the option's name, the value and what is allowed.
    """
    if patterns is None:
        return ()
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)) or not all(
            isinstance(p, str) and p for p in patterns):
        raise TypeError(f'{option}={patterns!r} is not allowed; expected a list of module name or '
                        "class name patterns, e.g. ['cls_head'], ['backbone.layer4.*'] or "
                        "['LayerNorm']")
    return tuple(patterns)


def match_modules(model: nn.Module, patterns: Sequence[str]) -> List[Tuple[str, nn.Module]]:
    """The outermost submodules of ``model`` that a pattern of ``patterns`` names.

    A pattern is a glob (``fnmatch``) over a module's qualified name within ``model``
    (``'cls_head'``, ``'backbone.layer4.*'``) or its class name (``'LayerNorm'``, ``'*Head'``).
    Inside a matched module nothing more is listed: the whole subtree is covered.
    """
    found: List[Tuple[str, nn.Module]] = []
    if not patterns:
        return found
    for name, module in model.named_modules():
        if any(name == f or name.startswith(f + '.') for f, _ in found):
            continue
        cls = type(module).__name__
        if any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(cls, p) for p in patterns):
            found.append((name, module))
    return found


# torch >= 2.1 runs a forward hook registered with always_call=True even when the forward raises,
# so the autocast state Fp32Modules turned off is always turned back on.
_ALWAYS_CALL = 'always_call' in inspect.signature(nn.Module.register_forward_hook).parameters


class Fp32Modules:
    """Removable hooks that run submodules in fp32 inside a half-precision model.

    apex's ``keep_batchnorm_fp32`` generalised (the wrappers' ``fp32_modules`` option): for code
    that cannot take half tensors, e.g. a head that computes its accuracy with numpy (which has no
    bf16) inside the model's forward. Each module's floating inputs are cast to fp32 and autocast is
    off while it runs (O1), so its parameters (kept fp32 by the cast at O2/O3) compute in fp32 and
    its outputs are fp32.

    Args:
        modules (Sequence[nn.Module]): The modules to run in fp32.
        device_type (str): The device type whose autocast is turned off (``'cpu'``, ``'cuda'``).
    """

    def __init__(self, modules: Sequence[nn.Module], device_type: str) -> None:
        self.device_type = device_type
        self._contexts: List[Any] = []  # one autocast context per forward in progress (nesting)
        self._handles = []
        post_kwargs = dict(always_call=True) if _ALWAYS_CALL else {}
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, **post_kwargs))

    def _pre(self, module, args, kwargs):
        context = torch.autocast(self.device_type, enabled=False)
        context.__enter__()
        self._contexts.append(context)
        return (cast_floating(args, torch.float32, data_samples=False),
                cast_floating(kwargs, torch.float32, data_samples=False))

    def _post(self, module, args, output):
        if self._contexts:
            self._contexts.pop().__exit__(None, None, None)
        return cast_floating(output, torch.float32)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def owned_roots(model: nn.Module, params) -> List[nn.Module]:
    """The largest submodules of ``model`` whose parameters all belong to ``params``.

    This is what one optimizer (one wrapper of an ``OptimWrapperDict``) may cast: ``[model]``
    when it owns every parameter, else e.g. ``[model.generator]`` for a GAN's generator wrapper.
    Parameters of ``params`` that sit directly in a module that also holds other parameters are in
    no root: they are left in their dtype (and stepped as they are).
    """
    own = {id(p) for p in params}
    roots: List[nn.Module] = []

    def visit(module: nn.Module) -> None:
        ps = list(module.parameters())
        if ps and all(id(p) in own for p in ps):
            roots.append(module)
            return
        if not any(id(p) in own for p in ps):
            return
        for child in module.children():
            visit(child)

    visit(model)
    return roots


def model_cast_dtype(model: nn.Module):
    """``(dtype, keep_norm_fp32)`` if :func:`cast_model` was applied to ``model``, else None."""
    return getattr(model, '_mp_wrappers_cast', None)


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition('.')
    owner = model.get_submodule(owner_name) if owner_name else model
    owner._buffers[leaf] = value


def _norm_inputs_to_fp32(module, args):
    return cast_floating(args, torch.float32)


def _make_output_cast(dtype):
    def _hook(module, args, output):
        return cast_floating(output, dtype)
    return _hook


def cast_floating(obj: Any, dtype: torch.dtype, data_samples: bool = True) -> Any:
    """Cast floating-point tensors inside ``obj`` to ``dtype``, recursing like apex's ``applier``.

    Handles tensors, dicts (the same mapping type is rebuilt), lists, tuples, namedtuples, and any
    other object with a ``.to`` method (custom batch classes, mmengine data samples), which is called
    as ``obj.to(dtype)``. Integer tensors and everything else are returned unchanged.

    Args:
        obj: What to cast.
        dtype (torch.dtype): The floating dtype to cast to.
        data_samples (bool): Also cast the floating data fields of mmengine data samples
            (``BaseDataElement``). False leaves them as they are: they hold targets (boxes, masks)
            and metas, not network inputs (see :class:`ForwardCaster`). Defaults to True.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, dict):
        return type(obj)((k, cast_floating(v, dtype, data_samples)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, '_fields'):  # namedtuple
        return type(obj)(*(cast_floating(v, dtype, data_samples) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(v, dtype, data_samples) for v in obj)
    if isinstance(obj, (str, bytes, int, float, bool)) or obj is None:
        return obj
    if _is_data_element(obj):
        if not data_samples:
            return obj
        # mmengine data samples: their .to(dtype) would also cast integer labels, so cast only the
        # floating tensors among their data fields.
        new = obj.clone()
        for key, value in obj.items():  # data fields only (metainfo_items() holds the rest)
            setattr(new, key, cast_floating(value, dtype, data_samples))
        return new
    to = getattr(obj, 'to', None)
    if callable(to):
        try:
            return to(dtype)
        except (TypeError, RuntimeError):
            # Objects whose .to() only takes a device (e.g. some data samples): leave them be.
            return obj
    return obj


def _is_data_element(obj: Any) -> bool:
    try:
        from mmengine.structures import BaseDataElement
    except ImportError:  # pragma: no cover - mmengine is a dependency
        return False
    return isinstance(obj, BaseDataElement)


class ForwardCaster:
    """Removable hooks that cast a module's floating inputs and outputs (apex O2/O3's forward patch).

    Inputs are the tensors that feed the network (positional and keyword, recursively through
    containers); mmengine data samples passed beside them (``data_samples=[DetDataSample...]``)
    hold targets and metas and are left in their own dtype, as apex cast only the model's inputs.
    Outputs, data samples included, are cast to ``output_dtype``.

    Args:
        module (nn.Module | Sequence[nn.Module]): The module(s) whose forward is wrapped: the
            model, or the submodules one optimizer owns (see :func:`owned_roots`).
        input_dtype (torch.dtype): dtype for floating inputs.
        output_dtype (torch.dtype, optional): dtype for floating outputs; None leaves them.
    """

    def __init__(self, module: Union[nn.Module, Sequence[nn.Module]], input_dtype: torch.dtype,
                 output_dtype: Optional[torch.dtype]) -> None:
        self.input_dtype, self.output_dtype = input_dtype, output_dtype
        modules = [module] if isinstance(module, nn.Module) else list(module)
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            if output_dtype is not None:
                self._handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args, kwargs):
        return (cast_floating(args, self.input_dtype, data_samples=False),
                cast_floating(kwargs, self.input_dtype, data_samples=False))

    def _post(self, module, args, output):
        return cast_floating(output, self.output_dtype)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def fp32_state_dict_hook(module: nn.Module, state_dict, prefix, local_metadata):
    """``nn.Module._register_state_dict_hook`` callback: checkpoints always hold fp32 tensors."""
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.dtype in HALF_DTYPES:
            state_dict[key] = value.to(torch.float32)
    return state_dict
