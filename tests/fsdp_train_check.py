"""Run by tests/runner/test_fsdp_runner.py under torchrun: train with tools/train.py's setup, save full weights.

Usage: torchrun --nproc_per_node=N tests/fsdp_train_check.py CONFIG RESULT_PT [train.py args...]
Builds the runner as tools/train.py does (FlexibleRunner for ``runner_type``), trains, then gathers
the full fp32 weights (FSDP1 ``summon_full_params``, FSDP2 ``full_tensor``) and rank 0 saves ``{'params': [...],
'iters': i, 'world_size': N, 'scale': s, 'skipped': k, 'opt_numel': [...per rank...]}``.
"""
import importlib.util
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
    cfg = train.build_config(args)
    train.configure_torch_threads(cfg)
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner
    runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
    train.attach_sharded_checkpoints(runner)
    runner.train()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    model = runner.model
    wrapper = runner.optim_wrapper
    opt = wrapper.optimizer
    from mp_wrappers.sharding import local_tensor
    opt_numel = sum(local_tensor(v).numel() for st in opt.state.values() for k, v in st.items()
                    if torch.is_tensor(v) and k != 'step')
    masters = sum(m.numel() for m, _ in wrapper._master_params().half_pairs())
    numel = torch.tensor([opt_numel + masters])
    gathered = [torch.zeros_like(numel) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, numel)
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            params = [p.detach().float().clone() for p in model.parameters()]
    else:  # FSDP2 (mp_wrappers.FullyShardedModel): DTensor parameters
        params = [p.full_tensor().detach().float().clone() for p in model.parameters()]
    if dist.get_rank() == 0:
        torch.save(dict(params=params, iters=runner.iter, world_size=dist.get_world_size(),
                        scale=wrapper.loss_scale,
                        skipped=sum(s.skipped_steps for s in wrapper.loss_scalers),
                        opt_numel=[int(g) for g in gathered],
                        total=sum(p.numel() for p in params)), result)
    # Leave the group cleanly: exiting with live gloo threads has aborted a rank at exit.
    dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    # Read by tests/runner/test_fsdp_runner.py: everything this script checks is done on this rank.
    print(f'fsdp_train_check: rank {rank} done', flush=True)


if __name__ == '__main__':
    main()
