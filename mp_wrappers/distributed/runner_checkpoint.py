"""mmengine Runner checkpoints of an FSDP2-sharded model through ``torch.distributed.checkpoint``.

Note [runner checkpoints under FSDP2]
    mmengine 0.10.7's ``Runner.save_checkpoint`` is ``@master_only``: rank 0 pickles
    ``model.state_dict()``, which under FSDP2 holds DTensors of *rank 0's shards only*, and the other
    ranks' shards are lost. Such a file resumes "successfully" on the same rank count with rank 0's
    data on every rank (a silently wrong resume). Every rank has to take part in a sharded save, so
    :class:`~mp_wrappers.distributed.fully_shard.FullyShardedRunner` overrides ``save_checkpoint``
    and ``load_checkpoint`` with the functions of this module (mmengine's ``resume`` reads through
    ``load_checkpoint``); mmengine's
    ``CheckpointHook`` (``interval``, ``max_keep_ckpts``, ``save_best``, ``save_last``, the
    ``last_checkpoint`` pointer) drives them unchanged, because it calls ``runner.save_checkpoint``
    on every rank and removes old checkpoints that are directories (as it does for DeepSpeed's).

    A checkpoint is a DCP directory named like mmengine's file (``epoch_3.pth/``) holding what
    mmengine's ordinary checkpoint holds, in the same layout; the DTensor subtrees go to DCP as
    tensors, the rest is one ``torch.save`` blob, and ``.metadata`` is read without running code
    from the file (:mod:`.dcp_format` has the format and its safety).

    ``load_from`` takes a DCP directory (weights only, re-sliced) or an ordinary full checkpoint
    (e.g. from a single-GPU run: every rank reads the file and keeps its shards,
    ``set_model_state_dict(full_state_dict=True)``). ``resume`` takes a DCP directory, or one file
    written by ``tools/consolidate_checkpoint.py --resumable`` (optimizer state keyed by parameter
    name, re-sliced the same way).

The interface for whatever attaches to a runner (see docs/distributed.md):

* :func:`attach` (``runner``): call once the runner is built, before ``runner.train()`` saves or
  loads anything. It refuses a runner whose model is FSDP2-sharded but whose ``save_checkpoint``
  is mmengine's rank-0-only one, naming the config line to change, so that no path writes a
  partial checkpoint (and an EMAHook under FSDP1, which would save a partial EMA or
  fail later otherwise).
* :func:`save_checkpoint`, :func:`load_checkpoint`: the collective versions of the ``Runner``
  methods of the same names (all ranks call them, with the runner as first argument).

Reading such a directory outside a runner (:func:`~.dcp_format.is_sharded_checkpoint`,
:func:`~.dcp_format.read_sharded_checkpoint`, :class:`~.dcp_format.SafeFileSystemReader`) is
:mod:`.dcp_format`'s.
"""
import os
import os.path as osp
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .dcp_format import (INFO_KEY, REST_KEY, VERSION, SafeFileSystemReader, check_plain_tensors,
                         from_blob, is_sharded_checkpoint, merge_tensors, rest_template,
                         sharded_keys, split_tensors, to_blob)

__all__ = ['fsdp2_root', 'attach', 'refuse_sharded_ema', 'save_checkpoint', 'load_checkpoint',
           'adapt_loaded_checkpoint', 'optimizer_state_by_position']


