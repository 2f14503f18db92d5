"""Gated features (mp_wrappers.compat): each refuses in one line on a torch without its API.

Every gate is tested here on any torch by making compat report the feature missing (as torch 2.1
does); the oldest-stack CI lane (tools/compat_matrix.sh oldest) runs the same tests where the
features are really missing, and the suite's own skips there carry the same lines.
"""
import importlib.util

import pytest
import torch
from torch import nn

import mp_wrappers
from mp_wrappers import compat
from mp_wrappers.compat import FeatureUnavailableError


@pytest.fixture
def without(monkeypatch):
    """``without('fsdp2')``: compat reports that feature missing for the rest of the test."""
    def remove(*features):
        real = compat.has.__wrapped__

        def has(feature):
            return False if feature in features else real(feature)
        monkeypatch.setattr(compat, 'has', has)
    return remove


def test_every_feature_probes_without_error():
    for name in compat.FEATURES:
        assert compat.has(name) in (True, False)


def test_unknown_feature_is_named():
    with pytest.raises(ValueError, match=r"unknown feature 'nope'; known: \["):
        compat.has('nope')


@pytest.mark.parametrize('feature', sorted(compat.FEATURES))
def test_refusal_is_one_line_naming_feature_versions_and_alternative(without, feature):
    without(feature)
    with pytest.raises(FeatureUnavailableError) as info:
        compat.require(feature)
    msg = str(info.value)
    f = compat.FEATURES[feature]
    assert '\n' not in msg
    assert msg.startswith(f'{f.title} needs torch >= {f.min_torch} (found {torch.__version__})')
    assert f'{f.api} is missing' in msg and f'install torch>={f.min_torch}' in msg
    assert f.instead in msg


def test_features_present_on_the_torch_they_need():
    # Feature detection must agree with the release each one names (a probe that fails on a torch
    # that has the API would gate a working feature).
    version = compat.torch_version_tuple()[:2]
    for name, f in compat.FEATURES.items():
        if version >= compat.torch_version_tuple(f.min_torch)[:2]:
            assert compat.has(name), f'{name} should be present on torch {torch.__version__}'


def test_torch_version_tuple():
    assert compat.torch_version_tuple('2.1.2+cu121') == (2, 1, 2)
    assert compat.torch_version_tuple('2.15.0.dev20261101') == (2, 15, 0)
    assert compat.torch_version_tuple('2.14') == (2, 14, 0)
    assert compat.torch_version_tuple() >= compat.TORCH_MIN


def test_newest_tested_matches_setup_and_docs():
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    text = (root / 'docs' / 'compatibility.md').read_text()
    assert f'torch {compat.TORCH_NEWEST_TESTED}' in text
    assert f"torch>={'.'.join(map(str, compat.TORCH_MIN))}" in (root / 'setup.py').read_text()


# ---- each gate, where it is used ----------------------------------------------------------------

def test_split_masters_refused_in_the_wrapper(without):
    without('uint16')
    with pytest.raises(FeatureUnavailableError, match=r"^master_weights='split' .* needs torch >= 2\.3"):
        mp_wrappers.ApexOptimWrapper(optimizer=mp_wrappers.FusedAdam(nn.Linear(2, 2).parameters()),
                                     opt_level='O2', dtype='bfloat16', master_weights='split')


def test_split_storage_refused_in_the_optimizer_and_the_op(without):
    without('uint16')
    with pytest.raises(FeatureUnavailableError, match='torch.uint16 is missing'):
        mp_wrappers.FusedAdam(nn.Linear(2, 2).parameters(), bf16_storage='split')
    from mp_wrappers.ops import multi_tensor_adam_lean
    p = [torch.zeros(4, dtype=torch.bfloat16)]
    with pytest.raises(FeatureUnavailableError, match='torch.uint16 is missing'):
        multi_tensor_adam_lean(p, p, p, [torch.zeros(4)], [torch.zeros(4)], torch.zeros(1),
                               1e-3, 0.9, 0.999, 1e-8, 0., True, True, 'split')


def test_kahan_and_stochastic_need_no_uint16(without):
    without('uint16')
    for storage in ('kahan', 'stochastic'):
        mp_wrappers.FusedAdam(nn.Linear(2, 2).parameters(), bf16_storage=storage)


def test_fp16_on_cpu_refused_by_o1_o2_and_fp16_wrapper(without):
    without('cpu_fp16')
    model = nn.Linear(4, 2)
    for level in ('O1', 'O2'):
        w = mp_wrappers.ApexOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         opt_level=level, dtype='float16')
        with pytest.raises(FeatureUnavailableError, match=r"^dtype='float16' on CPU .* needs torch >= 2\.2"):
            with w.optim_context(model):
                model(torch.randn(3, 4))
    half = nn.Linear(4, 2).half()
    with pytest.raises(FeatureUnavailableError, match="use dtype='bfloat16' or 'auto' on CPU"):
        mp_wrappers.FP16OptimWrapper(optimizer=torch.optim.SGD(half.parameters(), lr=0.1))


