// Bit-level bf16 helpers of the lean CPU optimizer kernels (cpu/multi_tensor_lean.cpp), one flavour
// per instruction set, beside the fp32 arithmetic of cpu_vec.h (Vec* flavours, same lane counts).
//
// Semantics are those of mp_wrappers/ops/reference/lean.py (Note [lean bf16 storage] there):
//   * join / store_split: an fp32 is its top 16 bits (a bf16, the value rounded toward zero) and its
//     low 16 bits (uint16), concatenated without arithmetic;
//   * store_stochastic: add the low 16 bits of a random word to the fp32 pattern and keep the top
//     half (NaN stores 0x7FC0, as the round-to-nearest store does);
//   * random words: mix32(element index ^ key), the hash of stochastic_bits() in the reference;
//   * round_nearest / store_hi: the value a round-to-nearest-even bf16 store keeps, as fp32 lanes
//     (NaN -> 0x7FC00000, as c10's conversion), and the store of such an exact value (its top half).
//     The 'kahan' update needs the rounded param both in memory and in the compensation's
//     arithmetic: computed in registers, it is not stored and read back.
// Every flavour computes the same bits, so the three ISAs agree with each other and the reference.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mp_wrappers/cpu_vec.h"

namespace mp_wrappers {
namespace cpu {
namespace lean {

// Odd multipliers below 2**31 (reference.lean._MIX1/_MIX2) and the golden-ratio tensor stride.
constexpr uint32_t kMix1 = 0x7FEB352Du;
constexpr uint32_t kMix2 = 0x5BD1E995u;
constexpr uint32_t kGolden = 0x9E3779B1u;

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMix1;
  x ^= x >> 15;
  x *= kMix2;
  return x ^ (x >> 16);
}

// The per-tensor key of stochastic_bits(): seed, update number and position in the list.
inline uint32_t tensor_key(int64_t seed, float count, int64_t index) {
  const uint32_t c = static_cast<uint32_t>(static_cast<int64_t>(count));
  return mix32(mix32(static_cast<uint32_t>(seed) ^ mix32(c)) ^
               (static_cast<uint32_t>(index) * kGolden));
}

template <class V>
struct Bits;

// ---------------------------------------------------------------------------------------------
// Baseline: plain C++ over V::kWidth lanes (the definition of every operation).
// ---------------------------------------------------------------------------------------------
template <>
struct Bits<VecBaseline> {
  using V = VecBaseline;
  using F = V::F;
  struct I { uint32_t v[V::kWidth]; };

  static inline F join(const c10::BFloat16* hi, const uint16_t* lo) {
    F r;
    for (int i = 0; i < V::kWidth; ++i) {
      const uint32_t b = (static_cast<uint32_t>(hi[i].x) << 16) | lo[i];
      std::memcpy(&r.v[i], &b, 4);
    }
    return r;
  }
  static inline void store_split(c10::BFloat16* hi, uint16_t* lo, F x) {
    for (int i = 0; i < V::kWidth; ++i) {
      uint32_t b;
      std::memcpy(&b, &x.v[i], 4);
      hi[i].x = static_cast<uint16_t>(b >> 16);
      lo[i] = static_cast<uint16_t>(b & 0xFFFFu);
    }
  }
  static inline F round_nearest(F x) {
    F r;
    for (int i = 0; i < V::kWidth; ++i) r.v[i] = static_cast<float>(c10::BFloat16(x.v[i]));
    return r;
  }
  static inline void store_hi(c10::BFloat16* out, F x) {
    for (int i = 0; i < V::kWidth; ++i) {
      uint32_t b;
      std::memcpy(&b, &x.v[i], 4);
      out[i].x = static_cast<uint16_t>(b >> 16);
    }
  }
  static inline I random(uint32_t base, uint32_t key) {
    I r;
    for (int i = 0; i < V::kWidth; ++i) r.v[i] = mix32((base + static_cast<uint32_t>(i)) ^ key);
    return r;
  }
  static inline void store_stochastic(c10::BFloat16* out, F x, I rnd) {
    for (int i = 0; i < V::kWidth; ++i) {
      uint32_t b;
      std::memcpy(&b, &x.v[i], 4);
      const bool nan = x.v[i] != x.v[i];
      out[i].x = nan ? static_cast<uint16_t>(0x7FC0u)
                     : static_cast<uint16_t>((b + (rnd.v[i] & 0xFFFFu)) >> 16);
    }
  }
};

#if defined(__x86_64__)
// ---------------------------------------------------------------------------------------------
// AVX2, 8 lanes.
// ---------------------------------------------------------------------------------------------
template <>
struct Bits<VecAvx2> {
  using F = __m256;
  using I = __m256i;

