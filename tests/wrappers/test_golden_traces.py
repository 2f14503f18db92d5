"""The golden training traces replay bitwise (see tests/golden_traces.py for what they hold and why
they are the same on every CPU). A refactoring keeps every digest; a commit that changes numerics on
purpose says so and re-records with ``python tests/golden_traces.py --record``."""
import json
import warnings

import pytest

import golden_traces

with open(golden_traces.TRACES) as _f:
    _GOLDEN = json.load(_f)

pytestmark = pytest.mark.skipif(
    _GOLDEN['fingerprint'] != golden_traces.fingerprint(),
    reason=f"traces recorded under {_GOLDEN['fingerprint']}; this is {golden_traces.fingerprint()} "
           '(other torch versions round some torch ops differently)')


def test_every_scenario_is_recorded():
    assert sorted(_GOLDEN['traces']) == sorted(golden_traces.scenarios())


@pytest.mark.parametrize('name', golden_traces.scenarios())
def test_trace_replays_bitwise(name):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        got = golden_traces.trace(name)
    want = _GOLDEN['traces'][name]
    assert len(got) == len(want), name
    for g, w in zip(got, want):
        for key in w:
            assert g[key] == w[key], f'{name}: micro-step {w["micro_step"]}: {key} differs'


def test_traces_cover_skips_and_scale_changes():
    """The traces exercise what a refactoring of the step can break: skipped steps, a scale that
    falls and grows back, and masters that differ from the model."""
    traces = _GOLDEN['traces']
    assert all(any(r['skipped'] for r in t) for n, t in traces.items() if not n.startswith('O0/'))
    scales = [r['loss_scale'] for r in traces['O2-fp16-window2/FusedAdam/plain']]
    assert min(scales) < scales[0] and scales[-1] > min(scales)