def test_bf16_on_cpu_unaffected_by_the_fp16_gate(without):
    without('cpu_fp16')
    model = nn.Linear(4, 2)
    w = mp_wrappers.ApexOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     opt_level='O1', dtype='bfloat16')
    with w.optim_context(model):
        out = model(torch.randn(3, 4))
    assert out.dtype == torch.bfloat16


def test_fsdp2_refused_before_anything_is_sharded(without):
    without('fsdp2')
    from mp_wrappers.distributed import FullyShardedModel
    from mp_wrappers.distributed.checkpoint import sharded_state_dict
    with pytest.raises(FeatureUnavailableError, match=r'^FSDP2 .* needs torch >= 2\.6 .*FSDP1'):
        FullyShardedModel(nn.Linear(2, 2), dtype='bfloat16')
    with pytest.raises(FeatureUnavailableError, match='FSDP2'):
        sharded_state_dict(nn.Linear(2, 2), None)


def test_secure_loader_skipped_on_import_refused_when_asked(without, monkeypatch):
    from mp_wrappers import checkpoint
    without('safe_globals')
    monkeypatch.setattr(checkpoint, 'install_secure_checkpoint_loader',
                        lambda: pytest.fail('must not be installed without safe_globals'))
    assert checkpoint._install_from_env() is False
    monkeypatch.undo()
    without('safe_globals')
    with pytest.raises(FeatureUnavailableError, match=r'weights_only checkpoint loader .* needs torch >= 2\.5'):
        checkpoint.install_secure_checkpoint_loader()
    with pytest.raises(FeatureUnavailableError, match='safe_globals is missing'):
        checkpoint.secure_torch_load('/nonexistent')


def test_extension_loads_without_fake_kernels(without, monkeypatch):
    """Eager ops need no fake kernels: on torch < 2.4 the extension loads without them."""
    from mp_wrappers.ops import _extension
    if _extension.extension() is None:
        pytest.skip('the extension is not built')
    without('fake_kernels')
    monkeypatch.setattr(_extension, '_loaded', False)
    monkeypatch.setattr(_extension, '_ext', None)
    assert _extension.extension() is not None


def test_autocast_helpers_match_torch():
    with torch.autocast(device_type='cpu', dtype=torch.bfloat16):
        assert compat.autocast_enabled('cpu')
        assert compat.autocast_dtype('cpu') == torch.bfloat16
    assert not compat.autocast_enabled('cpu')


def test_load_state_dict_pre_hook_helper_runs_the_hook():
    seen = []
    m = nn.Linear(2, 2)
    handle = compat.register_load_state_dict_pre_hook(m, lambda mod, sd, prefix, *a: seen.append(mod))
    m.load_state_dict(m.state_dict())
    handle.remove()
    assert seen == [m]


# ---- install behaviour (tools/install.sh asks tools/torch_range.py) --------------------------------

def _torch_range():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / 'tools' / 'torch_range.py'
    spec = importlib.util.spec_from_file_location('torch_range', path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_install_range_is_compat_range():
    low, newest = _torch_range().supported_range()
    assert low == compat.TORCH_MIN and newest == compat.TORCH_NEWEST_TESTED


@pytest.mark.parametrize('version,status,words', [
    ('2.0.1', 1, ['torch 2.0.1 is not supported', 'needs torch >= 2.1', 'pip install "torch==']),
    ('1.13.1+cu117', 1, ['is not supported']),
    ('2.1.2+cu121', 0, ['is supported']),
    ('2.13.0+cpu', 0, ['is supported']),
    ('2.14.1', 0, ['is supported']),
    ('2.15.0', 0, ['warning: torch 2.15.0 is newer than the newest tested (2.14.1']),
    ('2.15.0.dev20261201+cpu', 0, ['warning:']),
])
def test_install_verdict_is_one_line(version, status, words):
    got, line = _torch_range().verdict(version)
    assert got == status and '\n' not in line
    for w in words:
        assert w in line


def test_install_sh_consults_the_range_before_keeping_or_installing():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / 'tools' / 'install.sh').read_text()
    keep = text.index('keeping torch')
    install = text.index('installing torch==')
    assert text.index('torch_range.py --installed') < keep
    assert text.index('torch_range.py "$TORCH_VERSION"') < install


def test_fsdp1_on_cpu_refused_when_the_strategy_wraps(without):
    if torch.cuda.is_available():
        pytest.skip('the gate concerns FSDP1 on CPU')
    from mp_wrappers.distributed import MixedPrecisionFSDPStrategy
    without('fsdp_cpu')
    strategy = MixedPrecisionFSDPStrategy()
    with pytest.raises(FeatureUnavailableError, match=r'^FSDP1 on CPU .* needs torch >= 2\.4'):
        strategy._wrap_model(nn.Linear(2, 2))


# ---- Note [inductor's cache and ATEN_CPU_CAPABILITY] -----------------------------------------------

