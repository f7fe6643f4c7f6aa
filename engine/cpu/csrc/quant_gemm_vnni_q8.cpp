// y[M, N] = x[M, K] @ W^T for 8-bit weights (the q8 format of quant_gemm_cpu.cpp: int8 values,
// a scale per 32 or per 16, an optional min per 32) on AVX-512 VNNI: the same integer math as
// quant_gemm_q8 (each activation row quantised to int8 per group of 32, dx = amax/127; per scale
// group d*dx*sum(q*qx), plus m*dx*sum(qx) with mins), 64 weights per vpdpbusd instead of 32
// per maddubs+madd pair.
//
// vpdpbusd multiplies unsigned by signed bytes. As in the AVX2 kernel the activation's sign
// moves onto the weight (|qx| * (sign(qx) * q)); here |qx| and the sign bits are computed once
// per call when the rows are quantised, so each 64 weights cost one masked negate and one
// vpdpbusd per row. Weights must lie in [-127, 127] (all q8 producers: Q8_0, Q6_K, Q5_K, int8
// round-to-nearest): a weight of -128 cannot be negated in a byte (the AVX2 kernel and the
// interleaved and lanes kernels multiply it exactly).
//
// Lane i of the int32 result sums elements 4i..4i+3 of the 64: lanes 0-7 are group g, 8-15 group
// g+1 (and with a scale per 16, lanes 0-3, 4-7, 8-11, 12-15 its four halves), so one float FMA
// with the matching scale vector accumulates them. An odd last group runs the 256-bit form. Rows
// go in tiles of up to 4 sharing each weight load; threads split the output columns.
//
// Compiled only where the compiler targets AVX-512 F/BW/VL and VNNI (quant_vnni_common.h;
// quant_gemm_q4_vnni_available() says whether it was). Which of this and quant_gemm_q8 serves is
// measured at start-up (engine/models/quant_probe.py), not assumed.
#include "torch_lite.h"

#include <cstring>
#include <vector>

#include "quant_common.h"
#include "quant_vnni_common.h"

using kvserve_quant::kGroup;
using kvserve_quant::row_tiles;

#ifdef KVSERVE_VNNI
namespace {

// Row x [K] -> ax (|round(x * 127/amax)|, K bytes), sg (the sign bits, 32 per group), dx[g] =
// amax/127 and sx[g] = dx * sum of the group's rounded values: quant_gemm_q8's rounding; s16
// (unless null): the same sums per half group (kvserve_quant::half_sums).
void quantise_row(const float* x, int64_t K, uint8_t* ax, uint32_t* sg, float* dx, float* sx,
                  float* s16) {
  const int64_t G = K / kGroup;
  for (int64_t g = 0; g < G; g++) {
    __m512i qa, qb;
    const float amax = kvserve_vnni::round_group(x + g * kGroup, &qa, &qb);
    const __m128i lo = _mm512_cvtepi32_epi8(qa), hi = _mm512_cvtepi32_epi8(qb);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ax + g * kGroup), _mm_abs_epi8(lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ax + g * kGroup + 16), _mm_abs_epi8(hi));
    sg[g] = static_cast<uint32_t>(_mm_movemask_epi8(lo)) |
            (static_cast<uint32_t>(_mm_movemask_epi8(hi)) << 16);
    dx[g] = amax / 127.f;
    sx[g] = kvserve_vnni::scaled_sum(dx[g], qa, qb);
    if (s16 != nullptr) {
      const __m512i none = _mm512_setzero_si512();
      s16[2 * g] = kvserve_vnni::scaled_sum(dx[g], qa, none);
      s16[2 * g + 1] = kvserve_vnni::scaled_sum(dx[g], none, qb);
    }
  }
}

// The scales of groups g, g+1 for the 16 int32 lanes: a scale per 32 -> [s_g x8, s_g+1 x8];
// per 16 -> [s_2g x4, s_2g+1 x4, s_2g+2 x4, s_2g+3 x4] (s = d * dx of the lane's group).
template <bool kS16>
inline __m512 pair_scales(const float* d, const float* dx, int64_t g) {
  const __m128 dx2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx + g)));
  if constexpr (kS16) {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m128 s = _mm_mul_ps(_mm_loadu_ps(d + 2 * g), _mm_unpacklo_ps(dx2, dx2));
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s));
  } else {
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128 dw = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d + g)));
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(dw, dx2)));
  }
}

