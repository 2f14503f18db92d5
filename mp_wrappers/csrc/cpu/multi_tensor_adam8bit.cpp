// CPU kernel of multi_tensor_adam8bit_: Adam / AdamW with block-wise 8-bit moments (Note [8-bit
// optimizer states] in mp_wrappers/ops/reference/quant.py, the executable definition).
//
// One pass per block of kBlock elements: dequantize both moments, apply the fp32 Adam update with
// reciprocal bias corrections (one divide and one square root per element, the reference's
// operations in its order), store the param and the rounded model copy, keep the new
// moments in a block buffer (L1) while their absmax is reduced, then requantize the block. The
// block is the unit a CUDA version maps onto one thread block (absmax reduction, then encode).
// Chunks of the ChunkPlan start at multiples of kChunkElems, a multiple of kBlock, so a block never
// spans two threads and the result does not depend on the thread count.
//
// The codes are minifloats relative to the block's absmax, so encode and decode are a few integer
// and float operations per lane in every flavour (no table search), with the reference's rounding:
// the normal range rounds the fp32 mantissa by integer addition (ties to even), the subnormal range
// converts with the current (round-to-nearest-even) mode. 16 bytes per fp32 parameter (p read and
// written, g read, 1 byte per moment read and written, plus the absmax) against fp32 Adam's 28.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "mp_wrappers/checks.h"
#include "mp_wrappers/cpu_features.h"
#include "mp_wrappers/cpu_multi_tensor.h"
#include "mp_wrappers/cpu_optim.h"
#include "mp_wrappers/cpu_vec.h"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cpu {
namespace {

constexpr int64_t kBlock = 256;  // reference/quant.py: BLOCK_SIZE
static_assert(kChunkElems % kBlock == 0, "chunks must hold whole quantization blocks");

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

// ---- scalar forms: the baseline flavour, and the meaning of the vector forms ------------------
template <class C>
inline float decode_scalar(uint8_t byte, float dec) {
  const int32_t c = C::S ? (byte & 0x7F) : byte;
  float v;
  if (c < C::kFirstNormal) {
    v = static_cast<float>(c) * C::kSubDec;
  } else {
    const int32_t bits = (c + C::kRebase) << C::kShift;
    std::memcpy(&v, &bits, sizeof(v));
  }
  v *= dec;
  return (C::S && byte >= 0x80) ? -v : v;
}

template <class C>
inline uint8_t encode_scalar(float x, float enc) {
  const float scaled = x * enc;
  const float mag = std::fabs(scaled);
  const float a = mag < C::kMax ? mag : C::kMax;  // minps rule: C::kMax when mag is NaN
  int32_t c;
  if (a < C::kMinNormal) {
    c = static_cast<int32_t>(std::nearbyint(a * C::kSubEnc));
  } else {
    int32_t bits;
    std::memcpy(&bits, &a, sizeof(bits));
    c = ((bits + ((1 << (C::kShift - 1)) - 1) + ((bits >> C::kShift) & 1)) >> C::kShift) -
        C::kRebase;
  }
  if (C::S && scaled < 0.f) c |= 0x80;
  return static_cast<uint8_t>(c);
}

// ---- per-flavour byte <-> fp32 lanes -------------------------------------------------------------
template <class V>
struct Quant;

template <>
struct Quant<VecBaseline> {
  using V = VecBaseline;
  template <class C>
  static inline V::F decode(const uint8_t* p, int64_t n, float dec) {
    V::F r;
    for (int i = 0; i < V::kWidth; ++i) r.v[i] = i < n ? decode_scalar<C>(p[i], dec) : 0.f;
    return r;
  }
  template <class C>
  static inline void encode(uint8_t* p, V::F x, float enc, int64_t n) {
    const int64_t k = std::min<int64_t>(n, V::kWidth);
    for (int64_t i = 0; i < k; ++i) p[i] = encode_scalar<C>(x.v[i], enc);
  }
};

#if defined(__x86_64__)
template <>
struct Quant<VecAvx2> {
  using V = VecAvx2;
  template <class C>
  MP_WRAPPERS_TARGET_AVX2 static inline V::F decode(const uint8_t* p, int64_t n, float dec) {
    uint64_t raw = 0;
    std::memcpy(&raw, p, static_cast<size_t>(std::min<int64_t>(n, 8)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(raw)));
    const __m256i c = C::S ? _mm256_and_si256(b, _mm256_set1_epi32(0x7F)) : b;
    const __m256 normal = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(c, _mm256_set1_epi32(C::kRebase)), C::kShift));
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(C::kFirstNormal), c);
    __m256 v = normal;
    if (!_mm256_testz_si256(is_sub, is_sub)) {  // subnormal codes are rare: skip their path
      const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(C::kSubDec));
      v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
    }
    v = _mm256_mul_ps(v, _mm256_set1_ps(dec));
    if (C::S) {
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
      v = _mm256_xor_ps(v, _mm256_castsi256_ps(sign));
    }
    return v;
  }
  template <class C>
  MP_WRAPPERS_TARGET_AVX2 static inline void encode(uint8_t* p, V::F x, float enc, int64_t n) {
    const __m256 scaled = _mm256_mul_ps(x, _mm256_set1_ps(enc));
    const __m256 a = _mm256_min_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), scaled),
                                   _mm256_set1_ps(C::kMax));
    const __m256i bits = _mm256_castps_si256(a);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, C::kShift), _mm256_set1_epi32(1));
    const __m256i round = _mm256_add_epi32(lsb, _mm256_set1_epi32((1 << (C::kShift - 1)) - 1));
    const __m256i normal = _mm256_sub_epi32(
        _mm256_srli_epi32(_mm256_add_epi32(bits, round), C::kShift), _mm256_set1_epi32(C::kRebase));
    const __m256 is_sub = _mm256_cmp_ps(a, _mm256_set1_ps(C::kMinNormal), _CMP_LT_OQ);
    __m256i c = normal;
    if (_mm256_movemask_ps(is_sub) != 0) {
      const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(C::kSubEnc)));
      c = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub), is_sub));
    }
    if (C::S) {
      const __m256 neg = _mm256_cmp_ps(scaled, _mm256_setzero_ps(), _CMP_LT_OQ);
      c = _mm256_or_si256(c, _mm256_and_si256(_mm256_castps_si256(neg), _mm256_set1_epi32(0x80)));
    }
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    const __m128i bytes = _mm_packus_epi16(w, w);
    if (n >= 8) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(p), bytes);
    } else {
      uint8_t buf[16];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(buf), bytes);
      std::memcpy(p, buf, static_cast<size_t>(n));
    }
  }
};

