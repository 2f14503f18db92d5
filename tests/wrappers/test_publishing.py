"""What the wrappers tell users: published scalars, overflow reports, the scale-collapse policy."""
import logging
import uuid

import pytest
import torch
import torch.nn.functional as F
from mmengine.logging import MessageHub, MMLogger
from torch import nn

from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper, cast_model


def _setup(**kw):
    torch.manual_seed(0)
    model = cast_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.float16)
    kw.setdefault('dynamic_loss_scale', True)
    wrapper = FP16OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    return model, wrapper


def _step(model, wrapper, poison=False, poison_loss=False):
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    with wrapper.optim_context(model):
        loss = F.cross_entropy(model(x.half()).float(), y)
    if poison_loss:
        loss = loss * float('nan')
    wrapper.backward(loss, update_master_grads=False)
    if poison:
        model[2].weight.grad[0, 0] = float('inf')
    wrapper.step()
    wrapper.zero_grad()


@pytest.fixture
def hub():
    return MessageHub.get_instance(f'diag-{uuid.uuid4()}')


@pytest.fixture
def log_lines():
    # MMLogger's handlers hold the stream they were created with, so capture at the logger.
    lines = []

    class _Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = MMLogger.get_current_instance()
    handler = _Keep()
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def test_scalars_show_current_values(hub):
    model, w = _setup(dynamic_loss_args=dict(scale_window=100))
    w.message_hub = hub
    _step(model, w)
    _step(model, w, poison=True)
    assert hub.get_scalar('train/amp_scale').current() == 2.0**15
    assert hub.get_scalar('train/amp_skipped').current() == 1
    assert hub.get_scalar('train/amp_skipped_recent').current() == 1
    _step(model, w)
    assert hub.get_scalar('train/amp_skipped_recent').current() == 0
    assert hub.get_scalar('train/amp_gnorm').current() > 0


def test_scalars_published_at_log_interval_under_a_runner(hub):
    model, w = _setup(log_interval=3)
    w.message_hub = hub
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    published = []
    for it in range(6):
        hub.update_info('iter', it)
        with w.optim_context(model):
            loss = F.cross_entropy(model(x.half()).float(), y)
        w.update_params(loss)
        published.append('train/amp_scale' in hub.log_scalars and
                         len(hub.get_scalar('train/amp_scale').data[0]))
    assert published == [False, False, 1, 1, 1, 2]


def test_overflow_report_names_parameters_and_the_loss(hub, log_lines):
    model, w = _setup(overflow_report=True)
    w.message_hub = hub
    _step(model, w, poison=True)
    assert any("['2.weight']" in m and 'the loss itself was finite' in m for m in log_lines)
    _step(model, w, poison_loss=True)
    assert 'the loss itself was non-finite' in log_lines[-2]


def test_collapse_warns_with_iteration_scale_and_names(hub):
    model, w = _setup(dynamic_loss_args=dict(init_scale=4.0, min_loss_scale=1.0),
                      collapse_patience=3)
    w.message_hub = hub
    hub.update_info('iter', 41)
    with pytest.warns(RuntimeWarning, match=r'collapsed at iteration 41: 3 consecutive.*2\.weight'):
        for _ in range(5):
            _step(model, w, poison=True)


def test_collapse_can_raise(hub):
    model, w = _setup(static_loss_scale=1.0, dynamic_loss_scale=False, collapse_patience=2,
                      on_scale_collapse='raise')
    w.message_hub = hub
    _step(model, w, poison=True)
    with pytest.raises(FloatingPointError, match='could not go lower'):
        _step(model, w, poison=True)


def test_clean_step_resets_the_collapse_count(hub):
    model, w = _setup(static_loss_scale=1.0, dynamic_loss_scale=False, collapse_patience=2,
                      on_scale_collapse='raise')
    w.message_hub = hub
    for _ in range(3):
        _step(model, w, poison=True)
        _step(model, w)


@pytest.mark.parametrize('kwargs, match', [
    (dict(on_scale_collapse='explode'), 'on_scale_collapse'),
    (dict(collapse_patience=0), 'collapse_patience'),
    (dict(log_interval=-1), 'log_interval'),
    (dict(sync_found_inf='yes'), 'sync_found_inf'),
])
def test_bad_diagnostic_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _setup(**kwargs)
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=match):
        ApexOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
