// Run-time choice of the CPU kernel flavour. Kernels are compiled once per instruction set (with
// per-function target attributes, never -march=native) and the widest one the CPU supports is picked
// here, once. MP_WRAPPERS_CPU_ISA=avx512|avx2|baseline forces a narrower one (benchmarks, tests).
#pragma once

namespace mp_wrappers {

enum class CpuIsa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

CpuIsa cpu_isa();
const char* cpu_isa_name();

}  // namespace mp_wrappers
