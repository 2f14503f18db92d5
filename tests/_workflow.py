"""Tiny mmengine Runner workflows for the workflow tests (pretrained weights, EMA, unused params...).

A 8 -> 16 -> 4 MLP with a BatchNorm (kept fp32 when cast) on fixed random samples: fp16 matmuls this
small cost nothing even on a CPU without fp16 units, so every wrapper, level and dtype runs in well
under a second per Runner.
"""
import importlib.util
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from mmengine.config import Config
from mmengine.evaluator import BaseMetric
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.runner import Runner
from torch import nn

from mp_wrappers.casting import cast_model
from mp_wrappers import compat
from mp_wrappers.checkpoint import secure_torch_load
from mp_wrappers.registry import DATASETS, HOOKS, METRICS, MODELS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WRAPPERS = {
    # name: (optim_wrapper config without the optimizer, whether the model is built in half)
    'FP16': (lambda dtype: dict(type='mp_wrappers.FP16OptimWrapper', static_loss_scale=1.0,
                                dynamic_loss_scale=dtype == 'float16'), True),
    'O1': (lambda dtype: dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O1', dtype=dtype,
                              verbosity=0), False),
    'O2': (lambda dtype: dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype=dtype,
                              verbosity=0), False),
    'O3': (lambda dtype: dict(type='mp_wrappers.ApexOptimWrapper', opt_level='O3', dtype=dtype,
                              verbosity=0), False),
    # FP16OptimWrapper in a toolbox config: the toolbox builds an fp32 model, the wrapper casts it.
    'FP16cast': (lambda dtype: dict(type='mp_wrappers.FP16OptimWrapper', dtype=dtype,
                                    static_loss_scale=1.0), False),
}
# Levels that keep fp32 master weights.
KEEPS_MASTERS = ('FP16', 'O2', 'FP16cast')


@MODELS.register_module(force=True)
class WorkflowMLP(BaseModel):
    """fc1 -> BN -> ReLU -> fc2, plus two heads for the unused-parameter tests.

    ``late`` is used only at the iterations in ``late_iters`` (a branch the graph stops using);
    ``unused`` never. At the iterations in ``nan_loss_iters`` the loss is NaN. ``zero_kwargs``
    are passed to ``update_params`` (``set_to_none`` and apex's ``set_grads_to_None``).
    """

    def __init__(self, dtype: Optional[str] = None, late_iters=(), zero_kwargs=None,
                 init_cfg=None, nan_loss_iters=()) -> None:
        super().__init__(init_cfg=init_cfg)
        self.nan_loss_iters = tuple(nan_loss_iters)
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)
        self.late = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4)
        self.late_iters = tuple(late_iters)
        self.zero_kwargs = dict(zero_kwargs or {})
        if dtype is not None:
            cast_model(self, getattr(torch, dtype), keep_norm_fp32=True)

    def forward(self, inputs, labels=None, mode='tensor'):
        h = torch.relu(self.bn(self.fc1(inputs.to(self.fc1.weight.dtype))))
        out = self.fc2(h)
        if self.training and self._iter() in self.late_iters:
            out = out + self.late(h)
        if mode == 'loss':
            loss = F.cross_entropy(out.float(), labels)
            if self.training and self._iter() in self.nan_loss_iters:
                loss = loss * float('nan')  # a diverged batch: the loss itself is not finite
            return {'loss': loss}
        return out

    @staticmethod
    def _iter():
        from mmengine.logging import MessageHub
        return MessageHub.get_current_instance().get_info('iter')

    def train_step(self, data, optim_wrapper):
        with optim_wrapper.optim_context(self):
            data = self.data_preprocessor(data, True)
            losses = self._run_forward(data, mode='loss')
        parsed, log_vars = self.parse_losses(losses)
        optim_wrapper.update_params(parsed, zero_kwargs=self.zero_kwargs or None)
        return log_vars


