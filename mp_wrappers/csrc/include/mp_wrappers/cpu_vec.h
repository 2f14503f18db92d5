// Portable fp32 vector building blocks for the CPU kernels, one flavour per instruction set.
//
// Every kernel computes in fp32 whatever the storage dtype (float, c10::Half, c10::BFloat16): it
// loads a block of N values into fp32 registers, computes, and stores back with the same rounding
// torch's `.to()` uses (round-to-nearest-even), so results are bit-identical to the pure-PyTorch
// references whenever the arithmetic is the same.
//
// Three flavours with one interface (see VecBaseline for the documented list of operations):
//   VecAvx512   16 lanes, AVX-512F/BW/VL (+F16C for fp16).
//   VecAvx2      8 lanes, AVX2 + FMA + F16C (gcc 12 cannot vectorise _Float16 arithmetic, so fp16 is
//                converted with F16C; bf16 is a 16-bit shift either way).
//   VecBaseline  8 lanes of plain C++ that gcc auto-vectorises for the build's baseline ISA (SSE2 on
//                x86-64, NEON on aarch64); it also is the only flavour on non-x86 machines.
//
// How the flavours are compiled (why not -march=native): the intrinsics of a wider ISA may only be
// inlined into functions compiled for that ISA. Each flavour's functions carry a per-function
// `target` attribute, and kernels are written ONCE as `template <class V> static void run(...)`
// inside a struct; run_cpu_kernel<Kernel>() instantiates them through entry points that carry the
// same target attribute plus `flatten`, which inlines the whole kernel (and the Vec calls inside it)
// into a function compiled for that ISA. One binary therefore runs anywhere, and
// mp_wrappers::cpu_isa() picks the widest flavour at run time (MP_WRAPPERS_CPU_ISA narrows it).
//
// Determinism across flavours (tests compare avx512, avx2 and baseline bit for bit):
//   * No implicit FMA contraction (setup.py passes -ffp-contract=off): a*b+c is two roundings
//     unless a kernel calls V::fmadd, which is a true fused multiply-add on every flavour
//     (std::fma on the baseline).
//   * Sums of squares (SumSq32) use a fixed 32-lane layout in double precision; x*x of an fp32 value
//     is exact in double, so the result does not depend on the vector width either.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mp_wrappers/cpu_features.h"

// Passing __m512 between functions compiled for different ISAs changes the ABI, and gcc warns about
// it when it first sees a Kernel::run<VecAvx512> template body. Those bodies are only ever inlined
// into the matching flattened entry point (never emitted on their own), so the warning is noise.
#pragma GCC diagnostic ignored "-Wpsabi"
// gcc 12 reports its own _mm512_undefined_*() temporaries inside avx512fintrin.h as "may be used
// uninitialized" once they are inlined (gcc PR 105593, fixed in gcc 13): a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define MP_WRAPPERS_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MP_WRAPPERS_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

namespace mp_wrappers {
namespace cpu {

// ---------------------------------------------------------------------------------------------
// Baseline: plain C++ on fixed-size arrays. The reference for what every operation means.
// ---------------------------------------------------------------------------------------------
struct VecBaseline {
  static constexpr int kWidth = 8;   // fp32 lanes per F
  static constexpr int kDWidth = 4;  // fp64 lanes per D (only used by SumSq32)
  struct F { float v[kWidth]; };
  struct D { double v[kDWidth]; };

  // ---- loads: kWidth values of any storage dtype -> fp32 lanes --------------------------------
  static inline F load(const float* p) { F r; for (int i = 0; i < kWidth; ++i) r.v[i] = p[i]; return r; }
  static inline F load(const c10::Half* p) {
    F r; for (int i = 0; i < kWidth; ++i) r.v[i] = static_cast<float>(p[i]); return r;
  }
  static inline F load(const c10::BFloat16* p) {
    F r; for (int i = 0; i < kWidth; ++i) r.v[i] = static_cast<float>(p[i]); return r;
  }
  // ---- stores: fp32 lanes -> storage dtype, round-to-nearest-even (c10's own conversions) ------
  static inline void store(float* p, F a) { for (int i = 0; i < kWidth; ++i) p[i] = a.v[i]; }
  static inline void store(c10::Half* p, F a) { for (int i = 0; i < kWidth; ++i) p[i] = c10::Half(a.v[i]); }
  static inline void store(c10::BFloat16* p, F a) {
    for (int i = 0; i < kWidth; ++i) p[i] = c10::BFloat16(a.v[i]);
  }

