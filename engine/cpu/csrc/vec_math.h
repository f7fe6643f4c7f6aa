// Vector math shared by the CPU kernels: AVX2+FMA when the compiler targets it.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#define KVSERVE_AVX2 1

namespace kvserve {

// e^x, 8 lanes: x = n ln2 + r, a degree-6 polynomial for e^r, times 2^n (Cephes' expf scheme).
// Relative error ~1e-7, like expf. x is clamped to [-87, 88]: no denormals, no overflow.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// tanh(x), 8 lanes: (1 - e) / (1 + e) with e = e^(-2|x|) (exp256), the sign of x put back.
// Absolute error ~1e-7 (relative error grows near 0, where 1 - e cancels): for soft-capped
// attention scores, whose cap multiplies it before the softmax.
inline __m256 tanh256(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 e = exp256(_mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x),
                                        _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), sign);
}

// 8 floats stored as bfloat16, rounded to nearest even (torch's float->bfloat16 conversion for
// every finite value; NaN is not expected here).
inline void store_bf16x8(c10::BFloat16* dst, __m256 v) {
  const __m256i i = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(i, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  // packus works per 128-bit lane: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather the 64-bit halves 0, 2.
  const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(p));
}

inline void store8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }
inline void store8(c10::BFloat16* dst, __m256 v) { store_bf16x8(dst, v); }

}  // namespace kvserve
#endif
