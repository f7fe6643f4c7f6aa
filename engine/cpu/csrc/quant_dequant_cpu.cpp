// Float32 (or bfloat16) rows of a packed weight (engine/models/quant_formats.py; layouts in
// quant_gemm_cpu.cpp): embedding lookups, and panels for prefill's dense matmul. Exact up to one
// rounding of d * q + m (a fused multiply-add); with bf16 = true the float result is then
// rounded to bfloat16 (nearest even) as it is stored, for a bf16 matmul (no float32 panel is
// written and read back).
#include "torch_lite.h"

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

template <typename T>
static void dequant_q4(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                       const at::Tensor& ids, at::Tensor& out) {
  const int64_t K = qs.size(1) * 2, G = K / kGroup, R = ids.numel();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const uint8_t* w = qs.data_ptr<uint8_t>();
  const float *dw = d.data_ptr<float>(), *mw = m.data_ptr<float>();
  T* o = out.data_ptr<T>();
#pragma omp parallel for schedule(static) if (R * K > 65536)
  for (int64_t i = 0; i < R; i++) {
    const int64_t n = idp[i];
    for (int64_t g = 0; g < G; g++) {
      kvserve_quant::dequant_q4_group(w + n * (K / 2) + g * 16, dw[n * G + g], mw[n * G + g],
                                      o + i * K + g * kGroup);
    }
  }
}

// The packed weight's rows ``rows`` as float32, or bfloat16 when ``bf16``.
static at::Tensor rows_out(const at::Tensor& rows, int64_t K, bool bf16,
                              at::Tensor* ids, int64_t num_rows) {
  *ids = rows.to(at::kLong).contiguous();
  check_rows(ids->data_ptr<int64_t>(), ids->numel(), num_rows);
  return at::empty({ids->numel(), K}, bf16 ? at::kBFloat16 : at::kFloat);
}

at::Tensor quant_dequant_q4(at::Tensor qs, at::Tensor d, at::Tensor m,
                               at::Tensor rows, bool bf16) {
  at::Tensor ids;
  auto out = rows_out(rows, qs.size(1) * 2, bf16, &ids, qs.size(0));
  if (bf16) {
    dequant_q4<c10::BFloat16>(qs, d, m, ids, out);
  } else {
    dequant_q4<float>(qs, d, m, ids, out);
  }
  return out;
}

template <typename T>
static void dequant_q8(const at::Tensor& qs, const at::Tensor& d, const float* mw,
                       int64_t S, const at::Tensor& ids, at::Tensor& out) {
  const int64_t K = qs.size(1), G = K / kGroup, D = d.size(1), R = ids.numel();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int8_t* w = qs.data_ptr<int8_t>();
  const float* dw = d.data_ptr<float>();
  T* o = out.data_ptr<T>();
#pragma omp parallel for schedule(static) if (R * K > 65536)
  for (int64_t i = 0; i < R; i++) {
    const int64_t n = idp[i];
    for (int64_t g = 0; g < G; g++) {
      // Scales and mins of the group's two halves (equal when S = 32; mins 0 without them).
      const float a0 = S == 16 ? dw[n * D + 2 * g] : dw[n * D + g];
      const float a1 = S == 16 ? dw[n * D + 2 * g + 1] : a0;
      const float b0 = mw == nullptr ? 0.f : S == 16 ? mw[n * D + 2 * g] : mw[n * D + g];
      const float b1 = mw == nullptr ? 0.f : S == 16 ? mw[n * D + 2 * g + 1] : b0;
      const int8_t* src = w + n * K + g * kGroup;
      T* dst = o + i * K + g * kGroup;
#ifdef KVSERVE_AVX2
      for (int h = 0; h < 4; h++) {
        const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * h));
        const __m256 a = _mm256_set1_ps(h < 2 ? a0 : a1);
        kvserve::store8(dst + 8 * h, _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)),
                                                     _mm256_set1_ps(h < 2 ? b0 : b1)));
      }
#else
      for (int j = 0; j < 32; j++) {
        dst[j] = static_cast<T>((j < 16 ? a0 : a1) * static_cast<float>(src[j]) + (j < 16 ? b0 : b1));
      }
#endif
    }
  }
}

at::Tensor quant_dequant_q8(at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                               at::Tensor rows, bool bf16) {
  const int64_t S = q8_scale_group(qs, d, m);
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous(), "malformed q8 weight");
  at::Tensor ids;
  auto out = rows_out(rows, qs.size(1), bf16, &ids, qs.size(0));
  const float* mw = m.has_value() ? m->data_ptr<float>() : nullptr;
  if (bf16) {
    dequant_q8<c10::BFloat16>(qs, d, mw, S, ids, out);
  } else {
    dequant_q8<float>(qs, d, mw, S, ids, out);
  }
  return out;
}