  // ---- arithmetic (each op rounds once, like the scalar IEEE operation) ------------------------
  static inline F set1(float x) { F r; for (int i = 0; i < kWidth; ++i) r.v[i] = x; return r; }
  static inline F zero() { return set1(0.f); }
#define MP_WRAPPERS_BASELINE_BINARY(name, expr)                         \
  static inline F name(F a, F b) {                                    \
    F r;                                                              \
    for (int i = 0; i < kWidth; ++i) { const float x = a.v[i], y = b.v[i]; r.v[i] = (expr); } \
    return r;                                                         \
  }
  MP_WRAPPERS_BASELINE_BINARY(add, x + y)
  MP_WRAPPERS_BASELINE_BINARY(sub, x - y)
  MP_WRAPPERS_BASELINE_BINARY(mul, x * y)
  MP_WRAPPERS_BASELINE_BINARY(div, x / y)
  // max/min follow the x86 maxps/minps rule (return b when either is NaN) so flavours agree.
  MP_WRAPPERS_BASELINE_BINARY(max, x > y ? x : y)
  MP_WRAPPERS_BASELINE_BINARY(min, x < y ? x : y)
#undef MP_WRAPPERS_BASELINE_BINARY
  // a * b + c with a single rounding (a true FMA on every flavour, so results agree).
  static inline F fmadd(F a, F b, F c) {
    F r; for (int i = 0; i < kWidth; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r;
  }
  static inline F sqrt(F a) { F r; for (int i = 0; i < kWidth; ++i) r.v[i] = std::sqrt(a.v[i]); return r; }
  static inline F abs(F a) { F r; for (int i = 0; i < kWidth; ++i) r.v[i] = std::fabs(a.v[i]); return r; }

  // ---- non-finite detection --------------------------------------------------------------------
  // x - x is 0 for every finite x and NaN for inf or NaN, so accumulating it detects any non-finite
  // input with two cheap ops and no branch; check the probe once at the end of a chunk.
  static inline F nonfinite_probe(F acc, F x) { return add(acc, sub(x, x)); }
  static inline bool any_nonfinite(F acc) {
    bool bad = false;
    for (int i = 0; i < kWidth; ++i) bad |= (acc.v[i] != acc.v[i]);
    return bad;
  }

  // ---- double accumulators for sums of squares (see SumSq32) ------------------------------------
  static inline D zero_d() { D r; for (int i = 0; i < kDWidth; ++i) r.v[i] = 0.0; return r; }
  // acc[j] += (double)x[j*kDWidth + l]^2 for every lane l of every D covered by one F.
  static inline void sumsq_acc(F x, D* acc) {
    for (int j = 0; j < kWidth / kDWidth; ++j)
      for (int l = 0; l < kDWidth; ++l) {
        const double d = x.v[j * kDWidth + l];
        acc[j].v[l] += d * d;
      }
  }
  static inline void store_d(double* p, D a) { for (int i = 0; i < kDWidth; ++i) p[i] = a.v[i]; }
};

#if defined(__x86_64__)
// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C, 8 lanes.
// ---------------------------------------------------------------------------------------------
struct VecAvx2 {
  static constexpr int kWidth = 8;
  static constexpr int kDWidth = 4;
  using F = __m256;
  using D = __m256d;

  MP_WRAPPERS_TARGET_AVX2 static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  MP_WRAPPERS_TARGET_AVX2 static inline F load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  MP_WRAPPERS_TARGET_AVX2 static inline F load(const c10::BFloat16* p) {
    // bf16 is the upper half of an fp32: widen and shift, exact.
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  MP_WRAPPERS_TARGET_AVX2 static inline void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  MP_WRAPPERS_TARGET_AVX2 static inline void store(c10::Half* p, F a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  MP_WRAPPERS_TARGET_AVX2 static inline void store(c10::BFloat16* p, F a) {
    // c10::round_to_nearest_even: add 0x7FFF plus the lowest kept bit, truncate; NaN -> 0x7FC0.
    const __m256i bits = _mm256_castps_si256(a);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    // Values are <= 0xFFFF, so the unsigned-saturating pack is a plain narrowing.
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }

  MP_WRAPPERS_TARGET_AVX2 static inline F set1(float x) { return _mm256_set1_ps(x); }
  MP_WRAPPERS_TARGET_AVX2 static inline F zero() { return _mm256_setzero_ps(); }
  MP_WRAPPERS_TARGET_AVX2 static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX2 static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX2 static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX2 static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX2 static inline F max(F a, F b) { return _mm256_max_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX2 static inline F min(F a, F b) { return _mm256_min_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX2 static inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  MP_WRAPPERS_TARGET_AVX2 static inline F sqrt(F a) { return _mm256_sqrt_ps(a); }
  MP_WRAPPERS_TARGET_AVX2 static inline F abs(F a) {
    return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a);
  }
  MP_WRAPPERS_TARGET_AVX2 static inline F nonfinite_probe(F acc, F x) {
    return _mm256_add_ps(acc, _mm256_sub_ps(x, x));
  }
  MP_WRAPPERS_TARGET_AVX2 static inline bool any_nonfinite(F acc) {
    return _mm256_movemask_ps(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q)) != 0;
  }

  MP_WRAPPERS_TARGET_AVX2 static inline D zero_d() { return _mm256_setzero_pd(); }
  MP_WRAPPERS_TARGET_AVX2 static inline void sumsq_acc(F x, D* acc) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc[0] = _mm256_fmadd_pd(lo, lo, acc[0]);  // exact square: fused or not gives the same sum
    acc[1] = _mm256_fmadd_pd(hi, hi, acc[1]);
  }
  MP_WRAPPERS_TARGET_AVX2 static inline void store_d(double* p, D a) { _mm256_storeu_pd(p, a); }
};

// ---------------------------------------------------------------------------------------------
// AVX-512 F/BW/VL/DQ (+F16C), 16 lanes.
// ---------------------------------------------------------------------------------------------
struct VecAvx512 {
  static constexpr int kWidth = 16;
  static constexpr int kDWidth = 8;
  using F = __m512;
  using D = __m512d;