template <>
struct Quant<VecAvx512> {
  using V = VecAvx512;
  template <class C>
  MP_WRAPPERS_TARGET_AVX512 static inline V::F decode(const uint8_t* p, int64_t n, float dec) {
    const __m128i raw = n >= 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                                : _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1u), p);
    const __m512i b = _mm512_cvtepu8_epi32(raw);
    const __m512i c = C::S ? _mm512_and_si512(b, _mm512_set1_epi32(0x7F)) : b;
    const __m512 normal = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(C::kRebase)), C::kShift));
    const __mmask16 is_sub = _mm512_cmplt_epi32_mask(c, _mm512_set1_epi32(C::kFirstNormal));
    __m512 v = normal;
    if (is_sub) {  // subnormal codes are rare: skip their path
      v = _mm512_mask_mov_ps(
          normal, is_sub, _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(C::kSubDec)));
    }
    v = _mm512_mul_ps(v, _mm512_set1_ps(dec));
    if (C::S) {
      const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
      v = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), sign));
    }
    return v;
  }
  template <class C>
  MP_WRAPPERS_TARGET_AVX512 static inline void encode(uint8_t* p, V::F x, float enc, int64_t n) {
    const __m512 scaled = _mm512_mul_ps(x, _mm512_set1_ps(enc));
    const __m512 a = _mm512_min_ps(_mm512_abs_ps(scaled), _mm512_set1_ps(C::kMax));
    const __m512i bits = _mm512_castps_si512(a);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, C::kShift), _mm512_set1_epi32(1));
    const __m512i round = _mm512_add_epi32(lsb, _mm512_set1_epi32((1 << (C::kShift - 1)) - 1));
    const __m512i normal = _mm512_sub_epi32(
        _mm512_srli_epi32(_mm512_add_epi32(bits, round), C::kShift), _mm512_set1_epi32(C::kRebase));
    const __mmask16 is_sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(C::kMinNormal), _CMP_LT_OQ);
    __m512i c = normal;
    if (is_sub) {
      c = _mm512_mask_mov_epi32(
          normal, is_sub, _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(C::kSubEnc))));
    }
    if (C::S) {
      const __mmask16 neg = _mm512_cmp_ps_mask(scaled, _mm512_setzero_ps(), _CMP_LT_OQ);
      c = _mm512_mask_or_epi32(c, neg, c, _mm512_set1_epi32(0x80));
    }
    const __m128i bytes = _mm512_cvtepi32_epi8(c);
    if (n >= 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
    } else {
      _mm_mask_storeu_epi8(p, static_cast<__mmask16>((1u << n) - 1u), bytes);
    }
  }
};
#endif  // defined(__x86_64__)

