"""Run by tests/entry/test_train_tool.py under torchrun: train with tools/train.py's setup, then compare ranks.

Usage: torchrun --nproc_per_node=2 tests/ddp_equal_weights.py CONFIG RESULT_JSON [train.py args...]
Rank 0 writes ``{"world_size": N, "max_abs_diff": d, "iters": i}`` to RESULT_JSON, where ``d`` is
the largest difference between any rank's parameters and rank 0's after training.
"""
import importlib.util
import json
import os.path as osp
import sys

import torch
import torch.distributed as dist

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)


def _train_module():
    spec = importlib.util.spec_from_file_location('train_tool', osp.join(ROOT, 'tools', 'train.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    config, result = sys.argv[1], sys.argv[2]
    train = _train_module()
    args = train.parse_args([config, *sys.argv[3:]])
    from mmengine.runner import Runner
    runner = Runner.from_cfg(train.build_config(args))
    runner.train()
    model = runner.model.module if hasattr(runner.model, 'module') else runner.model
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    if dist.get_rank() == 0:
        diff = max(float((g - gathered[0]).abs().max()) for g in gathered)
        with open(result, 'w') as f:
            json.dump({'world_size': dist.get_world_size(), 'max_abs_diff': diff, 'iters': runner.iter}, f)
    dist.barrier()  # leave the group cleanly (exiting with live gloo threads can abort a rank)
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