  MP_WRAPPERS_TARGET_AVX512 static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  MP_WRAPPERS_TARGET_AVX512 static inline F load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  MP_WRAPPERS_TARGET_AVX512 static inline F load(const c10::BFloat16* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  MP_WRAPPERS_TARGET_AVX512 static inline void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  MP_WRAPPERS_TARGET_AVX512 static inline void store(c10::Half* p, F a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  MP_WRAPPERS_TARGET_AVX512 static inline void store(c10::BFloat16* p, F a) {
    // Integer rounding rather than AVX512_BF16's vcvtneps2bf16, which flushes denormals and so
    // would not match torch's .to(torch.bfloat16) bit for bit.
    const __m512i bits = _mm512_castps_si512(a);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }

  MP_WRAPPERS_TARGET_AVX512 static inline F set1(float x) { return _mm512_set1_ps(x); }
  MP_WRAPPERS_TARGET_AVX512 static inline F zero() { return _mm512_setzero_ps(); }
  MP_WRAPPERS_TARGET_AVX512 static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX512 static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX512 static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX512 static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX512 static inline F max(F a, F b) { return _mm512_max_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX512 static inline F min(F a, F b) { return _mm512_min_ps(a, b); }
  MP_WRAPPERS_TARGET_AVX512 static inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  MP_WRAPPERS_TARGET_AVX512 static inline F sqrt(F a) { return _mm512_sqrt_ps(a); }
  MP_WRAPPERS_TARGET_AVX512 static inline F abs(F a) { return _mm512_abs_ps(a); }
  MP_WRAPPERS_TARGET_AVX512 static inline F nonfinite_probe(F acc, F x) {
    return _mm512_add_ps(acc, _mm512_sub_ps(x, x));
  }
  MP_WRAPPERS_TARGET_AVX512 static inline bool any_nonfinite(F acc) {
    return _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q) != 0;
  }

  MP_WRAPPERS_TARGET_AVX512 static inline D zero_d() { return _mm512_setzero_pd(); }
  MP_WRAPPERS_TARGET_AVX512 static inline void sumsq_acc(F x, D* acc) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc[0] = _mm512_fmadd_pd(lo, lo, acc[0]);
    acc[1] = _mm512_fmadd_pd(hi, hi, acc[1]);
  }
  MP_WRAPPERS_TARGET_AVX512 static inline void store_d(double* p, D a) { _mm512_storeu_pd(p, a); }
};
#endif  // defined(__x86_64__)

// ---------------------------------------------------------------------------------------------
// Width-independent helpers, valid for every flavour V.
// ---------------------------------------------------------------------------------------------

// Load n < V::kWidth values (the tail of a chunk); missing lanes read as 0.
template <class V, class T>
inline typename V::F load_partial(const T* p, int64_t n) {
  T buf[V::kWidth];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));  // bit pattern 0 is +0.0 in all dtypes
  std::memcpy(static_cast<void*>(buf), p, static_cast<size_t>(n) * sizeof(T));
  return V::load(buf);
}

// Store the first n < V::kWidth lanes of a (same rounding as V::store).
template <class V, class T>
inline void store_partial(T* p, typename V::F a, int64_t n) {
  T buf[V::kWidth];
  V::store(buf, a);
  std::memcpy(static_cast<void*>(p), buf, static_cast<size_t>(n) * sizeof(T));
}

// Load min(n, kWidth) values, zero-padding a short tail.
template <class V, class T>
inline typename V::F load_n(const T* p, int64_t n) {
  return n >= V::kWidth ? V::load(p) : load_partial<V>(p, n);
}

template <class V, class T>
inline void store_n(T* p, typename V::F a, int64_t n) {
  if (n >= V::kWidth) V::store(p, a);
  else store_partial<V>(p, a, n);
}

// Sum of squares with a layout that does not depend on the flavour: element i of the input always
// lands in double lane i % 32, and the lanes are reduced in a fixed order. Squares of fp32 values
// are exact in double, so every flavour (and any thread count, when chunk boundaries are fixed)
// gives the same bits, with far more accuracy than an fp32 accumulator.
template <class V>
struct SumSq32 {
  static constexpr int kLanes = 32;
  static_assert(kLanes % V::kWidth == 0, "SumSq32 needs kWidth to divide 32");
  static constexpr int kVecs = kLanes / V::kWidth;          // F vectors per 32-element block
  static constexpr int kAccs = kLanes / V::kDWidth;         // D accumulators
  static constexpr int kAccPerVec = V::kWidth / V::kDWidth;  // D accumulators fed by one F
  typename V::D acc[kAccs];

