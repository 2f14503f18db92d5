"""Demo workload: scikit-learn's 8x8 digits (no download), a BatchNorm CNN and top-1 accuracy.

Not part of the ``mp_wrappers`` package: the configs under ``configs/digits/`` (and the tests and
benchmarks) import it with ``custom_imports=dict(imports=['mp_wrappers', 'projects.digits'],
allow_failed_imports=False)``, which needs the repository root on ``sys.path`` (``tools/train.py`` puts
it there; see ``projects/README.md``). Importing it registers :class:`DigitsDataset` in
``mp_wrappers.registry.DATASETS``, :class:`DigitsCNN` in ``MODELS`` and :class:`DigitsAccuracy` in
``METRICS``, under the ``mp_wrappers`` scope: ``type='mp_wrappers.DigitsCNN'``.
"""
from .dataset import DigitsDataset
from .metric import DigitsAccuracy
from .model import DigitsCNN

__all__ = ['DigitsDataset', 'DigitsCNN', 'DigitsAccuracy']
