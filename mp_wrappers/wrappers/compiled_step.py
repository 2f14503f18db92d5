"""The device stages of the wrappers' fused step, run as they are or through ``torch.compile``.

Note [compiled step]
    ``optim_wrapper.step()`` on the fused path (an optimizer with the fused master step, the
    gradients of one scaler) is two halves. The device stages are tensor work only: check the
    half gradients for inf/nan and take their norm, the clipping coefficient, the fused update
    (which skips itself on the device where ``found_inf`` is set) and the loss scaler's update.
    The host half is bookkeeping: the outcome ledger, the overflow messages, the collapse watch
    and the MessageHub (:mod:`mp_wrappers.step_outcomes`), Python that has no place in a graph.

    ``compile_step`` (a wrapper option) runs the device stages as one function through
    ``torch.compile(fullgraph=True)``: the whole of them is one graph, or compiling fails (no
    silent graph breaks), the overflow decision stays on the device and nothing is read on the
    host inside it. The bookkeeping runs eagerly after it, as on the eager path (on the CPU it
    reads the flag there; on CUDA it takes the deferred outcomes). The results are bit-identical
    to the eager step (tests/wrappers/test_compiled_step.py). The scaler's update differs in one
    detail only: on the CPU an eager static scaler counts from the host (``LossScaler.update``),
    under compile it counts on the device; the counters are the same.

    A step that would make optimizer state or an lr tensor runs eagerly (the first, one where a
    param gets its first gradient, one after a group was added), so that no graph's output is
    kept across steps: a CUDA graph overwrites its outputs at the next replay. Before a compiled
    call the tensors the stages update in place (params, optimizer state, the scaler's tensors,
    the overflow flag) are marked static addresses on CUDA, so that inductor's CUDA graphs
    (``mode='reduce-overhead'``) record the step instead of skipping it for mutated inputs
    (``compat.mark_static_addresses``); the optimizer's after the steps that made them, not at
    every step (it walks every state tensor). The second step compiles; later steps reuse the
    graph while the params that have gradients, their dtypes and the wrapper's options stay the
    same (a param's first gradient takes an eager step, then compiles once more). The learning
    rate must live on the device (the optimizer's
    ``capturable=True``, Note [capturable] in :mod:`mp_wrappers.optim.base`): a float lr is a
    constant of the graph, and an LR schedule would recompile the step at every new value, so
    ``compile_step`` refuses it. Schedulers that write the tensor in place (torch's) or assign a
    new one (mmengine's) both reuse the graph. The lean bf16 storages take the lr as a number (no
    ``capturable``), so ``compile_step`` refuses them too (8-bit states take a tensor lr, but not
    with them); a compiled ``opt.step`` of such an optimizer alone works, at a constant lr. ``compile_step`` needs an
    optimizer with the fused master step (refused otherwise, at construction); a step that still
    cannot fuse (the gradients of several loss scalers, clipping other than by the L2 norm) takes
    the eager path as before.
    Tested in one process; under DDP the stages hold no collective (DDP has reduced the
    gradients), while ``sync_found_inf=True`` without DDP all-reduces the flags inside them, which
    ``fullgraph`` refuses if this torch cannot trace it. FSDP is refused at the first step.
"""
import inspect
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from mmengine.logging import print_log
from torch import Tensor
from torch.optim import Optimizer

from .. import compat
from ..master import MasterParams
from ..scaler import LossScaler
from .overflow import StepFlags
from .unscale import fused_step

__all__ = ['DeviceStages', 'check_compile_step', 'refuse_lr_as_number']

Stages = Tuple[Optional[Tensor], Optional[List[Tensor]]]