# ---- what is sharded ------------------------------------------------------------------------------
def fsdp2_root(model: nn.Module) -> Optional[nn.Module]:
    """The FSDP2 root under ``model`` (itself or mmengine's wrapper's ``module``), or None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        return None
    for m in (model, getattr(model, 'module', None)):
        if isinstance(m, FSDPModule):
            return m
    return None


def attach(runner: Any) -> None:
    """Check that ``runner`` writes whole checkpoints of a sharded model (call before training).

    Under FSDP2 only a runner whose ``save_checkpoint`` is collective (this module's, as
    :class:`~mp_wrappers.distributed.fully_shard.FullyShardedRunner` has) may save; mmengine's own
    would write rank 0's shards only (Note [runner checkpoints under FSDP2]). mmengine's ``EMAHook``
    (and every subclass, ours included) is refused under FSDP1 (Note [EMA of a sharded
    model]). An ``OptimWrapperDict`` whose optimizer state a checkpoint would save is refused
    under either (:func:`~mp_wrappers.distributed.checkpoint.refuse_optim_wrapper_dict`).
    Idempotent; does nothing for models that are not sharded.

    Raises:
        RuntimeError: the model is FSDP2-sharded and the runner's ``save_checkpoint`` is
            mmengine's rank-0-only one.
        NotImplementedError: the model is FSDP1-sharded and an ``EMAHook`` is
            registered.
    """
    from .checkpoint import refuse_optim_wrapper_dict, saves_optimizer_state
    refuse_sharded_ema(runner)
    kind = _sharding(getattr(runner, 'model', None))
    if kind is not None:  # FSDP1's strategy cannot see the hooks when it builds the wrapper
        refuse_optim_wrapper_dict(getattr(runner, 'optim_wrapper', None), kind,
                                  saves_optimizer_state(getattr(runner, 'hooks', [])))
    if kind != 'FSDP2':
        return
    if getattr(type(runner).save_checkpoint, '_mp_wrappers_collective', False):
        return
    raise RuntimeError(
        f"{type(runner).__name__}.save_checkpoint writes from rank 0 only, which under FSDP2 holds "
        "rank 0's shards only (a partial checkpoint that resumes silently wrong). Set "
        "runner_type = 'mp_wrappers.FullyShardedRunner' in the config: it saves and resumes "
        'sharded checkpoints (torch.distributed.checkpoint) from every rank')


def _sharding(model: Any) -> Optional[str]:
    """``'FSDP1'`` or ``'FSDP2'`` when ``model`` (or mmengine's wrapper's ``module``) is sharded."""
    if fsdp2_root(model) is not None:
        return 'FSDP2'
    from torch.distributed.fsdp import FullyShardedDataParallel
    return 'FSDP1' if isinstance(model, FullyShardedDataParallel) else None


def refuse_sharded_ema(runner: Any) -> None:
    """Refuse mmengine's ``EMAHook`` (any subclass) over an FSDP1 model it cannot average right.

    Under FSDP2 (``FullyShardedModel``) and FSDP1 through ``mp_wrappers.MixedPrecisionFSDPStrategy``
    the hook's averaged model is a copy of each rank's pieces that saves and loads whole (Note [EMA
    of a sharded model] in :mod:`.sharded_ema`). An FSDP1 model wrapped otherwise (mmengine's own
    ``FSDPStrategy``, a hand-made wrapper) is refused before the hook copies it: the deepcopy fails
    on the wrapper's state (``cannot pickle 'module' object``), and were it made it would hold each
    rank's local flat views, which mmengine swaps into a ``'full'`` checkpoint in place of the
    gathered weights (rank 0's pieces only: a partial EMA that resumes wrong).
    """
    from mmengine.hooks import EMAHook

    from .sharded_ema import has_sharded_deepcopy
    model = getattr(runner, 'model', None)
    kind = _sharding(model)
    ema = [type(h).__name__ for h in getattr(runner, 'hooks', []) if isinstance(h, EMAHook)]
    if kind != 'FSDP1' or not ema or has_sharded_deepcopy(getattr(model, 'module', None)):
        return
    raise NotImplementedError(
        f"{ema[0]} under FSDP1 wrapped without mp_wrappers' strategy: its averaged model would be "
        "a deepcopy of the model, which torch cannot make of an FSDP1 model, and a copy would hold "
        "each rank's local shard views, of which a checkpoint would keep rank 0's only (Note [EMA "
        'of a sharded model] in mp_wrappers/distributed/sharded_ema.py). Set strategy = '
        "dict(type='mp_wrappers.MixedPrecisionFSDPStrategy', ...) with runner_type = "
        "'FlexibleRunner', whose EMA is sharded; or train with FSDP2 (runner_type = "
        "'mp_wrappers.FullyShardedRunner', model_wrapper_cfg = "
        "dict(type='mp_wrappers.FullyShardedModel')); or remove the "
        f"dict(type='{ema[0]}', ...) entry from custom_hooks")


def _collective(fn):
    fn._mp_wrappers_collective = True
    return fn


# ---- the checkpoint as mmengine builds it, from every rank ----------------------------------------
def _wrapper_extras(wrapper: Any) -> Dict[str, Any]:
    """The wrapper's keys besides the optimizer's own, for an FSDP2 model (no masters of ours)."""
    from .checkpoint import _check_no_half_masters
    if hasattr(wrapper, '_master_params'):
        _check_no_half_masters(wrapper)
    state = wrapper.state_dict()
    extras = {k: v for k, v in state.items() if k not in ('state', 'param_groups')}
    ours = extras.get('mp_wrappers')
    if isinstance(ours, dict):
        extras['mp_wrappers'] = {k: v for k, v in ours.items() if k != 'fp32_master_params'}
    return extras


def _optimizer_state(root: nn.Module, wrapper: Any) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from .checkpoint import refuse_optim_wrapper_dict
    # refused before training (FullyShardedRunner.build_optim_wrapper, attach); this is the save
    refuse_optim_wrapper_dict(wrapper, 'FSDP2', saving=True)
    extras = _wrapper_extras(wrapper)
    state = dict(get_optimizer_state_dict(root, wrapper.optimizer))
    state.update(extras)
    return state


# DCP loads into templates of this run's optimizer state: 8-bit moments (codes + absmax) and
# float32 ones do not convert there, only in load_state_dict of a consolidated checkpoint.
_STATE_DTYPE_HINT = (
    "(the checkpoint's and this run's optimizer state dtypes differ: 8-bit moments carry "
    "'*_absmax' entries. Resume with the checkpoint's optim_wrapper.optimizer.state_dtype, or "
    'consolidate it with tools/consolidate_checkpoint.py --resumable and resume from that file, '
    'which converts the moments)')


def _eight_bit(keys) -> bool:
    return any(k.startswith('optimizer.') and k.endswith('_absmax') for k in keys)


def _build_checkpoint(runner: Any, save_optimizer: bool, save_param_scheduler: bool,
                      meta: Dict[str, Any]) -> Dict[str, Any]:
    """mmengine's ``Runner.save_checkpoint`` dict, with FSDP2 state kept sharded."""
    from mmengine.utils import apply_to
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    root = fsdp2_root(runner.model)
    checkpoint = {
        'meta': meta,
        'state_dict': dict(get_model_state_dict(root)),
        'message_hub': apply_to(runner.message_hub.state_dict(), lambda x: hasattr(x, 'cpu'),
                                lambda x: x.cpu()),
    }
    if save_optimizer:
        checkpoint['optimizer'] = _optimizer_state(root, runner.optim_wrapper)
    if save_param_scheduler and runner.param_schedulers is None:
        runner.logger.warning('`save_param_scheduler` is True but `self.param_schedulers` is '
                              'None, so skip saving parameter schedulers')
        save_param_scheduler = False
    if save_param_scheduler:
        if isinstance(runner.param_schedulers, dict):
            checkpoint['param_schedulers'] = {
                name: [s.state_dict() for s in schedulers]
                for name, schedulers in runner.param_schedulers.items()}
        else:
            checkpoint['param_schedulers'] = [s.state_dict() for s in runner.param_schedulers]
    return checkpoint


def _meta(runner: Any, meta: Optional[dict], by_epoch: bool) -> Dict[str, Any]:
    """What mmengine's ``Runner.save_checkpoint`` puts in ``meta``."""
    import mmengine
    from mmengine.utils import get_git_hash
    if meta is None:
        meta = {}
    elif not isinstance(meta, dict):
        raise TypeError(f'meta should be a dict or None, but got {type(meta)}')
    meta = dict(meta)
    if by_epoch:
        meta.setdefault('epoch', runner.epoch + 1)
        meta.setdefault('iter', runner.iter)
    else:
        meta.setdefault('epoch', runner.epoch)
        meta.setdefault('iter', runner.iter + 1)
    meta.update(cfg=runner.cfg.pretty_text, seed=runner.seed,
                experiment_name=runner.experiment_name,
                time=time.strftime('%Y%m%d_%H%M%S', time.localtime()),
                mmengine_version=mmengine.__version__ + get_git_hash(),
                world_size=dist.get_world_size() if dist.is_initialized() else 1)
    if hasattr(runner.train_dataloader.dataset, 'metainfo'):
        meta.update(dataset_meta=runner.train_dataloader.dataset.metainfo)
    return meta


@_collective
def save_checkpoint(runner: Any, out_dir: str, filename: str, file_client_args: Optional[dict] = None,
                    save_optimizer: bool = True, save_param_scheduler: bool = True,
                    meta: Optional[dict] = None, by_epoch: bool = True,
                    backend_args: Optional[dict] = None) -> None:
    """``Runner.save_checkpoint`` for an FSDP2 model: a DCP directory written by every rank.

    Same arguments as mmengine's; ``out_dir`` must be a local path. Hooks'
    ``before_save_checkpoint`` run on every rank (so that e.g. EMAHook adds its sharded state).
    """
    if file_client_args is not None or backend_args is not None:
        raise ValueError('sharded (DCP) checkpoints are written to a local directory; '
                         'file_client_args/backend_args are not supported (checkpoint hook config)')
    import torch.distributed.checkpoint as dcp
    path = osp.join(out_dir, filename)
    checkpoint = _build_checkpoint(runner, save_optimizer, save_param_scheduler,
                                   _meta(runner, meta, by_epoch))
    runner.call_hook('before_save_checkpoint', checkpoint=checkpoint)
    keys = sharded_keys(checkpoint)
    tensors, rest = split_tensors(checkpoint, keys)
    rest[INFO_KEY] = dict(version=VERSION, keys=list(keys))
    tensors[REST_KEY] = to_blob(rest)
    if osp.isfile(path):  # an ordinary checkpoint of the same name: replace it
        if dist.get_rank() == 0:
            os.remove(path)
    dcp.save(tensors, checkpoint_id=path)


# ---- loading ---------------------------------------------------------------------------------------
def _flat_keys(tree: Dict[str, Any], prefix: str = '') -> List[str]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += _flat_keys(v, f'{prefix}{k}.')
        else:
            out.append(prefix + str(k))
    return out


def _load_tensors(path: str, runner: Any, optimizer: bool) -> Dict[str, Any]:
    """DCP-load the checkpoint at ``path`` into tensors laid out as the live model's (re-sliced)."""
    import torch.distributed.checkpoint as dcp
    reader = SafeFileSystemReader(path)
    state = {REST_KEY: rest_template(path, reader)}
    dcp.load(state, storage_reader=reader)
    rest = from_blob(state[REST_KEY], path)
    info = rest.pop(INFO_KEY, None)
    if not isinstance(info, dict) or info.get('version', 0) > VERSION:
        raise ValueError(f'{path}: not a Runner checkpoint this mp_wrappers can read ({info!r})')
    keys = tuple(info['keys'])
    # The live checkpoint, built as at save time, gives each tensor its current sharding.
    live = _build_checkpoint(runner, save_optimizer='optimizer' in keys and optimizer,
                             save_param_scheduler=False, meta={})
    if 'optimizer' not in keys or not optimizer:
        live.pop('optimizer', None)
    runner.call_hook('before_save_checkpoint', checkpoint=live)
    wanted = [k for k in keys if k in live and (optimizer or k != 'optimizer')]
    templates, _ = split_tensors(live, tuple(wanted))
    saved = {k for k in reader.read_metadata().state_dict_metadata if k != REST_KEY}
    asked = set(_flat_keys(templates))
    missing = sorted(k for k in asked if k not in saved)
    if missing:
        raise KeyError(f'{path} lacks {len(missing)} entries the model has: {missing[:8]} '
                       + (_STATE_DTYPE_HINT if _eight_bit(missing) else
                          '(a checkpoint of another model?)'))
    unexpected = sorted(k for k in saved if k.split('.')[0] in wanted and k not in asked)
    if unexpected and 'optimizer' in wanted:
        raise KeyError(f'{path} has {len(unexpected)} entries the model lacks: {unexpected[:8]}'
                       + (' ' + _STATE_DTYPE_HINT if _eight_bit(unexpected) else ''))
    # DCP loads in place: fresh buffers, so that nothing live changes before the hooks have run.
    templates = _clone_tree(templates)
    check_plain_tensors(templates)
    dcp.load(templates, storage_reader=SafeFileSystemReader(path))
    merged = merge_tensors({k: rest[k] for k in wanted}, templates)
    checkpoint = dict(rest)
    checkpoint.update(merged)
    return checkpoint


def _clone_tree(tree: Dict[str, Any]) -> Dict[str, Any]:
    return {k: _clone_tree(v) if isinstance(v, dict) else v.detach().clone()
            for k, v in tree.items()}


def _apply_model(runner: Any, state_dict: Dict[str, Any], strict: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    root = fsdp2_root(runner.model)
    result = set_model_state_dict(root, state_dict, options=StateDictOptions(strict=strict))
    if result is not None and (result.missing_keys or result.unexpected_keys):
        runner.logger.warning(f'load_from: missing keys {result.missing_keys}, unexpected keys '
                              f'{result.unexpected_keys}')


def _apply_optimizer(runner: Any, state: Dict[str, Any]) -> Dict[str, Any]:
    """Load FSDP2 optimizer state; return the wrapper's int-keyed dict plus its saved extras."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    root = fsdp2_root(runner.model)
    wrapper = runner.optim_wrapper
    osd = {k: state[k] for k in ('state', 'param_groups')}
    extras = {k: v for k, v in state.items() if k not in osd}
    set_optimizer_state_dict(root, wrapper.optimizer, osd)
    loaded = dict(wrapper.optimizer.state_dict())
    loaded.update(extras)
    return loaded


@_collective
def load_checkpoint(runner: Any, filename: str, map_location: Any = 'cpu', strict: bool = False,
                    revise_keys: list = [(r'^module.', '')]) -> Dict[str, Any]:  # noqa: B006
    """``Runner.load_checkpoint`` for an FSDP2 model (all ranks): a DCP directory or a full file.

    A DCP directory is re-sliced onto the current ranks; with ``runner._resume`` the optimizer
    state is loaded too and returned in the wrapper's own layout for ``Runner.resume``. An ordinary
    checkpoint (one file, full tensors) is read by every rank with the ``weights_only`` loader and
    each keeps its shards.
    """
    from mmengine.runner.checkpoint import _load_checkpoint
    if is_sharded_checkpoint(filename):
        checkpoint = _load_tensors(filename, runner, optimizer=bool(runner._resume))
        runner.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        _apply_model(runner, checkpoint['state_dict'], strict)
        if runner._resume and 'optimizer' in checkpoint:
            checkpoint['optimizer'] = _apply_optimizer(runner, checkpoint['optimizer'])
    else:
        if osp.isdir(filename):
            raise FileNotFoundError(f'{filename} is a directory without a .metadata file: not a '
                                    'complete sharded (DCP) checkpoint (a save that was cut off?)')
        checkpoint = _load_checkpoint(filename, map_location=map_location)
        runner.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        _apply_full_weights(runner, checkpoint, strict, revise_keys)
        if runner._resume:
            checkpoint['optimizer'] = _apply_full_optimizer(runner, checkpoint, filename)
    runner._has_loaded = True
    runner.logger.info(f'Load checkpoint from {filename}')
    return checkpoint


def _apply_full_optimizer(runner: Any, checkpoint: Any, filename: str) -> Dict[str, Any]:
    """Resume from one file: a consolidated checkpoint (``consolidate_checkpoint.py --resumable``)
    whose optimizer state is keyed by parameter name; each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_optimizer_state_dict)
    state = checkpoint.get('optimizer') if isinstance(checkpoint, dict) else None
    if not (isinstance(state, dict) and isinstance(state.get('state'), dict)
            and all(isinstance(k, str) for k in state['state'])
            and 'message_hub' in checkpoint and 'meta' in checkpoint):
        raise ValueError(
            f'resume={filename!r}: resuming an FSDP2 model needs a sharded (DCP) checkpoint '
            'directory, or one file from tools/consolidate_checkpoint.py --resumable (optimizer '
            'state keyed by parameter name). To start from the weights of an ordinary checkpoint, '
            'set load_from to it and resume=False')
    root = fsdp2_root(runner.model)
    wrapper = runner.optim_wrapper
    osd = {k: state[k] for k in ('state', 'param_groups')}
    set_optimizer_state_dict(root, wrapper.optimizer, osd,
                             options=StateDictOptions(full_state_dict=True))
    loaded = dict(wrapper.optimizer.state_dict())
    loaded.update({k: v for k, v in state.items() if k not in osd})
    return loaded


def _apply_full_weights(runner: Any, checkpoint: Any, strict: bool, revise_keys: list) -> None:
    import re
    from collections import OrderedDict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    state_dict = checkpoint.get('state_dict', checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state_dict, dict):
        raise ValueError(f'no state_dict in the checkpoint to load (got {type(checkpoint)})')
    metadata = getattr(state_dict, '_metadata', OrderedDict())
    for p, r in revise_keys:
        state_dict = OrderedDict({re.sub(p, r, k): v for k, v in state_dict.items()})
    state_dict._metadata = metadata
    root = fsdp2_root(runner.model)
    own = set(root.state_dict().keys())
    missing = sorted(own - set(state_dict))
    unexpected = sorted(set(state_dict) - own)
    if strict and (missing or unexpected):
        raise RuntimeError(f'load_from: missing keys {missing}, unexpected keys {unexpected}')
    if missing or unexpected:
        runner.logger.warning(f'load_from: missing keys {missing}, unexpected keys {unexpected}')
    state_dict = {k: v for k, v in state_dict.items() if k in own}
    set_model_state_dict(root, state_dict,
                         options=StateDictOptions(full_state_dict=True, strict=False))


# ---- a sharded run's full checkpoint, resumed without sharding -------------------------------------
def optimizer_state_by_position(state: Dict[str, Any], model: nn.Module,
                                optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """An optimizer state dict keyed by parameter name (FSDP1 ``'full'``, consolidated FSDP2)
    re-keyed by position in ``optimizer``'s groups, torch's own layout, for an unsharded model.

    Raises:
        KeyError: a parameter of ``optimizer`` has no name in ``model``, or the checkpoint's
            groups name other parameters.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    out_groups, out_state, index = [], {}, 0
    if len(state['param_groups']) != len(optimizer.param_groups):
        raise KeyError(f"the checkpoint has {len(state['param_groups'])} param groups, the "
                       f'optimizer {len(optimizer.param_groups)}')
    for saved, group in zip(state['param_groups'], optimizer.param_groups):
        ids = []
        for p in group['params']:
            name = names.get(id(p))
            if name is None or name not in saved['params']:
                raise KeyError(f'optimizer parameter {name!r} is not in the checkpoint\'s group '
                               f"(it names {saved['params'][:4]}...)")
            if name in state['state']:
                out_state[index] = state['state'][name]
            ids.append(index)
            index += 1
        out_groups.append(dict(saved, params=ids))
    converted = {k: v for k, v in state.items() if k not in ('state', 'param_groups')}
    converted.update(state=out_state, param_groups=out_groups)
    return converted


def adapt_loaded_checkpoint(runner: Any, checkpoint: Dict[str, Any]) -> None:
    """Make a sharded run's full checkpoint resumable by an unsharded model (in place).

    For ``after_load_checkpoint`` (before ``Runner.resume`` loads the optimizer): when the model
    is not sharded and ``checkpoint['optimizer']`` is keyed by parameter name (FSDP1
    ``state_dict_cfg='full'``, ``tools/consolidate_checkpoint.py --resumable``), re-key it by
    position (:func:`optimizer_state_by_position`) and drop the empty master list a sharded
    wrapper writes (its fp32 shards were the masters: the unsharded wrapper starts its masters
    from the checkpoint's fp32 weights, bit for bit). Does nothing otherwise.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    state = checkpoint.get('optimizer') if isinstance(checkpoint, dict) else None
    model = getattr(runner, 'model', None)
    wrapper = getattr(runner, 'optim_wrapper', None)
    optimizer = getattr(wrapper, 'optimizer', None)
    if not (isinstance(state, dict) and isinstance(state.get('state'), dict)
            and isinstance(state.get('param_groups'), list) and state['param_groups']
            and all(isinstance(n, str) for g in state['param_groups'] for n in g['params'])
            and isinstance(optimizer, torch.optim.Optimizer) and model is not None):
        return
    module = getattr(model, 'module', model)
    if fsdp2_root(model) is not None or isinstance(model, FullyShardedDataParallel) or \
            isinstance(module, FullyShardedDataParallel):
        return
    converted = optimizer_state_by_position(state, module, optimizer)
    ours = converted.get('mp_wrappers')
    if isinstance(ours, dict) and not any(ours.get('fp32_master_params') or []):
        converted['mp_wrappers'] = {k: v for k, v in ours.items() if k != 'fp32_master_params'}
    checkpoint['optimizer'] = converted