  inline SumSq32() { for (int j = 0; j < kAccs; ++j) acc[j] = V::zero_d(); }
  // Add the squares of a block of 32 fp32 values given as kVecs vectors.
  inline void add_block(const typename V::F* x) {
    for (int k = 0; k < kVecs; ++k) V::sumsq_acc(x[k], &acc[k * kAccPerVec]);
  }
  inline double total() const {
    double lanes[kLanes];
    for (int j = 0; j < kAccs; ++j) V::store_d(lanes + j * V::kDWidth, acc[j]);
    // Pairwise in a fixed order: the same on every flavour.
    for (int width = kLanes / 2; width >= 1; width /= 2)
      for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
    return lanes[0];
  }
};

// Run Kernel::run<V>(args...) for the flavour chosen at run time. Kernel is a struct with
//   template <class V> static void run(Args...);
// Each entry point below is compiled for its ISA and `flatten`s the kernel into itself, so the
// kernel's Vec calls are inlined under the right target (see the note at the top of this file).
// Call it once per chunk (or per thread): the switch costs nothing next to 64K elements of work.
template <class Kernel, class... Args>
__attribute__((flatten)) void run_baseline(Args&&... args) {
  Kernel::template run<VecBaseline>(static_cast<Args&&>(args)...);
}
#if defined(__x86_64__)
template <class Kernel, class... Args>
MP_WRAPPERS_TARGET_AVX2 __attribute__((flatten)) void run_avx2(Args&&... args) {
  Kernel::template run<VecAvx2>(static_cast<Args&&>(args)...);
}
template <class Kernel, class... Args>
MP_WRAPPERS_TARGET_AVX512 __attribute__((flatten)) void run_avx512(Args&&... args) {
  Kernel::template run<VecAvx512>(static_cast<Args&&>(args)...);
}
#endif

// OutOfLine<V>::run<Kernel>(args...) calls Kernel::run<V>(args...) through a function of its own,
// compiled for V's ISA and flattened like the entry points above, but never inlined into its
// caller. For a rarely taken part of a kernel (the tail of a span, Note [whole vectors] in
// cpu_optim.h): inlined, a second copy of a loop body in one flattened function makes gcc -O3
// superlinearly slower (measured with the tail inlined: multi_tensor_adam.cpp 39 -> 142 CPU s). It
// takes its arguments by value: a caller's local whose address escaped here could be aliased by
// every vector store of the caller's loop (vector types alias everything), which would then reload
// it after each store.
template <class V>
struct OutOfLine;
template <>
struct OutOfLine<VecBaseline> {
  template <class Kernel, class... Args>
  __attribute__((noinline, flatten)) static void run(Args... args) {
    Kernel::template run<VecBaseline>(args...);
  }
};
#if defined(__x86_64__)
template <>
struct OutOfLine<VecAvx2> {
  template <class Kernel, class... Args>
  MP_WRAPPERS_TARGET_AVX2 __attribute__((noinline, flatten)) static void run(Args... args) {
    Kernel::template run<VecAvx2>(args...);
  }
};
template <>
struct OutOfLine<VecAvx512> {
  template <class Kernel, class... Args>
  MP_WRAPPERS_TARGET_AVX512 __attribute__((noinline, flatten)) static void run(Args... args) {
    Kernel::template run<VecAvx512>(args...);
  }
};
#endif

template <class Kernel, class... Args>
inline void run_cpu_kernel(CpuIsa isa, Args&&... args) {
#if defined(__x86_64__)
  if (isa == CpuIsa::kAvx512) return run_avx512<Kernel>(static_cast<Args&&>(args)...);
  if (isa == CpuIsa::kAvx2) return run_avx2<Kernel>(static_cast<Args&&>(args)...);
#endif
  (void)isa;
  run_baseline<Kernel>(static_cast<Args&&>(args)...);
}

}  // namespace cpu
}  // namespace mp_wrappers