@pytest.fixture
def inductor_env(monkeypatch, tmp_path):
    """A temp dir of our own (torch's default directory is computed from it too) and neither
    variable set; both restored after the test."""
    monkeypatch.setattr(compat.tempfile, 'gettempdir', lambda: str(tmp_path))
    monkeypatch.delenv('TORCHINDUCTOR_CACHE_DIR', raising=False)
    monkeypatch.delenv('ATEN_CPU_CAPABILITY', raising=False)
    return monkeypatch, tmp_path


def _cache_dir():
    return compat.os.environ.get('TORCHINDUCTOR_CACHE_DIR')


@pytest.mark.parametrize('capability', ['avx2', 'avx512', 'default'])
def test_isolate_inductor_cache_keys_the_directory_by_aten_cpu_capability(inductor_env, capability):
    monkeypatch, tmp = inductor_env
    monkeypatch.setenv('ATEN_CPU_CAPABILITY', capability)
    directory = compat.isolate_inductor_cache()
    assert directory == compat._default_inductor_cache_dir() + f'_aten_{capability}'
    assert directory.startswith(str(tmp) + '/torchinductor_') and _cache_dir() == directory


@pytest.mark.parametrize('value', [None, '', 'AVX2', 'avx2 ', 'bogus'])
def test_isolate_inductor_cache_leaves_a_value_inductor_ignores_in_the_default(inductor_env, value):
    """Inductor matches the value exactly; any other (or none) means the widest ISA, as without
    the variable: torch's default directory, never the avx2 graphs' one."""
    monkeypatch, _ = inductor_env
    if value is not None:
        monkeypatch.setenv('ATEN_CPU_CAPABILITY', value)
    assert compat.isolate_inductor_cache() is None and _cache_dir() is None


def test_isolate_inductor_cache_with_a_tag_keys_every_case(inductor_env):
    monkeypatch, _ = inductor_env
    unset = compat.isolate_inductor_cache('suite')
    monkeypatch.setenv('ATEN_CPU_CAPABILITY', 'default')  # scalar code: not the unset case
    assert unset.endswith('_suite_aten_unset')
    assert compat.isolate_inductor_cache('suite').endswith('_suite_aten_default')


def test_isolate_inductor_cache_keeps_a_directory_the_user_chose(inductor_env):
    monkeypatch, tmp = inductor_env
    monkeypatch.setenv('ATEN_CPU_CAPABILITY', 'avx2')
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp / 'mine'))
    assert compat.isolate_inductor_cache('suite') is None and _cache_dir() == str(tmp / 'mine')


def test_isolate_inductor_cache_replaces_the_default_torch_wrote(inductor_env):
    """torch writes its default directory into the variable on first use (a feature probe does
    it): that is not a user's choice, so the capability still gets its own directory."""
    monkeypatch, _ = inductor_env
    default = compat._default_inductor_cache_dir()
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', default + '/')
    monkeypatch.setenv('ATEN_CPU_CAPABILITY', 'avx2')
    assert compat.isolate_inductor_cache() == default + '_aten_avx2'


def test_isolate_inductor_cache_redoes_a_directory_a_parent_process_chose(inductor_env):
    """A child inherits the variable: a directory of ours, for another value, is redone."""
    monkeypatch, _ = inductor_env
    default = compat._default_inductor_cache_dir()
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', default + '_aten_avx2')
    assert compat.isolate_inductor_cache() == default  # the child has no variable: the default
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', default + '_mp_wrappers_tests_aten_unset')
    monkeypatch.setenv('ATEN_CPU_CAPABILITY', 'avx2')
    # compile_step's call (no tag) keeps the suite's directory; the suite's own call redoes it.
    assert compat.isolate_inductor_cache() is None
    assert compat.isolate_inductor_cache('mp_wrappers_tests') == default + '_mp_wrappers_tests_aten_avx2'


def test_isolate_inductor_cache_without_a_user_name(inductor_env):
    monkeypatch, _ = inductor_env

    def no_user():
        raise KeyError('getpwuid(): uid not found')
    monkeypatch.setattr(compat.getpass, 'getuser', no_user)
    monkeypatch.setenv('ATEN_CPU_CAPABILITY', 'avx2')
    assert '/torchinductor_uid_' in compat.isolate_inductor_cache()


def test_the_suite_compiles_into_a_cache_of_its_aten_cpu_capability(suite_inductor_cache):
    """tests/conftest.py gave the suite's inductor graphs a cache of their capability, unless the
    runner chose a directory (TORCHINDUCTOR_CACHE_DIR set before the session)."""
    if suite_inductor_cache is None:
        pytest.skip(f'the runner chose TORCHINDUCTOR_CACHE_DIR: {_cache_dir()}')
    value = compat.os.environ.get('ATEN_CPU_CAPABILITY')
    key = value if value in compat._ATEN_CAPABILITIES else 'unset'
    assert suite_inductor_cache.endswith(f'_mp_wrappers_tests_aten_{key}')
    assert _cache_dir() == suite_inductor_cache
