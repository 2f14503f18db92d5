"""Skip markers for tests of features the installed torch lacks (mp_wrappers.compat).

A test that *uses* a gated feature needs no marker: tests/conftest.py reports its
``FeatureUnavailableError`` as a skip with that one-line reason. These markers are for tests that
call the torch API directly (torch.amp.GradScaler on CPU, torch.library.opcheck).
"""
import os

import pytest
import torch

from mp_wrappers import compat
from mp_wrappers.ops import _extension

__all__ = ['requires', 'needs_cpu_grad_scaler', 'needs_extension', 'needs_opcheck',
           'needs_schedulers_writing_1_element_lr', 'opcheck']


def requires(feature: str):
    """Skip unless the installed torch has ``feature`` (a key of ``compat.FEATURES``)."""
    f = compat.FEATURES[feature]
    return pytest.mark.skipif(not compat.has(feature),
                              reason=f'{f.title} needs torch >= {f.min_torch} (found '
                                     f'{torch.__version__}: {f.api} is missing)')


# Tests of the extension's ops skip where it is not built, except on a GPU run
# (MP_WRAPPERS_TEST_REQUIRE_CUDA=1): there the CUDA cases go on to tests/conftest.py's check, which
# fails them (a GPU run once reported such a module as all skipped after its build had failed).
# The module's CPU cases then run without the extension too, and fail: a GPU run has no business
# without it.
needs_extension = pytest.mark.skipif(
    _extension.extension() is None and os.environ.get('MP_WRAPPERS_TEST_REQUIRE_CUDA') != '1',
    reason='the extension is not built')
# torch.amp.GradScaler('cpu') is torch >= 2.3 (torch.cuda.amp.GradScaler before: CUDA only).
needs_cpu_grad_scaler = pytest.mark.skipif(
    not hasattr(torch.amp, 'GradScaler'),
    reason=f'torch.amp.GradScaler (on CPU) needs torch >= 2.3 (found {torch.__version__})')
# torch.library.opcheck is torch >= 2.4, like the fake kernels it checks.
needs_opcheck = pytest.mark.skipif(
    not hasattr(torch.library, 'opcheck') or not compat.has('fake_kernels'),
    reason=f'torch.library.opcheck and register_fake need torch >= 2.4 (found {torch.__version__})')



def _torch_schedulers_write_a_1_element_lr() -> bool:
    # torch 2.6's schedulers write a tensor lr with fill_(new lr), which takes 0-dim values only, and
    # the new lr of a 1-element lr is a 1-element tensor; torch 2.13's convert it to a number first.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=torch.tensor([0.1]))
    try:
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, 20)
    except RuntimeError:
        return False
    return True


# Our device lrs have one element (Note [capturable] in mp_wrappers/optim/base.py).
needs_schedulers_writing_1_element_lr = pytest.mark.skipif(
    not _torch_schedulers_write_a_1_element_lr(),
    reason=f"torch {torch.__version__}'s LR schedulers cannot update a 1-element tensor lr (fill_ "
           "takes 0-dim values); a 0-dim lr, and mmengine's schedulers (which assign), work")


def opcheck(packet, args) -> None:
    """``torch.library.opcheck`` of one of our ops, minus AOT dispatch where torch cannot do it.

    torch 2.4 cannot functionalize a custom op that mutates a Tensor[] (auto_functionalize takes
    them from a later release), so the AOT dispatch of the list-updating ops is not checked there;
    the same question decides whether torch.compile can trace them (compat ``compile_list_ops``).
    """
    from torch._higher_order_ops.auto_functionalize import can_auto_functionalize
    utils = torch.library._OPCHECK_DEFAULT_UTILS
    overload = packet.default
    if overload._schema.is_mutable and not can_auto_functionalize(overload):
        utils = tuple(u for u in utils if u != 'test_aot_dispatch_dynamic')
    torch.library.opcheck(packet, args, test_utils=utils)
