#include "mp_wrappers/cpu_features.h"

#include <cstdlib>
#include <cstring>

namespace mp_wrappers {
namespace {

CpuIsa detect() {
  CpuIsa best = CpuIsa::kBaseline;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // F16C and FMA come with every AVX2 CPU we target, but check them: the kernels use both.
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  best = avx512 ? CpuIsa::kAvx512 : (avx2 ? CpuIsa::kAvx2 : CpuIsa::kBaseline);
#endif
  const char* forced = std::getenv("MP_WRAPPERS_CPU_ISA");
  if (forced != nullptr) {
    CpuIsa want = best;
    if (std::strcmp(forced, "baseline") == 0) want = CpuIsa::kBaseline;
    else if (std::strcmp(forced, "avx2") == 0) want = CpuIsa::kAvx2;
    else if (std::strcmp(forced, "avx512") == 0) want = CpuIsa::kAvx512;
    // Never go wider than the hardware allows: that would crash with SIGILL.
    if (static_cast<int>(want) < static_cast<int>(best)) best = want;
  }
  return best;
}

}  // namespace

CpuIsa cpu_isa() {
  static const CpuIsa isa = detect();
  return isa;
}

const char* cpu_isa_name() {
  switch (cpu_isa()) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace mp_wrappers
