"""Small real workloads for end-to-end checks: sklearn's 8x8 digits, a BatchNorm CNN, accuracy.

Importing this package registers :class:`DigitsDataset` in ``mp_wrappers.registry.DATASETS``,
:class:`DigitsCNN` in ``MODELS`` and :class:`DigitsAccuracy` in ``METRICS``; the registries name this
package in their ``locations``, so ``type='mp_wrappers.DigitsCNN'`` in a config imports it on demand.
"""
from .digits import DigitsDataset
from .metrics import DigitsAccuracy
from .models import DigitsCNN

__all__ = ['DigitsDataset', 'DigitsCNN', 'DigitsAccuracy']