// R rows against one weight row; two accumulators per row (even and odd pairs of groups).
template <int R, bool kS16, bool kHasM>
void dot_q8_vnni(const int8_t* w, const float* d, const float* m, const uint8_t* ax,
                 const uint32_t* sg, const float* dx, const float* sx, int64_t K, int64_t G,
                 float* y, int64_t ldy) {
  __m512 acc[2][R];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    const __m512i wq = _mm512_loadu_si512(w + g * kGroup);
    const int odd = (g >> 1) & 1;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      uint64_t neg;
      std::memcpy(&neg, sg + r * G + g, sizeof(neg));
      const __m512i ws = _mm512_mask_sub_epi8(wq, static_cast<__mmask64>(neg), zero, wq);
      const __m512i xa = _mm512_loadu_si512(ax + r * K + g * kGroup);
      const __m512i p = _mm512_dpbusd_epi32(zero, xa, ws);
      acc[odd][r] = _mm512_fmadd_ps(pair_scales<kS16>(d, dx + r * G, g), _mm512_cvtepi32_ps(p),
                                    acc[odd][r]);
    }
  }
  float last[R] = {};
  if (g < G) {  // an odd last group: 256-bit
    const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kGroup));
    for (int r = 0; r < R; r++) {
      const __m256i ws = _mm256_mask_sub_epi8(wq, static_cast<__mmask32>(sg[r * G + g]),
                                              _mm256_setzero_si256(), wq);
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ax + r * K + g * kGroup));
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), xa, ws);
      const __m512i p16 = _mm512_zextsi256_si512(p);
      if constexpr (kS16) {  // lanes 0-3: the first half, 4-7: the second
        last[r] = dx[r * G + g] *
                  (d[2 * g] * static_cast<float>(_mm512_mask_reduce_add_epi32(0x000F, p16)) +
                   d[2 * g + 1] * static_cast<float>(_mm512_mask_reduce_add_epi32(0x00F0, p16)));
      } else {
        last[r] = d[g] * dx[r * G + g] * static_cast<float>(_mm512_reduce_add_epi32(p16));
      }
    }
  }
  for (int r = 0; r < R; r++) {
    float tail = last[r];
    constexpr int64_t kPer = kS16 ? 2 : 1;  // mins (and activation sums) per group of 32
    if constexpr (kHasM) tail += kvserve_vnni::dot_f32(m, sx + r * kPer * G, kPer * G);
    y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r])) + tail;
  }
}

}  // namespace
#endif

at::Tensor quant_gemm_q8_vnni(at::Tensor x, at::Tensor qs, at::Tensor d,
                                 c10::optional<at::Tensor> m) {
#ifdef KVSERVE_VNNI
  const int64_t N = qs.size(0), K = qs.size(1), G = K / kGroup, M = x.size(0);
  const int64_t S = kvserve_quant::q8_scale_group(qs, d, m);
  kvserve_quant::check_gemm_args(x, qs, d, K, S);
  thread_local std::vector<uint8_t> ax;
  thread_local std::vector<uint32_t> sg;
  thread_local std::vector<float> dxv, sxv, s16v;
  const bool half = S == 16 && m.has_value();  // mins per 16: the activations' half sums
  ax.resize(M * K);
  sg.resize(M * G + 1);  // + 1: the 64-bit sign loads of the last pair may read one word past
  dxv.resize(M * G);
  sxv.resize(M * G);
  s16v.resize(half ? M * 2 * G : 0);
  auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  for (int64_t r = 0; r < M; r++) {
    quantise_row(xp + r * K, K, ax.data() + r * K, sg.data() + r * G, dxv.data() + r * G,
                 sxv.data() + r * G, half ? s16v.data() + r * 2 * G : nullptr);
  }
  auto y = at::empty({M, N});
  const int8_t* w = qs.data_ptr<int8_t>();
  const float* dw = d.data_ptr<float>();
  const float* mw = m.has_value() ? m->data_ptr<float>() : nullptr;
  const int64_t D = d.size(1);
  const uint8_t* axp = ax.data();
  const uint32_t* sgp = sg.data();
  const float *dx = dxv.data(), *sx = half ? s16v.data() : sxv.data();
  const int64_t SX = half ? 2 * G : G;  // activation sums per row
  float* yp = y.data_ptr<float>();
  auto run = [&](auto s16, auto has_m) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      row_tiles(M, [&](auto tile, int64_t r0) {
        dot_q8_vnni<decltype(tile)::value, decltype(s16)::value, decltype(has_m)::value>(
            w + n * K, dw + n * D, mw == nullptr ? nullptr : mw + n * D, axp + r0 * K,
            sgp + r0 * G, dx + r0 * G, sx + r0 * SX, K, G, yp + r0 * N + n, N);
      });
    }
  };
  kvserve_quant::dispatch_q8(S, mw != nullptr, run);
  return y;
#else
  TORCH_CHECK(false, "quant_gemm_q8_vnni: not built for this CPU (needs AVX-512 BW/VL and VNNI)");
  return x;
#endif
}
