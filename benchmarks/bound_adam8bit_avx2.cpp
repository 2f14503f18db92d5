// What bounds the AVX2 8-bit AdamW step on one core (docs/quantized_states.md, "What bounds the
// 8-bit step on AVX2"): a replica of the kernel's whole-block path (fp32 params, AdamW, no loss
// scale, every code normal: csrc/cpu/multi_tensor_adam8bit.cpp and cpu_quant.h, the same
// instructions written out) timed on data in L2, beside variants that give the same bits and
// variants that do not (bounds, and the rounding of ties to even the codes had before 2026-12-07:
// Note [ties away from zero] in mp_wrappers/ops/reference/quant.py). "two passes" is the kernel's
// schedule since 2026-12-08 (benchmarks/RESULTS.md, "Two passes over a block"); "as is" is the
// single loop it had before. Then how many simple
// vector operations issue beside the square root and division of each vector for free. A
// measurement only: the kernel is what runs. Run, from the repository root:
//   g++ -O3 -mavx2 -mfma -std=c++17 benchmarks/bound_adam8bit_avx2.cpp -o /tmp/b8 && /tmp/b8
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr int kBlock = 256;

// The minifloat codes (mp_wrappers/ops/reference/quant.py): E4M3 signed for exp_avg, E5M3 for
// exp_avg_sq, bias 2^E - 1, mantissa shift 23 - 3.
template <int E, bool S>
struct Code {
  static constexpr bool kSigned = S;
  static constexpr int kBias = (1 << E) - 1, kShift = 20;
  static constexpr int32_t kRebase = (127 - kBias) << 3;
  static constexpr float kMax = 1.875f;
  static float min_normal() { return std::ldexp(1.f, 1 - kBias); }
  static float sub_enc() { return std::ldexp(1.f, kBias + 2); }
  static float decode_rebase() { return std::ldexp(1.f, 127 - kBias); }
};
using ExpAvg = Code<4, true>;
using ExpAvgSq = Code<5, false>;

enum Variant {
  kAsIs,          // the kernel's path
  kBlockSubTest,  // one subnormal test per block (smallest magnitudes tracked): same bits
  kPipelined,     // a block's requantization inside the next block's update: same bits
  kTiesEven,      // ties to the even mantissa (the rule until 2026-12-07): other bits at ties
  kNoEncode,      // bound: no requantization
  kNoDivider,     // bound: a fused multiply-add for the square root and the division
  kTwoPasses,     // the moments and their absmax first, then the division beside the encode
  kVariants
};
const char* const kNames[kVariants] = {
    "as is", "one subnormal test per block", "pipelined requantization",
    "ties to even (the earlier rule)", "no requantization (bound)", "no sqrt and division (bound)", "two passes"};

// 8 codes, one per int32 lane: the encode of cpu_quant.h (no clamp: a finite block factor).
template <class C, bool kTest, bool kTiesEven>
inline __m256i codes(__m256 x, __m256 enc) {
  const __m256 scaled = _mm256_mul_ps(x, enc);
  const __m256 a = C::kSigned ? _mm256_andnot_ps(_mm256_set1_ps(-0.f), scaled) : scaled;
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i half =
      _mm256_set1_epi32((1 << (C::kShift - 1)) - (kTiesEven ? 1 : 0) - (C::kRebase << C::kShift));
  __m256i t = _mm256_add_epi32(bits, half);
  if (kTiesEven) {
    t = _mm256_add_epi32(
        t, _mm256_and_si256(_mm256_srli_epi32(bits, C::kShift), _mm256_set1_epi32(1)));
  }
  __m256i c = _mm256_srli_epi32(t, C::kShift);
  if (kTest) {
    const __m256 is_sub = _mm256_cmp_ps(a, _mm256_set1_ps(C::min_normal()), _CMP_LT_OQ);
    if (_mm256_movemask_ps(is_sub) != 0) {
      const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(C::sub_enc())));
      c = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(c), _mm256_castsi256_ps(sub), is_sub));
    }
  }
  if (C::kSigned) {
    const __m256i with_sign = _mm256_or_si256(c, _mm256_set1_epi32(0x80));
    c = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(c), _mm256_castsi256_ps(with_sign), scaled));
  }
  return c;
}

