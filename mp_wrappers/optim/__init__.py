"""Fused optimizers: apex's FusedAdam, FusedSGD, FusedLAMB, FusedAdagrad and FusedNovoGrad.

Each updates its parameters with one ``mp_wrappers`` multi-tensor op per (group, device, dtype)
bucket, unscales and skips on the device (``torch.amp.GradScaler`` compatible) and implements the
fused mixed-precision step (:meth:`FusedOptimizer.fused_master_step`). All are registered in
``mp_wrappers.registry.OPTIMIZERS``, so configs can say ``type='mp_wrappers.FusedAdam'``.
"""
from .adagrad import FusedAdagrad
from .adam import FusedAdam
from .base import FusedOptimizer
from .lamb import FusedLAMB
from .novograd import FusedNovoGrad
from .sgd import FusedSGD

__all__ = ['FusedOptimizer', 'FusedAdam', 'FusedSGD', 'FusedLAMB', 'FusedAdagrad',
           'FusedNovoGrad']
