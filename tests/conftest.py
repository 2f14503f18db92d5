import os
import sys
import warnings

import pytest
import torch

# Note [test layout]: tests live in tests/<layer>/test_<module>.py, one folder per layer of
# docs/architecture.md (plus workflows/, toolboxes/, tools/ and repo/ for what spans layers), with
# file names unique across folders. Their shared helpers (_workflow.py, _guards.py, ...) sit here,
# and some tests reuse another layer's cases (the CUDA host tests run the CPU kernel tests' cases),
# so every test folder is importable by module name whichever file pytest was given.
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _folder in sorted(os.listdir(_TESTS)):
    _path = os.path.join(_TESTS, _folder)
    if os.path.isdir(_path) and not _folder.startswith(('_', '.')) and _folder != 'configs':
        if _path not in sys.path:
            sys.path.append(_path)

# Set by tools/gpu_check.sh: on a GPU machine a CUDA case that would skip (no CUDA kernels built)
# fails instead, so a GPU session cannot pass by skipping everything it was started for.
REQUIRE_CUDA_ENV = 'MP_WRAPPERS_TEST_REQUIRE_CUDA'

# The inductor cache directory pytest_configure set for the session (None: the runner chose one).
INDUCTOR_CACHE_KEY = pytest.StashKey()


@pytest.fixture
def suite_inductor_cache(request):
    """The inductor cache directory pytest_configure set for the session (None: the runner chose)."""
    return request.config.stash[INDUCTOR_CACHE_KEY]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _guard_canaries():
    """The guards of every tensor a test made with tests/_guards.py must be intact at its end."""
    import _guards
    _guards.reset()
    yield
    try:
        _guards.check_all('at the end of the test')
    finally:
        _guards.reset()


@pytest.fixture(params=['tools_train', 'toolbox'])
def launcher(request):
    """Note [two launchers] (tests/_workflow.py): make_runner builds its Runner as our
    tools/train.py does, then as a toolbox's train script does (no hook of ours)."""
    import _workflow
    _workflow.LAUNCHER[0] = request.param
    yield request.param
    _workflow.LAUNCHER[0] = 'tools_train'


def pytest_configure(config):
    # The reference fallback warns once when the extension is not built; tests cover both paths.
    warnings.filterwarnings('ignore', message='mp_wrappers: the C\\+\\+ extension')
    # Compiled graphs of this suite in a cache of their own per ATEN_CPU_CAPABILITY (Note
    # [inductor's cache and ATEN_CPU_CAPABILITY] in mp_wrappers/compat.py): a run with
    # ATEN_CPU_CAPABILITY=avx2 no longer leaves graphs that crash the next run without it.
    from mp_wrappers import compat
    config.stash[INDUCTOR_CACHE_KEY] = compat.isolate_inductor_cache('mp_wrappers_tests')


class _NoReferenceOnCuda:
    """Stands in for mp_wrappers.ops.reference inside the dispatcher during a CUDA case."""

    def __getattr__(self, name):
        raise AssertionError(f'mp_wrappers.ops: the pure-PyTorch reference of {name} was picked in a '
                             'CUDA test case instead of our CUDA kernel (no CUDA kernel is registered '
                             'for it); a CUDA case must run our kernels')


def _cuda_case_skip_reason():
    """Why a CUDA case cannot run our CUDA kernels here, or None when it can."""
    if not torch.cuda.is_available():
        return 'no CUDA device'
    from mp_wrappers import ops
    b = ops.backend()
    if b['cuda'] != 'cuda':
        return (f"the build has no CUDA kernels: mp_wrappers.ops.backend()['cuda'] is {b['cuda']!r} "
                f"(extension loaded: {b['extension']}, error: {b['error']}); rebuild with "
                'MP_WRAPPERS_CUDA=1 pip install --no-build-isolation -e . to see why')
    return None


@pytest.fixture(autouse=True)
def _cuda_cases_run_our_kernels(request, monkeypatch):
    """Every test case parametrised with a CUDA ``device`` runs our CUDA kernels or is skipped.

    Without this a CUDA case passed when the build had no CUDA kernels: the public ops fell back to
    the references, and the test compared a reference with itself (issue 12, item 3). Here a CUDA case
    asserts ``ops.backend()['cuda'] == 'cuda'`` (skipping with the reason otherwise, failing under
    MP_WRAPPERS_TEST_REQUIRE_CUDA=1), and any fallback to a reference inside the dispatcher during
    the case fails it.
    """
    callspec = getattr(request.node, 'callspec', None)
    device = callspec.params.get('device') if callspec is not None else None
    if not isinstance(device, (str, torch.device)) or torch.device(device).type != 'cuda':
        yield
        return
    reason = _cuda_case_skip_reason()
    if reason is not None:
        if os.environ.get(REQUIRE_CUDA_ENV) == '1':
            pytest.fail(f'{REQUIRE_CUDA_ENV}=1 but {reason}')
        pytest.skip(reason)
    from mp_wrappers import ops
    from mp_wrappers.ops import _dispatch
    assert ops.backend()['cuda'] == 'cuda'
    monkeypatch.setattr(_dispatch, 'reference', _NoReferenceOnCuda())
    yield
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


# ---- features the installed torch lacks ------------------------------------------------------------
# mp_wrappers supports torch >= 2.1; a feature resting on a newer torch API raises
# mp_wrappers.compat.FeatureUnavailableError (one line) where that API is missing. A test that uses
# such a feature is reported as skipped with exactly that line (on a torch that has the feature the
# error cannot occur, so nothing is hidden there). torch 2.1's own missing fp16 CPU kernels
# ("addmm_impl_cpu_" not implemented for 'Half'), reached by tests that build an fp16 model without
# one of our wrappers, are reported the same way, and only on a torch without them.
def _gated_reason(exc):
    from mp_wrappers import compat
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, compat.FeatureUnavailableError):
            return str(exc)
        if (isinstance(exc, RuntimeError) and "not implemented for 'Half'" in str(exc)
                and not compat.has('cpu_fp16')):
            f = compat.FEATURES['cpu_fp16']
            return (f'{f.title} needs torch >= {f.min_torch} (found {torch.__version__}): '
                    f'{str(exc).splitlines()[0]}')
        exc = exc.__cause__ or exc.__context__
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or report.when == 'teardown' or call.excinfo.errisinstance(pytest.skip.Exception):
        return
    reason = _gated_reason(call.excinfo.value)
    if reason is not None:
        report.outcome = 'skipped'
        report.longrepr = (str(item.path), item.location[1] or 0, f'Skipped: {reason}')
