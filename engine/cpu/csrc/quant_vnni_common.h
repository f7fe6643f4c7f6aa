// Shared by the AVX-512 VNNI kernels (quant_gemm_vnni.cpp: 4-bit, quant_gemm_vnni_q8.cpp,
// quant_gemm_q8_batch.cpp, quant_gemm_q8_interleaved.cpp: 8-bit): whether they are built
// (KVSERVE_VNNI: the compiler targets AVX-512 F/BW/VL and VNNI, as -march=native does on such
// a CPU), the activations' int8 rounding of one group of 32 (the base kernels' rounding,
// quant_gemm_cpu.cpp), a float dot product for the mins' term, and the 8-bit kernels' per-row
// activation terms (RowTerms, built everywhere).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KVSERVE_VNNI 1
#include <immintrin.h>

namespace kvserve_vnni {

// The 32 floats at x rounded to int8 steps of amax/127 (to nearest, ties to even):
// lo/hi the two halves' integers (16 int32 lanes each); returns amax.
inline float round_group(const float* x, __m512i* lo, __m512i* hi) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
  const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  *lo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  *hi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return amax;
}

// dx * (the sum of a group's integers), the activation term of a weight's min.
inline float scaled_sum(float dx, __m512i lo, __m512i hi) {
  return dx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi)));
}

// 16 floats of a tile's scales (or mins), stored as float32 or float16 (widened exactly): the
// interleaved 8-bit weight's (quant_gemm_q8_interleaved.cpp, quant_gemm_q8_amx.cpp).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// sum_k a[k] * b[k], k < n, 16 lanes at a time (the last step masked).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc);
  if (k < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - k)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + k), _mm512_maskz_loadu_ps(mask, b + k), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace kvserve_vnni
#endif

namespace kvserve_vnni {

// The activations' per-row terms of the 8-bit kernels that add 128 to each weight (vpdpbusd
// multiplies unsigned by signed bytes: quant_gemm_q8_batch, quant_gemm_q8_interleaved; plain
// C++, so the interleaved kernel's AVX2 path takes its sx too):
// neg [M][SG] = -128 * sum(qx) of each scale group of S (16 or 32; SG = K / S), which cancels
// what the +128 adds, exactly (only with offset: the AVX2 path multiplies the weights
// themselves); with mins, sx [M][SG] = the scale group's dx * sum(qx)
// (QuantisedRows::s per 32, kvserve_quant::half_sums per 16).
struct RowTerms {
  std::vector<int32_t> neg;
  std::vector<float> sx;
};

inline void row_terms(const kvserve_quant::QuantisedRows& rows, int64_t M, int64_t K, int64_t S,
                      bool mins, RowTerms& t, bool offset = true) {
  const int64_t SG = K / S;
  t.neg.resize(offset ? M * SG : 0);
  for (int64_t i = 0; offset && i < M * SG; i++) {
    int32_t sum = 0;
    for (int64_t k = 0; k < S; k++) sum += rows.q[i * S + k];
    t.neg[i] = -128 * sum;
  }
  if (!mins) return;
  t.sx.resize(M * SG);
  if (S == 16) {
    kvserve_quant::half_sums(rows.q, rows.d, M, K, t.sx.data());
  } else {
    std::copy(rows.s, rows.s + M * SG, t.sx.begin());
  }
}

}  // namespace kvserve_vnni
