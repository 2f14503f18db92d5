"""A test-only multi-optimizer constructor (as mmagic's configs use one), imported by configs through
``custom_imports`` with ``tests/`` on ``PYTHONPATH``.

``optim_wrapper=dict(constructor='RelTestTwoOptimizersConstructor', first=dict(...), rest=dict(...))``
builds an ``OptimWrapperDict`` of two wrappers: ``first`` steps the model's first parameter, ``rest``
every other one (by position, so FSDP's renamed parameters split the same way).
"""
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapperDict
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS, OPTIM_WRAPPERS, OPTIMIZERS


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class RelTestTwoOptimizersConstructor:
    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg=None) -> None:
        # mmengine's FSDPStrategy adds type='OptimWrapper' to every optim_wrapper config
        cfgs = {k: v for k, v in optim_wrapper_cfg.items() if k != 'type'}
        if set(cfgs) != {'first', 'rest'}:
            raise ValueError(f'optim_wrapper: expected the keys first and rest, got {sorted(cfgs)}')
        self.cfgs = cfgs

    def __call__(self, model) -> OptimWrapperDict:
        module = model.module if is_model_wrapper(model) else model
        params = [p for p in module.parameters() if p.requires_grad]
        wrappers = {}
        for name, group in (('first', params[:1]), ('rest', params[1:])):
            cfg = dict(self.cfgs[name])
            optimizer = OPTIMIZERS.build(dict(cfg.pop('optimizer'), params=group))
            wrappers[name] = OPTIM_WRAPPERS.build(dict(cfg, optimizer=optimizer))
        return OptimWrapperDict(**wrappers)
