// Shared by the packed-weight kernels (quant_gemm_cpu.cpp, quant_dequant_cpu.cpp,
// quant_gemm_q4_tiled.cpp, quant_gemm_q4_blocked.cpp): the group size, the checks of a
// weight's layout (see quant_gemm_cpu.cpp for the formats), a 4-bit group's dequantisation and
// the activations' int8 rounding.
#pragma once

#include "torch_lite.h"

#include <type_traits>

#include "vec_math.h"

namespace kvserve_quant {

constexpr int64_t kGroup = 32;

// The scale group of a q8 weight (16 or 32, from d's width) and its optional min, checked.
inline int64_t q8_scale_group(const at::Tensor& qs, const at::Tensor& d,
                              const c10::optional<at::Tensor>& m) {
  TORCH_CHECK(qs.dim() == 2 && d.dim() == 2 && d.size(1) > 0, "malformed q8 weight");
  const int64_t K = qs.size(1);
  TORCH_CHECK(qs.scalar_type() == at::kChar && (d.size(1) * 16 == K || d.size(1) * 32 == K),
              "malformed q8 weight: int8 values and one scale per 16 or 32 of them");
  const int64_t S = K / d.size(1);
  if (m.has_value()) {
    TORCH_CHECK(m->is_contiguous() && m->scalar_type() == at::kFloat && m->sizes() == d.sizes(),
                "malformed q8 weight: a min needs one per scale group, like its scale");
  }
  return S;
}

// A row's activation sums per 16 values (a q8 weight with a scale and a min per 16, Q2_K):
// s16[2g + h] = dx[g] * sum of the rounded values q[32g + 16h .. + 15], the half-group form of
// QuantisedRows::s. q: M rows of K int8 values; dx: their scales per 32.
inline void half_sums(const int8_t* q, const float* dx, int64_t M, int64_t K, float* s16) {
  for (int64_t i = 0; i < M * K / 16; i++) {
    int sum = 0;
    for (int j = 0; j < 16; j++) sum += q[16 * i + j];
    s16[i] = dx[i / 2] * static_cast<float>(sum);
  }
}

// The arguments of a packed-weight GEMM: x [M, K] float32 on the CPU, qs/d contiguous rows of
// the weight, d float32 with one scale per scale_group of the K columns.
inline void check_gemm_args(const at::Tensor& x, const at::Tensor& qs,
                            const at::Tensor& d, int64_t K, int64_t scale_group = kGroup) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == K && K % kGroup == 0, "x has ", x.size(1), " columns; the weight has ",
              K, " (a multiple of 32)");
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && d.scalar_type() == at::kFloat &&
                  d.size(0) == qs.size(0) && d.size(1) == K / scale_group,
              "malformed packed weight");
}

// check_gemm_args for a q4 weight (uint8 nibble pairs, a min per group like its scale).
inline void check_q4_args(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                          const at::Tensor& m) {
  check_gemm_args(x, qs, d, qs.size(1) * 2);
  TORCH_CHECK(qs.scalar_type() == at::kByte && m.is_contiguous() && m.sizes() == d.sizes(),
              "malformed q4 weight");
}

// One group of a 4-bit weight as T (float or c10::BFloat16): its 16 bytes in the rows layout
// (byte j holds q[j] in its low nibble, q[j + 16] in its high one) -> dst[k] = a * q[k] + b,
// one rounding where the machine has FMA (then rounded to bfloat16, nearest even, for T).
template <typename T>
inline void dequant_q4_group(const uint8_t* src, float a, float b, T* dst) {
#ifdef KVSERVE_AVX2
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
  const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int h = 0; h < 4; h++) {
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[h]));
    kvserve::store8(dst + 8 * h, _mm256_fmadd_ps(av, q, bv));
  }
#else
  for (int j = 0; j < 16; j++) {
    dst[j] = static_cast<T>(a * static_cast<float>(src[j] & 0x0F) + b);
    dst[j + 16] = static_cast<T>(a * static_cast<float>(src[j] >> 4) + b);
  }
#endif
}

// The activations of the integer-dot kernels: x [M, K] float32 as q int8 [M, K] (each 32-group
// rounded to steps of d = amax/127, to nearest, ties to even), d [M, K/32] and
// s [M, K/32] = d * sum(q) of the group. quantise() (quant_gemm_cpu.cpp) writes them into
// buffers of the calling thread, reused by its next call (a decode step makes ~100 of these
// calls; three tensor allocations each were measurable); threaded for large M * K.
struct QuantisedRows {
  const int8_t* q;
  const float *d, *s;
};
QuantisedRows quantise(const at::Tensor& x);

// f(integral_constant<R>, r0) for the last n (< R + 1) rows from r0, if any (row_tiles).
template <int R, typename F>
void last_tile(int64_t n, int64_t r0, F& f) {
  if constexpr (R > 0) {
    if (n == R) {
      f(std::integral_constant<int, R>{}, r0);
    } else {
      last_tile<R - 1>(n, r0, f);
    }
  }
}

// Calls f(integral_constant<R>, r0) for row tiles of kMax rows (the last one 1..kMax-1 rows).
template <int kMax = 4, typename F>
void row_tiles(int64_t M, F&& f) {
  int64_t r0 = 0;
  for (; r0 + kMax <= M; r0 += kMax) f(std::integral_constant<int, kMax>{}, r0);
  last_tile<kMax - 1>(M - r0, r0, f);
}

// Calls run(s16, has_m) with the compile-time layout of a q8 weight: a scale (and a min) per
// 16, or per 32. With a min per 16 the kernels take the activations' half_sums.
template <typename Run>
void dispatch_q8(int64_t scale_group, bool has_m, Run&& run) {
  using T = std::true_type;
  using F = std::false_type;
  if (scale_group == 16) {
    if (has_m) {
      run(T{}, T{});
    } else {
      run(T{}, F{});
    }
  } else if (has_m) {
    run(F{}, T{});
  } else {
    run(F{}, F{});
  }
}

}  // namespace kvserve_quant
