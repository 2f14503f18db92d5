"""The ``amp_*`` scalars the wrappers publish to mmengine's MessageHub, and when.

Names without ``loss``/``grad_norm``, which mmengine would print as 10-iteration means:
``amp_scale`` (``amp_scale_<k>`` for loss ``k`` > 0), ``amp_skipped`` (total),
``amp_skipped_recent`` (since the previous publication), ``amp_gnorm`` (norm of the unscaled
gradients the optimizer stepped with). A publication reads device state (a host sync), so it
follows the LoggerHook's cadence rather than every step.
"""
from typing import Optional, Sequence

from mmengine.logging import MessageHub
from torch import Tensor

from ..scaler import LossScaler

__all__ = ['publish_due', 'publishes_every_step', 'publish_amp_scalars']


def publish_due(hub: MessageHub, publish_now: Optional[bool], log_interval: Optional[int]) -> bool:
    """Whether this iteration's log line is due: ``publish_now`` when the lifecycle hook set it,
    else every ``log_interval`` (10, the LoggerHook's default) iterations; always outside a loop."""
    if publish_now is not None:
        return publish_now
    it = hub.get_info('iter')
    if it is None:
        return True
    interval = 10 if log_interval is None else log_interval
    return (it + 1) % interval == 0


def publishes_every_step(hub: MessageHub, publish_now: Optional[bool]) -> bool:
    """Outside a training loop (no MessageHub ``iter``) every step publishes, unless told not to
    (``publish_now=False``): a publication reads the device (Note [deferred outcomes])."""
    return hub.get_info('iter') is None and publish_now is not False


def publish_amp_scalars(hub: MessageHub, scalers: Sequence[LossScaler], skipped_published: int,
                        grad_norm: Optional[Tensor]) -> int:
    """Write the ``amp_*`` scalars; returns the skipped total, the next ``skipped_published``."""
    for k, scaler in enumerate(scalers):
        hub.update_scalar('train/amp_scale' if k == 0 else f'train/amp_scale_{k}',
                          scaler.loss_scale)
    total = sum(s.skipped_steps for s in scalers)
    hub.update_scalar('train/amp_skipped', float(total))
    hub.update_scalar('train/amp_skipped_recent', float(total - skipped_published))
    if grad_norm is not None:
        hub.update_scalar('train/amp_gnorm', float(grad_norm))
    return total
