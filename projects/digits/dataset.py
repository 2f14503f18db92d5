"""scikit-learn's bundled 8x8 handwritten digits as an mmengine-ready dataset (no download)."""
from typing import Dict, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from mp_wrappers.registry import DATASETS

__all__ = ['DigitsDataset']

_SPLITS = ('train', 'val')
# load_digits stores pixel intensities as integers 0..16.
_MAX_PIXEL = 16.0


@DATASETS.register_module()
class DigitsDataset(Dataset):
    """The 1797 8x8 digit images of ``sklearn.datasets.load_digits``, split train/val.

    The split is stratified by label and fixed by ``split_seed``, so ``train`` and ``val`` are disjoint,
    cover every sample once and are identical from run to run and rank to rank. Images are scaled to
    [0, 1] and then normalised with the mean and standard deviation of the *training* split's pixels
    (the same constants for both splits, as a real pipeline would do).

    Each item is ``{'inputs': float32 tensor [1, 8, 8], 'labels': int64 scalar tensor}``, which both
    mmengine's ``default_collate`` (batched tensors) and ``pseudo_collate`` (lists) can batch.

    Args:
        split: ``'train'`` or ``'val'``.
        val_fraction: Fraction of the samples held out for ``val``, in (0, 1). Defaults to 0.2.
        split_seed: Seed of the stratified split. Defaults to 0.

    Examples:
        >>> train_dataloader = dict(
        ...     batch_size=32,
        ...     dataset=dict(type='mp_wrappers.DigitsDataset', split='train'),
        ...     sampler=dict(type='DefaultSampler', shuffle=True),
        ...     collate_fn=dict(type='default_collate'))
    """

    METAINFO: Dict[str, Tuple[str, ...]] = {'classes': tuple(str(i) for i in range(10))}

    def __init__(self, split: str = 'train', val_fraction: float = 0.2, split_seed: int = 0) -> None:
        if split not in _SPLITS:
            raise ValueError(f'DigitsDataset: split={split!r} is not supported; '
                             f'allowed: {", ".join(repr(s) for s in _SPLITS)}')
        if not 0.0 < float(val_fraction) < 1.0:
            raise ValueError(f'DigitsDataset: val_fraction={val_fraction!r} must be in (0, 1)')
        # Imported here so that a config's custom_imports of this project does not pay for
        # scikit-learn until a dataset is built.
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        images = digits.images.astype(np.float32) / _MAX_PIXEL  # [N, 8, 8] in [0, 1]
        labels = digits.target.astype(np.int64)
        train_idx, val_idx = train_test_split(
            np.arange(len(labels)), test_size=float(val_fraction), random_state=int(split_seed),
            stratify=labels)
        mean = float(images[train_idx].mean())
        std = float(images[train_idx].std())
        idx = np.sort(train_idx if split == 'train' else val_idx)

        self.split = split
        self.indices = idx
        self.mean, self.std = mean, std
        self.images = torch.from_numpy((images[idx] - mean) / std).unsqueeze(1).contiguous()
        self.labels = torch.from_numpy(labels[idx])

    @property
    def metainfo(self) -> Dict[str, Tuple[str, ...]]:
        """Class names; mmengine stores this in checkpoints, so it holds only plain Python types."""
        return dict(self.METAINFO)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {'inputs': self.images[index], 'labels': self.labels[index]}

    def __repr__(self) -> str:
        return f'{type(self).__name__}(split={self.split!r}, num_samples={len(self)})'
