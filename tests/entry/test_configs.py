"""Every shipped config loads, and its model and optimizer wrapper build (no training)."""
import glob
import os
import warnings

import pytest
from mmengine.config import Config
from mmengine.optim import build_optim_wrapper
from mmengine.registry import MODELS, DefaultScope

import mp_wrappers  # noqa: F401  (registers the mp_wrappers scope)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, 'configs', '*', '*.py')))


def test_configs_are_found():
    assert len(CONFIGS) >= 20


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: os.path.relpath(p, ROOT))
def test_config_builds(path):
    cfg = Config.fromfile(path)
    # The library, then the demo project of the config's folder (projects/<folder>, outside the package).
    folder = os.path.basename(os.path.dirname(path))
    assert cfg.custom_imports['imports'] == ['mp_wrappers', f'projects.{folder}']
    with DefaultScope.overwrite_default_scope(cfg.default_scope), warnings.catch_warnings():
        warnings.simplefilter('ignore')  # fp16-on-CPU advice
        model = MODELS.build(cfg.model)
        wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    assert wrapper.param_groups and wrapper.get_lr()['lr'][0] > 0