// Horizontal max of the lanes (exact in any order for the non-negative, non-NaN values it sees).
template <class V>
inline float lane_max(typename V::F a) {
  alignas(64) float lanes[V::kWidth];
  V::store(lanes, a);
  float r = lanes[0];
  for (int i = 1; i < V::kWidth; ++i) r = lanes[i] > r ? lanes[i] : r;
  return r;
}

struct Adam8bitConsts {
  float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, rbc1, rsbc2;
  bool adam_w_mode, has_weight_decay;
  optim::Unscale unscale;
};

// The new moment values of a block stay here between the update and the requantization.
struct alignas(64) BlockBuffer {
  float m[kBlock];
  float v[kBlock];
};

// One block of n <= kBlock elements; `p`, `g`, `out`, the codes and the absmax pointers are at
// the block's start.
template <class V, class P, class G, class O>
inline void adam8bit_block(P* p, const G* g, uint8_t* mc, float* ma, uint8_t* vc, float* va,
                           O* out, int64_t n, const Adam8bitConsts& c, BlockBuffer& buf) {
  using F = typename V::F;
  using Q = Quant<V>;
  const F lr = V::set1(c.lr), b1 = V::set1(c.beta1), b2 = V::set1(c.beta2);
  const F omb1 = V::set1(c.one_minus_beta1), omb2 = V::set1(c.one_minus_beta2);
  const F eps = V::set1(c.eps), wd = V::set1(c.weight_decay);
  const F rbc1 = V::set1(c.rbc1), rsbc2 = V::set1(c.rsbc2), us = V::set1(c.unscale.factor);
  const bool l2 = !c.adam_w_mode && c.has_weight_decay;
  const bool decoupled = c.adam_w_mode && c.has_weight_decay;
  const float m_dec = *ma / ExpAvgCode::kMax, v_dec = *va / ExpAvgSqCode::kMax;
  F m_max = V::zero(), v_max = V::zero();
  for (int64_t i = 0; i < n; i += V::kWidth) {
    const int64_t k = n - i;  // < kWidth only in the tail: loads pad with 0, stores are partial
    // The streams of the next blocks (cpu_optim.h: explicit prefetch helped the fp32 update too).
    optim::prefetch_write_line<V>(p, i);
    optim::prefetch_read_line<V>(g, i);
    optim::prefetch_write_line<V>(mc, i);
    optim::prefetch_write_line<V>(vc, i);
    optim::prefetch_write_line<V>(out, i);
    const F p32 = load_n<V>(p + i, k);
    F g32 = c.unscale.template apply<V>(load_n<V>(g + i, k), us);
    if (l2) g32 = V::add(g32, V::mul(wd, p32));
    const F m_old = Q::template decode<ExpAvgCode>(mc + i, k, m_dec);
    const F v_old = Q::template decode<ExpAvgSqCode>(vc + i, k, v_dec);
    const F m_new = V::add(V::mul(b1, m_old), V::mul(omb1, g32));
    const F v_new = V::add(V::mul(b2, v_old), V::mul(V::mul(omb2, g32), g32));
    F update = V::div(V::mul(m_new, rbc1), V::add(V::mul(V::sqrt(v_new), rsbc2), eps));
    if (decoupled) update = V::add(update, V::mul(wd, p32));
    const F p_new = V::sub(p32, V::mul(lr, update));
    store_n<V>(p + i, p_new, k);
    optim::store_out<V>(optim::at_offset(out, i), p_new, k);
    // Padded lanes hold 0 (zero grad, param and codes), so they never raise the absmax.
    V::store(buf.m + i, m_new);
    V::store(buf.v + i, v_new);
    m_max = V::max(m_max, V::abs(m_new));
    v_max = V::max(v_max, v_new);
  }
  const float m_abs = lane_max<V>(m_max), v_abs = lane_max<V>(v_max);
  // An all-zero block keeps absmax 0 and codes 0 (reference/quant.py _block_factors).
  const float m_enc = m_abs > 0.f ? ExpAvgCode::kMax / m_abs : 0.f;
  const float v_enc = v_abs > 0.f ? ExpAvgSqCode::kMax / v_abs : 0.f;
  for (int64_t i = 0; i < n; i += V::kWidth) {
    Q::template encode<ExpAvgCode>(mc + i, V::load(buf.m + i), m_enc, n - i);
    Q::template encode<ExpAvgSqCode>(vc + i, V::load(buf.v + i), v_enc, n - i);
  }
  *ma = m_abs;
  *va = v_abs;
}