// 32 codes from the block buffer, packed and stored in memory order.
template <class C, bool kTest, bool kTiesEven>
inline void encode32(uint8_t* p, const float* x, __m256 enc) {
  const __m256i c0 = codes<C, kTest, kTiesEven>(_mm256_load_ps(x), enc);
  const __m256i c1 = codes<C, kTest, kTiesEven>(_mm256_load_ps(x + 8), enc);
  const __m256i c2 = codes<C, kTest, kTiesEven>(_mm256_load_ps(x + 16), enc);
  const __m256i c3 = codes<C, kTest, kTiesEven>(_mm256_load_ps(x + 24), enc);
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permutevar8x32_epi32(b, order));
}

inline float lane_max(__m256 a) {
  alignas(32) float l[8];
  _mm256_store_ps(l, a);
  return *std::max_element(l, l + 8);
}
inline float lane_min(__m256 a) {
  alignas(32) float l[8];
  _mm256_store_ps(l, a);
  return *std::min_element(l, l + 8);
}

struct State {
  std::vector<float> p;
  std::vector<uint8_t> mc, vc;
  std::vector<float> ma, va;
};
struct alignas(64) Buffers {
  float m[2][kBlock], v[2][kBlock];
};
constexpr float kOmb1 = 0.1f, kOmb2 = 0.001f, kBeta1 = 0.9f, kBeta2 = 0.999f, kSqrtScale = 0.95f,
                kEps = 1e-8f, kLr = 1e-3f, kWd = 0.01f;

// The decode factors of block `blk` (the decay times absmax / MAX, re-based for normal codes).
inline void block_factors(const State& s, int64_t blk, __m256& mf, __m256& vf) {
  mf = _mm256_set1_ps(kBeta1 * (s.ma[blk] / ExpAvg::kMax) * ExpAvg::decode_rebase());
  vf = _mm256_set1_ps(kBeta2 * (s.va[blk] / ExpAvgSq::kMax) * ExpAvgSq::decode_rebase());
}

// The new moments of the 8 elements at i: both codes decoded (normal codes, no re-base), one FMA
// for m, a multiply and an FMA for v.
inline void new_moments(__m256 g32, const uint8_t* mc, const uint8_t* vc, int i, __m256 mf,
                        __m256 vf, __m256& m, __m256& v) {
  const __m256i sign_mag = _mm256_set1_epi32(static_cast<int32_t>(0x80000000u | (0x7Fu << 20)));
  const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mc + i));
  const __m128i v8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(vc + i));
  const __m256i mraw = _mm256_cvtepi8_epi32(m8), vraw = _mm256_cvtepu8_epi32(v8);
  const __m256 m_code =
      _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(mraw, 20), sign_mag));
  const __m256 v_code = _mm256_castsi256_ps(_mm256_slli_epi32(vraw, 20));
  m = _mm256_fmadd_ps(m_code, mf, _mm256_mul_ps(_mm256_set1_ps(kOmb1), g32));
  v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kOmb2), g32), g32, _mm256_mul_ps(v_code, vf));
}

