"""Loss scalers: dynamics against an independent host-side model of apex amp's scaler, state, errors."""
import math
import random

import pytest
import torch

from _compat import needs_cpu_grad_scaler
from mp_wrappers.scaler import (DynamicLossScaler, StaticLossScaler, build_loss_scaler)


def _oracle(flags, init=2.0**16, factor=2.0, window=2000, lo=None, hi=2.0**24, hysteresis=1):
    """apex amp's LossScaler.update_scale written out on the host, plus consecutive hysteresis."""
    scale, unskipped, left, out = init, 0, hysteresis, []
    for overflow in flags:
        if overflow:
            left -= 1
            if left <= 0:
                scale = scale / factor
                if lo is not None:
                    scale = max(scale, lo)
            unskipped = 0
        else:
            left = hysteresis
            unskipped += 1
            if unskipped == window:
                scale = scale * factor
                if hi is not None:
                    scale = min(scale, hi)
                unskipped = 0
        out.append((scale, unskipped))
    return out


def _run(scaler, flags):
    got = []
    for f in flags:
        scaler.update(torch.tensor([float(f)]))
        got.append((scaler.loss_scale, scaler.unskipped))
    return got


def test_dynamic_defaults_match_apex_amp():
    s = DynamicLossScaler()
    assert s.loss_scale == 2.0**16
    assert (s.scale_factor, s.scale_window, s.min_loss_scale, s.max_loss_scale, s.hysteresis) == \
        (2.0, 2000, None, 2.0**24, 1)


def test_dynamic_grows_after_window_and_halves_on_overflow():
    s = DynamicLossScaler(scale_window=2000)
    _run(s, [0] * 1999)
    assert s.loss_scale == 2.0**16
    _run(s, [0])
    assert s.loss_scale == 2.0**17 and s.unskipped == 0
    _run(s, [1])
    assert s.loss_scale == 2.0**16 and s.skipped_steps == 1 and s.steps == 2001


@pytest.mark.parametrize('seed', range(4))
@pytest.mark.parametrize('hysteresis', [1, 2, 3])
def test_dynamic_matches_oracle_on_random_sequences(seed, hysteresis):
    rng = random.Random(seed)
    flags = [rng.random() < 0.3 for _ in range(300)]
    kw = dict(init=2.0**10, factor=2.0, window=4, lo=4.0, hi=2.0**12, hysteresis=hysteresis)
    s = DynamicLossScaler(init_scale=kw['init'], scale_factor=kw['factor'],
                          scale_window=kw['window'], min_loss_scale=kw['lo'],
                          max_loss_scale=kw['hi'], hysteresis=hysteresis)
    assert _run(s, flags) == _oracle(flags, **kw)
    assert s.skipped_steps == sum(flags)


def test_min_and_max_bounds_hold():
    s = DynamicLossScaler(init_scale=8.0, min_loss_scale=2.0, scale_window=1, max_loss_scale=32.0)
    _run(s, [1] * 10)
    assert s.loss_scale == 2.0
    _run(s, [0] * 10)
    assert s.loss_scale == 32.0


def test_scale_never_grows_to_inf_without_max():
    s = DynamicLossScaler(init_scale=2.0**126, max_loss_scale=None, scale_window=1)
    _run(s, [0] * 5)
    assert math.isfinite(s.loss_scale)


def test_static_scale_never_changes_but_counts_skips():
    s = StaticLossScaler(128.0)
    _run(s, [1, 0, 1, 1])
    assert s.loss_scale == 128.0 and s.skipped_steps == 3 and s.steps == 4


def test_scale_loss_and_inv_scale():
    s = StaticLossScaler(3.0)
    loss = torch.tensor(2.0)
    assert s.scale_loss(loss).item() == 6.0
    assert s.inv_scale().dtype == torch.float32
    assert s.inv_scale().item() == pytest.approx(1 / 3.0, rel=1e-7)


def test_state_dict_round_trip_is_plain_and_exact(tmp_path):
    s = DynamicLossScaler(scale_window=3, hysteresis=2)
    _run(s, [0, 1, 1, 0, 0])
    path = tmp_path / 's.pt'
    torch.save(s.state_dict(), path)
    state = torch.load(path, weights_only=True)
    t = DynamicLossScaler(scale_window=3, hysteresis=2)
    t.load_state_dict(state)
    assert t.state_dict() == s.state_dict()
    flags = [1, 0, 0, 0, 1, 1]
    assert _run(t, flags) == _run(s, flags)


@needs_cpu_grad_scaler
def test_adopts_torch_gradscaler_state():
    gs = torch.amp.GradScaler('cpu', init_scale=512.0)
    state = gs.state_dict()
    state['_growth_tracker'] = 7
    s = DynamicLossScaler()
    s.load_state_dict(state)
    assert s.loss_scale == 512.0 and s.unskipped == 7


def test_adopts_apex_amp_state():
    s = DynamicLossScaler()
    s.load_state_dict({'loss_scale': 1024.0, 'unskipped': 12})
    assert s.loss_scale == 1024.0 and s.unskipped == 12


def test_static_scaler_keeps_configured_scale_when_loading():
    s = StaticLossScaler(64.0)
    s.load_state_dict({'loss_scale': 1024.0, 'unskipped': 3})
    assert s.loss_scale == 64.0 and s.unskipped == 3


@pytest.mark.parametrize('state, error', [
    ({'foo': 1}, KeyError),
    ({'loss_scale': -1.0}, ValueError),
    ({'loss_scale': float('nan')}, ValueError),
    ({'loss_scale': 2.0, 'version': 99}, ValueError),
    ([1, 2], TypeError),
])
def test_bad_state_is_refused(state, error):
    with pytest.raises(error):
        DynamicLossScaler().load_state_dict(state)


@pytest.mark.parametrize('kwargs, match', [
    (dict(dynamic=False, static_loss_scale=0.0), 'static_loss_scale'),
    (dict(dynamic=False, static_loss_scale=-2.0), 'static_loss_scale'),
    (dict(dynamic=False, static_loss_scale=float('nan')), 'static_loss_scale'),
    (dict(dynamic=False, static_loss_scale=float('inf')), 'static_loss_scale'),
    (dict(dynamic=False, static_loss_scale='128'), 'static_loss_scale'),
    (dict(dynamic=True, dynamic_loss_args=dict(init_scal=2.0)), 'unknown keys'),
    (dict(dynamic=True, dynamic_loss_args=dict(min_loss_scale=8.0, max_loss_scale=4.0)),
     'min_loss_scale'),
    (dict(dynamic=True, dynamic_loss_args=dict(scale_factor=1.0)), 'scale_factor'),
    (dict(dynamic=True, dynamic_loss_args=dict(scale_window=0)), 'scale_window'),
    (dict(dynamic=True, dynamic_loss_args=dict(hysteresis=0)), 'hysteresis'),
    (dict(dynamic=True, dynamic_loss_args=dict(init_scale=0)), 'init_scale'),
    (dict(dynamic=False, dynamic_loss_args=dict(init_scale=2.0)), 'dynamic_loss_args'),
    (dict(dynamic=True, dynamic_loss_args=[1]), 'dynamic_loss_args'),
])
def test_bad_options_name_the_option(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build_loss_scaler(**kwargs)


def test_loss_scale_setter_validates():
    s = DynamicLossScaler()
    s.loss_scale = 8.0
    assert s.loss_scale == 8.0
    with pytest.raises(ValueError, match='loss_scale'):
        s.loss_scale = 0.0
