import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    # The reference fallback warns once when the extension is not built; tests cover both paths.
    warnings.filterwarnings('ignore', message='mp_wrappers: the C\\+\\+ extension')


# ---- CPU kernel flavours --------------------------------------------------------------------------
CPU_ISAS = ('avx512', 'avx2', 'baseline')  # widest first, as the extension orders them


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request):
    """Run a kernel-vs-reference test once per CPU kernel flavour this machine can run.

    Switches the extension's flavour in this process (``_C._set_cpu_isa``) and puts it back after
    the test; a flavour wider than the CPU skips, naming what is missing. A test parametrised over
    ``device`` runs its CUDA case once (the switch concerns CPU kernels only).
    """
    from mp_wrappers.ops._extension import extension
    isa = request.param
    device = getattr(getattr(request.node, 'callspec', None), 'params', {}).get('device', 'cpu')
    ext = extension()
    if ext is None:
        if isa != CPU_ISAS[0]:
            pytest.skip('the C++ extension is not built: the references run once')
        yield None
        return
    widest = ext.cpu_isa_hardware()
    if str(device).startswith('cuda'):
        if isa != widest:
            pytest.skip('the CPU kernel flavour does not matter for a CUDA case')
        yield isa
        return
    if CPU_ISAS.index(isa) < CPU_ISAS.index(widest):
        pytest.skip(f'this CPU cannot run the {isa} kernels (the widest it supports is {widest})')
    previous = ext._set_cpu_isa(isa)
    try:
        yield isa
    finally:
        ext._set_cpu_isa(previous)