// One block's update into buffer `cur`; with kPipelined, the previous block's requantization
// (buffer cur ^ 1, factors enc_prev) 32 elements per 32.
template <Variant W>
__attribute__((noinline)) void block(State& s, const float* g, int64_t b, Buffers& buf, int cur,
                                     const float* enc_prev) {
  float* p = &s.p[b];
  const uint8_t* mc = &s.mc[b];
  const uint8_t* vc = &s.vc[b];
  const int64_t blk = b / kBlock;
  __m256 mf, vf;
  block_factors(s, blk, mf, vf);
  __m256 m_max = _mm256_setzero_ps(), v_max = m_max;
  __m256 m_min = _mm256_set1_ps(INFINITY), v_min = m_min;
  for (int j = 0; j < kBlock; j += 32) {
    for (int i = j; i < j + 32; i += 8) {
      const __m256 p32 = _mm256_loadu_ps(p + i), g32 = _mm256_loadu_ps(g + b + i);
      __m256 m, v;
      new_moments(g32, mc, vc, i, mf, vf, m, v);
      const __m256 ss = _mm256_set1_ps(kSqrtScale);
      const __m256 q = W == kNoDivider
                           ? _mm256_fmadd_ps(v, ss, m)
                           : _mm256_div_ps(m, _mm256_fmadd_ps(_mm256_sqrt_ps(v), ss,
                                                              _mm256_set1_ps(kEps)));
      const __m256 decayed = _mm256_fmadd_ps(_mm256_set1_ps(-(kLr * kWd)), p32, p32);
      _mm256_storeu_ps(p + i, _mm256_fmadd_ps(_mm256_set1_ps(-kLr), q, decayed));
      _mm256_store_ps(buf.m[cur] + i, m);
      _mm256_store_ps(buf.v[cur] + i, v);
      const __m256 am = _mm256_andnot_ps(_mm256_set1_ps(-0.f), m);
      m_max = _mm256_max_ps(m_max, am);
      v_max = _mm256_max_ps(v_max, v);
      if (W == kBlockSubTest) {
        m_min = _mm256_min_ps(m_min, am);
        v_min = _mm256_min_ps(v_min, v);
      }
    }
    if (W == kPipelined && enc_prev != nullptr) {
      const int64_t prev = b - kBlock + j;
      encode32<ExpAvg, true, false>(&s.mc[prev], buf.m[cur ^ 1] + j, _mm256_set1_ps(enc_prev[0]));
      encode32<ExpAvgSq, true, false>(&s.vc[prev], buf.v[cur ^ 1] + j,
                                      _mm256_set1_ps(enc_prev[1]));
    }
  }
  const float m_abs = lane_max(m_max), v_abs = lane_max(v_max);
  s.ma[blk] = m_abs;
  s.va[blk] = v_abs;
  const float m_enc = m_abs > 0.f ? ExpAvg::kMax / m_abs : 0.f;
  const float v_enc = v_abs > 0.f ? ExpAvgSq::kMax / v_abs : 0.f;
  if (W == kPipelined || W == kNoEncode) return;
  uint8_t* mo = &s.mc[b];
  uint8_t* vo = &s.vc[b];
  const __m256 me = _mm256_set1_ps(m_enc), ve = _mm256_set1_ps(v_enc);
  if (W == kBlockSubTest && lane_min(m_min) * m_enc >= ExpAvg::min_normal() &&
      lane_min(v_min) * v_enc >= ExpAvgSq::min_normal()) {
    for (int j = 0; j < kBlock; j += 32) encode32<ExpAvg, false, false>(mo + j, buf.m[cur] + j, me);
    for (int j = 0; j < kBlock; j += 32) {
      encode32<ExpAvgSq, false, false>(vo + j, buf.v[cur] + j, ve);
    }
  } else if (W == kTiesEven) {
    for (int j = 0; j < kBlock; j += 32) encode32<ExpAvg, true, true>(mo + j, buf.m[cur] + j, me);
    for (int j = 0; j < kBlock; j += 32) encode32<ExpAvgSq, true, true>(vo + j, buf.v[cur] + j, ve);
  } else {
    for (int j = 0; j < kBlock; j += 32) encode32<ExpAvg, true, false>(mo + j, buf.m[cur] + j, me);
    for (int j = 0; j < kBlock; j += 32) {
      encode32<ExpAvgSq, true, false>(vo + j, buf.v[cur] + j, ve);
    }
  }
}


