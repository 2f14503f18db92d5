// The floor an exact Adam step has on one CPU core: the square root of v and the division of m by
// the denominator, which every update of an element does (IEEE-exact in every kernel and in the
// reference, so no reciprocal estimates), timed alone on data in L1 (no memory traffic), AVX-512
// and AVX2, for the 24.6M elements of bench_quantized_states.py's model. Compared with the time an
// 8-bit step may take to reach a share of the bandwidth, it says whether that share is reachable
// (docs/quantized_states.md, "The one-thread floor"). Run, from the repository root:
//   g++ -O2 -mavx512f -mfma -mavx2 benchmarks/bound_sqrt_div.cpp -o /tmp/bound && /tmp/bound
// (without AVX-512, drop -mavx512f and run it with the argument avx2).
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstring>

namespace {

constexpr long kElements = 24600000;
constexpr int kBuffer = 1024;  // 3 x 4 KiB: stays in L1

alignas(64) float m[kBuffer], v[kBuffer], out[kBuffer];

#ifdef __AVX512F__
void pass512() {
  const __m512 s = _mm512_set1_ps(0.9f), e = _mm512_set1_ps(1e-8f);
  for (int i = 0; i < kBuffer; i += 16) {
    const __m512 d = _mm512_fmadd_ps(_mm512_sqrt_ps(_mm512_load_ps(v + i)), s, e);
    _mm512_store_ps(out + i, _mm512_div_ps(_mm512_load_ps(m + i), d));
  }
}
#endif

void pass256() {
  const __m256 s = _mm256_set1_ps(0.9f), e = _mm256_set1_ps(1e-8f);
  for (int i = 0; i < kBuffer; i += 8) {
    const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(_mm256_load_ps(v + i)), s, e);
    _mm256_store_ps(out + i, _mm256_div_ps(_mm256_load_ps(m + i), d));
  }
}

double best_ms(void (*pass)()) {
  double best = 1e30;
  for (int round = 0; round < 7; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long done = 0; done < kElements; done += kBuffer) {
      pass();
      asm volatile("" ::: "memory");  // every pass stores: none is folded away
    }
    const std::chrono::duration<double, std::milli> took = std::chrono::steady_clock::now() - t0;
    if (took.count() < best) best = took.count();
  }
  return best;
}

void report(const char* isa, double ms) {
  std::printf("| %s | %.2f | %.3f |\n", isa, ms, ms * 1e6 / kElements);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 0; i < kBuffer; ++i) {
    m[i] = 1e-3f * static_cast<float>(i + 1);
    v[i] = 1e-6f * static_cast<float>(i + 3);
  }
  const bool avx2_only = argc > 1 && std::strcmp(argv[1], "avx2") == 0;
  std::printf("sqrt + fma + div per element, %ld elements, one thread, fastest of 7\n\n", kElements);
  std::printf("| ISA | ms | ns/element |\n|---|---|---|\n");
#ifdef __AVX512F__
  if (!avx2_only) report("AVX-512", best_ms(pass512));
#endif
  report("AVX2", best_ms(pass256));
  return out[7] > 0.0f ? 0 : 1;
}
