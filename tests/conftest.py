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
