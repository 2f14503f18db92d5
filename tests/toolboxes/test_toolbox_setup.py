"""The toolbox tests' own set-up: a missing toolbox skips them with the install command, and fails
them under MP_WRAPPERS_REQUIRE_TOOLBOXES=1 (as .ci/run sets after installing)."""
import pytest

from _toolbox_runs import REQUIRE_ENV, require_toolbox


def test_missing_toolbox_skips_naming_the_install_script(monkeypatch):
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception,
                       match=r'mp_wrappers_no_such_toolbox 1\.0 is not installed \(run '
                             r'`bash tools/install_toolboxes\.sh`; CI does\)'):
        require_toolbox('mp_wrappers_no_such_toolbox', 'mp_wrappers_no_such_toolbox', '1.0')


def test_missing_toolbox_fails_when_required(monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, '1')
    with pytest.raises(pytest.fail.Exception,
                       match=f'{REQUIRE_ENV}=1 but mp_wrappers_no_such_toolbox 1.0 is not installed'):
        require_toolbox('mp_wrappers_no_such_toolbox', 'mp_wrappers_no_such_toolbox', '1.0')