@METRICS.register_module(force=True)
class WorkflowLossMetric(BaseMetric):
    """Accuracy of the predicted class against the dataset's labels."""

    def process(self, data_batch, data_samples) -> None:
        preds = torch.stack(list(data_samples)).float().argmax(1)
        self.results.append((preds == data_batch['labels']).float().mean().item())

    def compute_metrics(self, results) -> Dict[str, float]:
        return {'acc': sum(results) / len(results)}


@DATASETS.register_module(force=True)
class WorkflowData(torch.utils.data.Dataset):
    """Fixed random samples; 512 of them, so that no run reaches the end of an epoch (mmengine's
    infinite iterator sleeps 2 s at every epoch boundary)."""

    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :4].argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return dict(inputs=self.x[i], labels=self.y[i])


@HOOKS.register_module(force=True)
class RecordHook(Hook):
    """Records the model weights and the wrapper's masters after every training iteration."""

    priority = 'LOWEST'

    def __init__(self) -> None:
        self.weights: List[Dict[str, torch.Tensor]] = []
        self.masters: List[Dict[str, torch.Tensor]] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        model = runner.model
        self.weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        self.masters.append(masters_by_name(runner))


def masters_by_name(runner) -> Dict[str, torch.Tensor]:
    """name -> the wrapper's fp32 master (only params that have one; none for mmengine's)."""
    wrapper = runner.optim_wrapper
    if not hasattr(wrapper, 'full_precision_weights'):
        return {}
    full = wrapper.full_precision_weights()
    return {n: full[id(p)].detach().clone() for n, p in runner.model.named_parameters()
            if id(p) in full}


_RUNS = [0]


def make_runner(work_dir, wrapper='O2', dtype='bfloat16', optimizer=None, iters=6,
                model: Optional[dict] = None, ckpt_interval: Optional[int] = None,
                custom_hooks=(), accumulative_counts: int = 1, val: bool = False,
                extra_wrapper: Optional[dict] = None, launcher: Optional[str] = None,
                log_interval: int = 1,
                **runner_kwargs: Any) -> Runner:
    """A Runner over WorkflowMLP with ``wrapper`` in {'FP16', 'O1', 'O2', 'O3', 'fp32'}."""
    model_cfg = dict(type='mp_wrappers.WorkflowMLP')
    if wrapper == 'fp32':
        wrapper_cfg = dict(type='OptimWrapper')
    else:
        build, half_model = WRAPPERS[wrapper]
        wrapper_cfg = build(dtype)
        if half_model:
            model_cfg['dtype'] = dtype
    model_cfg.update(model or {})
    wrapper_cfg['optimizer'] = optimizer or dict(type='SGD', lr=0.2, momentum=0.9)
    wrapper_cfg['accumulative_counts'] = accumulative_counts
    wrapper_cfg.update(extra_wrapper or {})
    hooks = dict(logger=dict(type='LoggerHook', interval=log_interval),
                 checkpoint=dict(type='CheckpointHook', interval=ckpt_interval or 10 ** 6,
                                 by_epoch=False, save_last=ckpt_interval is not None,
                                 save_param_scheduler=False))
    _RUNS[0] += 1
    val_kwargs = {}
    if val:
        val_kwargs = dict(
            val_dataloader=dict(dataset=dict(type='mp_wrappers.WorkflowData', n=16), batch_size=16, num_workers=0,
                                sampler=dict(type='DefaultSampler', shuffle=False),
                                collate_fn=dict(type='default_collate')),
            val_cfg=dict(), val_evaluator=dict(type='mp_wrappers.WorkflowLossMetric'))
    return runner_from_cfg(dict(
        model=model_cfg, work_dir=str(work_dir), experiment_name=f'workflow_{_RUNS[0]}',
        train_dataloader=dict(dataset=dict(type='mp_wrappers.WorkflowData'), batch_size=16, num_workers=0,
                              sampler=dict(type='DefaultSampler', shuffle=True),
                              collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=iters, val_interval=runner_kwargs.pop(
            'val_interval', 10 ** 6)),
        optim_wrapper=wrapper_cfg, default_hooks=hooks, custom_hooks=list(custom_hooks),
        randomness=dict(seed=0), log_level='WARNING', **val_kwargs, **runner_kwargs),
        launcher=launcher)