// kTwoPasses: pass 1 decodes, updates both moments into the buffer and reduces their absmax (no
// division); pass 2 takes the square root and the division of each vector from the buffer and
// encodes the block 32 codes at a time beside them, so that the encode issues in the divider's
// shadow. Each element's arithmetic is the one of `block`, so the bits are the same.
__attribute__((noinline)) void block_two_passes(State& s, const float* g, int64_t b, Buffers& buf) {
  float* p = &s.p[b];
  uint8_t* mc = &s.mc[b];
  uint8_t* vc = &s.vc[b];
  const int64_t blk = b / kBlock;
  __m256 mf, vf;
  block_factors(s, blk, mf, vf);
  __m256 m_max = _mm256_setzero_ps(), v_max = m_max;
  for (int i = 0; i < kBlock; i += 8) {
    __m256 m, v;
    new_moments(_mm256_loadu_ps(g + b + i), mc, vc, i, mf, vf, m, v);
    _mm256_store_ps(buf.m[0] + i, m);
    _mm256_store_ps(buf.v[0] + i, v);
    m_max = _mm256_max_ps(m_max, _mm256_andnot_ps(_mm256_set1_ps(-0.f), m));
    v_max = _mm256_max_ps(v_max, v);
  }
  const float m_abs = lane_max(m_max), v_abs = lane_max(v_max);
  s.ma[blk] = m_abs;
  s.va[blk] = v_abs;
  const __m256 me = _mm256_set1_ps(m_abs > 0.f ? ExpAvg::kMax / m_abs : 0.f);
  const __m256 ve = _mm256_set1_ps(v_abs > 0.f ? ExpAvgSq::kMax / v_abs : 0.f);
  for (int j = 0; j < kBlock; j += 32) {
    for (int i = j; i < j + 32; i += 8) {
      const __m256 p32 = _mm256_loadu_ps(p + i);
      const __m256 den = _mm256_fmadd_ps(_mm256_sqrt_ps(_mm256_load_ps(buf.v[0] + i)),
                                         _mm256_set1_ps(kSqrtScale), _mm256_set1_ps(kEps));
      const __m256 q = _mm256_div_ps(_mm256_load_ps(buf.m[0] + i), den);
      const __m256 decayed = _mm256_fmadd_ps(_mm256_set1_ps(-(kLr * kWd)), p32, p32);
      _mm256_storeu_ps(p + i, _mm256_fmadd_ps(_mm256_set1_ps(-kLr), q, decayed));
    }
    encode32<ExpAvg, true, false>(mc + j, buf.m[0] + j, me);
    encode32<ExpAvgSq, true, false>(vc + j, buf.v[0] + j, ve);
  }
}

template <Variant W>
void step(State& s, const std::vector<float>& g) {
  static Buffers buf;
  const int64_t n = static_cast<int64_t>(s.p.size());
  float enc[2] = {0.f, 0.f};
  for (int64_t b = 0; b < n; b += kBlock) {
    const int cur = static_cast<int>(b / kBlock) & 1;
    if (W == kTwoPasses) {
      block_two_passes(s, g.data(), b, buf);
      continue;
    }
    block<W>(s, g.data(), b, buf, cur, b > 0 ? enc : nullptr);
    const float m_abs = s.ma[b / kBlock], v_abs = s.va[b / kBlock];
    enc[0] = m_abs > 0.f ? ExpAvg::kMax / m_abs : 0.f;
    enc[1] = v_abs > 0.f ? ExpAvgSq::kMax / v_abs : 0.f;
  }
  if (W == kPipelined) {  // the last block's requantization
    const int64_t b = n - kBlock;
    const int cur = static_cast<int>(b / kBlock) & 1;
    for (int j = 0; j < kBlock; j += 32) {
      encode32<ExpAvg, true, false>(&s.mc[b + j], buf.m[cur] + j, _mm256_set1_ps(enc[0]));
      encode32<ExpAvgSq, true, false>(&s.vc[b + j], buf.v[cur] + j, _mm256_set1_ps(enc[1]));
    }
  }
}

void run(int w, State& s, const std::vector<float>& g) {
  switch (w) {
    case kAsIs: return step<kAsIs>(s, g);
    case kBlockSubTest: return step<kBlockSubTest>(s, g);
    case kPipelined: return step<kPipelined>(s, g);
    case kTiesEven: return step<kTiesEven>(s, g);
    case kNoEncode: return step<kNoEncode>(s, g);
    case kTwoPasses: return step<kTwoPasses>(s, g);
    default: return step<kNoDivider>(s, g);
  }
}

