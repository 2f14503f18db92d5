"""mmengine registry nodes of the ``mp_wrappers`` scope.

Children of mmengine's root registries, so configs can say ``type='mp_wrappers.FP16OptimWrapper'``
from any ``default_scope`` (mmengine imports ``mp_wrappers.registry`` by itself when it meets the
prefix) and ``type='FP16OptimWrapper'`` inside ``default_scope='mp_wrappers'``. Registering in a child
node also keeps our names from shadowing mmengine's own (mmengine has an ``ApexOptimWrapper`` too).
"""
from mmengine.registry import DATASETS as MMENGINE_DATASETS
from mmengine.registry import HOOKS as MMENGINE_HOOKS
from mmengine.registry import LOOPS as MMENGINE_LOOPS
from mmengine.registry import METRICS as MMENGINE_METRICS
from mmengine.registry import MODEL_WRAPPERS as MMENGINE_MODEL_WRAPPERS
from mmengine.registry import MODELS as MMENGINE_MODELS
from mmengine.registry import OPTIM_WRAPPERS as MMENGINE_OPTIM_WRAPPERS
from mmengine.registry import OPTIMIZERS as MMENGINE_OPTIMIZERS
from mmengine.registry import RUNNERS as MMENGINE_RUNNERS
from mmengine.registry import STRATEGIES as MMENGINE_STRATEGIES
from mmengine.registry import Registry

__all__ = ['OPTIM_WRAPPERS', 'OPTIMIZERS', 'DATASETS', 'MODELS', 'METRICS', 'HOOKS',
           'MODEL_WRAPPERS', 'LOOPS', 'STRATEGIES', 'RUNNERS']

_SCOPE = 'mp_wrappers'
# `locations` makes a registry lookup import the modules that register into it, so a config that only
# names `mp_wrappers.X` works even without custom_imports.
OPTIM_WRAPPERS = Registry('optim_wrapper', parent=MMENGINE_OPTIM_WRAPPERS, scope=_SCOPE,
                          locations=['mp_wrappers.wrappers'])
OPTIMIZERS = Registry('optimizer', parent=MMENGINE_OPTIMIZERS, scope=_SCOPE,
                      locations=['mp_wrappers.optim'])
# The library registers no dataset, model or metric of its own: these nodes are where the demo
# workloads (projects/digits, projects/charlm: not shipped in the wheel) register, under this scope, when
# a config imports them with custom_imports; so they name no location to import.
DATASETS = Registry('dataset', parent=MMENGINE_DATASETS, scope=_SCOPE)
MODELS = Registry('model', parent=MMENGINE_MODELS, scope=_SCOPE)
METRICS = Registry('metric', parent=MMENGINE_METRICS, scope=_SCOPE)
HOOKS = Registry('hook', parent=MMENGINE_HOOKS, scope=_SCOPE,
                 locations=['mp_wrappers.hooks', 'mp_wrappers.lifecycle'])
MODEL_WRAPPERS = Registry('model_wrapper', parent=MMENGINE_MODEL_WRAPPERS, scope=_SCOPE,
                          locations=['mp_wrappers.distributed'])
LOOPS = Registry('loop', parent=MMENGINE_LOOPS, scope=_SCOPE, locations=['mp_wrappers.loops'])
STRATEGIES = Registry('strategy', parent=MMENGINE_STRATEGIES, scope=_SCOPE,
                      locations=['mp_wrappers.distributed'])
RUNNERS = Registry('runner', parent=MMENGINE_RUNNERS, scope=_SCOPE,
                   locations=['mp_wrappers.distributed'])
