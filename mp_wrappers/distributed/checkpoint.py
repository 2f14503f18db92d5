"""Sharded checkpoints of an FSDP2 model and our wrapper through ``torch.distributed.checkpoint``.

torch's own machinery does the work: ``get_state_dict`` / ``set_state_dict`` (parameter and
optimizer state keyed by fully qualified names, DTensors kept sharded) and ``dcp.save`` /
``dcp.load`` (one file per rank plus metadata; DCP re-slices DTensors saved on N ranks for M). We add the wrapper's own state: the loss scalers (scale, growth and
hysteresis trackers, skip and step counters) and its policy, plain numbers that are the same on
every rank.

Masters: with FSDP's mixed precision the fp32 shards are the master weights (Note [sharded
masters]) and travel as the model's parameters. A wrapper holding fp32 masters of *half* shards
(a model cast before sharding) is refused here with the alternative: the optimizer then steps the
masters, which torch's state-dict helpers cannot map to the model's parameter names.
"""
import io
from typing import Any, Dict

import torch
from torch import nn

from .. import compat

__all__ = ['sharded_state_dict', 'load_sharded_state_dict', 'save_sharded', 'load_sharded',
           'refuse_optim_wrapper_dict', 'saves_optimizer_state']

_KEY = 'mp_wrappers'


def _check_no_half_masters(wrapper: Any) -> None:
    masters = wrapper._master_params()
    if masters.has_half:
        raise NotImplementedError(
            f'{type(wrapper).__name__} holds fp32 masters of half-precision shards (the model was '
            'cast before sharding); sharded checkpoints support the layout where the fp32 shards '
            "are the masters: keep the model fp32 and let FSDP make the half copies "
            '(MixedPrecisionPolicy(param_dtype=...), or mp_wrappers.FullyShardedModel(dtype=...))')


# The way out of an OptimWrapperDict under each sharding: DDP with one wrapper per submodule, as
# GAN configs (mmagic) train.
_WITHOUT_FSDP = {
    'FSDP1': "strategy=dict(type='DDPStrategy', model_wrapper=dict("
             "type='MMSeparateDistributedDataParallel'))",
    'FSDP2': "runner_type='Runner', model_wrapper_cfg=dict("
             "type='MMSeparateDistributedDataParallel')",
}


def saves_optimizer_state(hooks: Any) -> bool:
    """Whether one of ``hooks`` is a ``CheckpointHook`` that saves the optimizer state."""
    from mmengine.hooks import CheckpointHook
    return any(isinstance(h, CheckpointHook) and getattr(h, 'save_optimizer', True) for h in hooks)


def refuse_optim_wrapper_dict(optim_wrapper: Any, sharding: str, saving: bool) -> None:
    """Refuse an ``OptimWrapperDict`` over a sharded model whose checkpoints save its optimizer
    state.

    The checkpoints of a sharded model hold the state of one optimizer (FSDP1's
    ``FSDP.optim_state_dict`` and FSDP2's ``get_optimizer_state_dict`` take one): an
    ``OptimWrapperDict`` would train and then fail at the first ``CheckpointHook`` save with
    ``save_optimizer=True`` (its default), that epoch lost. Called before training with
    ``saving=saves_optimizer_state(runner.hooks)``; without such a hook nothing fails and nothing
    is refused.

    Args:
        optim_wrapper: what the runner or strategy built.
        sharding: ``'FSDP1'`` or ``'FSDP2'``.
        saving: whether a checkpoint will save (or is saving) the optimizer state.

    Raises:
        NotImplementedError: ``optim_wrapper`` is an ``OptimWrapperDict`` and ``saving``.
    """
    from mmengine.optim import OptimWrapperDict
    if not saving or not isinstance(optim_wrapper, OptimWrapperDict):
        return
    raise NotImplementedError(
        f'optim_wrapper built an OptimWrapperDict '
        f'({", ".join(repr(k) for k in optim_wrapper.keys())}), whose optimizer state {sharding} '
        'checkpoints cannot hold (they hold one optimizer\'s), so this run would fail at its first '
        'checkpoint. Train with one optim wrapper (optim_wrapper=dict(type=..., '
        'optimizer=dict(...)), per-module settings through optim_wrapper.paramwise_cfg); or save '
        'weights only (default_hooks=dict(checkpoint=dict(type=\'CheckpointHook\', '
        'save_optimizer=False)): no resume); or train without FSDP '
        f'({_WITHOUT_FSDP[sharding]}, as GAN configs do)')


