"""What this machine computes natively, and what mp_wrappers makes of it. Three jobs, one module each:

* :mod:`.probe`: a cheap, cached capability probe of the CPU and the GPUs (instruction sets, compute
  capability, what oneDNN and torch may use, the last-level cache). Imports only torch, so every
  layer may ask it.
* :mod:`.policy`: what ``dtype='auto'`` means on a device (:func:`auto_dtype`) and the warning for
  an explicit dtype the device does not run natively (:func:`slowdown_reason`), from the probe.
* :mod:`.doctor`: the hardware half of the doctor (``python -m mp_wrappers``): every device, its
  ``dtype='auto'`` and the build of our extension, as plain data.

The probe does not import the other two; the policy imports the probe; the doctor imports both.
Every public name is re-exported here, so ``hardware.auto_dtype(...)``, ``hardware.report()`` and the
others work as before. (The doctor's module is not called ``report``: ``hardware.report`` has to stay
the function, and a submodule of that name would be shadowed by it.)
"""
from .doctor import extension_info, report
from .policy import AutoDtype, auto_dtype, resolve_dtype, slowdown_reason
from .probe import (DeviceCapability, cpu_capability, cpu_flags, cuda_capability,
                    device_capability, last_level_cache_bytes)

__all__ = ['DeviceCapability', 'AutoDtype', 'cpu_flags', 'cpu_capability', 'cuda_capability',
           'device_capability', 'auto_dtype', 'resolve_dtype', 'slowdown_reason',
           'extension_info', 'report', 'last_level_cache_bytes']
