"""ops/_registration: each op's implementation settled when the extension loads, not per call.

Note [dispatch decided at registration]: the references are registered as the kernels of the ops a
build lacks, the compiled kernels are remembered apart from them, and a public op traced by
torch.compile finds its implementation without a graph break. Costs: the two compile tests trace
with the 'eager' backend (~1 s each); the rest is milliseconds.
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from mp_wrappers import compat
from mp_wrappers.ops import _dispatch, _extension, _registration, multi_tensor_l2norm, reference
from mp_wrappers.ops import multi_tensor_scale

needs_extension = pytest.mark.skipif(_extension.extension() is None,
                                     reason='the extension is not built')
needs_compile = pytest.mark.skipif(
    not (compat.has('fake_kernels') and compat.has('compile_list_ops')),
    reason='torch.compile of our ops needs torch >= 2.4 (fake kernels) and, for the ops that update '
           'lists in place, torch >= 2.13 (compat compile_list_ops)')

# A namespace of its own: the probes must not join the ops the doctor and the kernel tests list.
PROBES = 'mp_wrappers_registration_probe'
_PROBE_LIB = None


def _probe_op(name):
    """Declare ``<PROBES>::<name>`` with no kernel at all, as an op whose kernel has not landed."""
    global _PROBE_LIB
    if _PROBE_LIB is None:
        _PROBE_LIB = torch.library.Library(PROBES, 'DEF')
    if not _registration.declared([name], PROBES):
        _PROBE_LIB.define(f'{name}(Tensor(a!) x, float value) -> ()')
    return f'{PROBES}::{name}'


@needs_extension
def test_every_declared_op_is_settled_on_the_cpu():
    impls = _registration.implementations('cpu')
    for name in ('multi_tensor_adam_', 'multi_tensor_scale_', 'update_scale_hysteresis_',
                 'multi_tensor_adam8bit_'):
        assert impls[name] is getattr(torch.ops.mp_wrappers, name)
        assert _dispatch.implementation(name, torch.device('cpu')) is impls[name]
        assert _registration.has_compiled_kernel(name, 'cpu')


@needs_extension
def test_uncovered_device_types_get_the_references():
    # meta tensors (and CUDA in a CPU-only build) have no kernels of ours: the references.
    assert _dispatch.implementation('multi_tensor_scale_', torch.device('meta')) is \
        reference.multi_tensor_scale_
    if not _extension.extension().cuda_built:
        assert _registration.implementations('cuda') is None
        assert not _registration.has_compiled_kernel('multi_tensor_scale_', 'cuda')


@needs_extension
def test_a_declared_op_without_kernel_runs_its_registered_reference():
    qualified = _probe_op('probe_')
    calls = []

    def probe_reference(x, value):
        calls.append(value)
        x.fill_(value)

    compiled = _registration.register_references(['probe_'], ['cpu'], {'probe_': probe_reference},
                                                 namespace=PROBES)
    assert compiled == {'cpu': frozenset()}  # a reference is not a compiled kernel
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, 'CPU')
    x = torch.zeros(3)
    getattr(torch.ops, PROBES).probe_(x, 2.5)
    assert calls == [2.5] and torch.equal(x, torch.full((3,), 2.5))
    # Registering again (the extension reloaded) neither fails nor counts it as compiled.
    assert _registration.register_references(['probe_'], ['cpu'], {'probe_': probe_reference},
                                             namespace=PROBES) == {'cpu': frozenset()}


@needs_extension
def test_an_op_without_kernel_or_reference_stays_unserved():
    qualified = _probe_op('orphan_')
    assert _registration.register_references(['orphan_'], ['cpu'], {}, namespace=PROBES) == \
        {'cpu': frozenset()}
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, 'CPU')


@needs_extension
def test_reloading_the_extension_keeps_the_settlement(monkeypatch):
    before = dict(_registration.implementations('cpu'))
    monkeypatch.setattr(_extension, '_loaded', False)
    monkeypatch.setattr(_extension, '_ext', None)
    assert _extension.extension() is not None
    assert _registration.implementations('cpu') == before
    assert _registration.has_compiled_kernel('multi_tensor_adam_', 'cpu')


@needs_extension
@needs_compile
def test_public_ops_trace_whole():
    """A dispatcher query per call broke every trace; a lookup does not."""
    counter = CompileCounter()

    @torch.compile(fullgraph=True, backend=counter)
    def unscale_and_norm(tensors, flag):
        multi_tensor_scale(tensors, tensors, 0.5, flag)
        return multi_tensor_l2norm(tensors)[0]

    ts = [torch.arange(6.0), torch.ones(3)]
    want = [t * 0.5 for t in ts]
    flag = torch.zeros(1)
    total = unscale_and_norm(ts, flag)
    assert counter.frame_count == 1
    assert all(torch.equal(a, b) for a, b in zip(ts, want)) and flag.item() == 0
    assert torch.equal(total, multi_tensor_l2norm(want)[0])


@pytest.mark.skipif(not compat.has('fake_kernels'), reason='fake kernels need torch >= 2.4')
def test_a_fake_kernel_is_registered_only_for_a_declared_op():
    """An older build lacks the newest ops: their fake kernels are skipped, not an error that
    would drop the whole extension at import (its other ops' compiled kernels with it)."""
    def fake(x, value):
        return None

    # torch.library.register_fake itself refuses an op nobody declared
    with pytest.raises(Exception):
        torch.library.register_fake(f'{PROBES}::never_declared_')(fake)
    assert _registration.register_fake_if_declared('never_declared_', PROBES)(fake) is fake
    qualified = _probe_op('faked_')
    assert _registration.register_fake_if_declared('faked_', PROBES)(fake) is fake
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, 'Meta')
