"""Train a model from an mmengine config, OpenMMLab style, on CPU or GPU, single or multi-process.

Examples:
    python tools/train.py configs/digits/cnn_bf16.py
    python tools/train.py configs/digits/cnn_bf16.py --resume            # last complete checkpoint
    python tools/train.py configs/digits/cnn_fp32.py --cfg-options train_cfg.max_epochs=2
    python tools/train.py configs/digits/cnn_bf16.py --auto-scale-lr     # lr x batch / base batch
    python tools/train.py configs/digits/cnn_fp32.py --amp             # O1, dtype='auto'
    torchrun --nproc_per_node=2 tools/train.py configs/digits/cnn_fp32.py --launcher pytorch

The two mmengine 0.10.7 traps on torch 2.13 are handled by the package, not here: importing
``mp_wrappers`` installs the weights_only checkpoint loader (:mod:`mp_wrappers.checkpoint`), and
:func:`mp_wrappers.launch.prepare_distributed` starts a gloo group on machines without CUDA.
:func:`mp_wrappers.train_config.add_mixed_precision_hook` adds ``mp_wrappers.MixedPrecisionHook`` when the
config trains with one of our optimizer wrappers (``mixed_precision_hook = False`` opts out).
"""
import argparse
import os
import os.path as osp
import sys

# Run from a checkout without installing: the repository root holds the mp_wrappers package.
_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from mmengine.config import Config, DictAction  # noqa: E402
from mmengine.logging import print_log  # noqa: E402
from mmengine.registry import RUNNERS  # noqa: E402
from mmengine.runner import Runner  # noqa: E402

import mp_wrappers  # noqa: E402,F401  (installs the secure loader and atomic checkpoint writes)
from mp_wrappers.atomic_io import resolve_resume_checkpoint  # noqa: E402
from mp_wrappers.distributed.runner_checkpoint import attach as attach_sharded_checkpoints  # noqa: E402
from mp_wrappers.loops import use_mixed_precision_loops  # noqa: E402
from mp_wrappers.launch import (LAUNCHERS, backend_summary,  # noqa: E402
                                configure_torch_threads, prepare_distributed)
from mp_wrappers.train_config import add_mixed_precision_hook, enable_amp  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Train a model with mmengine and mp_wrappers')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and checkpoints '
                        '(default: work_dirs/<config name>)')
    parser.add_argument('--resume', nargs='?', type=str, const='auto',
                        help='resume from the given checkpoint, or, without a value, from the last '
                        'complete checkpoint in the work dir')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, e.g. train_cfg.max_epochs=2 '
                        'optim_wrapper.optimizer.lr=0.1 (lists as key="[a,b]")')
    parser.add_argument('--launcher', choices=LAUNCHERS, default='none', help='job launcher')
    parser.add_argument('--auto-scale-lr', action='store_true',
                        help="scale the learning rate by (world size x batch size) / "
                        "auto_scale_lr.base_batch_size, as OpenMMLab's train scripts do (the config "
                        'must set auto_scale_lr=dict(base_batch_size=N))')
    parser.add_argument('--amp', action='store_true',
                        help="train the config's OptimWrapper with mixed precision: "
                        "mp_wrappers.ApexOptimWrapper(opt_level='O1', dtype='auto'), keeping its "
                        'optimizer, accumulative_counts and clip_grad')
    # torch.distributed.launch passes --local-rank (torch>=2.0) or --local_rank.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def build_config(args: argparse.Namespace) -> Config:
    cfg = Config.fromfile(args.config)
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    # Priority: --work-dir > work_dir in the config > work_dirs/<config name>.
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    if args.resume == 'auto':
        cfg.resume = True
        # mmengine would follow the last_checkpoint pointer blindly; take the last *complete*
        # checkpoint instead (mp_wrappers.atomic_io: a run killed mid-save, a truncated pointer).
        cfg.load_from = resolve_resume_checkpoint(cfg.work_dir)
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    if args.auto_scale_lr:
        enable_auto_scale_lr(cfg)
    if args.amp:
        enable_amp(cfg)
    return configure(cfg, args.launcher)


def configure(cfg: Config, launcher: str = 'none') -> Config:
    """What this script adds to a config beyond a toolbox's train script (none of it is needed for
    correct training: the wrappers attach what they need to the Runner by themselves)."""
    # Precision summary, skip-aware schedules and overflow reports for our wrappers (opt out with
    # `mixed_precision_hook = False` in the config).
    add_mixed_precision_hook(cfg)
    # val_cfg/test_cfg=dict(fp16=True) evaluate in the training wrapper's dtype (mp_wrappers.loops).
    use_mixed_precision_loops(cfg)
    # A gloo group on machines without CUDA, and O2/O3 models cast before DDP wraps them.
    return prepare_distributed(cfg, launcher)


def enable_auto_scale_lr(cfg: Config) -> None:
    """``--auto-scale-lr``: turn on mmengine's ``auto_scale_lr`` (the config gives the base batch)."""
    auto = cfg.get('auto_scale_lr', None)
    if not isinstance(auto, dict) or 'base_batch_size' not in auto:
        raise ValueError(f'--auto-scale-lr needs auto_scale_lr=dict(base_batch_size=N) in the config '
                         f'(the batch size the learning rate was tuned for); got auto_scale_lr='
                         f'{auto!r}')
    cfg.auto_scale_lr = dict(auto, enable=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = build_config(args)
    configure_torch_threads(cfg)
    # runner_type='FlexibleRunner' (e.g. FSDP through a strategy, docs/distributed.md) as in
    # OpenMMLab's train scripts.
    runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
    # An FSDP2 model under a runner that would save rank 0's shards only is refused here, before
    # training (mp_wrappers.distributed.runner_checkpoint).
    attach_sharded_checkpoints(runner)
    print_log(backend_summary(), logger='current')
    runner.train()
    _close_process_group()


def _close_process_group() -> None:
    """Leave the process group cleanly: exiting with a live gloo group (its threads still running)
    has aborted a rank at exit ("terminate called without an active exception") after a good run."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == '__main__':
    main()
