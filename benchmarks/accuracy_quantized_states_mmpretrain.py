"""8-bit optimizer states on a real mmpretrain model: fp32 against int8 Adam moments (not a test).

mmpretrain's own ``tools/train.py`` trains its shipped ``configs/resnet/resnet18_8xb16_cifar10.py``
(``ResNet_CIFAR`` depth 18, 3x3 stem, no max-pool) with the one optimizer-wrapper line a user
changes: ``mp_wrappers.ApexOptimWrapper`` O2 bf16 with ``mp_wrappers.FusedAdam`` (or, with
``--optimizer sgd``, ``mp_wrappers.FusedSGD`` with momentum), once with
``state_dtype='float32'`` and once with ``state_dtype='int8'``, same seed, data order and schedule.

The data is real and offline: scikit-learn's 1797 handwritten digits (8x8, 17 grey levels), scaled
to 32x32 RGB PNGs in mmpretrain's ``CustomDataset`` folder layout, split 80/20 stratified with seed 0
(the split of ``projects/digits``: 1437 train, 360 val images). CIFAR-10 is not on this machine and
cannot be downloaded here. The network is ResNet-18 at ``--width`` base channels (64 is the shipped
full width, 11.2M params; the default 32 keeps a run within minutes on a shared 2-core CPU).

After training, the final checkpoint is evaluated once more outside the Runner for the val
cross-entropy (mmpretrain's ``Accuracy`` logs top-1 only): the model built from the same config,
the checkpoint's fp32 weights loaded and cast to bf16 as O2 trains it (norm layers fp32), logits
cast to fp32 for the loss. The optimizer state of the checkpoint gives the count of params with
8-bit moments and the state bytes (with ``--master-weights split|kahan|stochastic``, lean bf16
params without fp32 masters, those bytes include the lean storage's per-param optimizer state: the
low half of 'split', the compensation of 'kahan').

Run (one arm per call, or both; prints a Markdown table row per arm):
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/accuracy_quantized_states_mmpretrain.py \\
        --work-dir work_dirs/q8_resnet --states float32 int8 --epochs 10 --seed 0 \\
        [--master-weights kahan]
"""
import argparse
import glob
import importlib.util
import json
import os
import os.path as osp
import platform
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np
import torch

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))

CONFIG = """_base_ = ['{shipped}']
custom_imports = dict(imports=['mp_wrappers'], allow_failed_imports=False)
model = dict(backbone=dict(base_channels={width}, stem_channels={width}),
             head=dict(in_channels={head_in}))
train_pipeline = [dict(type='LoadImageFromFile'),
                  dict(type='RandomCrop', crop_size=32, padding=4), dict(type='PackInputs')]
test_pipeline = [dict(type='LoadImageFromFile'), dict(type='PackInputs')]
train_dataloader = dict(
    batch_size=32, num_workers=0, persistent_workers=False,
    dataset=dict(_delete_=True, type='CustomDataset', data_root='{data}', data_prefix='train',
                 pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=120, num_workers=0, persistent_workers=False,
    dataset=dict(_delete_=True, type='CustomDataset', data_root='{data}', data_prefix='val',
                 pipeline=test_pipeline))
test_dataloader = val_dataloader
optim_wrapper = dict(
    type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16',{masters}
    optimizer=dict(_delete_=True, {optimizer}, state_dtype='{states}'))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=True, begin=0, end=1,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=1, end={epochs}, eta_min=1e-5,
         convert_to_iter_based=True)]
train_cfg = dict(by_epoch=True, max_epochs={epochs}, val_interval={val_interval})
auto_scale_lr = dict(enable=False)
default_hooks = dict(logger=dict(interval=15),
                     checkpoint=dict(interval={epochs}, max_keep_ckpts=1))
env_cfg = dict(cudnn_benchmark=False)
randomness = dict(seed={seed}, deterministic=True)
"""