def _wrapper_state(wrapper: Any) -> Dict[str, Any]:
    state = wrapper.state_dict()
    ours = dict(state['mp_wrappers'])
    ours.pop('fp32_master_params', None)  # empty here: the fp32 shards are the model's params
    # Plain numbers, equal on every rank: stored as one serialised blob (DCP keeps non-tensor
    # values per rank 0 and reads them back on every rank).
    buf = io.BytesIO()
    torch.save(ours, buf)
    return {'blob': torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}


def sharded_state_dict(model: nn.Module, wrapper: Any) -> Dict[str, Any]:
    """``{'model', 'optimizer', 'mp_wrappers'}`` for ``dcp.save``: sharded tensors stay sharded.

    Args:
        model: The FSDP2 (``fully_shard``) root module.
        wrapper: Our optimizer wrapper over ``model``'s parameters.

    Raises:
        NotImplementedError: the wrapper keeps masters of half shards (see the module docstring).
        mp_wrappers.compat.FeatureUnavailableError: torch < 2.6 (no FSDP2).
    """
    compat.require('fsdp2')  # the layout of FSDP2's DTensor state dicts (get_state_dict)
    from torch.distributed.checkpoint.state_dict import get_state_dict
    _check_no_half_masters(wrapper)
    model_sd, optim_sd = get_state_dict(model, wrapper.optimizer)
    return {'model': model_sd, 'optimizer': optim_sd, _KEY: _wrapper_state(wrapper)}


def load_sharded_state_dict(model: nn.Module, wrapper: Any, state: Dict[str, Any]) -> None:
    """Apply a dict filled by ``dcp.load`` into :func:`sharded_state_dict`'s layout."""
    compat.require('fsdp2')
    from torch.distributed.checkpoint.state_dict import set_state_dict
    _check_no_half_masters(wrapper)
    set_state_dict(model, wrapper.optimizer, model_state_dict=state['model'],
                   optim_state_dict=state['optimizer'])
    blob = state[_KEY]['blob']
    ours = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
    wrapper._warn_if_foreign(ours)
    wrapper._load_scalers(ours['loss_scalers'], source='mp_wrappers (sharded checkpoint)')
    wrapper._load_extra_state(ours)


def save_sharded(checkpoint_dir: str, model: nn.Module, wrapper: Any) -> None:
    """Save model, optimizer and wrapper state with ``torch.distributed.checkpoint`` (all ranks)."""
    import torch.distributed.checkpoint as dcp
    dcp.save(sharded_state_dict(model, wrapper), checkpoint_id=checkpoint_dir)


def load_sharded(checkpoint_dir: str, model: nn.Module, wrapper: Any) -> None:
    """Load what :func:`save_sharded` wrote into the current sharding (DCP re-slices DTensors)."""
    import torch.distributed.checkpoint as dcp
    state = sharded_state_dict(model, wrapper)
    # The blob's length differs between runs: let DCP allocate it from the checkpoint.
    state[_KEY] = {'blob': _saved_blob_template(checkpoint_dir)}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    load_sharded_state_dict(model, wrapper, state)


def _saved_blob_template(checkpoint_dir: str) -> torch.Tensor:
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(checkpoint_dir).read_metadata()
    size = meta.state_dict_metadata[f'{_KEY}.blob'].size
    return torch.empty(size, dtype=torch.uint8)
