// Pieces the paged-decode kernel shares (paged_decode_vec.h and its formats' sources): the
// prefetch distances, an 8-way horizontal sum and the softmax numerators of one query head's
// scores, all on AVX2+FMA.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace kvserve {

// A soft-capped score (Gemma 2): cap * tanh(s / cap), the portable paths' way.
inline float softcap(float s, float cap) { return cap * std::tanh(s / cap); }

}  // namespace kvserve

#ifdef KVSERVE_AVX2
namespace kvserve {

constexpr int64_t kAhead = 32;  // rows prefetched this far ahead of use
constexpr int64_t kLine = 64;   // bytes per cache line

// Lane i of the result is the horizontal sum of a[i].
inline __m256 hsum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// sg[0, n) (room for n rounded up to 8 floats) soft-capped in place: cap * tanh(s / cap), the
// vector paths' way (tanh256); the lanes past n take whatever comes, softmax_numerators
// overwrites them.
inline void softcap_scores(float* sg, int64_t n, float cap) {
  const __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.0f / cap);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(sg + i), inv);
    _mm256_storeu_ps(sg + i, _mm256_mul_ps(c, tanh256(x)));
  }
}

// sg[0, n) (npad = n rounded up to 8 floats of room): the scores of one query head become
// their softmax numerators exp(s - max) in place, sg[n, npad) exactly 0; returns 1 / their sum
// (applied to the output instead of every weight).
inline float softmax_numerators(float* sg, int64_t n, int64_t npad) {
  for (int64_t i = n; i < npad; i++) sg[i] = -INFINITY;
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < npad; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sg + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, vm);
  const __m256 m = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t i = 0; i < npad; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + i), m));
    if (i + 8 > n) {  // zero the padded lanes exactly
      const __m256 idx = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(i)),
                                       _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
      e = _mm256_and_ps(e, _mm256_cmp_ps(idx, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ));
    }
    _mm256_storeu_ps(sg + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  _mm256_storeu_ps(lanes, vsum);
  float sum = 0.0f;
  for (float l : lanes) sum += l;
  return 1.0f / sum;
}

}  // namespace kvserve
#endif
