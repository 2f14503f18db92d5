"""Demo workload: a byte-level transformer language model on Python's standard-library source.

Not part of the ``mp_wrappers`` package: the configs under ``configs/charlm/`` (and the tests)
import it with ``custom_imports=dict(imports=['mp_wrappers', 'projects.charlm'],
allow_failed_imports=False)``, which needs the repository root on ``sys.path`` (``tools/train.py`` puts
it there; see ``projects/README.md``). Importing it registers :class:`CharLMDataset`,
:class:`CharTransformerLM` and :class:`CharLMMetric` under the ``mp_wrappers`` scope:
``type='mp_wrappers.CharTransformerLM'``.
"""
from .charlm import (DEFAULT_MODULES, CharLMDataset, CharLMMetric, CharTransformerLM,
                     stdlib_corpus)

__all__ = ['CharLMDataset', 'CharTransformerLM', 'CharLMMetric', 'DEFAULT_MODULES', 'stdlib_corpus']
