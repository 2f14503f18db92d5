"""Test-only mmengine hooks for the reliability tests, imported by configs through ``custom_imports``.

The tests put ``tests/`` on ``PYTHONPATH`` and add ``'_reliability_hooks'`` to
``custom_imports.imports``. Registered in mmengine's root HOOKS registry under names no other code
uses, so they resolve from ``default_scope='mmengine'``.

* ``RelTestKillHook(at_iter)``: SIGKILLs its own process after iteration ``at_iter`` (1-based; with
  ``priority='LOWEST'`` after the checkpoint hook ran, with ``'NORMAL'`` before): a crash nothing
  can catch or clean up after.
* ``RelTestGradFaultHook(iters, rank, value, param)``: during the given iterations (1-based; ``from_iter``
  for all later ones too), plants ``value`` into the gradient of one parameter on one rank (all
  ranks when ``rank`` is None) via a tensor hook, i.e. inside backward, before DDP's all-reduce.
* ``RelTestShardFaultHook(iters, rank)``: during the given iterations (1-based), on one rank, plants
  inf into the first non-empty local gradient shard after backward, just before the optimizer
  wrapper's step (under FSDP the gradients are reduce-scattered during backward: a fault planted
  there reaches the other ranks' shards too; this one stays on one rank).
* ``RelTestRecordHook(out_dir)``: after every iteration records the flat parameters, the fp32
  masters, the loss scale and the skipped-step count; writes ``rank{r}.pt`` after the run.
"""
import os
import signal
from typing import List, Optional, Sequence

import torch
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS


def _module(runner):
    return runner.model.module if is_model_wrapper(runner.model) else runner.model


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


@HOOKS.register_module()
class RelTestKillHook(Hook):
    priority = 'LOWEST'  # override per instance with priority='NORMAL' in the hook's config

    def __init__(self, at_iter: int) -> None:
        self.at_iter = at_iter

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if runner.iter + 1 == self.at_iter:
            os.kill(os.getpid(), signal.SIGKILL)


@HOOKS.register_module()
class RelTestGradFaultHook(Hook):
    priority = 'NORMAL'

    def __init__(self, iters: Sequence[int] = (), from_iter: Optional[int] = None,
                 rank: Optional[int] = None, value: float = float('inf'),
                 param: str = 'head.weight') -> None:
        self.iters = set(iters)
        self.from_iter = from_iter
        self.rank = rank
        self.value = float(value)
        self.param = param
        self._handle = None

    def _due(self, it: int) -> bool:
        return it in self.iters or (self.from_iter is not None and it >= self.from_iter)

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if not self._due(runner.iter + 1) or (self.rank is not None and _rank() != self.rank):
            return
        param = dict(_module(runner).named_parameters())[self.param]
        value = self.value

        def plant(grad):
            grad = grad.clone()
            grad.view(-1)[0] = value
            return grad

        self._handle = param.register_hook(plant)

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


@HOOKS.register_module()
class RelTestShardFaultHook(Hook):
    priority = 'NORMAL'

    def __init__(self, iters: Sequence[int] = (), rank: int = 1) -> None:
        self.iters = set(iters)
        self.rank = rank
        self._restore = None

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if runner.iter + 1 not in self.iters or _rank() != self.rank:
            return
        wrapper = runner.optim_wrapper
        own = vars(wrapper).get('step')  # a replacement set on the instance, if any
        step = wrapper.step

        def restore():
            if own is None:
                vars(wrapper).pop('step', None)
            else:
                wrapper.step = own

        def planted_step(*args, **kwargs):
            from mp_wrappers.sharding import local_tensor
            for p in _module(runner).parameters():
                g = local_tensor(p.grad)
                if g is not None and g.numel():
                    g.view(-1)[0] = float('inf')
                    break
            restore()  # once
            return step(*args, **kwargs)

        wrapper.step = planted_step
        self._restore = restore

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if self._restore is not None:
            self._restore()  # not reached while accumulating: do not leave it for later
        self._restore = None


@HOOKS.register_module()
class RelTestRecordHook(Hook):
    priority = 'LOW'  # after the optimizer step (it happens in the train step) and the LR hook

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.records: List[dict] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        wrapper = runner.optim_wrapper
        params = torch.cat([p.detach().float().reshape(-1) for p in _module(runner).parameters()])
        record = dict(iter=runner.iter + 1, params=params.clone())
        if hasattr(wrapper, 'master_params'):
            record['masters'] = torch.cat([m.detach().reshape(-1).float()
                                           for m in wrapper.master_params()])
            record['scale'] = wrapper.loss_scale
            record['skipped'] = sum(s.skipped_steps for s in wrapper.loss_scalers)
            record['last_step_skipped'] = wrapper.last_step_skipped
        self.records.append(record)

    def after_run(self, runner) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save(dict(world_size=(torch.distributed.get_world_size()
                                    if torch.distributed.is_initialized() else 1),
                        records=self.records),
                   os.path.join(self.out_dir, f'rank{_rank()}.pt'))
