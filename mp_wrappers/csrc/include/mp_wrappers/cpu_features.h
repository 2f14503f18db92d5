// Run-time choice of the CPU kernel flavour. Kernels are compiled once per instruction set (with
// per-function target attributes, never -march=native) and the widest one the CPU supports is picked
// at the first call. MP_WRAPPERS_CPU_ISA=avx512|avx2|baseline forces a narrower one (benchmarks);
// set_cpu_isa() switches it while the process runs (tests run every kernel once per ISA).
#pragma once

namespace mp_wrappers {

enum class CpuIsa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// The flavour the kernels use now: the hardware's widest, narrowed by MP_WRAPPERS_CPU_ISA, or the
// last set_cpu_isa().
CpuIsa cpu_isa();
const char* cpu_isa_name();

// The widest flavour this CPU can run (ignores MP_WRAPPERS_CPU_ISA and set_cpu_isa()).
const char* cpu_isa_hardware_name();

// Switch the flavour ("avx512", "avx2" or "baseline"); returns the previous one's name. Throws
// (std::invalid_argument) for an unknown name or one wider than the hardware: that would SIGILL.
// Not meant to race with running kernels: a kernel reads the flavour once, at its start.
const char* set_cpu_isa(const char* name);

}  // namespace mp_wrappers