struct Adam8bitArgs {
  const RawTensor& p;
  const RawTensor& g;
  uint8_t* mc;
  float* ma;
  uint8_t* vc;
  float* va;
  const RawTensor* out;
};

struct Adam8bitChunk {
  template <class V>
  static void run(const Adam8bitArgs& a, const TensorChunk& ch, const Adam8bitConsts& c) {
    BlockBuffer buf;
    optim::with_typed(a.p, [&](auto* pp) {
      optim::with_typed(a.g, [&](auto* gp) {
        optim::with_typed_opt(a.out, [&](auto* op) {
          for (int64_t b = ch.begin; b < ch.end; b += kBlock) {
            const int64_t blk = b / kBlock;
            adam8bit_block<V>(pp + b, gp + b, a.mc + b, a.ma + blk, a.vc + b, a.va + blk,
                              optim::at_offset(op, b), std::min(kBlock, ch.end - b), c, buf);
          }
        });
      });
    });
  }
};

void check_codes(const char* op, const char* name, at::TensorList codes, at::TensorList params,
                 const at::Device& device) {
  TORCH_CHECK(codes.size() == params.size(), op, ": ", name, " has ", codes.size(),
              " tensors but params has ", params.size(), "; the lists must be parallel");
  for (size_t i = 0; i < codes.size(); ++i) {
    const at::Tensor& t = codes[i];
    TORCH_CHECK(t.defined() && t.scalar_type() == at::kByte && t.is_contiguous() &&
                    t.device() == device && t.numel() == params[i].numel(),
                op, ": ", name, "[", i, "] must be a contiguous uint8 tensor on ", device,
                " with ", params[i].numel(), " elements");
  }
}

