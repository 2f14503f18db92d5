"""``slots_dense``, the one check of a fused step's lists per op call (Note [collect in one pass] in
mp_wrappers.optim.buckets): the extension's answer equals the reference's for every way a list can
fail, and bad arguments raise in both."""
import pytest
import torch

from mp_wrappers.ops import _extension, reference, slots

F32, BF16, U8 = torch.float32, torch.bfloat16, torch.uint8


def _implementations():
    impls = [pytest.param(reference.slots.slots_dense, id='reference')]
    ext = _extension.extension()
    impls.append(pytest.param(
        None if ext is None else ext.slots_dense, id='extension',
        marks=pytest.mark.skipif(ext is None, reason='the extension is not built')))
    return impls


def _lists(n=3, shape=(4, 3), model=True, keys=2):
    """Lists the one-pass collection builds for n Adam-like slots: all dense and alike."""
    targets = [torch.randn(shape) for _ in range(n)]
    grads = [torch.randn(shape) for _ in range(n)]
    models = [torch.randn(shape).to(BF16) for _ in range(n)] if model else []
    states = [[torch.zeros(shape) for _ in range(n)] for _ in range(keys)]
    return dict(targets=targets, grads=grads, models=models, states=states,
                allowed=tuple((F32,) for _ in range(keys)))


def _noncontig(shape=(4, 3)):
    return torch.randn(shape[::-1]).t()


def _meta(dtype=F32):
    return torch.empty(4, 3, device='meta', dtype=dtype)


# name -> how to break the lists of _lists() (None: leave them passing)
CASES = {
    'all dense and alike': None,
    'no slots': lambda a: a.update(targets=[], grads=[], models=[], states=[[], []]),
    'no model copies': lambda a: a.update(models=[]),
    'no state': lambda a: a.update(states=[], allowed=()),
    'a strided target': lambda a: a['targets'].__setitem__(1, _noncontig()),
    'a strided grad': lambda a: a['grads'].__setitem__(2, _noncontig()),
    'a strided model copy': lambda a: a['models'].__setitem__(0, _noncontig().to(BF16)),
    'a strided state': lambda a: a['states'][1].__setitem__(1, _noncontig()),
    'a grad of another shape, same size': lambda a: a['grads'].__setitem__(1, torch.randn(3, 4)),
    'a state of another shape': lambda a: a['states'][0].__setitem__(2, torch.zeros(12)),
    'a model of another shape': lambda a: a['models'].__setitem__(1, torch.zeros(2, 6, dtype=BF16)),
    'a target of another dtype': lambda a: a['targets'].__setitem__(1, torch.randn(4, 3).double()),
    'grads of two dtypes': lambda a: a['grads'].__setitem__(1, torch.randn(4, 3).to(BF16)),
    'half grads': lambda a: a.update(grads=[g.to(BF16) for g in a['grads']]),
    'integer grads': lambda a: a.update(grads=[g.long() for g in a['grads']]),
    'model copies of two dtypes': lambda a: a['models'].__setitem__(2, torch.randn(4, 3)),
    'integer model copies': lambda a: a.update(models=[torch.zeros(4, 3, dtype=torch.int32)] * 3),
    'a target on another device': lambda a: a['targets'].__setitem__(2, _meta()),
    'a grad on another device': lambda a: a['grads'].__setitem__(0, _meta()),
    'grads all on another device': lambda a: a.update(grads=[_meta()] * 3),
    'a model on another device': lambda a: a['models'].__setitem__(1, _meta(BF16)),
    'a sparse grad': lambda a: a['grads'].__setitem__(1, torch.randn(4, 3).to_sparse()),
    'a missing state': lambda a: a['states'][1].__setitem__(0, None),
    'a state of a dtype not allowed':
        lambda a: a['states'][0].__setitem__(1, torch.zeros(4, 3).double()),
    'a state of a second allowed dtype': lambda a: (
        a['states'][0].__setitem__(1, torch.zeros(4, 3, dtype=U8)),
        a.update(allowed=((F32, U8), (F32,)))),
    'states on another device (left to the op)': lambda a: a['states'][0].__setitem__(0, _meta()),
    'fewer grads': lambda a: a['grads'].pop(),
    'fewer model copies': lambda a: a['models'].pop(),
    'fewer states': lambda a: a['states'][1].pop(),
    'a grad that is no tensor': lambda a: a['grads'].__setitem__(1, 1.0),
}
PASSING = {'all dense and alike', 'no slots', 'no model copies', 'no state', 'half grads',
           'a state of a second allowed dtype', 'states on another device (left to the op)'}


@pytest.mark.parametrize('impl', _implementations())
@pytest.mark.parametrize('case', sorted(CASES))
def test_answers(impl, case):
    args = _lists()
    if CASES[case] is not None:
        CASES[case](args)
    assert impl(**args) is (case in PASSING)


def test_the_dispatcher_agrees_with_the_reference():
    for case, breaks in CASES.items():
        args = _lists()
        if breaks is not None:
            breaks(args)
        assert slots.slots_dense(**args) is reference.slots.slots_dense(**args), case


@pytest.mark.parametrize('impl', _implementations())
@pytest.mark.parametrize('bad, match', [
    (dict(targets=(1,)), 'targets must be a list'),
    (dict(grads=None), 'grads must be a list'),
    (dict(models=()), 'models must be a list'),
    (dict(states=((),)), 'states must be a list'),
    (dict(states=[(), ()]), r'states\[k\] must be a list'),
    (dict(allowed=((F32,),)), 'one entry per state list'),
    (dict(allowed=[(F32,), (F32,)]), 'one entry per state list'),
    (dict(allowed=((F32,), ('float32',))), r'allowed\[k\] must be a tuple of torch.dtype'),
    (dict(allowed=((F32,), [F32])), r'allowed\[k\] must be a tuple of torch.dtype'),
])
@pytest.mark.parametrize('lists', ['three slots', 'no slots', 'a strided target'])
def test_bad_arguments_raise(impl, bad, match, lists):
    # Whatever the tensors would answer: the arguments are checked first.
    args = _lists(n=0 if lists == 'no slots' else 3)
    if lists == 'a strided target':
        args['targets'][0] = _noncontig()
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        impl(**args)
