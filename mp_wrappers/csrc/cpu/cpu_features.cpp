#include "mp_wrappers/cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace mp_wrappers {
namespace {

CpuIsa detect_hardware() {
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
  return best;
}

CpuIsa hardware_isa() {
  static const CpuIsa isa = detect_hardware();
  return isa;
}

bool parse_isa(const char* name, CpuIsa* out) {
  if (std::strcmp(name, "baseline") == 0) *out = CpuIsa::kBaseline;
  else if (std::strcmp(name, "avx2") == 0) *out = CpuIsa::kAvx2;
  else if (std::strcmp(name, "avx512") == 0) *out = CpuIsa::kAvx512;
  else return false;
  return true;
}

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

CpuIsa initial_isa() {
  CpuIsa best = hardware_isa();
  const char* forced = std::getenv("MP_WRAPPERS_CPU_ISA");
  CpuIsa want = best;
  // An unknown value keeps the hardware's choice (backend() shows which one is in use), and a wider
  // one than the hardware is never taken: that would crash with SIGILL.
  if (forced != nullptr && parse_isa(forced, &want) &&
      static_cast<int>(want) < static_cast<int>(best)) {
    best = want;
  }
  return best;
}

// -1 until the first cpu_isa() call reads the environment; an atomic so that set_cpu_isa() from one
// thread is seen by OpenMP workers of the next kernel without a data race.
std::atomic<int> g_isa{-1};

}  // namespace

CpuIsa cpu_isa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    int expected = -1;
    g_isa.compare_exchange_strong(expected, static_cast<int>(initial_isa()));
    isa = g_isa.load(std::memory_order_relaxed);
  }
  return static_cast<CpuIsa>(isa);
}

const char* cpu_isa_name() { return isa_name(cpu_isa()); }

const char* cpu_isa_hardware_name() { return isa_name(hardware_isa()); }

const char* set_cpu_isa(const char* name) {
  CpuIsa want;
  if (!parse_isa(name, &want)) {
    throw std::invalid_argument(std::string("set_cpu_isa: unknown ISA '") + name +
                                "'; allowed: 'avx512', 'avx2', 'baseline'");
  }
  if (static_cast<int>(want) > static_cast<int>(hardware_isa())) {
    throw std::invalid_argument(std::string("set_cpu_isa: this CPU cannot run the '") + name +
                                "' kernels; the widest it supports is '" +
                                isa_name(hardware_isa()) + "'");
  }
  const char* previous = cpu_isa_name();
  g_isa.store(static_cast<int>(want), std::memory_order_relaxed);
  return previous;
}

}  // namespace mp_wrappers
