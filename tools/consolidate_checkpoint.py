"""Turn a sharded checkpoint into one ordinary file: full fp32 weights, ``weights_only``-loadable.

Examples:
    python tools/consolidate_checkpoint.py work_dirs/cnn_fsdp2_apex_O2_bf16/epoch_20.pth model.pth
    python tools/consolidate_checkpoint.py work_dirs/.../epoch_20.pth model_bf16.pth --dtype bfloat16
    python tools/consolidate_checkpoint.py work_dirs/.../epoch_20.pth full.pth --resumable

Input: a ``torch.distributed.checkpoint`` directory written by ``mp_wrappers.FullyShardedRunner``
(FSDP2; any number of ranks). One process, no process group: every tensor is read whole from the
shards of all ranks. The output is ``{'meta': {...}, 'state_dict': {name: tensor}}``, what
mmengine's ``load_from``/``load_checkpoint`` and ``torch.load(path, weights_only=True)`` read: the
fp32 weights (the FSDP shards, i.e. the master weights), or with ``--dtype`` the half model apex O2
would run (floating tensors cast, BatchNorm layers, recognised by their ``running_mean``, kept
fp32). ``--resumable`` adds what ``--resume`` needs (full optimizer state keyed by parameter name,
our wrapper's scaler state, the message hub, the schedulers): ``FullyShardedRunner`` resumes it on
any number of ranks; the message hub's history makes it a file for mp_wrappers' ``weights_only``
loader (mmengine's HistoryBuffer allow-listed), not for a bare ``torch.load``. With mmengine's EMAHook the ``state_dict`` holds the averaged weights, as in mmengine's own
checkpoints (its ``before_save_checkpoint`` swaps them in for deployment).

Safety: nothing in the checkpoint is unpickled beyond DCP's own metadata types (read by
``mp_wrappers.distributed.dcp_format.SafeFileSystemReader``) and the checkpoint's plain part
(read with ``weights_only=True``); checkpoints holding DCP non-tensor entries (which torch would
unpickle with ``weights_only=False``) are refused.
"""
import argparse
import os
import os.path as osp
import sys
from typing import Any, Dict, Optional

_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from mp_wrappers.casting import parse_dtype  # noqa: E402
from mp_wrappers.distributed import dcp_format  # noqa: E402

# meta entries copied to the output: plain values only, so that weights_only loads the file.
_META_KEYS = ('epoch', 'iter', 'cfg', 'seed', 'experiment_name', 'time', 'mmengine_version',
              'world_size')


def read_full_tensors(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the DCP checkpoint at ``path``, whole, keyed by DCP's flattened name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader = dcp_format.SafeFileSystemReader(path)
    entries = reader.read_metadata().state_dict_metadata
    not_tensors = sorted(k for k, v in entries.items() if not isinstance(v, TensorStorageMetadata))
    if not_tensors:
        raise ValueError(f'{path} holds non-tensor DCP entries {not_tensors[:5]}, which torch would '
                         'unpickle with weights_only=False; refusing (mp_wrappers writes none)')
    tensors = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()}
    dcp.load(tensors, storage_reader=dcp_format.SafeFileSystemReader(path), no_dist=True)
    return tensors


def _is_plain(value: Any) -> bool:
    import io
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception:
        return False
    return True


def _half(state_dict: Dict[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    norm_prefixes = {k[:-len('running_mean')] for k in state_dict if k.endswith('running_mean')}
    out = {}
    for k, v in state_dict.items():
        keep = any(k.startswith(p) for p in norm_prefixes) or not v.is_floating_point()
        out[k] = v if keep else v.to(dtype)
    return out


def _subtree(skeleton: Dict[str, Any], tensors: Dict[str, torch.Tensor], prefix: str) -> Any:
    """Put the full tensors back into the plain part's skeleton (markers at tensor leaves)."""
    if isinstance(skeleton, dict):
        return {k: _subtree(v, tensors, f'{prefix}.{k}') for k, v in skeleton.items()}
    if isinstance(skeleton, str) and skeleton == dcp_format.TENSOR_MARKER:
        return tensors[prefix]
    return skeleton


def consolidate(path: str, dtype: Optional[torch.dtype] = None,
                resumable: bool = False) -> Dict[str, Any]:
    """``{'meta', 'state_dict'}`` of the sharded Runner checkpoint at ``path`` (see the module doc).

    Raises:
        ValueError: ``path`` is not a complete DCP checkpoint written by mp_wrappers, or
            ``resumable`` with ``dtype`` or without optimizer state.
    """
    if resumable and dtype is not None:
        raise ValueError('--resumable keeps the fp32 weights (the masters); drop --dtype')
    if not dcp_format.is_sharded_checkpoint(path):
        raise ValueError(f'{path} is not a complete sharded (DCP) checkpoint directory (no '
                         '.metadata); an ordinary checkpoint file needs no consolidation')
    tensors = read_full_tensors(path)
    rest = dcp_format.from_blob(tensors.pop(dcp_format.REST_KEY), path)
    if not isinstance(rest.get('state_dict'), dict):
        raise ValueError(f'{path} holds no model state_dict')
    state_dict = _subtree(rest['state_dict'], tensors, 'state_dict')
    if dtype is not None:
        state_dict = _half(state_dict, dtype)
    if resumable:
        if 'optimizer' not in rest:
            raise ValueError(f'{path} holds no optimizer state (saved with save_optimizer=False, '
                             'e.g. a save_best checkpoint): it cannot be made resumable')
        out = {k: v for k, v in rest.items() if not k.startswith('_mp_wrappers')}
        for key in rest.get(dcp_format.INFO_KEY, {}).get('keys', ()):
            out[key] = _subtree(rest[key], tensors, key)
        out['meta'] = dict(out['meta'], consolidated_from=osp.abspath(path))
        return out
    meta = {k: v for k, v in rest.get('meta', {}).items() if k in _META_KEYS}
    dataset_meta = rest.get('meta', {}).get('dataset_meta')
    if dataset_meta is not None and _is_plain(dataset_meta):
        meta['dataset_meta'] = dataset_meta
    meta['consolidated_from'] = osp.abspath(path)
    return {'meta': meta, 'state_dict': state_dict}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('checkpoint', help='sharded checkpoint directory (epoch_N.pth/)')
    parser.add_argument('out', help='output file')
    parser.add_argument('--dtype', default=None, choices=('bfloat16', 'float16'),
                        help='write the half model (norm layers fp32) instead of fp32 weights')
    parser.add_argument('--resumable', action='store_true',
                        help='also write the optimizer, scaler, message hub and scheduler state '
                        '(resumable by mp_wrappers.FullyShardedRunner on any number of ranks)')
    args = parser.parse_args(argv)
    dtype = parse_dtype(args.dtype, option='--dtype') if args.dtype else None
    result = consolidate(args.checkpoint, dtype, resumable=args.resumable)
    os.makedirs(osp.dirname(osp.abspath(args.out)), exist_ok=True)
    torch.save(result, args.out)
    n = sum(t.numel() for t in result['state_dict'].values())
    print(f'{args.out}: {len(result["state_dict"])} tensors, {n} elements, from {args.checkpoint}')


if __name__ == '__main__':
    main()