def check_compile_step(value: Any, optimizer: Optional[Optimizer] = None
                       ) -> Optional[Dict[str, Any]]:
    """The ``torch.compile`` keywords ``compile_step`` asks for, or None (eager); refuses a wrong
    value, an optimizer without the fused master step and a torch that cannot compile our fused
    steps (compat ``fake_kernels`` and ``compile_list_ops``)."""
    if value is False or value is None:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise TypeError(f'compile_step must be True, False or a dict of torch.compile keywords '
                        f"such as dict(backend='inductor'), got {value!r}")
    if 'fullgraph' in value:
        raise ValueError(f'compile_step={value!r}: fullgraph is always True (the device stages '
                         'compile whole, Note [compiled step]); remove the key')
    if optimizer is not None and not getattr(optimizer, 'supports_fused_master_step', False):
        raise ValueError(
            f'compile_step={value!r} compiles the fused step, which needs an optimizer with the '
            f'fused master step; {type(optimizer).__name__} has none. Use one of mp_wrappers\' '
            "fused optimizers, e.g. optimizer=dict(type='mp_wrappers.FusedAdam', lr=...) "
            "(also FusedSGD, FusedLAMB, FusedNovoGrad, FusedAdagrad), or compile_step=False")
    if optimizer is not None and getattr(optimizer, 'bf16_storage', None) is not None:
        refuse_lr_as_number(value, f'bf16_storage={optimizer.bf16_storage!r}')
    if optimizer is not None and not _lr_on_device(optimizer):
        raise ValueError(
            f'compile_step={value!r} needs the learning rate on the device: a float lr is a '
            'constant of the compiled graph, so every new value an LR schedule sets would compile '
            f'the step again (and fail after a few). Build {type(optimizer).__name__} with '
            'capturable=True, e.g. optimizer=dict(type=\'mp_wrappers.FusedAdam\', lr=..., '
            'capturable=True): the lr becomes a 1-element tensor the kernels read when they run')
    compat.require('fake_kernels')
    compat.require('compile_list_ops')
    _check_compile_keywords(value)
    return dict(value)


def _invalid_backend() -> type:
    """What lookup_backend raises for an unknown name: torch._dynamo.exc.InvalidBackend (a
    RuntimeError), or RuntimeError on a torch without it."""
    try:
        from torch._dynamo.exc import InvalidBackend
        return InvalidBackend
    except ImportError:
        return RuntimeError


def _registered_backends() -> List[str]:
    from torch._dynamo import list_backends
    return list_backends(exclude_tags=())


def _check_compile_keywords(value: Dict[str, Any]) -> None:
    """Refuse, at construction, what torch.compile would refuse only when the first step compiles:
    an unknown keyword, backend name or inductor mode, or mode with options (torch takes one).
    The names are the running torch's own (its backend registry, entry points included; its
    inductor modes), so what that torch takes stays allowed."""
    allowed = [k for k in inspect.signature(torch.compile).parameters
               if k not in ('model', 'fullgraph')]
    unknown = sorted(k for k in value if k not in allowed)
    if unknown:
        raise ValueError(f'compile_step has unknown torch.compile keywords {unknown}; allowed: '
                         f'{allowed}')
    mode, backend = value.get('mode'), value.get('backend')
    if mode is not None and value.get('options') is not None:
        raise ValueError("compile_step: torch.compile takes mode or options, not both; got "
                         f"mode={mode!r} and options={value['options']!r}")
    if backend is None or isinstance(backend, str):
        # Both import dynamo / inductor: only done when a step is to be compiled anyway.
        from torch._dynamo.backends.registry import lookup_backend
        name = 'inductor' if backend is None else backend
        try:
            lookup_backend(name)
        except _invalid_backend():  # only that: a plugin failing to load keeps its own error
            raise ValueError(f'compile_step backend={backend!r} is not a registered '
                             f'torch.compile backend; registered here: '
                             f'{_registered_backends()}') from None
        if name == 'inductor' and mode is not None:
            from torch._inductor import list_mode_options
            modes = list(list_mode_options())
            if mode not in modes and mode != '':  # torch takes '' as the default mode
                raise ValueError(f'compile_step mode={mode!r} is not an inductor mode of this '
                                 f'torch; allowed: {modes} or None')
    elif not callable(backend):
        raise TypeError(f'compile_step backend must be a backend name or a callable, got '
                        f'{backend!r}')


def refuse_lr_as_number(value: Any, what: str) -> None:
    """Refuse ``compile_step`` with ``what``, whose kernels take the lr as a number."""
    if check_compile_step(value) is None:
        return
    raise ValueError(
        f'compile_step={value!r} does not combine with {what}: its kernels take the lr as a '
        'number, a constant of the compiled graph (every new value an LR schedule sets would '
        'compile the step again). Use master_weights=True (fp32 masters) with '
        "optimizer=dict(type='mp_wrappers.FusedAdam', ..., capturable=True), or compile_step=False")


def _lr_on_device(optimizer: Optimizer) -> bool:
    """Whether every group's lr is (or becomes at the first step, ``capturable``) a tensor."""
    return bool(getattr(optimizer, 'capturable', False)) or all(
        isinstance(g['lr'], Tensor) for g in optimizer.param_groups)


