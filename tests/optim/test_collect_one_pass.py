"""The one-pass collection of a fused step (Note [collect in one pass] in
mp_wrappers.optim.buckets): when it applies it builds exactly the buckets of the one-by-one
collection (same lists, same tensors, same order), so the ops get the same arguments; when a slot
needs more it gives the group back to the one-by-one collection; and only optimizers whose params
are their own targets use it."""
import inspect

import pytest
import torch
from torch import nn

import mp_wrappers.optim as optim
from mp_wrappers.optim import (FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedOptimizer,
                               FusedSGD, base, buckets)


def _params(dtypes=(torch.float32,), shapes=((8, 4), (300,), (3,), (16, 16))):
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=gen).to(d)) for d in dtypes for s in shapes]


def _grad(params, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _layout(buckets):
    """Everything an op call gets from a bucket, by tensor identity."""
    return [(b.device, id(b.group), id(b.step), [id(t) for t in b.params],
             [id(t) for t in b.grads], [id(t) for t in b.model_params],
             {k: [id(t) for t in v] for k, v in b.states.items()},
             [id(s) for s in b.slot_states]) for b in buckets]


@pytest.fixture
def one_pass_results(monkeypatch):
    """What each call of collect_in_one_pass returned (None: the group went one by one)."""
    found = []
    real = base.collect_in_one_pass

    def spy(*args):
        result = real(*args)
        found.append(result)
        return result

    monkeypatch.setattr(base, 'collect_in_one_pass', spy)
    return found


def _both_ways(opt, grads=None, models=None):
    """The buckets of one collection, in one pass and one by one (the state made by the first)."""
    one_pass = opt._collect(grads, models, [])
    real = opt._targets_are_params
    opt._targets_are_params = lambda with_models: False
    try:
        one_by_one = opt._collect(grads, models, [])
    finally:
        opt._targets_are_params = real
    return one_pass, one_by_one


SETUPS = {
    'adam, two groups': lambda ps: FusedAdam([{'params': ps[:2]}, {'params': ps[2:], 'lr': 0.1}]),
    'adam int8, big and small': lambda ps: FusedAdam(ps, state_dtype='int8', min_8bit_size=64),
    'adamw, fp32 and bf16 params': lambda ps: FusedAdam(ps, adam_w_mode=True, weight_decay=0.1),
    'sgd momentum': lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
    'sgd without state': lambda ps: FusedSGD(ps, lr=0.1),
    'lamb': lambda ps: FusedLAMB(ps),
    'novograd (scalar state)': lambda ps: FusedNovoGrad(ps),
    'adagrad': lambda ps: FusedAdagrad(ps),
    # The lean bf16 storages: the bf16 params are their own targets, with an aux state (split,
    # kahan) or none (stochastic), fp32 or bf16 moments, or 8-bit ones.
    'adam kahan, fp32 and bf16 params': lambda ps: FusedAdam(ps, bf16_storage='kahan'),
    'adam split, bf16 state, bf16 params': lambda ps: FusedAdam(ps, bf16_storage='split',
                                                              state_dtype='bfloat16'),
    'adam stochastic int8, bf16 params': lambda ps: FusedAdam(ps, bf16_storage='stochastic',
                                                            state_dtype='int8', min_8bit_size=64),
    'sgd split momentum, bf16 params': lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9,
                                                         bf16_storage='split'),
}


@pytest.mark.parametrize('setup', sorted(SETUPS))
def test_the_buckets_are_those_of_the_one_by_one_collection(setup, one_pass_results):
    dtypes = (torch.float32, torch.bfloat16) if 'bf16' in setup else (torch.float32,)
    ps = _params(dtypes)
    opt = SETUPS[setup](ps)
    _grad(ps)
    opt.step()  # the first step makes state, one by one
    one_pass_results.clear()
    _grad(ps, seed=2)
    ps[1].grad = None  # left alone by both
    one_pass, one_by_one = _both_ways(opt)
    assert one_pass and _layout(one_pass) == _layout(one_by_one)
    assert one_pass_results and all(r is not None for r in one_pass_results)


