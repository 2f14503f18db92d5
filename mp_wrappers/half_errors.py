"""A hint for errors raised when a half tensor reaches code that cannot take it.

mmengine models compute their losses, and toolboxes' heads their training accuracies, inside the
model's forward, some of them with numpy, which has no bfloat16 (mmaction2's
``BaseHead.loss_by_feat`` calls ``top_k_accuracy(cls_scores.detach().cpu().numpy(), ...)``:
``TypeError: Got unsupported ScalarType BFloat16``), or with CPU ops that have no half kernel. Casting
the model's outputs back to fp32 comes too late. The fix is to keep that module in fp32
(``fp32_modules``); :func:`add_half_hint` says so, naming the module the error came from.
"""
from types import TracebackType
from typing import Optional

from torch import nn

__all__ = ['half_hint', 'add_half_hint']

# What such errors say: numpy's conversion, and a torch op without a kernel for the dtype.
_MARKERS = ('unsupported ScalarType BFloat16', "not implemented for 'BFloat16'",
            "not implemented for 'Half'")


def _raising_module(tb: Optional[TracebackType], model: nn.Module) -> Optional[str]:
    """Qualified name of the innermost submodule of ``model`` whose code is in the traceback."""
    names = {id(m): n for n, m in model.named_modules() if n}
    found = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get('self')
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


def half_hint(exc: BaseException, model: nn.Module, option_owner: str) -> Optional[str]:
    """The hint for ``exc`` raised inside ``model``'s forward, or None if it is another error.

    Args:
        exc: The error.
        model: The (unwrapped) model whose forward raised it.
        option_owner: Where ``fp32_modules`` goes, e.g. ``'optim_wrapper'``.
    """
    text = str(exc)
    if not isinstance(exc, (TypeError, RuntimeError, NotImplementedError)) or not any(
            marker in text for marker in _MARKERS):
        return None
    dtype = 'bfloat16' if ('BFloat16' in text) else 'float16'
    name = _raising_module(exc.__traceback__, model)
    if name is None:
        where = 'inside the model'
        fix = "fp32_modules=['<the module that raised it>']"
    else:
        module = model.get_submodule(name)
        where = f'inside {type(module).__name__} {name!r}'
        fix = f'fp32_modules=[{name!r}]'
    return (f'mp_wrappers: a {dtype} tensor reached code that cannot take it {where} (numpy has '
            'no bfloat16; some CPU ops have no half kernel). Keep that module in fp32, with fp32 '
            f'inputs and outputs, by adding {fix} to the {option_owner} config.')


def add_half_hint(exc: BaseException, model: nn.Module,
                  option_owner: str = 'optim_wrapper') -> BaseException:
    """``exc`` with :func:`half_hint` appended to its message (the same type), or ``exc`` itself."""
    hint = half_hint(exc, model, option_owner)
    if hint is None:
        return exc
    try:
        new = type(exc)(f'{exc}\n{hint}')
    except Exception:  # an exception type with another constructor: keep the original
        return exc
    new.__cause__ = exc
    return new

