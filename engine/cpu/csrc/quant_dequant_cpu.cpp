// Float32 rows of a packed weight (engine/models/quant_formats.py; layouts in
// quant_gemm_cpu.cpp): embedding lookups, and panels for prefill's dense matmul. Exact up to one
// rounding of d * q + m (a fused multiply-add).
#include <torch/extension.h>

#include "quant_common.h"
#include "vec_math.h"

using kvserve_quant::kGroup;
using kvserve_quant::q8_scale_group;

// Every requested row index must name a row of the packed weight (checked before any thread runs).
static void check_rows(const int64_t* idp, int64_t R, int64_t num_rows) {
  for (int64_t i = 0; i < R; i++) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < num_rows, "row index out of range");
  }
}

torch::Tensor quant_dequant_q4(torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                               torch::Tensor rows) {
  const int64_t K = qs.size(1) * 2, G = K / kGroup, R = rows.numel();
  auto ids = rows.to(torch::kInt64).contiguous();
  auto out = torch::empty({R, K});
  const int64_t* idp = ids.data_ptr<int64_t>();
  const uint8_t* w = qs.data_ptr<uint8_t>();
  const float *dw = d.data_ptr<float>(), *mw = m.data_ptr<float>();
  float* o = out.data_ptr<float>();
  check_rows(idp, R, qs.size(0));
#pragma omp parallel for schedule(static) if (R * K > 65536)
  for (int64_t i = 0; i < R; i++) {
    const int64_t n = idp[i];
    for (int64_t g = 0; g < G; g++) {
      const uint8_t* src = w + n * (K / 2) + g * 16;
      float* dst = o + i * K + g * kGroup;
      const float a = dw[n * G + g], b = mw[n * G + g];
#ifdef KVSERVE_AVX2
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
      const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int h = 0; h < 4; h++) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[h]));
        _mm256_storeu_ps(dst + 8 * h, _mm256_fmadd_ps(av, q, bv));
      }
#else
      for (int j = 0; j < 16; j++) {
        dst[j] = a * static_cast<float>(src[j] & 0x0F) + b;
        dst[j + 16] = a * static_cast<float>(src[j] >> 4) + b;
      }
#endif
    }
  }
  return out;
}

torch::Tensor quant_dequant_q8(torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m,
                               torch::Tensor rows) {
  const int64_t S = q8_scale_group(qs, d, m);
  const int64_t K = qs.size(1), G = K / kGroup, D = d.size(1), R = rows.numel();
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous(), "malformed q8 weight");
  auto ids = rows.to(torch::kInt64).contiguous();
  auto out = torch::empty({R, K});
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int8_t* w = qs.data_ptr<int8_t>();
  const float* dw = d.data_ptr<float>();
  const float* mw = m.has_value() ? m->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  check_rows(idp, R, qs.size(0));
#pragma omp parallel for schedule(static) if (R * K > 65536)
  for (int64_t i = 0; i < R; i++) {
    const int64_t n = idp[i];
    for (int64_t g = 0; g < G; g++) {
      // Scales of the group's two halves (equal when S = 32) and its min (0 without one).
      const float a0 = S == 16 ? dw[n * D + 2 * g] : dw[n * D + g];
      const float a1 = S == 16 ? dw[n * D + 2 * g + 1] : a0;
      const float b = mw == nullptr ? 0.f : mw[n * G + g];
      const int8_t* src = w + n * K + g * kGroup;
      float* dst = o + i * K + g * kGroup;
#ifdef KVSERVE_AVX2
      for (int h = 0; h < 4; h++) {
        const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * h));
        const __m256 a = _mm256_set1_ps(h < 2 ? a0 : a1);
        _mm256_storeu_ps(dst + 8 * h, _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)),
                                                      _mm256_set1_ps(b)));
      }
#else
      for (int j = 0; j < 32; j++) dst[j] = (j < 16 ? a0 : a1) * static_cast<float>(src[j]) + b;
#endif
    }
  }
  return out;
}
