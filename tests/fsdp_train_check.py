"""Run by tests/runner/test_fsdp_runner.py under torchrun: train with tools/train.py's setup, save full weights.

Usage: torchrun --nproc_per_node=N tests/fsdp_train_check.py CONFIG RESULT_PT [--plain] [train.py args...]
       [--then CONFIG RESULT_PT [--plain] [train.py args...]]...
Builds the runner as tools/train.py does (FlexibleRunner for ``runner_type``), trains, then gathers
the full fp32 weights (FSDP1 ``summon_full_params``, FSDP2 ``full_tensor``) and rank 0 saves ``{'params': [...],
'iters': i, 'world_size': N, 'scale': s, 'skipped': k, 'opt_numel': [...per rank...],
'val': [...each rank's last val/accuracy...], 'state_dtypes': [rank 0's optimizer state dtypes],
'opt_state': [rank 0's optimizer state of each param, in order]}``.

``--plain`` builds the runner as an OpenMMLab toolbox's ``tools/train.py`` does (mmengine's template:
the config, ``--cfg-options``, ``--work-dir``, ``--resume``, ``cfg.launcher``, then ``Runner.from_cfg``
or ``RUNNERS.build`` for ``runner_type``): none of tools/train.py's config edits (no automatic hook,
no mixed precision loops, no gloo group, no thread setting, no ``attach``). What the run needs from
mp_wrappers then comes from the config alone.

``--then`` runs another config after the first one, in the same processes and process group (each
its own Runner, model and seeded RNGs): starting processes is most of a launch's time.
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


def _toolbox_config(args):
    """The config as a toolbox's train script makes it (mmpretrain's, minus its --amp and such)."""
    from mmengine.config import Config
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    cfg.work_dir = args.work_dir
    if args.resume is not None:
        cfg.resume, cfg.load_from = True, args.resume
    return cfg


def _build_runner(config, argv, train, first):
    plain = '--plain' in argv
    args = train.parse_args([config, *(a for a in argv if a != '--plain')])
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner
    if plain:
        cfg = _toolbox_config(args)
    else:
        cfg = train.build_config(args)
        train.configure_torch_threads(cfg)
    if not first:
        # mmengine names its MessageHub, logger and visualizer instances after the experiment
        # (config name + the second it started): a later run of the same config in this process
        # would get the earlier run's MessageHub, scalars and all
        cfg.experiment_name = osp.basename(osp.normpath(args.work_dir))
    runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
    if not plain:
        train.attach_sharded_checkpoints(runner)
    return runner


def _ema_weights(runner):
    """An EMAHook's averaged weights, gathered (FSDP2: DTensor shards), with its step count."""
    from mmengine.hooks import EMAHook
    hooks = [h for h in runner.hooks if isinstance(h, EMAHook)]
    if not hooks:
        return None
    hook, ema = hooks[0], hooks[0].ema_model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    if isinstance(runner.model, FSDP):  # local flat pieces: gathered as the model's, swapped in
        hook._swap_ema_parameters()
        try:
            with FSDP.summon_full_params(runner.model):
                weights = [p.detach().float().clone() for p in runner.model.parameters()]
        finally:
            hook._swap_ema_parameters()
    else:
        weights = [p.full_tensor() if hasattr(p, 'full_tensor') else p
                   for p in ema.module.parameters()]
    return dict(steps=int(ema.steps), params=[p.detach().float().clone() for p in weights])


def _train_and_save(runner, result) -> None:
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
    # mmengine's evaluator computes the metrics on rank 0 and broadcasts them: every rank's
    # RuntimeInfoHook records the same val/accuracy (or none, without evaluation)
    hub = runner.message_hub
    accuracy = (float(hub.get_scalar('val/accuracy').current()) if 'val/accuracy' in hub.log_scalars
                else None)
    accuracies = [None] * dist.get_world_size()
    dist.all_gather_object(accuracies, accuracy)
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            params = [p.detach().float().clone() for p in model.parameters()]
    else:  # FSDP2 (mp_wrappers.FullyShardedModel): DTensor parameters
        params = [p.full_tensor().detach().float().clone() for p in model.parameters()]
    ema = _ema_weights(runner)
    if dist.get_rank() == 0:
        torch.save(dict(params=params, ema=ema, iters=runner.iter, world_size=dist.get_world_size(),
                        scale=wrapper.loss_scale,
                        skipped=sum(s.skipped_steps for s in wrapper.loss_scalers),
                        opt_numel=[int(g) for g in gathered], val=accuracies,
                        state_dtypes=sorted({str(local_tensor(v).dtype) for st in opt.state.values()
                                             for k, v in st.items() if torch.is_tensor(v)
                                             and k != 'step'}),
                        opt_state=[{k: local_tensor(v).clone() for k, v in opt.state[p].items()
                                    if torch.is_tensor(v)}
                                   for g in opt.param_groups for p in g['params'] if p in opt.state],
                        total=sum(p.numel() for p in params)), result)
    dist.barrier()


def main() -> None:
    # CONFIG RESULT [args] [--then CONFIG RESULT [args]]...: one run after the other, in the same
    # processes and process group (the first run starts it)
    runs, current = [], []
    for arg in sys.argv[1:]:
        if arg == '--then':
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)
    train = _train_module()
    for i, (config, result, *argv) in enumerate(runs):
        _train_and_save(_build_runner(config, argv, train, first=i == 0), result)
    # Leave the group cleanly: exiting with live gloo threads has aborted a rank at exit.
    rank = dist.get_rank()
    dist.destroy_process_group()
    # Read by tests/runner/test_fsdp_runner.py: everything this script checks is done on this rank.
    print(f'fsdp_train_check: rank {rank} done', flush=True)


if __name__ == '__main__':
    main()
