"""Run by the FSDP runner tests under torchrun: configs that must be refused before training.

Usage: torchrun --nproc_per_node=N tests/refusal_check.py WORK_DIR CONFIG [CONFIG...]
Each config is built as a toolbox's train script builds it (mmengine's template: ``cfg.launcher``,
then ``Runner.from_cfg``, or ``RUNNERS.build`` for ``runner_type``; none of tools/train.py's edits)
and trained in ``WORK_DIR/<config name>``; each rank prints one line per config,
``refusal_check: rank R: NAME: <exception type>: <message>`` (``trained`` when nothing was raised),
then ``refusal_check: rank R done``. All the configs run in one process per rank, one after the
other (starting processes is most of a launch's time), in the gloo group this script starts: the
process group is not what these runs test (tests/fsdp_train_check.py ``--plain`` runs start theirs
from the config alone).
"""
import os.path as osp
import sys
import traceback

import torch.distributed as dist

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)


def _attempt(config: str, work_dir: str) -> str:
    from mmengine.config import Config
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner
    cfg = Config.fromfile(config)
    cfg.launcher = 'pytorch'
    cfg.work_dir = work_dir
    try:
        runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
        runner.train()
    except Exception as e:  # noqa: BLE001 - what was raised is the result
        traceback.print_exc()
        return f'{type(e).__name__}: {e}'.replace('\n', ' ')
    return 'trained'


def main() -> None:
    work_dir, configs = sys.argv[1], sys.argv[2:]
    dist.init_process_group('gloo')
    rank = dist.get_rank()
    for config in configs:
        name = osp.splitext(osp.basename(config))[0]
        outcome = _attempt(config, osp.join(work_dir, name))
        print(f'refusal_check: rank {rank}: {name}: {outcome}', flush=True)
        dist.barrier()
    dist.destroy_process_group()
    print(f'refusal_check: rank {rank} done', flush=True)


if __name__ == '__main__':
    main()