// The square root and division of one vector (in L1) with K more independent operations of a kind.
constexpr int kL1 = 1024;
alignas(64) float l1_m[kL1], l1_v[kL1], l1_out[kL1], l1_x[kL1];
template <int K, int kKind>
__attribute__((noinline)) void coissue_pass() {
  for (int i = 0; i < kL1; i += 8) {
    const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(_mm256_load_ps(l1_v + i)),
                                     _mm256_set1_ps(0.9f), _mm256_set1_ps(1e-8f));
    _mm256_store_ps(l1_out + i, _mm256_div_ps(_mm256_load_ps(l1_m + i), d));
    const __m256 x = _mm256_load_ps(l1_x + i);
    __m256 acc = x;
    for (int k = 0; k < K; ++k) {
      const __m256 c = _mm256_set1_ps(1.f + 0.125f * k);
      __m256 y;
      if (kKind == 0) y = _mm256_castsi256_ps(_mm256_srli_epi32(_mm256_castps_si256(x), k + 1));
      else if (kKind == 1)
        y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(x), _mm256_castps_si256(c)));
      else y = _mm256_fmadd_ps(x, c, c);
      acc = _mm256_max_ps(acc, y);  // one more operation per extra one: 2K in all
    }
    _mm256_store_ps(l1_out + i, _mm256_add_ps(_mm256_load_ps(l1_out + i), acc));
  }
}
template <int K, int kKind>
double coissue_ns() {
  double best = 1e9;
  for (int r = 0; r < 9; ++r) {
    const auto t = std::chrono::steady_clock::now();
    for (int j = 0; j < 20000; ++j) {
      coissue_pass<K, kKind>();
      asm volatile("" ::: "memory");
    }
    const std::chrono::duration<double> d = std::chrono::steady_clock::now() - t;
    best = std::min(best, d.count() / (20000.0 * kL1 / 8) * 1e9);
  }
  return best;
}

}  // namespace

int main() {
  const int64_t n = 65536;  // 256 KiB of params, 256 KiB of grads, 128 KiB of codes: L2
  std::vector<float> g(n), p(n);
  uint32_t r = 12345;
  for (int64_t i = 0; i < n; ++i) {  // a normal-ish sample (sum of uniforms), no zero codes
    float z = -6.f;
    for (int k = 0; k < 12; ++k) z += ((r = r * 1664525u + 1013904223u) >> 8) * 0x1p-24f;
    g[i] = z * 1e-2f;
    p[i] = z;
  }
  const State init{p, std::vector<uint8_t>(n, 0x40), std::vector<uint8_t>(n, 0x40),
                   std::vector<float>(n / kBlock, 1e-3f), std::vector<float>(n / kBlock, 1e-6f)};
  std::vector<State> st(kVariants, init);
  for (int w = 0; w < 5; ++w)
    for (int v = 0; v < kVariants; ++v) run(v, st[v], g);
  double best[kVariants];
  std::fill(best, best + kVariants, 1e9);
  for (int rep = 0; rep < 9; ++rep) {  // interleaved rounds, the fastest of each
    for (int v = 0; v < kVariants; ++v) {
      const auto t = std::chrono::steady_clock::now();
      for (int k = 0; k < 300; ++k) run(v, st[v], g);
      const std::chrono::duration<double> d = std::chrono::steady_clock::now() - t;
      best[v] = std::min(best[v], d.count() / (300.0 * n) * 1e9);
    }
  }
  std::printf("8-bit AdamW whole-block step, %lld elements (in L2), one thread, AVX2, "
              "fastest of 9 rounds:\n", static_cast<long long>(n));
  for (int v = 0; v < kVariants; ++v) {
    const bool same = st[v].p == st[0].p && st[v].mc == st[0].mc && st[v].vc == st[0].vc &&
                      st[v].ma == st[0].ma;
    std::printf("  %-36s %.3f ns/element  %.2fx  %s\n", kNames[v], best[v], best[v] / best[0],
                same ? "bits: same" : "bits: differ");
  }
  for (int i = 0; i < kL1; ++i) {
    l1_m[i] = 0.001f * (i - 500);
    l1_v[i] = 1e-4f * i + 1e-6f;
    l1_x[i] = 1.f + 0.001f * i;
  }
  coissue_ns<0, 0>();  // warm up
  std::printf("a square root and a division per 8 elements (in L1) beside 2K more operations, "
              "ns per vector:\n");
  std::printf("  K            0      2      4      6      8     10\n");
#define MP_ROW(kind, name)                                                                  \
  std::printf("  %-8s %6.2f %6.2f %6.2f %6.2f %6.2f %6.2f\n", name, coissue_ns<0, kind>(),  \
              coissue_ns<2, kind>(), coissue_ns<4, kind>(), coissue_ns<6, kind>(),          \
              coissue_ns<8, kind>(), coissue_ns<10, kind>());
  MP_ROW(0, "shift") MP_ROW(1, "int add") MP_ROW(2, "fma")
  return 0;
}
