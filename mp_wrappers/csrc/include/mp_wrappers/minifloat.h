// The block-wise 8-bit codes of the optimizer states (Note [8-bit optimizer states] in
// mp_wrappers/ops/reference/quant.py, the executable definition): the block size and the constants
// of the two minifloat codes, shared by the CPU kernel (cpu/multi_tensor_adam8bit.cpp), the CUDA
// kernel (cuda/multi_tensor_adam8bit.cu) and the argument checks (op_args.h), so that the kernels
// cannot disagree on them. Compile-time constants only: host code, and device code through
// nvcc's --expt-relaxed-constexpr.
#pragma once

#include <cstdint>

namespace mp_wrappers {
namespace quant {

constexpr int64_t kBlock = 256;  // reference/quant.py: BLOCK_SIZE

constexpr int64_t num_blocks(int64_t numel) { return (numel + kBlock - 1) / kBlock; }

constexpr float pow2(int e) {
  float r = 1.f;
  for (; e > 0; --e) r *= 2.f;
  for (; e < 0; ++e) r *= 0.5f;
  return r;
}

// A minifloat code (reference/quant.py Minifloat): kExp exponent bits, kMan mantissa bits.
template <int kExp, int kMan, bool kSigned>
struct Code {
  static constexpr int E = kExp, M = kMan;
  static constexpr bool S = kSigned;
  static constexpr int kBias = (1 << kExp) - 1;
  static constexpr int kShift = 23 - kMan;
  static constexpr int32_t kRebase = (127 - kBias) << kMan;  // fp32 exponent field -> code field
  static constexpr int32_t kFirstNormal = 1 << kMan;
  static constexpr float kMax = 2.f - pow2(-kMan);
  static constexpr float kMinNormal = pow2(1 - kBias);
  static constexpr float kSubEnc = pow2(kBias - 1 + kMan);
  static constexpr float kSubDec = pow2(1 - kBias - kMan);
};
using ExpAvgCode = Code<4, 3, true>;     // reference/quant.py EXP_AVG_CODE
using ExpAvgSqCode = Code<5, 3, false>;  // reference/quant.py EXP_AVG_SQ_CODE

}  // namespace quant
}  // namespace mp_wrappers