@pytest.mark.parametrize('late', [False, True])
def test_a_first_step_goes_one_by_one_and_the_pass_changes_nothing(late, one_pass_results):
    # State is made one by one: new params of a group share one step counter (Note [step
    # cohorts]), also when they join a group whose other params have state.
    ps = _params()
    opt = FusedAdam(ps[:2] if late else ps)
    _grad(ps)
    if late:
        opt.step()
        opt.param_groups[0]['params'] += ps[2:]
    before = {id(p): dict(s) for p, s in opt.state.items()}
    assert buckets.collect_in_one_pass(opt, opt.param_groups[0], None, None, [], None) is None
    assert {id(p): dict(s) for p, s in opt.state.items()} == before
    opt.step()
    assert len({id(opt.state[p]['step']) for p in ps[2:]}) == 1
    assert one_pass_results[-1] is None  # the step's own pass gave up too
    opt.step()
    assert one_pass_results[-1] is not None


def test_with_model_copies_and_a_late_param(one_pass_results):
    # A fused master step's explicit grads and model copies (a None grad: its .grad, here none),
    # and a group whose params step with two counters (one joined later: two cohorts, two buckets).
    ps = _params()
    opt = FusedAdam(ps[:3])
    _grad(ps)
    opt.step()
    opt.param_groups[0]['params'].append(ps[3])
    opt.step()  # its first step, one by one: its own counter
    one_pass_results.clear()
    grads = [[torch.randn(p.shape).to(torch.bfloat16) for p in ps]]
    grads[0][2] = ps[2].grad = None
    models = [[p.detach().to(torch.bfloat16) for p in ps]]
    one_pass, one_by_one = _both_ways(opt, grads, models)
    assert len(one_pass) == 2 and _layout(one_pass) == _layout(one_by_one)
    assert one_pass_results[0] is not None


@pytest.mark.parametrize('odd', ['channels_last param', 'grad of another shape',
                                 'grads of two dtypes', 'a state of another dtype'])
def test_a_slot_that_needs_more_sends_its_group_one_by_one(odd, one_pass_results):
    extra = [nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))]
    ps = _params() + (extra if odd == 'channels_last param' else [])
    twins = [nn.Parameter(p.detach().clone()) for p in ps]
    opt, twin = FusedAdam(ps, lr=0.1), FusedAdam(twins, lr=0.1)
    twin._targets_are_params = lambda with_models: False
    for step in range(3):
        for o, params in ((opt, ps), (twin, twins)):
            gen = torch.Generator().manual_seed(step)
            grads = [torch.randn(p.shape, generator=gen) for p in params]
            if step and odd == 'grad of another shape':
                grads[0] = grads[0].reshape(4, 8)
            if step and odd == 'grads of two dtypes':
                grads[1] = grads[1].to(torch.bfloat16)
            if step == 1 and odd == 'a state of another dtype':
                o.state[params[2]]['exp_avg'] = o.state[params[2]]['exp_avg'].double()
            with torch.no_grad():  # as step() runs it
                o._update([grads], None, None, None)
    assert None in one_pass_results
    for p, q in zip(ps, twins):
        assert torch.equal(p, q)


def test_params_without_a_model_copy_get_their_own_bucket(one_pass_results):
    ps = _params()
    opt = FusedAdam(ps)
    _grad(ps)
    opt.step()
    one_pass_results.clear()
    models = [[p.detach().to(torch.bfloat16) for p in ps]]
    models[0][1] = None
    one_pass, one_by_one = _both_ways(opt, None, models)
    assert len(one_pass) == 2 and _layout(one_pass) == _layout(one_by_one)
    assert one_pass_results[-1] is not None


def test_only_optimizers_whose_params_are_their_targets_use_it(one_pass_results):
    ps = _params((torch.bfloat16,))
    opt = FusedAdam(ps, master_weights=True)
    assert not opt._targets_are_params(False)
    _grad(ps)
    opt.step()
    opt.step()
    assert one_pass_results == []
    # A state holding an internal master (from a master_weights=True checkpoint) is stepped as one.
    opt = FusedAdam(ps)
    assert opt._targets_are_params(False)
    opt.load_state_dict(FusedAdam(ps, master_weights=True).state_dict())
    assert opt._targets_are_params(False)  # nothing stepped yet: no state
    saved = FusedAdam(ps, master_weights=True)
    _grad(ps)
    saved.step()
    opt.load_state_dict(saved.state_dict())
    assert not opt._targets_are_params(False)
    # bf16 moments without a lean storage: refused by the one-by-one collection, never in one pass.
    assert not FusedAdam(ps, state_dtype='bfloat16')._targets_are_params(False)