void check_absmax(const char* op, const char* name, at::TensorList absmax, at::TensorList params,
                  const at::Device& device) {
  TORCH_CHECK(absmax.size() == params.size(), op, ": ", name, " has ", absmax.size(),
              " tensors but params has ", params.size(), "; the lists must be parallel");
  for (size_t i = 0; i < absmax.size(); ++i) {
    const at::Tensor& t = absmax[i];
    const int64_t blocks = (params[i].numel() + kBlock - 1) / kBlock;
    TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.device() == device && t.numel() == blocks,
                op, ": ", name, "[", i, "] must be a contiguous float32 tensor on ", device,
                " with ", blocks, " elements (one per block of ", kBlock, ")");
  }
}

void multi_tensor_adam8bit_cpu(at::TensorList params, at::TensorList grads,
                               at::TensorList exp_avgs, at::TensorList exp_avg_absmaxes,
                               at::TensorList exp_avg_sqs, at::TensorList exp_avg_sq_absmaxes,
                               at::TensorList model_params, const at::Tensor& step, double lr,
                               double beta1, double beta2, double eps, double weight_decay,
                               bool adam_w_mode, bool bias_correction,
                               const c10::optional<at::Tensor>& grad_scale,
                               const c10::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "multi_tensor_adam8bit_";
  const at::Device device = check_tensor_lists(
      op, {{"params", params}, {"grads", grads}, {"model_params", model_params}},
      {"model_params"});
  check_codes(op, "exp_avgs", exp_avgs, params, device);
  check_codes(op, "exp_avg_sqs", exp_avg_sqs, params, device);
  check_absmax(op, "exp_avg_absmaxes", exp_avg_absmaxes, params, device);
  check_absmax(op, "exp_avg_sq_absmaxes", exp_avg_sq_absmaxes, params, device);
  check_step(op, step, device);
  const float* grad_scale_ptr = optional_scalar(op, "grad_scale", grad_scale, device);
  const float* found_inf_ptr = optional_scalar(op, "found_inf", found_inf, device);
  // A skipped step returns before touching anything: codes and absmax keep their bits.
  if (optim::should_skip(found_inf_ptr)) return;

  const float count = optim::read_count(step);
  Adam8bitConsts c;
  c.lr = static_cast<float>(lr);
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.weight_decay = static_cast<float>(weight_decay);
  c.has_weight_decay = weight_decay != 0.0;
  c.adam_w_mode = adam_w_mode;
  // reference/quant.py _reciprocal_bias_corrections: float64, rounded once.
  c.rbc1 = 1.f;
  c.rsbc2 = 1.f;
  if (bias_correction) {
    const double n = static_cast<double>(count);
    c.rbc1 = static_cast<float>(1.0 / (1.0 - std::pow(beta1, n)));
    c.rsbc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, n)));
  }
  c.unscale = optim::Unscale::from(grad_scale_ptr);

  const std::vector<RawTensor> ps = raw_tensors(params), gs = raw_tensors(grads),
                               os = raw_tensors(model_params);
  std::vector<Adam8bitArgs> args;
  args.reserve(params.size());
  for (size_t t = 0; t < params.size(); ++t) {
    args.push_back({ps[t], gs[t], exp_avgs[t].data_ptr<uint8_t>(),
                    exp_avg_absmaxes[t].data_ptr<float>(), exp_avg_sqs[t].data_ptr<uint8_t>(),
                    exp_avg_sq_absmaxes[t].data_ptr<float>(),
                    optim::raw_at(os, static_cast<int64_t>(t))});
  }
  const ChunkPlan plan(params);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    run_cpu_kernel<Adam8bitChunk>(isa, args[static_cast<size_t>(ch.tensor)], ch, c);
  });
  optim::commit_count(step, count);
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("multi_tensor_adam8bit_", &mp_wrappers::cpu::multi_tensor_adam8bit_cpu);
}
