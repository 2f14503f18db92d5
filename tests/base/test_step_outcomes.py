"""The fused master step without host reads (Note [deferred outcomes] in mp_wrappers.step_outcomes).

On an accelerator the wrappers learn a fused step's outcome (skipped or not, the scales, the clipped
norm) from a pinned host copy that lands later, instead of reading the flags (a device sync). These
tests run that path on the CPU with ``simulate_accelerator`` (copies landing 0-3 polls late) under a
guard that fails any host read of a tensor value (tests/_sync_guard.py), and check that it does
exactly what the direct path does: weights bit for bit, scales, skipped counts, the overflow
messages, the logged grad_norm, the collapse watch, through a bare wrapper and through mmengine's
Runner. tests/kernels/test_cuda_paths.py checks the same step with torch.cuda.set_sync_debug_mode('error').
"""
import pytest
import torch
from mmengine.hooks import Hook
from mmengine.logging import MessageHub
from torch import nn

import mp_wrappers.step_outcomes as step_outcomes_module
from _sync_guard import HostRead, forbid_host_reads
from _workflow import RecordHook, make_runner, train
from mp_wrappers import (ApexOptimWrapper, FP16OptimWrapper, FusedAdagrad, FusedAdam, FusedLAMB,
                         FusedNovoGrad, FusedSGD)
from mp_wrappers.casting import cast_model
from mp_wrappers.step_outcomes import OutcomeQueue, simulate_accelerator

pytestmark = pytest.mark.filterwarnings('ignore:.*without native f.*:UserWarning')

FUSED = {
    'FusedAdam': lambda p: FusedAdam(p, lr=1e-2, weight_decay=1e-2),
    'FusedSGD': lambda p: FusedSGD(p, lr=1e-2, momentum=0.9),
    'FusedLAMB': lambda p: FusedLAMB(p, lr=1e-2),
    'FusedAdagrad': lambda p: FusedAdagrad(p, lr=1e-2),
    'FusedNovoGrad': lambda p: FusedNovoGrad(p, lr=1e-2),
}
# Iterations whose loss is inf: overflow steps between clean ones (the first steps also overflow
# naturally at apex's initial scale of 2^16 with these sums).
INF_AT = (2, 5)
STEPS = 8