def _device_stages(optimizer: Optimizer, masters: MasterParams, scaler: LossScaler,
                   flags: StepFlags, clip: Optional[dict], sharding: Any,
                   sync_flags: Callable[[], None]) -> Stages:
    """Check, clip, update and update the scaler: (the gradient norm, the scale before)."""
    flag = flags.flag(flags.pending)
    total = fused_step(optimizer, masters, scaler, flags, clip, sharding, sync_flags)
    before = scaler.scale.clone()
    scaler.update(flag)
    return total, [before]


def _makes_state(optimizer: Optimizer, masters: MasterParams) -> bool:
    """Whether this step would make optimizer state (a slot with a gradient and no state yet: the
    first step, a param that gets its first gradient later, a group added later) or an lr tensor
    (a capturable optimizer's float lr). Made inside a graph they would be its outputs, which a
    CUDA graph overwrites at its next replay: such a step runs eagerly."""
    if any(not isinstance(group['lr'], Tensor) for group in optimizer.param_groups):
        return True
    state = optimizer.state
    for group, row in zip(optimizer.param_groups, masters.model_params):
        for slot, model_p in zip(group['params'], row):
            if ((model_p if model_p is not None else slot).grad is not None
                    and 'step' not in state.get(slot, ())):
                return True
    return False


def _mark_static(optimizer: Optimizer, masters: MasterParams) -> None:
    """The tensors the stages update in place that the optimizer and the masters own, as static
    addresses for CUDA graphs (a no-op on the CPU); after the steps that made them."""
    mark = getattr(optimizer, 'mark_static_addresses', None)
    if mark is not None:
        mark()
    compat.mark_static_addresses([p for _, p in masters.half_pairs()])


class DeviceStages:
    """The fused step's device stages: eager (the scaler is updated by the bookkeeping, as
    always), or compiled with the scaler's update inside (Note [compiled step]).

    Args:
        compile_step: The wrapper option: False, True or a dict of ``torch.compile`` keywords.
        optimizer: The wrapper's optimizer (checked: it must have the fused master step).
    """

    def __init__(self, compile_step: Union[bool, Dict[str, Any]] = False,
                 optimizer: Optional[Optimizer] = None) -> None:
        self.compile_kwargs = check_compile_step(compile_step, optimizer)
        if self.compile_kwargs is not None:
            # At construction, before the first step compiles anything of the run.
            cache = compat.isolate_inductor_cache()  # Note [inductor's cache and ATEN_CPU_CAPABILITY]
            if cache is not None:
                print_log(f'mp_wrappers compile_step: inductor caches in {cache} '
                          '(TORCHINDUCTOR_CACHE_DIR, for this process and the ones it starts): its '
                          'default cache does not keep graphs of different ATEN_CPU_CAPABILITY '
                          'vector widths apart', logger='current', level=logging.INFO)
        self._compiled: Optional[Callable[..., Stages]] = None
        self._mark_pending = True  # the optimizer's tensors are to be marked before a graph runs

    @property
    def compiled(self) -> bool:
        return self.compile_kwargs is not None

    def __call__(self, optimizer: Optimizer, masters: MasterParams, scaler: LossScaler,
                 flags: StepFlags, clip: Optional[dict], sharding: Any,
                 sync_flags: Callable[[], None]) -> Stages:
        """(norm, scales before the step): the latter None when the scaler is still to update."""
        if self.compile_kwargs is None:
            return fused_step(optimizer, masters, scaler, flags, clip, sharding, sync_flags), None
        if sharding is not None:
            # The global norm of sharded gradients all-reduces across ranks inside the stages;
            # not traced or tested under compile yet.
            raise NotImplementedError(
                f'compile_step={self.compile_kwargs!r} is not supported with a sharded (FSDP) '
                'model yet; set compile_step=False')
        if _makes_state(optimizer, masters):
            out = fused_step(optimizer, masters, scaler, flags, clip, sharding, sync_flags)
            self._mark_pending = True
            return out, None
        if self._compiled is None:
            self._compiled = torch.compile(_device_stages, fullgraph=True, **self.compile_kwargs)
        if self._mark_pending:
            _mark_static(optimizer, masters)
            self._mark_pending = False
        # The flag is made at its first use: here, eagerly, rather than inside the graph.
        compat.mark_static_addresses(scaler.state_tensors() + [flags.flag(flags.pending)])
        return self._compiled(optimizer, masters, scaler, flags, clip, sharding, sync_flags)
