// The two divisions by constants in an fp32 Adam step (apex's m / bc1 and v / bc2) as a multiply
// by the rounded reciprocal plus one correcting FMA pair, q = x * y, q += (x - q * c) * y with
// y = fl(1 / c), against the divisions, on data in L1 (no memory traffic), one thread, AVX2; a
// vector with any |x| outside [2^-97, 2^100) takes the divisions instead. Both loops end with the
// square root and the division every exact Adam step keeps. A measurement of the bound only. The
// correction is fl(x / c) while nothing underflows or overflows (Markstein's theorem: a division by
// a precomputed reciprocal rounded to nearest, in one multiply and two fused multiply-adds, is
// correctly rounded; docs/quantized_states.md, "Two ways to cut fp32 Adam's divisions", checked it
// exhaustively for 36 divisors). Run, from the repository root:
//   g++ -O2 -mavx2 -mfma benchmarks/bound_recip_div.cpp -o /tmp/recip && /tmp/recip
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace {

constexpr int kBuffer = 1024;  // 3 x 4 KiB: stays in L1
alignas(64) float m[kBuffer], v[kBuffer], out[kBuffer];

// fl(x / c) from the reciprocal y, for |x| in [2^-97, 2^100)
inline __m256 corrected(__m256 x, __m256 c, __m256 y) {
  const __m256 q = _mm256_mul_ps(x, y);
  return _mm256_fmadd_ps(_mm256_fnmadd_ps(q, c, x), y, q);
}

inline __m256 out_of_range(__m256 x) {
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
  return _mm256_or_ps(_mm256_cmp_ps(a, _mm256_set1_ps(0x1p-97f), _CMP_LT_OQ),
                      _mm256_cmp_ps(a, _mm256_set1_ps(0x1p100f), _CMP_GE_OQ));
}

template <bool kReciprocal>
void pass() {
  const __m256 c1 = _mm256_set1_ps(0.271f), c2 = _mm256_set1_ps(0.00995f);
  const __m256 y1 = _mm256_set1_ps(1.f / 0.271f), y2 = _mm256_set1_ps(1.f / 0.00995f);
  const __m256 eps = _mm256_set1_ps(1e-8f);
  for (int i = 0; i < kBuffer; i += 8) {
    const __m256 mm = _mm256_load_ps(m + i), vv = _mm256_load_ps(v + i);
    __m256 m_hat, v_hat;
    if (kReciprocal) {
      m_hat = corrected(mm, c1, y1);
      v_hat = corrected(vv, c2, y2);
      // rare (a moment near 0 or huge): the divisions, for that vector only
      if (__builtin_expect(_mm256_movemask_ps(_mm256_or_ps(out_of_range(mm), out_of_range(vv))),
                           0)) {
        m_hat = _mm256_div_ps(mm, c1);
        v_hat = _mm256_div_ps(vv, c2);
      }
    } else {
      m_hat = _mm256_div_ps(mm, c1);
      v_hat = _mm256_div_ps(vv, c2);
    }
    _mm256_store_ps(out + i, _mm256_div_ps(m_hat, _mm256_add_ps(_mm256_sqrt_ps(v_hat), eps)));
  }
}

template <bool kReciprocal>
double best_ns_per_element() {
  double best = 1e9;
  for (int r = 0; r < 7; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int j = 0; j < 20000; ++j) {
      pass<kReciprocal>();
      asm volatile("" ::: "memory");
    }
    const std::chrono::duration<double> d = std::chrono::steady_clock::now() - start;
    best = std::min(best, d.count() / (20000.0 * kBuffer) * 1e9);
  }
  return best;
}

}  // namespace

int main() {
  for (int i = 0; i < kBuffer; ++i) {
    m[i] = 0.001f * static_cast<float>(i - 500);
    v[i] = 1e-4f * static_cast<float>(i) + 1e-6f;
  }
  std::printf("ns/element, one thread, fastest of 7:\n");
  for (int rep = 0; rep < 3; ++rep)
    std::printf("  3 divisions + sqrt (apex) %.3f   reciprocal + FMA pair + division + sqrt %.3f\n",
                best_ns_per_element<false>(), best_ns_per_element<true>());
}
