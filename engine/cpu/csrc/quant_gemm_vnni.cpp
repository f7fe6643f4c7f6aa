// y[M, N] = x[M, K] @ W^T for 4-bit packed weights (the q4 format of quant_gemm_cpu.cpp), on
// AVX-512 VNNI: the same integer math as quant_gemm_q4 (each activation row quantised to int8 per
// group of 32, dx = amax/127; per group d*dx*sum(q*qx) + m*dx*sum(qx)), two groups per 512-bit
// step instead of one per 256-bit step.
//
// Two groups' 32 packed bytes unpack to one 64-byte register ordered [g.lo | g+1.lo | g.hi |
// g+1.hi] (lo: the 16 low nibbles = elements 0..15 of a group, hi: elements 16..31). The
// activation rows are quantised once per call straight into that order, so one vpdpbusd gives
// 16 int32 partial sums, lanes 0-3 and 8-11 for group g, 4-7 and 12-15 for g+1; one float FMA
// with the scales [s_g x4, s_g+1 x4, s_g x4, s_g+1 x4] (s = d*dx) accumulates them. An odd last
// group runs the 256-bit form. Rows go in tiles of up to 4 sharing each unpacked weight pair;
// threads split the output columns.
//
// Compiled only where the compiler targets AVX-512 F/BW/VL and VNNI (-march=native on such a
// CPU); quant_gemm_q4_vnni_available() says whether it was. Which of this and quant_gemm_q4
// serves is measured at start-up (engine/models/quant_probe.py), not assumed.
#include "torch_lite.h"

#include <vector>

#include "quant_common.h"
#include "quant_vnni_common.h"

using kvserve_quant::kGroup;
using kvserve_quant::row_tiles;

bool quant_gemm_q4_vnni_available() {
#ifdef KVSERVE_VNNI
  return true;
#else
  return false;
#endif
}

#ifdef KVSERVE_VNNI
namespace {

// Row r of x -> qx (K bytes, pairs of groups in [g.lo, g+1.lo, g.hi, g+1.hi] order; an odd last
// group in natural order), dx[g] = amax/127 and sx[g] = dx * sum(qx of the group).
void quantise_row(const float* x, int64_t K, int8_t* qx, float* dx, float* sx) {
  const int64_t G = K / kGroup;
  for (int64_t g = 0; g < G; g++) {
    __m512i qa, qb;
    const float amax = kvserve_vnni::round_group(x + g * kGroup, &qa, &qb);
    // Destination of this group's two halves: in a pair, lo at 16*(g%2), hi at 32 + 16*(g%2).
    const bool paired = (g | 1) < G;
    const int64_t base = (g & ~int64_t(1)) * kGroup;
    int8_t* lo = paired ? qx + base + 16 * (g & 1) : qx + g * kGroup;
    int8_t* hi = paired ? qx + base + 32 + 16 * (g & 1) : qx + g * kGroup + 16;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtepi32_epi8(qb));
    dx[g] = amax / 127.f;
    sx[g] = kvserve_vnni::scaled_sum(dx[g], qa, qb);
  }
}

// R rows against one weight row. Two accumulators per row (even and odd pairs of groups), so
// consecutive FMAs do not wait on each other's latency.
template <int R>
void dot_q4_vnni(const uint8_t* w, const float* d, const float* m, const int8_t* x,
                 const float* dx, const float* sx, int64_t K, int64_t G, float* y, int64_t ldy) {
  __m512 acc[2][R];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // Lane i of the scale register takes element (i / 4) % 2 of [s_g, s_g+1].
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 16));
    const __m512i wq = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(raw, low4)),
        _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4), 1);
    const __m128 dw = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d + g)));
    const int odd = (g >> 1) & 1;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      const __m512i xq = _mm512_loadu_si512(x + r * K + g * kGroup);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xq);
      const __m128 dxr = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx + r * G + g)));
      const __m512 s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(dw, dxr)));
      acc[odd][r] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(p), acc[odd][r]);
    }
  }
  float last[R] = {};
  if (g < G) {  // an odd last group, natural order: 256-bit
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16));
    const __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)),
                                        _mm_and_si128(raw, _mm_set1_epi8(0x0F)));
    for (int r = 0; r < R; r++) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * K + g * kGroup));
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xq);
      last[r] = d[g] * dx[r * G + g] *
                static_cast<float>(_mm512_reduce_add_epi32(_mm512_zextsi256_si512(p)));
    }
  }
  for (int r = 0; r < R; r++) {
    y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r])) + last[r] +
                 kvserve_vnni::dot_f32(m, sx + r * G, G);
  }
}

}  // namespace
#endif

at::Tensor quant_gemm_q4_vnni(at::Tensor x, at::Tensor qs, at::Tensor d,
                                 at::Tensor m) {
#ifdef KVSERVE_VNNI
  const int64_t N = qs.size(0), K = qs.size(1) * 2, G = K / kGroup, M = x.size(0);
  kvserve_quant::check_q4_args(x, qs, d, m);
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> dxv, sxv;
  q.resize(M * K);
  dxv.resize(M * G);
  sxv.resize(M * G);
  auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  for (int64_t r = 0; r < M; r++) {
    quantise_row(xp + r * K, K, q.data() + r * K, dxv.data() + r * G, sxv.data() + r * G);
  }
  auto y = at::empty({M, N});
  const uint8_t* w = qs.data_ptr<uint8_t>();
  const float *dw = d.data_ptr<float>(), *mw = m.data_ptr<float>();
  const int8_t* xq = q.data();
  const float *dx = dxv.data(), *sx = sxv.data();
  float* yp = y.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    row_tiles(M, [&](auto tile, int64_t r0) {
      dot_q4_vnni<decltype(tile)::value>(w + n * (K / 2), dw + n * G, mw + n * G, xq + r0 * K,
                                         dx + r0 * G, sx + r0 * G, K, G, yp + r0 * N + n, N);
    });
  }
  return y;
#else
  TORCH_CHECK(false, "quant_gemm_q4_vnni: not built for this CPU (needs AVX-512 BW/VL and VNNI)");
  return x;
#endif
}
