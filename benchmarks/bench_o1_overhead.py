"""O1 overhead: ``ApexOptimWrapper(opt_level='O1')`` against mmengine's ``AmpOptimWrapper``, same policy.

Both wrappers run the forward under ``torch.autocast`` with the same dtype, so any time difference is
the wrapper's own cost (loss scaling, the non-finite check, bookkeeping). The workload is a
ResNet-18-shaped mmengine ``BaseModel`` (BasicBlocks [2, 2, 2, 2], 64-512 channels, BatchNorm,
11.2M parameters with mmpretrain's CIFAR stem; mmpretrain and torchvision are not needed) trained by ``model.train_step(data,
optim_wrapper)``, which is exactly what mmengine's ``IterBasedTrainLoop`` calls each iteration.

Peers, all in this one process, over the same model and data, stepped in turn each round so that
load from other processes hits all alike:

* ``amp``: mmengine's ``AmpOptimWrapper(dtype=...)``. It refuses to construct without a GPU
  (``assert is_cuda_available() ...``); :class:`CpuAmpOptimWrapper` lifts only that assertion for the
  duration of ``__init__``. Everything else is mmengine's code: its ``torch.cuda.amp.GradScaler``
  disables itself without CUDA, so on CPU it is autocast plus a plain ``optimizer.step()``, no
  non-finite check.
* ``autocast``: mmengine's plain ``OptimWrapper`` with the forward under ``torch.autocast`` (the
  floor: no wrapper logic at all).
* ``ours``: ``mp_wrappers.ApexOptimWrapper(opt_level='O1', dtype=...)``. At bf16's static scale of
  1.0 it checks the loss for inf/nan (skipping such steps) and reads the gradients only for the
  ``amp_gnorm`` it publishes every ``log_interval`` (10) iterations (Note [unit-scale check]).
* ``ours-always``: the same with ``grad_check='always'``: one read pass over every gradient per
  step (inf/nan check fused with the norm), what ``ours`` did before.

Each round sets the MessageHub's ``iter`` as mmengine's training loop does (publications follow it).

Prints the median and fastest seconds per iteration of each, and ours / best peer.

Run: ``python benchmarks/bench_o1_overhead.py [--iters 30] [--batch 16] [--size 32] [--threads 2]``
(``--stem cifar|imagenet``, ``--optimizer sgd|adamw``, ``--dtype bfloat16|float16``; keep bf16 on CPUs
without AVX512-FP16). The default clock is this process's CPU time, which other processes on a shared
machine disturb far less than elapsed time (``--clock wall`` for elapsed time).
"""
import argparse
import contextlib
import pathlib
import platform
import statistics
import sys
import time
from typing import Dict, List
from unittest import mock

import torch
from mmengine.logging import MessageHub
from mmengine.model import BaseModel
from mmengine.optim import AmpOptimWrapper, OptimWrapper
from mmengine.optim.optimizer import amp_optimizer_wrapper
from torch import nn

# Run from a checkout without installing: the package sits next to this folder.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import mp_wrappers  # noqa: E402


class CpuAmpOptimWrapper(AmpOptimWrapper):
    """mmengine's ``AmpOptimWrapper`` with only its accelerator assertion lifted (benchmark use).

    ``AmpOptimWrapper.__init__`` asserts a GPU/NPU/MLU/MUSA is available; nothing else in it or its
    methods depends on one (its GradScaler disables itself, ``optim_context`` enters mmengine's
    ``autocast``, which supports CPU with bf16).
    """

    def __init__(self, **kwargs) -> None:
        with mock.patch.object(amp_optimizer_wrapper, 'is_cuda_available', lambda: True):
            super().__init__(**kwargs)