def _model(half: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if half:
        cast_model(model, torch.float16)
    return model


def _wrapper(kind: str, opt_name: str, **kwargs):
    model = _model(half=kind == 'FP16')
    opt = FUSED[opt_name](model.parameters())
    if kind == 'FP16':
        wrapper = FP16OptimWrapper(optimizer=opt, dynamic_loss_scale=True, **kwargs)
    else:
        wrapper = ApexOptimWrapper(optimizer=opt, opt_level='O2', dtype='float16',
                                   loss_scale='dynamic', verbosity=0, **kwargs)
    return model, wrapper


def _steps(model, wrapper, steps=STEPS, guard=False, inf_at=INF_AT):
    """Train ``steps`` iterations as mmengine's loop would (MessageHub iter set, no publication
    due); returns the weights after each step."""
    hub = MessageHub.get_current_instance()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    weights = []
    for it in range(steps):
        hub.update_info('iter', it)
        wrapper.publish_now = False
        with wrapper.optim_context(model):
            loss = model(x.half()).float().pow(2).mean()
        if it in inf_at:
            loss = loss * float('inf')
        if guard:
            with forbid_host_reads():
                wrapper.update_params(loss)
        else:
            wrapper.update_params(loss)
        weights.append([p.detach().clone() for p in model.parameters()])
    return weights


@pytest.fixture
def fresh_hub():
    hub = MessageHub.get_instance('test_deferred_outcomes_' + str(id(object())))
    previous = MessageHub._instance_dict.copy()
    # get_current_instance() returns the newest instance: make ours the current one.
    MessageHub._instance_dict.pop(hub.instance_name)
    MessageHub._instance_dict[hub.instance_name] = hub
    yield hub
    MessageHub._instance_dict.clear()
    MessageHub._instance_dict.update(previous)


def test_simulate_accelerator_rejects_a_bad_lag():
    for bad in (-1, 1.5, True, '1'):
        with pytest.raises(ValueError, match=r'simulate_accelerator: lag must be an integer >= 0, '
                                             rf'got {bad!r}'):
            with simulate_accelerator(lag=bad):
                pass


def test_guard_fails_a_host_read_and_passes_host_copies():
    """The guard can fail: a plain read is caught, the queue's host copies are not."""
    t = torch.ones(1)
    with forbid_host_reads():
        for read in (t.item, lambda: bool(t), lambda: float(t), t.tolist):
            with pytest.raises(HostRead, match='host read of a device value'):
                read()
        with simulate_accelerator(lag=0):
            q = OutcomeQueue()
            q.push(0, None, [0], [t], [t * 4], [t * 2])
            assert next(q.take()).flags == (True,)
    assert t.item() == 1.0  # restored


def test_outcome_queue_keeps_step_order_and_waits_when_asked():
    one, zero = torch.ones(1), torch.zeros(1)
    with simulate_accelerator(lag=1):
        q = OutcomeQueue()
        q.push(0, 10, [0], [one], [torch.full((1,), 8.0)], [torch.full((1,), 4.0)])
        q.push(1, 11, [0, 1], [zero, one], [one, one * 2], [one, one], norm=torch.full((1,), 3.5))
        q.push(2, None, [0], [zero], [one], [one * 2])
        assert list(q.take()) == []  # the oldest copy is still in flight: nothing overtakes it
        first = list(q.take())
        assert [o.seq for o in first] == [0] and len(q) == 2 and first[0].iteration == 10
        assert first[0].skipped and first[0].scales_before == (8.0,)
        assert first[0].scales_after == (4.0,) and first[0].norm is None
        rest = list(q.take(wait=True))
        assert [o.seq for o in rest] == [1, 2] and len(q) == 0
        assert rest[0].flags == (False, True) and rest[0].skipped and rest[0].norm == 3.5
        assert not rest[1].skipped and rest[1].scales_after == (2.0,)


@pytest.mark.parametrize('opt_name', sorted(FUSED))
@pytest.mark.parametrize('kind', ['O2', 'FP16'])
def test_fused_step_with_dynamic_scaling_reads_nothing_on_the_host(fresh_hub, kind, opt_name):
    """Overflowing and clean fused steps, initialisation included: not one host read, and the
    result equals the direct path's bit for bit."""
    model, wrapper = _wrapper(kind, opt_name)
    direct = _steps(model, wrapper)
    model, wrapper_sim = _wrapper(kind, opt_name)
    with simulate_accelerator(lag=1):
        deferred = _steps(model, wrapper_sim, guard=True)
        assert len(wrapper_sim._outcomes) >= 1  # outcomes really were in flight
        assert wrapper_sim.last_step_skipped == wrapper.last_step_skipped
    for a, b in zip(direct, deferred):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert wrapper_sim.loss_scalers[0].loss_scale == wrapper.loss_scalers[0].loss_scale
    assert wrapper_sim.loss_scalers[0].skipped_steps == wrapper.loss_scalers[0].skipped_steps >= 2


@pytest.mark.parametrize('lag', [0, 1, 3])
def test_deferred_bookkeeping_equals_the_direct_path(fresh_hub, monkeypatch, lag):
    """Messages, clipped grad_norm history, skipped counts and amp_* scalars, at every lag."""
    runs = {}
    for mode in ('direct', 'deferred'):
        logged = []
        monkeypatch.setattr(step_outcomes_module, 'print_log',
                            lambda msg, **kw: logged.append(msg))
        hub = MessageHub.get_instance(f'deferred_{mode}_{lag}')
        MessageHub._instance_dict.pop(hub.instance_name)
        MessageHub._instance_dict[hub.instance_name] = hub
        model, wrapper = _wrapper('O2', 'FusedAdam', clip_grad=dict(max_norm=0.5))
        wrapper.verbose = True
        if mode == 'deferred':
            with simulate_accelerator(lag=lag):
                weights = _steps(model, wrapper, guard=True)
                wrapper.publish_scalars()
        else:
            weights = _steps(model, wrapper)
            wrapper.publish_scalars()
        runs[mode] = dict(weights=weights, logged=logged,
                          norms=list(hub.get_scalar('train/grad_norm').data[0]),
                          skipped=hub.get_scalar('train/amp_skipped').current(),
                          scale=hub.get_scalar('train/amp_scale').current(),
                          gnorm=hub.get_scalar('train/amp_gnorm').current())
    direct, deferred = runs['direct'], runs['deferred']
    assert deferred['logged'] == direct['logged']
    assert sum('Gradient overflow.  Skipping step' in m for m in direct['logged']) >= 2
    assert deferred['norms'] == direct['norms'] and len(direct['norms']) >= 3
    for key in ('skipped', 'scale', 'gnorm'):
        assert deferred[key] == direct[key], key
    for a, b in zip(direct['weights'], deferred['weights']):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_deferred_collapse_watch_raises_naming_the_step(fresh_hub):
    """A collapsed scale is caught from the deferred outcomes too (a step or so later), and the
    message says the parameters were not read."""
    model, wrapper = _wrapper('O2', 'FusedAdam', on_scale_collapse='raise', collapse_patience=3,
                              min_loss_scale=1024.0)
    wrapper.loss_scalers[0].loss_scale = 1024.0
    with simulate_accelerator(lag=1), pytest.raises(FloatingPointError) as info:
        _steps(model, wrapper, guard=True, inf_at=range(STEPS))
    msg = str(info.value)
    # The step's own iteration (as the direct path names it), and when the host learned of it.
    assert 'the loss scale collapsed at iteration 2 (reported at iteration 3): 3 consecutive' in msg
    assert 'parameters: not read' in msg and 'overflow_report=True names them' in msg

    model, wrapper = _wrapper('O2', 'FusedAdam', on_scale_collapse='raise', collapse_patience=3,
                              min_loss_scale=1024.0)
    wrapper.loss_scalers[0].loss_scale = 1024.0
    with pytest.raises(FloatingPointError, match='collapsed at iteration 2: 3 consecutive'):
        _steps(model, wrapper, inf_at=range(STEPS))


def test_overflow_report_reads_the_flags_at_the_step(fresh_hub):
    """overflow_report=True names the parameters with bad gradients, so it keeps the host read
    (documented): the guard sees it."""
    model, wrapper = _wrapper('O2', 'FusedAdam', overflow_report=True)
    with simulate_accelerator(lag=1), pytest.raises(HostRead):
        _steps(model, wrapper, guard=True)


class _InFlight(Hook):
    """Records how many outcomes are in flight at the end of each iteration (a host count)."""

    priority = 'LOWEST'

    def __init__(self):
        self.counts = []

    def after_train_iter(self, runner, *args, **kwargs):
        self.counts.append(len(runner.optim_wrapper._outcomes))


@pytest.mark.parametrize('with_hook', [True, False], ids=['MixedPrecisionHook', 'no_hook'])
def test_runner_o2_float16_fused_adam_deferred_equals_direct(tmp_path, monkeypatch, with_hook):
    """Through mmengine's Runner (LoggerHook, clip_grad, a NaN loss at iteration 3; with
    MixedPrecisionHook, which reads last_step_skipped every iteration, and without it, where the
    outcomes stay in flight across the iterations between two log lines): the deferred path trains to the same weights at
    every iteration and logs the same grad_norm and amp_* scalars as the direct path."""
    results = {}
    pushed = []
    push = OutcomeQueue.push
    monkeypatch.setattr(OutcomeQueue, 'push',
                        lambda self, seq, *a, **kw: (pushed.append(seq), push(self, seq, *a, **kw)))
    in_flight = _InFlight()
    for mode in ('direct', 'deferred'):
        record = RecordHook()
        runner = make_runner(tmp_path / mode, 'O2', 'float16', iters=8,
                             model=dict(nan_loss_iters=(3,)),
                             optimizer=dict(type='mp_wrappers.FusedAdam', lr=1e-2),
                             extra_wrapper=dict(clip_grad=dict(max_norm=1.0)),
                             log_interval=1 if with_hook else 4)
        if not with_hook:
            runner._hooks = [h for h in runner._hooks if type(h).__name__ != 'MixedPrecisionHook']
        runner.register_hook(record, priority='LOWEST')
        if mode == 'deferred':
            runner.register_hook(in_flight, priority='LOWEST')
            with simulate_accelerator(lag=2):
                train(runner)
                runner.optim_wrapper.publish_scalars()  # waits for the last outcomes
        else:
            train(runner)
            runner.optim_wrapper.publish_scalars()
        hub = runner.message_hub
        results[mode] = dict(weights=record.weights,
                             norms=list(hub.get_scalar('train/grad_norm').data[0]),
                             skipped=hub.get_scalar('train/amp_skipped').current(),
                             scale=runner.optim_wrapper.loss_scalers[0].loss_scale)
    assert pushed == list(range(8))  # every step of the deferred run, none of the direct one
    if with_hook:
        assert in_flight.counts == [0] * 8  # the hook's read waits for each step's outcome
    else:
        assert max(in_flight.counts) >= 2  # outcomes crossed iteration boundaries
    direct, deferred = results['direct'], results['deferred']
    assert direct['skipped'] == deferred['skipped'] >= 1
    assert direct['scale'] == deferred['scale']
    assert direct['norms'] == deferred['norms']
    w = direct['weights']
    assert all(torch.equal(w[2][n], w[3][n]) for n in w[2])  # the NaN iteration changed nothing
    for a, b in zip(direct['weights'], deferred['weights']):
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_direct_step_accounts_for_earlier_deferred_steps_first(fresh_hub):
    """A fused (deferred) overflowing step, then an unfused (direct) clean one: the direct step
    waits for the older outcome first, so last_step_skipped describes the newest step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    wrapper = ApexOptimWrapper(optimizer=FusedAdam(model.parameters(), lr=1e-2), opt_level='O2',
                               dtype='float16', loss_scale='dynamic', num_losses=2, verbosity=0)
    x = torch.randn(16, 8)
    hub = fresh_hub
    with simulate_accelerator(lag=5):
        hub.update_info('iter', 0)
        wrapper.publish_now = False
        with wrapper.optim_context(model):
            loss = model(x.half()).float().pow(2).mean()
        wrapper.update_params(loss * float('inf'))  # one loss: the fused, deferred step
        assert len(wrapper._outcomes) == 1
        hub.update_info('iter', 1)
        wrapper.loss_scalers[0].loss_scale = 1.0  # no natural overflow at the second step
        wrapper.loss_scalers[1].loss_scale = 1.0
        with wrapper.optim_context(model):
            out = model(x.half()).float()
        wrapper.backward(out.pow(2).mean(), loss_id=0, retain_graph=True)
        wrapper.backward(out.abs().mean(), loss_id=1)  # two scalers: the unfused, direct step
        wrapper.step()
        wrapper.zero_grad()
        assert len(wrapper._outcomes) == 0
        assert wrapper.last_step_skipped is False
        assert wrapper.loss_scalers[0].skipped_steps == 1


def test_load_state_dict_accounts_for_earlier_steps_first(fresh_hub):
    """FP16OptimWrapper saves apex's 'overflow': loading a checkpoint after a deferred
    overflowing step restores the saved value, not the stale outcome's."""
    model, wrapper = _wrapper('FP16', 'FusedAdam')
    wrapper.loss_scalers[0].loss_scale = 1.0
    _steps(model, wrapper, steps=1, inf_at=())
    saved = wrapper.state_dict()
    assert wrapper.overflow is False
    with simulate_accelerator(lag=5):
        _steps(model, wrapper, steps=1, inf_at=(0,))
        assert len(wrapper._outcomes) == 1
        wrapper.load_state_dict(saved)
        assert len(wrapper._outcomes) == 0
        assert wrapper.overflow is False


def test_plain_loop_with_publish_now_false_reads_nothing(fresh_hub):
    """Outside a training loop (no MessageHub iter) a step publishes, which reads the device;
    publish_now=False makes a plain PyTorch loop sync-free too."""
    model, wrapper = _wrapper('O2', 'FusedAdam')
    wrapper.publish_now = False
    x = torch.randn(16, 8)
    with simulate_accelerator(lag=1):
        for it in range(4):
            with wrapper.optim_context(model):
                loss = model(x.half()).float().pow(2).mean()
            with forbid_host_reads():
                wrapper.update_params(loss * (float('inf') if it == 1 else 1.0))
        wrapper.publish_scalars()
    assert fresh_hub.get_scalar('train/amp_skipped').current() >= 1
