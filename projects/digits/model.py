"""A small BatchNorm CNN for the 8x8 digits, optionally cast to half precision at construction."""
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from torch import nn

from mp_wrappers.casting import cast_floating, cast_model, parse_dtype
from mp_wrappers.hardware import auto_dtype
from mp_wrappers.registry import MODELS

__all__ = ['DigitsCNN']

_MODES = ('tensor', 'loss', 'predict')
Inputs = Union[torch.Tensor, Sequence[torch.Tensor]]


@MODELS.register_module()
class DigitsCNN(BaseModel):
    """conv(32) -> BN -> ReLU -> conv(64) -> BN -> ReLU -> max-pool -> linear, for [N, 1, 8, 8] inputs.

    With ``dtype`` set, the model is cast in its constructor (BatchNorm parameters and statistics stay
    fp32, see :func:`mp_wrappers.casting.cast_model`), that is *before* mmengine wraps it in
    DistributedDataParallel: casting after DDP wrapping silently stops gradient all-reduce. Floating
    inputs are cast to ``dtype`` in :meth:`forward`, and the loss is computed in fp32 from fp32 logits.

    Args:
        num_classes: Number of output classes. Defaults to 10.
        width: Channels of the first conv; the second has ``2 * width``. Defaults to 32.
        dtype: ``None`` (fp32), ``'float16'`` or ``'bfloat16'`` (aliases such as ``'bf16'`` work),
            or ``'auto'``: the format the training device (CUDA if available, else the CPU) computes
            natively, fp32 where it has none (:func:`mp_wrappers.hardware.auto_dtype`); pair it with
            ``FP16OptimWrapper(dtype='auto')``.
        data_preprocessor: mmengine data preprocessor config; defaults to ``BaseDataPreprocessor``.
        init_cfg: mmengine weight-initialisation config.

    Examples:
        >>> model = dict(type='mp_wrappers.DigitsCNN', dtype='bfloat16')
    """

    def __init__(self, num_classes: int = 10, width: int = 32,
                 dtype: Union[str, torch.dtype, None] = None,
                 data_preprocessor: Optional[dict] = None,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(data_preprocessor=data_preprocessor, init_cfg=init_cfg)
        if isinstance(dtype, str) and dtype == 'auto':
            resolved = auto_dtype().dtype
            dtype = None if resolved == torch.float32 else resolved
        self.dtype = parse_dtype(dtype, option='DigitsCNN(dtype)')
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.head = nn.Linear(2 * width * 4 * 4, num_classes)
        if self.dtype is not None:
            cast_model(self, self.dtype, keep_norm_fp32=True)

    def forward(self, inputs: Inputs, labels: Optional[Union[torch.Tensor, Sequence[torch.Tensor]]] = None,
                mode: str = 'tensor') -> Union[torch.Tensor, Dict[str, torch.Tensor], List[dict]]:
        """Run the network.

        Args:
            inputs: A batch ``[N, 1, 8, 8]`` (``default_collate``) or a list of ``[1, 8, 8]`` images
                (``pseudo_collate``).
            labels: ``[N]`` int64 class indices (or a list of scalars); needed for ``mode='loss'``.
            mode: ``'tensor'`` returns logits in the model dtype; ``'loss'`` returns ``{'loss': ce}``
                (fp32); ``'predict'`` returns one dict per sample with ``pred_label``, ``scores``
                (fp32 softmax) and, when labels are given, ``gt_label``.
        """
        if mode not in _MODES:
            raise ValueError(f'DigitsCNN.forward: mode={mode!r} is not supported; '
                             f'allowed: {", ".join(repr(m) for m in _MODES)}')
        x = torch.stack(list(inputs)) if not isinstance(inputs, torch.Tensor) else inputs
        if self.dtype is not None:
            x = cast_floating(x, self.dtype)
        logits = self.head(torch.flatten(self.features(x), 1))
        if mode == 'tensor':
            return logits
        if labels is not None and not isinstance(labels, torch.Tensor):
            labels = torch.stack([torch.as_tensor(label) for label in labels])
        if labels is not None:
            labels = labels.to(device=logits.device, dtype=torch.long).reshape(-1)
        if mode == 'loss':
            if labels is None:
                raise ValueError("DigitsCNN.forward: mode='loss' needs labels")
            # Softmax and log in fp32: half-precision cross-entropy loses the small probabilities.
            return {'loss': F.cross_entropy(logits.float(), labels)}
        scores = logits.detach().float().softmax(dim=1)
        preds = scores.argmax(dim=1)
        results = []
        for i in range(len(preds)):
            sample = {'pred_label': preds[i], 'scores': scores[i]}
            if labels is not None:
                sample['gt_label'] = labels[i]
            results.append(sample)
        return results
