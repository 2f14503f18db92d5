"""Top-1 accuracy for :class:`~projects.digits.DigitsCNN` predictions."""
from typing import Any, Dict, List, Optional, Sequence

import torch
from mmengine.evaluator import BaseMetric

from mp_wrappers.registry import METRICS

__all__ = ['DigitsAccuracy']


@METRICS.register_module()
class DigitsAccuracy(BaseMetric):
    """Top-1 accuracy in percent, reported as ``accuracy``.

    Reads ``pred_label`` from each prediction of ``DigitsCNN(mode='predict')`` and the ground truth
    from the prediction's ``gt_label`` or, when absent, from ``data_batch['labels']``.

    Args:
        collect_device: ``'cpu'`` or ``'gpu'``, where results are gathered across ranks.
        prefix: Optional prefix of the metric name (mmengine convention).

    Examples:
        >>> val_evaluator = dict(type='mp_wrappers.DigitsAccuracy')
    """

    # '' (not None): the metric is logged as plain ``accuracy`` and mmengine does not warn that no
    # prefix is set; pass ``prefix='digits'`` to get ``digits/accuracy``.
    default_prefix: Optional[str] = ''

    def __init__(self, collect_device: str = 'cpu', prefix: Optional[str] = None) -> None:
        super().__init__(collect_device=collect_device, prefix=prefix)

    def process(self, data_batch: Any, data_samples: Sequence[dict]) -> None:
        """Store ``(prediction, label)`` pairs of one batch as plain ints."""
        batch_labels = None
        if isinstance(data_batch, dict) and data_batch.get('labels') is not None:
            batch_labels = data_batch['labels']
        for i, sample in enumerate(data_samples):
            if 'gt_label' in sample:
                gt = sample['gt_label']
            elif batch_labels is not None:
                gt = batch_labels[i]
            else:
                raise KeyError('DigitsAccuracy: a prediction has no "gt_label" and data_batch has no '
                               '"labels"; cannot score it')
            self.results.append((int(torch.as_tensor(sample['pred_label'])), int(torch.as_tensor(gt))))

    def compute_metrics(self, results: List[tuple]) -> Dict[str, float]:
        """Accuracy over all gathered samples, in percent."""
        if not results:
            raise ValueError('DigitsAccuracy: no results to evaluate (empty validation set?)')
        correct = sum(pred == gt for pred, gt in results)
        return {'accuracy': 100.0 * correct / len(results)}
