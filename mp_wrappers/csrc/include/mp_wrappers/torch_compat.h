// What the torch we are built against has, for the few places where torch 2.1-2.14 differ in C++.
// mp_wrappers supports torch >= 2.1 (docs/compatibility.md); Python gates the same features by
// feature detection (mp_wrappers/compat.py) and refuses them before a kernel is reached, so these
// checks only turn a compile error on an old torch into the same one-line refusal.
#pragma once

#include <torch/version.h>

// at::kUInt16 (torch.uint16) exists from torch 2.3; the lean 'split' storage keeps its low halves
// in it, so 'split' needs torch >= 2.3 and the other storages work everywhere.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define MP_WRAPPERS_HAS_UINT16 1
#else
#define MP_WRAPPERS_HAS_UINT16 0
#endif

#define MP_WRAPPERS_TORCH_VERSION_STR \
  MP_WRAPPERS_STR(TORCH_VERSION_MAJOR) "." MP_WRAPPERS_STR(TORCH_VERSION_MINOR) "." \
  MP_WRAPPERS_STR(TORCH_VERSION_PATCH)
#define MP_WRAPPERS_STR(x) MP_WRAPPERS_STR_(x)
#define MP_WRAPPERS_STR_(x) #x