class AutocastOptimWrapper(OptimWrapper):
    """mmengine's plain ``OptimWrapper`` whose forward runs under ``torch.autocast`` (the floor)."""

    def __init__(self, dtype: torch.dtype, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cast_dtype = dtype

    @contextlib.contextmanager
    def optim_context(self, model: nn.Module):
        with super().optim_context(model), torch.autocast('cpu', dtype=self.cast_dtype):
            yield


class BasicBlock(nn.Module):
    """ResNet's BasicBlock: two 3x3 convolutions with BatchNorm and a projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18Like(BaseModel):
    """A ResNet-18-shaped classifier as an mmengine model (``forward(inputs, labels, mode)``).

    ``stem='cifar'`` is mmpretrain's ``ResNet_CIFAR`` stem (3x3 convolution, no max-pool, for 32x32
    images, as in ``resnet18_8xb16_cifar10.py``); ``'imagenet'`` the 7x7/2 convolution and max-pool.
    """

    def __init__(self, num_classes: int = 10, stem: str = 'cifar') -> None:
        super().__init__()
        if stem == 'cifar':
            layers = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                      nn.ReLU(inplace=True)]
        else:
            layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                      nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.backbone = nn.Sequential(*layers)
        self.head = nn.Linear(512, num_classes)

    def forward(self, inputs, labels=None, mode='tensor'):
        logits = self.head(self.backbone(inputs))
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits.float(), labels))
        return logits


def build(kind: str, model: nn.Module, args) -> OptimWrapper:
    dtype = getattr(torch, args.dtype)
    params = model.parameters()
    if args.optimizer == 'sgd':
        optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=1e-4)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05)
    if kind == 'amp':
        return CpuAmpOptimWrapper(optimizer=optimizer, dtype=dtype)
    if kind == 'autocast':
        return AutocastOptimWrapper(dtype, optimizer=optimizer)
    extra = dict(grad_check='always') if kind == 'ours-always' else {}
    return mp_wrappers.ApexOptimWrapper(optimizer=optimizer, opt_level='O1', dtype=args.dtype,
                                        verbosity=0, **extra)


def main(argv=None) -> Dict[str, List[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--iters', type=int, default=30, help='timed rounds (one step per peer)')
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--batch', type=int, default=16)
    parser.add_argument('--size', type=int, default=32, help='input height and width')
    parser.add_argument('--stem', default='cifar', choices=('cifar', 'imagenet'))
    parser.add_argument('--clock', default='process', choices=('process', 'wall'),
                        help="'process': CPU time of this process (robust on a shared machine); "
                        "'wall': elapsed time")
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--dtype', default='bfloat16', choices=('bfloat16', 'float16'))
    parser.add_argument('--optimizer', default='sgd', choices=('sgd', 'adamw'))
    parser.add_argument('--peers', nargs='+', default=['amp', 'autocast', 'ours', 'ours-always'],
                        choices=('amp', 'autocast', 'ours', 'ours-always'))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = dict(inputs=torch.randn(args.batch, 3, args.size, args.size),
                labels=torch.randint(0, 10, (args.batch,)))
    base = ResNet18Like(stem=args.stem)
    models, wrappers = {}, {}
    for kind in args.peers:
        models[kind] = ResNet18Like(stem=args.stem)
        models[kind].load_state_dict(base.state_dict())
        wrappers[kind] = build(kind, models[kind], args)
    clock = time.process_time if args.clock == 'process' else time.perf_counter
    times: Dict[str, List[float]] = {k: [] for k in args.peers}
    hub = MessageHub.get_current_instance()
    for r in range(args.warmup + args.iters):
        hub.update_info('iter', r)  # as mmengine's loops do before each iteration
        for kind in args.peers:
            t0 = clock()
            models[kind].train_step(data, wrappers[kind])
            dt = clock() - t0
            if r >= args.warmup:
                times[kind].append(dt)
    n_params = sum(p.numel() for p in base.parameters())
    print(f'# O1 overhead, ResNet-18-shaped model ({args.stem} stem, {n_params / 1e6:.1f}M params), '
          f'batch {args.batch} x 3 x {args.size}^2, {args.dtype} autocast, {args.optimizer}, '
          f'{args.threads} threads, {args.iters} rounds, {args.clock} time')
    print(f'# torch {torch.__version__}, {platform.processor() or platform.machine()}, '
          f'mp_wrappers backend {mp_wrappers.ops.backend()["cpu"]}')
    print('| peer | median s/iter | fastest s/iter |')
    print('|---|---|---|')
    for kind in args.peers:
        print(f'| {kind} | {statistics.median(times[kind]):.4f} | {min(times[kind]):.4f} |')
    peers = [k for k in times if not k.startswith('ours')]
    if peers:
        best_med = min(statistics.median(times[k]) for k in peers)
        best_min = min(min(times[k]) for k in peers)
        print()
        for ours in (k for k in times if k.startswith('ours')):
            print(f'{ours} / best peer: median {statistics.median(times[ours]) / best_med:.3f}, '
                  f'fastest {min(times[ours]) / best_min:.3f}')
    return times


if __name__ == '__main__':
    main()
