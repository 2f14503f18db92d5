// The block-wise 8-bit codes on the CPU (Note [8-bit optimizer states] in
// mp_wrappers/ops/reference/quant.py, the executable definition): decode and encode of the
// minifloat codes per SIMD flavour, shared by the 8-bit updates (cpu/multi_tensor_adam8bit.cpp:
// Adam's two moments; cpu/multi_tensor_sgd8bit.cpp: SGD's momentum). Every flavour gives the
// reference's bits; the faster paths for whole blocks of normal codes (all_normal, decode_normal,
// encode_block) give the same bits as the general ones (Notes below and at the top of
// cpu/multi_tensor_adam8bit.cpp).
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "mp_wrappers/cpu_vec.h"
#include "mp_wrappers/minifloat.h"

namespace mp_wrappers {
namespace cpu {
namespace quant_codes {

constexpr int64_t kBlock = quant::kBlock;

// ---- scalar forms: the baseline flavour, and the meaning of the vector forms ------------------
// The value of a code with absmax = MAX (reference/quant.py code_table; exact in fp32). The block's
// decode factor is applied by the update's fused multiply-add (Note [the folded decode factor]).
template <class C>
inline float decode_scalar(uint8_t byte) {
  const int32_t c = C::S ? (byte & 0x7F) : byte;
  float v;
  if (c < C::kFirstNormal) {
    v = static_cast<float>(c) * C::kSubDec;
  } else {
    const int32_t bits = (c + C::kRebase) << C::kShift;
    std::memcpy(&v, &bits, sizeof(v));
  }
  return (C::S && byte >= 0x80) ? -v : v;
}

// The nearest code, ties away from zero (Note [ties away from zero] in reference/quant.py). `enc`
// infinite (a block absmax below MAX / FLT_MAX): clamp as torch.clamp does, NaN (0 * inf) passes
// through and encodes as the reference's integer arithmetic on its bits does.
template <class C>
inline uint8_t encode_scalar(float x, float enc) {
  const float scaled = x * enc;
  const float mag = std::fabs(scaled);
  const float a = mag > C::kMax ? C::kMax : mag;
  int32_t c;
  if (a < C::kMinNormal) {
    const float y = a * C::kSubEnc;  // in [0, 2^M): exact
    const int32_t whole = static_cast<int32_t>(y);
    c = whole + (y - static_cast<float>(whole) >= 0.5f ? 1 : 0);  // half up (an exact difference)
  } else {
    int32_t bits;
    std::memcpy(&bits, &a, sizeof(bits));
    c = ((bits + (1 << (C::kShift - 1))) >> C::kShift) - C::kRebase;
  }
  if (C::S && std::signbit(scaled)) c |= 0x80;  // -0 too (Note [signed zero codes])
  return static_cast<uint8_t>(c);
}

// ---- per-flavour byte <-> fp32 lanes -------------------------------------------------------------
template <class V>
struct Quant;

// Note [normal decode without the re-base]
//   A normal code's bits, shifted into an fp32's exponent and mantissa fields, are a normal fp32
//   value 2^(127 - kBias) times too small (its exponent field is the code's, not re-based by
//   kRebase). Multiplying it by the block's factor times 2^(127 - kBias) (exact: a power of two,
//   when the product is finite) is the same real product as code value times factor, so the
//   update's fused multiply-add rounds it to the same bits, and the integer add of the re-base is
//   saved. A block whose re-based factor would overflow (absmax above ~1.2e5 / beta1 for exp_avg,
//   ~8e9 / beta2 for exp_avg_sq) takes the general decode.
template <class C>
constexpr float kDecodeRebase = quant::pow2(127 - C::kBias);

template <>
struct Quant<VecBaseline> {
  using V = VecBaseline;
  template <class C>
  static inline V::F decode(const uint8_t* p, int64_t n) {
    V::F r;
    for (int i = 0; i < V::kWidth; ++i) r.v[i] = i < n ? decode_scalar<C>(p[i]) : 0.f;
    return r;
  }
  // The scalar forms have no faster cases: the whole-block flags change nothing here.
  template <class C>
  static inline bool all_normal(const uint8_t*) { return false; }
  template <class C>
  static inline V::F decode_normal(const uint8_t* p) {
    return V::mul(decode<C>(p, V::kWidth), V::set1(1.f / kDecodeRebase<C>));  // exact
  }
  template <class C>
  static inline void encode(uint8_t* p, V::F x, V::F enc, bool, int64_t n) {
    const int64_t k = std::min<int64_t>(n, V::kWidth);
    for (int64_t i = 0; i < k; ++i) p[i] = encode_scalar<C>(x.v[i], enc.v[0]);
  }
  // The codes of kGroup elements of a whole block (kBlock is a multiple of every flavour's group).
  static constexpr int64_t kGroup = V::kWidth;
  template <class C, bool kClamp>
  static inline void encode_group(uint8_t* p, const float* x, V::F enc) {
    encode<C>(p, V::load(x), enc, kClamp, V::kWidth);
  }
  template <class C>
  static inline void encode_block(uint8_t* p, const float* x, V::F enc, bool clamp) {
    for (int64_t i = 0; i < kBlock; i += kGroup) encode<C>(p + i, V::load(x + i), enc, clamp, V::kWidth);
  }
  static inline V::F max_abs(V::F acc, V::F x) { return V::max(acc, V::abs(x)); }
};

// The mask of a code's exponent field: zero for code 0 and the subnormal codes.
template <class C>
constexpr int kExpField = ((1 << C::E) - 1) << C::M;
template <class C>
constexpr int32_t kSignedMagMask = static_cast<int32_t>(0x80000000u | (0x7Fu << C::kShift));


#if defined(__x86_64__)
template <>
struct Quant<VecAvx2> {
  using V = VecAvx2;
  // True when none of the kBlock codes at p has a zero exponent field.
  template <class C>
  MP_WRAPPERS_TARGET_AVX2 static inline bool all_normal(const uint8_t* p) {
    const __m256i field = _mm256_set1_epi8(static_cast<char>(kExpField<C>));
    __m256i low = _mm256_set1_epi8(-1);
    for (int64_t i = 0; i < kBlock; i += 32) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
      low = _mm256_min_epu8(low, _mm256_and_si256(b, field));
    }
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(low, _mm256_setzero_si256())) == 0;
  }
  template <class C>
  MP_WRAPPERS_TARGET_AVX2 static inline V::F decode(const uint8_t* p, int64_t n) {
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
    if (C::S) {
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
      v = _mm256_xor_ps(v, _mm256_castsi256_ps(sign));
    }
    return v;
  }
  // 8 codes with nonzero exponent fields (Note [normal decode without the re-base] above): the
  // code's bits as an fp32 value's, with the sign (sign-extended from bit 7 into bits 27-31, bit 31
  // kept) in place, for the block's re-based factor.
  template <class C>
  MP_WRAPPERS_TARGET_AVX2 static inline V::F decode_normal(const uint8_t* p) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    __m256i bits;
    if (C::S) {
      const __m256i x = _mm256_slli_epi32(_mm256_cvtepi8_epi32(raw), C::kShift);
      bits = _mm256_and_si256(x, _mm256_set1_epi32(kSignedMagMask<C>));
    } else {
      bits = _mm256_slli_epi32(_mm256_cvtepu8_epi32(raw), C::kShift);
    }
    return _mm256_castsi256_ps(bits);
  }
  // The codes of 8 lanes, one per int32 lane (the low byte, as the reference's uint8 cast).
  template <class C>
  MP_WRAPPERS_TARGET_AVX2 static inline __m256i codes(V::F x, V::F enc, bool clamp) {
    const __m256 scaled = _mm256_mul_ps(x, enc);
    __m256 a = C::S || clamp ? _mm256_andnot_ps(_mm256_set1_ps(-0.f), scaled) : scaled;
    if (clamp) a = _mm256_min_ps(_mm256_set1_ps(C::kMax), a);  // NaN passes, as in torch.clamp
    // Half a code step added to the bits, the exponent re-base folded in (ties away from zero).
    const __m256i half = _mm256_set1_epi32((1 << (C::kShift - 1)) - (C::kRebase << C::kShift));
    __m256i c = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(a), half), C::kShift);
    const __m256 is_sub = _mm256_cmp_ps(a, _mm256_set1_ps(C::kMinNormal), _CMP_LT_OQ);
    if (_mm256_movemask_ps(is_sub) != 0) {  // y = a * kSubEnc in [0, 2^M): its half-up integer
      const __m256 y = _mm256_mul_ps(a, _mm256_set1_ps(C::kSubEnc));
      const __m256i whole = _mm256_cvttps_epi32(y);
      const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(y, _mm256_cvtepi32_ps(whole)),
                                      _mm256_set1_ps(0.5f), _CMP_GE_OQ);
      const __m256i sub = _mm256_sub_epi32(whole, _mm256_castps_si256(up));  // mask -1: + 1
      c = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(c), _mm256_castsi256_ps(sub), is_sub));
    }
    if (clamp) c = _mm256_and_si256(c, _mm256_set1_epi32(0xFF));  // NaN: low byte, unsaturated
    if (C::S) {  // the sign bit of `scaled` picks the code with bit 7 set: one blend
      const __m256i with_sign = _mm256_or_si256(c, _mm256_set1_epi32(0x80));
      c = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(c),
                                               _mm256_castsi256_ps(with_sign), scaled));
    }
    return c;
  }
  template <class C>
  MP_WRAPPERS_TARGET_AVX2 static inline void encode(uint8_t* p, V::F x, V::F enc, bool clamp,
                                                    int64_t n) {
    const __m256i c = codes<C>(x, enc, clamp);
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
  // A group of a whole block from the block buffer: 32 codes per store, packed by two saturating
  // packs (exact: every code is in [0, 255]) and one permutation back into memory order. The
  // clamp is fixed at compile time (callers choose once per block), not a test at every vector:
  // with ties away from zero this took the AVX2 step on a Zen 3 from 0.77-0.80 to 0.67 ns/element
  // in cache, where either alone gave at most 3% (docs/quantized_states.md, "What bounds the 8-bit
  // step on AVX2").
  static constexpr int64_t kGroup = 32;
  template <class C, bool kClamp>
  MP_WRAPPERS_TARGET_AVX2 static inline void encode_group(uint8_t* p, const float* x, V::F enc) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i c0 = codes<C>(_mm256_load_ps(x), enc, kClamp);
    const __m256i c1 = codes<C>(_mm256_load_ps(x + 8), enc, kClamp);
    const __m256i c2 = codes<C>(_mm256_load_ps(x + 16), enc, kClamp);
    const __m256i c3 = codes<C>(_mm256_load_ps(x + 24), enc, kClamp);
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permutevar8x32_epi32(b, order));
  }
  template <class C>
  MP_WRAPPERS_TARGET_AVX2 static inline void encode_block(uint8_t* p, const float* x, V::F enc,
                                                          bool clamp) {
    if (clamp) {
      for (int64_t i = 0; i < kBlock; i += kGroup) encode_group<C, true>(p + i, x + i, enc);
    } else {
      for (int64_t i = 0; i < kBlock; i += kGroup) encode_group<C, false>(p + i, x + i, enc);
    }
  }
  MP_WRAPPERS_TARGET_AVX2 static inline V::F max_abs(V::F acc, V::F x) {
    return _mm256_max_ps(acc, _mm256_andnot_ps(_mm256_set1_ps(-0.f), x));
  }
};

