"""Small real workloads for end-to-end checks (no downloads).

sklearn's 8x8 digits with a BatchNorm CNN and accuracy; a byte-level transformer language model on
Python's standard-library source (:mod:`.charlm`).

Importing this package registers :class:`DigitsDataset` in ``mp_wrappers.registry.DATASETS``,
:class:`DigitsCNN` in ``MODELS`` and :class:`DigitsAccuracy` in ``METRICS``, and the CharLM classes
likewise; the registries name this
package in their ``locations``, so ``type='mp_wrappers.DigitsCNN'`` in a config imports it on demand.
"""
from .charlm import CharLMDataset, CharLMMetric, CharTransformerLM
from .digits import DigitsDataset
from .metrics import DigitsAccuracy
from .models import DigitsCNN

__all__ = ['DigitsDataset', 'DigitsCNN', 'DigitsAccuracy', 'CharLMDataset', 'CharTransformerLM',
           'CharLMMetric']