def mmpretrain_mim() -> str:
    spec = importlib.util.find_spec('mmpretrain')
    if spec is None or spec.origin is None:
        sys.exit('mmpretrain is not installed (bash tools/install_toolboxes.sh)')
    return osp.join(osp.dirname(spec.origin), '.mim')


def make_digits_folder(root: str) -> str:
    """``root/{train,val}/class_<k>/<i>.png``: the digits at 32x32 (bilinear), grey as RGB."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    if osp.isdir(osp.join(root, 'val')):
        return root
    digits = load_digits()
    labels = digits.target
    train_idx, val_idx = train_test_split(np.arange(len(labels)), test_size=0.2, random_state=0,
                                          stratify=labels)
    for split, idx in (('train', train_idx), ('val', val_idx)):
        for i in np.sort(idx):
            folder = osp.join(root, split, f'class_{labels[i]}')
            os.makedirs(folder, exist_ok=True)
            grey = (digits.images[i] * (255.0 / 16.0)).astype(np.uint8)
            image = Image.fromarray(grey).resize((32, 32), Image.BILINEAR).convert('RGB')
            image.save(osp.join(folder, f'{i}.png'))
    return root


# --optimizer: FusedAdam (AdamW), or FusedSGD as the shipped CIFAR schedule's SGD (momentum 0.9,
# weight decay 1e-4) at the lr of this script's batch size.
OPTIMIZERS = {'adam': "type='mp_wrappers.FusedAdam', lr=2e-3, weight_decay=0.05",
              'sgd': "type='mp_wrappers.FusedSGD', lr=0.05, momentum=0.9, weight_decay=1e-4"}
# The state key of each optimizer's 8-bit moment that counts its params.
MOMENT = {'adam': 'exp_avg', 'sgd': 'momentum_buffer'}


def write_config(work_dir: str, data: str, states: str, args) -> str:
    shipped = osp.join(mmpretrain_mim(), 'configs', 'resnet', 'resnet18_8xb16_cifar10.py')
    path = osp.join(work_dir, f'resnet18_digits_{states}.py')
    # fp32 masters are O2's default; a lean mode is the one line docs/user_guide.md section 10 adds
    masters = '' if args.master_weights == 'fp32' else f" master_weights='{args.master_weights}',"
    with open(path, 'w') as f:
        f.write(CONFIG.format(shipped=shipped, width=args.width, head_in=8 * args.width, data=data,
                              states=states, epochs=args.epochs, seed=args.seed,
                              val_interval=args.val_interval, masters=masters,
                              optimizer=OPTIMIZERS[args.optimizer]))
    return path


def train(config: str, work_dir: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get('OMP_NUM_THREADS', '1'),
               CUDA_VISIBLE_DEVICES='')
    env['PYTHONPATH'] = os.pathsep.join([REPO] + [p for p in env.get('PYTHONPATH', '').split(
        os.pathsep) if p])
    script = osp.join(mmpretrain_mim(), 'tools', 'train.py')
    start = time.time()
    subprocess.run([sys.executable, script, config, '--work-dir', work_dir], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return time.time() - start


def val_accuracies(work_dir: str) -> List[float]:
    files = sorted(glob.glob(osp.join(work_dir, '*', 'vis_data', 'scalars.json')))
    with open(files[-1]) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r['accuracy/top1'] for r in records if 'accuracy/top1' in r]


def evaluate(config: str, checkpoint: str, moment: str = 'exp_avg') -> Dict[str, float]:
    """Val cross-entropy and top-1 of the checkpoint, as O2 computes (bf16 model, fp32 norms)."""
    from mmengine.config import Config
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS

    from mp_wrappers.casting import cast_model
    from mp_wrappers.checkpoint import secure_torch_load
    from PIL import Image
    cfg = Config.fromfile(config)
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        # as the Runner builds it: the config's top-level data_preprocessor goes into the model
        model = MODELS.build(dict(cfg.model, data_preprocessor=cfg.data_preprocessor))
    ckpt = secure_torch_load(checkpoint, map_location='cpu')
    model.load_state_dict(ckpt['state_dict'])
    model.eval()
    data = cfg.val_dataloader.dataset.data_root
    files = sorted(glob.glob(osp.join(data, 'val', 'class_*', '*.png')))
    images = [torch.from_numpy(np.array(Image.open(f).convert('RGB'))).permute(2, 0, 1)
              for f in files]
    labels = torch.tensor([int(osp.basename(osp.dirname(f)).split('_')[1]) for f in files])
    with torch.no_grad():
        # mmpretrain's own normalization, in fp32 before the cast (as the O2 Runner feeds it)
        inputs = model.data_preprocessor(dict(inputs=images), False)['inputs']
        cast_model(model, torch.bfloat16)
        logits = model(inputs.to(torch.bfloat16), mode='tensor').float()
    ce = torch.nn.functional.cross_entropy(logits, labels).item()
    top1 = (logits.argmax(1) == labels).float().mean().item() * 100
    return dict(val_ce=ce, top1=top1, **state_counts(ckpt, moment))


def state_counts(ckpt: dict, moment: str = 'exp_avg') -> Dict[str, float]:
    """Params with 8-bit moments (state key ``moment``) and the optimizer-state bytes of the
    checkpoint."""
    state = ckpt['optimizer']['state']
    int8 = sum(s[moment].numel() for s in state.values() if s[moment].dtype == torch.uint8)
    total = sum(s[moment].numel() for s in state.values())
    nbytes = sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
                 if torch.is_tensor(v))
    return dict(params=total, int8_params=int8, state_bytes=nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--work-dir', default='work_dirs/q8_resnet')
    parser.add_argument('--states', nargs='+', default=['float32', 'int8'],
                        choices=['float32', 'int8'])
    parser.add_argument('--epochs', type=int, default=10)
    parser.add_argument('--val-interval', type=int, default=5)
    parser.add_argument('--width', type=int, default=32)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--optimizer', choices=sorted(OPTIMIZERS), default='adam',
                        help='FusedAdam (AdamW) or FusedSGD (momentum 0.9): the moments quantized')
    parser.add_argument('--master-weights', default='fp32',
                        choices=['fp32', 'split', 'kahan', 'stochastic'],
                        help="O2's fp32 masters, or a lean bf16 storage (no fp32 master)")
    args = parser.parse_args()
    root = osp.abspath(args.work_dir)
    os.makedirs(root, exist_ok=True)
    data = make_digits_folder(osp.join(root, 'data'))
    print(f'# {platform.processor() or platform.machine()}, torch {torch.__version__}, '
          f'OMP_NUM_THREADS={os.environ.get("OMP_NUM_THREADS", "1")}, seed {args.seed}, '
          f'width {args.width}, {args.epochs} epochs, masters {args.master_weights}, '
          f'optimizer {args.optimizer}')
    print('| states | seed | val top-1 per val (log) | top-1 | val CE | int8 params / params '
          '| state bytes (B/param) | wall s |')
    print('|---|---|---|---|---|---|---|---|')
    for states in args.states:
        masters = '' if args.master_weights == 'fp32' else f'{args.master_weights}_'
        opt = '' if args.optimizer == 'adam' else f'{args.optimizer}_'
        work_dir = osp.join(root, f'{opt}{masters}{states}_seed{args.seed}')
        os.makedirs(work_dir, exist_ok=True)
        config = write_config(work_dir, data, states, args)
        seconds = train(config, work_dir)
        result = evaluate(config, osp.join(work_dir, f'epoch_{args.epochs}.pth'),
                          MOMENT[args.optimizer])
        logged = ' / '.join(f'{a:.2f}' for a in val_accuracies(work_dir))
        print(f'| {states} | {args.seed} | {logged} | {result["top1"]:.2f} | '
              f'{result["val_ce"]:.4f} | {result["int8_params"]:,} / {result["params"]:,} | '
              f'{result["state_bytes"]:,} ({result["state_bytes"] / result["params"]:.2f}) | '
              f'{seconds:.0f} |', flush=True)


if __name__ == '__main__':
    main()