template <>
struct Quant<VecAvx512> {
  using V = VecAvx512;
  template <class C>
  MP_WRAPPERS_TARGET_AVX512 static inline bool all_normal(const uint8_t* p) {
    const __m512i field = _mm512_set1_epi8(static_cast<char>(kExpField<C>));
    __mmask64 zero = 0;
    for (int64_t i = 0; i < kBlock; i += 64) {
      zero |= _mm512_testn_epi8_mask(_mm512_loadu_si512(p + i), field);
    }
    return zero == 0;
  }
  template <class C>
  MP_WRAPPERS_TARGET_AVX512 static inline V::F decode(const uint8_t* p, int64_t n) {
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
    if (C::S) {
      const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
      v = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), sign));
    }
    return v;
  }
  template <class C>
  MP_WRAPPERS_TARGET_AVX512 static inline V::F decode_normal(const uint8_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m512i bits;
    if (C::S) {
      const __m512i x = _mm512_slli_epi32(_mm512_cvtepi8_epi32(raw), C::kShift);
      bits = _mm512_and_si512(x, _mm512_set1_epi32(kSignedMagMask<C>));
    } else {
      bits = _mm512_slli_epi32(_mm512_cvtepu8_epi32(raw), C::kShift);
    }
    return _mm512_castsi512_ps(bits);
  }
  template <class C>
  MP_WRAPPERS_TARGET_AVX512 static inline __m512i codes(V::F x, V::F enc, bool clamp) {
    const __m512 scaled = _mm512_mul_ps(x, enc);
    __m512 a = C::S || clamp ? _mm512_abs_ps(scaled) : scaled;
    if (clamp) a = _mm512_min_ps(_mm512_set1_ps(C::kMax), a);  // NaN passes, as in torch.clamp
    // Half a code step added to the bits, the exponent re-base folded in (ties away from zero).
    const __m512i half = _mm512_set1_epi32((1 << (C::kShift - 1)) - (C::kRebase << C::kShift));
    __m512i c = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(a), half), C::kShift);
    const __mmask16 is_sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(C::kMinNormal), _CMP_LT_OQ);
    if (is_sub) {  // y = a * kSubEnc in [0, 2^M): its half-up integer
      const __m512 y = _mm512_mul_ps(a, _mm512_set1_ps(C::kSubEnc));
      const __m512i whole = _mm512_cvttps_epi32(y);
      const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(y, _mm512_cvtepi32_ps(whole)),
                                              _mm512_set1_ps(0.5f), _CMP_GE_OQ);
      c = _mm512_mask_mov_epi32(
          c, is_sub, _mm512_mask_add_epi32(whole, up, whole, _mm512_set1_epi32(1)));
    }
    if (clamp) c = _mm512_and_si512(c, _mm512_set1_epi32(0xFF));  // NaN: low byte, unsaturated
    if (C::S) {
      const __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(scaled));  // sign bits
      c = _mm512_mask_or_epi32(c, neg, c, _mm512_set1_epi32(0x80));
    }
    return c;
  }
  template <class C>
  MP_WRAPPERS_TARGET_AVX512 static inline void encode(uint8_t* p, V::F x, V::F enc, bool clamp,
                                                      int64_t n) {
    const __m128i bytes = _mm512_cvtepi32_epi8(codes<C>(x, enc, clamp));
    if (n >= 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
    } else {
      _mm_mask_storeu_epi8(p, static_cast<__mmask16>((1u << n) - 1u), bytes);
    }
  }
  // A group of a whole block: 64 codes per store, two saturating packs (exact: codes are in
  // [0, 255]) and one permutation instead of a VPMOVDB (two micro-ops on Zen 4) and a store per 16.
  static constexpr int64_t kGroup = 64;
  template <class C, bool kClamp>
  MP_WRAPPERS_TARGET_AVX512 static inline void encode_group(uint8_t* p, const float* x, V::F enc) {
    constexpr bool clamp = kClamp;
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i c0 = codes<C>(_mm512_load_ps(x), enc, clamp);
    const __m512i c1 = codes<C>(_mm512_load_ps(x + 16), enc, clamp);
    const __m512i c2 = codes<C>(_mm512_load_ps(x + 32), enc, clamp);
    const __m512i c3 = codes<C>(_mm512_load_ps(x + 48), enc, clamp);
    const __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
    _mm512_storeu_si512(p, _mm512_permutexvar_epi32(order, b));
  }
  template <class C>
  MP_WRAPPERS_TARGET_AVX512 static inline void encode_block(uint8_t* p, const float* x, V::F enc,
                                                            bool clamp) {
    if (clamp) {
      for (int64_t i = 0; i < kBlock; i += kGroup) encode_group<C, true>(p + i, x + i, enc);
    } else {
      for (int64_t i = 0; i < kBlock; i += kGroup) encode_group<C, false>(p + i, x + i, enc);
    }
  }
  // max(acc, |x|) in one VRANGEPS (imm 0b1011: the larger magnitude, sign cleared).
  MP_WRAPPERS_TARGET_AVX512 static inline V::F max_abs(V::F acc, V::F x) {
    return _mm512_range_ps(acc, x, 0x0B);
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

}  // namespace quant_codes
}  // namespace cpu
}  // namespace mp_wrappers