  MP_WRAPPERS_TARGET_AVX2 static inline F join(const c10::BFloat16* hi, const uint16_t* lo) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)));
    const __m256i l = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(h, 16), l));
  }
  MP_WRAPPERS_TARGET_AVX2 static inline __m128i narrow(__m256i w) {
    // Values are <= 0xFFFF, so the unsigned-saturating pack is a plain narrowing.
    return _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  }
  MP_WRAPPERS_TARGET_AVX2 static inline void store_split(c10::BFloat16* hi, uint16_t* lo, F x) {
    const __m256i b = _mm256_castps_si256(x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), narrow(_mm256_srli_epi32(b, 16)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo),
                     narrow(_mm256_and_si256(b, _mm256_set1_epi32(0xFFFF))));
  }
  MP_WRAPPERS_TARGET_AVX2 static inline F round_nearest(F x) {
    // VecAvx2::store's rounding (add 0x7FFF plus the lowest kept bit), the low half cleared in place.
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_and_si256(
        _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
        _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(nan));
    return _mm256_castsi256_ps(r);
  }
  MP_WRAPPERS_TARGET_AVX2 static inline void store_hi(c10::BFloat16* out, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     narrow(_mm256_srli_epi32(_mm256_castps_si256(x), 16)));
  }
  MP_WRAPPERS_TARGET_AVX2 static inline __m256i mix(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kMix1)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kMix2)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  MP_WRAPPERS_TARGET_AVX2 static inline I random(uint32_t base, uint32_t key) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(base)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return mix(_mm256_xor_si256(idx, _mm256_set1_epi32(static_cast<int>(key))));
  }
  MP_WRAPPERS_TARGET_AVX2 static inline void store_stochastic(c10::BFloat16* out, F x, I rnd) {
    const __m256i b = _mm256_castps_si256(x);
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(b, _mm256_and_si256(rnd, _mm256_set1_epi32(0xFFFF))), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), narrow(r));
  }
};

// ---------------------------------------------------------------------------------------------
// AVX-512 F/BW, 16 lanes.
// ---------------------------------------------------------------------------------------------
template <>
struct Bits<VecAvx512> {
  using F = __m512;
  using I = __m512i;

  MP_WRAPPERS_TARGET_AVX512 static inline F join(const c10::BFloat16* hi, const uint16_t* lo) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)));
    const __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(h, 16), l));
  }
  MP_WRAPPERS_TARGET_AVX512 static inline void store_split(c10::BFloat16* hi, uint16_t* lo, F x) {
    const __m512i b = _mm512_castps_si512(x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), _mm512_cvtepi32_epi16(b));  // truncates
  }
  MP_WRAPPERS_TARGET_AVX512 static inline F round_nearest(F x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(
        _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
        _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(r);
  }
  MP_WRAPPERS_TARGET_AVX512 static inline void store_hi(c10::BFloat16* out, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
  }
  MP_WRAPPERS_TARGET_AVX512 static inline __m512i mix(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kMix1)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kMix2)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  MP_WRAPPERS_TARGET_AVX512 static inline I random(uint32_t base, uint32_t key) {
    const __m512i idx = _mm512_add_epi32(
        _mm512_set1_epi32(static_cast<int>(base)),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    return mix(_mm512_xor_si512(idx, _mm512_set1_epi32(static_cast<int>(key))));
  }
  MP_WRAPPERS_TARGET_AVX512 static inline void store_stochastic(c10::BFloat16* out, F x, I rnd) {
    const __m512i b = _mm512_castps_si512(x);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(b, _mm512_and_si512(rnd, _mm512_set1_epi32(0xFFFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
  }
};
#endif  // defined(__x86_64__)

// ---- tails: n < kWidth lanes through a zero-padded local block -----------------------------------

template <class V>
inline typename V::F join_n(const c10::BFloat16* hi, const uint16_t* lo, int64_t n) {
  if (n >= V::kWidth) return Bits<V>::join(hi, lo);
  c10::BFloat16 h[V::kWidth];
  uint16_t l[V::kWidth] = {};
  std::memset(static_cast<void*>(h), 0, sizeof(h));
  std::memcpy(static_cast<void*>(h), hi, static_cast<size_t>(n) * 2);
  std::memcpy(l, lo, static_cast<size_t>(n) * 2);
  return Bits<V>::join(h, l);
}

template <class V>
inline void store_split_n(c10::BFloat16* hi, uint16_t* lo, typename V::F x, int64_t n) {
  if (n >= V::kWidth) return Bits<V>::store_split(hi, lo, x);
  c10::BFloat16 h[V::kWidth];
  uint16_t l[V::kWidth];
  Bits<V>::store_split(h, l, x);
  std::memcpy(static_cast<void*>(hi), h, static_cast<size_t>(n) * 2);
  std::memcpy(lo, l, static_cast<size_t>(n) * 2);
}

template <class V>
inline void store_hi_n(c10::BFloat16* out, typename V::F x, int64_t n) {
  if (n >= V::kWidth) return Bits<V>::store_hi(out, x);
  c10::BFloat16 o[V::kWidth];
  Bits<V>::store_hi(o, x);
  std::memcpy(static_cast<void*>(out), o, static_cast<size_t>(n) * 2);
}

template <class V>
inline void store_stochastic_n(c10::BFloat16* out, typename V::F x,
                               typename Bits<V>::I rnd, int64_t n) {
  if (n >= V::kWidth) return Bits<V>::store_stochastic(out, x, rnd);
  c10::BFloat16 o[V::kWidth];
  Bits<V>::store_stochastic(o, x, rnd);
  std::memcpy(static_cast<void*>(out), o, static_cast<size_t>(n) * 2);
}

}  // namespace lean
}  // namespace cpu
}  // namespace mp_wrappers