# Note [two launchers]: users train a config either with our tools/train.py or with their
# toolbox's own train script, which is `Runner.from_cfg(cfg).train()` with none of our hooks. The
# workflow tests run under both (the `launcher` fixture in conftest.py) and assert the same results.
LAUNCHERS = ('tools_train', 'toolbox')
LAUNCHER = ['tools_train']  # what make_runner uses when not told; set by the `launcher` fixture
_TRAIN_TOOL = []


def _train_tool():
    if not _TRAIN_TOOL:
        spec = importlib.util.spec_from_file_location(
            'mp_wrappers_train_tool', os.path.join(REPO, 'tools', 'train.py'))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _TRAIN_TOOL.append(module)
    return _TRAIN_TOOL[0]


def runner_from_cfg(cfg: Dict[str, Any], launcher: Optional[str] = None) -> Runner:
    """A Runner for ``cfg`` as ``launcher`` builds it: ``'tools_train'`` applies what our
    tools/train.py adds to a config (MixedPrecisionHook, ...), ``'toolbox'`` nothing."""
    launcher = launcher or LAUNCHER[0]
    if launcher not in LAUNCHERS:
        raise ValueError(f'launcher={launcher!r}; expected one of {LAUNCHERS}')
    cfg = Config(cfg)
    if launcher == 'tools_train':
        cfg = _train_tool().configure(cfg, 'none')
    return Runner.from_cfg(cfg)


def train_recorded(work_dir, optimizer: dict, extra_wrapper: dict) -> Tuple[Runner, 'RecordHook']:
    """What users combine, trained and recorded: O2 bf16 for 8 iterations with gradient
    accumulation, EMAHook, mmengine's LinearLR and a head whose params get their first gradient at
    iteration 3; the runner after training and its RecordHook."""
    hook = RecordHook()
    runner = make_runner(
        work_dir, wrapper='O2', iters=8, accumulative_counts=2,
        model=dict(late_iters=(3, 4, 5, 6, 7)), optimizer=optimizer, extra_wrapper=extra_wrapper,
        custom_hooks=[dict(type='EMAHook', momentum=0.1)],
        param_scheduler=[dict(type='LinearLR', start_factor=0.5, by_epoch=False, begin=0,
                              end=8)])
    runner.register_hook(hook)
    train(runner)
    return runner, hook


def train(runner: Runner) -> Runner:
    threads = torch.get_num_threads()
    try:
        # Tensors this small are fastest on one thread; on a loaded machine, OpenMP threads
        # waiting for each other made each op 10-50x slower.
        torch.set_num_threads(1)
        runner.train()
    finally:
        torch.set_num_threads(threads)
    return runner


def losses(runner: Runner) -> List[float]:
    return [float(v) for v in runner.message_hub.get_scalar('train/loss').data[0]]


def load(path) -> dict:
    if not compat.has('safe_globals'):  # torch < 2.5: no allow-list; torch.load's old default
        return torch.load(path, map_location='cpu')
    return secure_torch_load(path, map_location='cpu')  # weights_only, mmengine's types allowed


def save_pretrained(path, seed: int = 7) -> Dict[str, torch.Tensor]:
    """An fp32 'pretrained' checkpoint (mmengine layout) whose weights are not bf16/fp16-exact."""
    torch.manual_seed(seed)
    model = WorkflowMLP()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in state.items():
        if v.is_floating_point():
            state[k] = v * 1.37 + 0.0123  # values with full fp32 mantissas
    torch.save({'state_dict': state, 'meta': {}}, path)
    return state


def latest_checkpoint(work_dir) -> str:
    with open(os.path.join(str(work_dir), 'last_checkpoint')) as f:
        return f.read().strip()