@pytest.mark.parametrize('storage', ['split', 'kahan', 'stochastic'])
def test_a_lean_storage_given_model_copies_is_still_refused(storage, one_pass_results):
    # A lean bf16 param is stepped in place: a fused master step asking it to write a model copy
    # too is refused by the one-by-one collection, and the one pass leaves such a step to it.
    ps = _params((torch.bfloat16,))
    opt = FusedAdam(ps, bf16_storage=storage)
    assert opt._targets_are_params(False) and not opt._targets_are_params(True)
    _grad(ps)
    opt.step()
    opt.step()
    assert one_pass_results[-1] is not None  # without model copies: in one pass
    # A wrapper's fused step on lean masters: a row of Nones (each param is its own model).
    one_pass_results.clear()
    with torch.no_grad():
        opt._update([[p.grad for p in ps]], [[None] * len(ps)], None, None)
    assert len(one_pass_results) == 1 and one_pass_results[0] is not None
    before = [p.detach().clone() for p in ps]
    models = [[p.detach().clone() for p in ps]]
    with pytest.raises(ValueError, match='cannot also write a model copy'):
        with torch.no_grad():
            opt._update([[p.grad for p in ps]], models, None, None)
    assert all(torch.equal(p, b) for p, b in zip(ps, before))


def test_every_optimizer_that_maps_its_targets_says_when(one_pass_results):
    # _update_target may swap a param for another tensor: the class defining it must say when it
    # does not (_targets_are_params), or its steps collect one by one.
    classes = [c for _, c in inspect.getmembers(optim, inspect.isclass)
               if issubclass(c, FusedOptimizer) and c is not FusedOptimizer]
    assert len(classes) >= 5
    assert all(buckets._says_when(cls) for cls in classes)

    class Mapping(FusedAdam):  # a user's optimizer stepping another tensor for some params
        def _update_target(self, param, state, model):
            return super()._update_target(param, state, model)

    ps = _params()
    opt = Mapping(ps)
    assert not buckets._says_when(Mapping) and not buckets.one_pass_applies(opt, False)
    _grad(ps)
    opt.step()
    assert one_pass_results == []


def _storage_switches(opt, params, step):
    """What may happen to a lean optimizer between steps: its storage set anew (as a wrapper's
    master_weights does), or its aux state left with another dtype or shape (an old checkpoint)."""
    if step == 2:
        opt.set_bf16_storage('kahan')  # split -> kahan: no 'kahan_comp' yet
    if step == 3:
        opt.state[params[0]]['kahan_comp'] = opt.state[params[0]]['kahan_comp'].float()
    if step == 4:
        opt.state[params[3]]['kahan_comp'] = torch.zeros(5, dtype=torch.bfloat16)
    if step == 5:
        opt.set_bf16_storage('split')  # back: 'master_low' anew (dropped at the switch away)


@pytest.mark.parametrize('make', ['adam', 'adam bf16 state', 'adam int8', 'sgd momentum'])
def test_lean_storages_step_as_one_by_one_through_their_changes(make, one_pass_results):
    # Every step of a lean optimizer, through storage switches and aux state that lean_aux must
    # replace, gives the bits of a twin that always collects one by one (params and state).
    kw = {'adam': {}, 'adam bf16 state': {'state_dtype': 'bfloat16'},
          'adam int8': {'state_dtype': 'int8', 'min_8bit_size': 64}, 'sgd momentum': {}}[make]

    def build(params):
        if make == 'sgd momentum':
            return FusedSGD(params, lr=0.1, momentum=0.9, bf16_storage='split')
        return FusedAdam(params, lr=0.01, bf16_storage='split', **kw)
    ps = _params((torch.float32, torch.bfloat16))
    twins = [nn.Parameter(p.detach().clone()) for p in ps]
    opt, twin = build(ps), build(twins)
    twin._targets_are_params = lambda with_models: False
    for step in range(7):
        for o, params in ((opt, ps), (twin, twins)):
            _storage_switches(o, params[4:], step)
            _grad(params, seed=step)
            o.step()
    assert None in one_pass_results and any(r is not None for r in one_pass_results)
    for p, q in zip(ps, twins):
        assert torch.equal(p, q)
        a, b = opt.state[p], twin.state[q]
        assert sorted(a) == sorted(b)
        for k in a:
            assert torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype, k
