// y[M, N] = x[M, K] @ W^T for weights kept in GGUF-style 32-element groups (CPU, float32 out).
//
// Formats (engine/models/quant_formats.py builds them; K is a multiple of 32):
//   q4: qs uint8 [N, K/2], d float32 [N, K/32], m float32 [N, K/32]; w = d * q + m, q in 0..15.
//       Group g of row n is bytes qs[n, 16g .. 16g+15]: byte j holds q[32g+j] in its low nibble
//       and q[32g+j+16] in its high nibble (GGUF's Q4_0/Q4_1 order, copied as is).
//   q8: qs int8 [N, K], d float32 [N, K/S] with S (the scale group) 32 or 16, optional m
//       float32 [N, K/32] (only with S = 32); w = d[k/S] * q (+ m[k/32]). Q8_0 is S = 32 without
//       m, Q5_K is S = 32 with m (q in 0..31), Q6_K is S = 16 without m (q in -32..31).
//
// Decode-sized M (llama.cpp's scheme): each activation row is quantised once per call to int8
// per 32-group (dx = amax/127, qx = round(x/dx)), then every group's dot product is integer:
//   q4: sum_k w*x = d*dx*sum(q*qx) + m*dx*sum(qx)        q8: d*dx*sum(q*qx)
// On AVX2 the 32 products of a group are one _mm256_maddubs_epi16 (unsigned x signed bytes) and
// one _mm256_madd_epi16, then one float FMA per group. Rows go in tiles of 4 that share each
// loaded (and unpacked) weight group; the weight row (K/2 or K bytes) stays in L1 across the
// tiles; threads split the output columns. Without AVX2 the same math runs in scalar code. The error against float is that
// of the activation's int8 rounding (|dx|/2 per element), as in llama.cpp.
//
// quant_dequant_* (quant_dequant_cpu.cpp): float32 rows of W (for embedding lookups and for
// prefill, where the caller runs a dense matmul over dequantised panels).
#include "torch_lite.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "quant_common.h"
#include "vec_math.h"

using kvserve_quant::kGroup;
using kvserve_quant::q8_scale_group;
using kvserve_quant::check_gemm_args;
using kvserve_quant::check_q4_args;
using kvserve_quant::row_tiles;

namespace {

#ifdef KVSERVE_AVX2
// One group of 32: returns amax; writes round(x * 127/amax) (half to even, as nearbyint) as
// int8 and the sum of those integers.
inline float quantise_group(const float* src, int8_t* dst, int* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int h = 0; h < 4; h++) {
    v[h] = _mm256_loadu_ps(src + 8 * h);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[h]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float a = _mm_cvtss_f32(m4);
  const __m256 id = _mm256_set1_ps(a > 0.f ? 127.f / a : 0.f);
  __m256i q[4];
  for (int h = 0; h < 4; h++) {
    q[h] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[h], id),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  t4 = _mm_hadd_epi32(t4, t4);
  t4 = _mm_hadd_epi32(t4, t4);
  *sum = _mm_cvtsi128_si32(t4);
  // packs work per 128-bit lane: restore element order with one cross-lane permute.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return a;
}
#endif

// x [M, K] -> qx int8 [M, K], dx [M, K/32], sx [M, K/32] = dx * sum(qx) of the group.
void quantise_rows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx) {
  const int64_t G = K / kGroup;
  auto row = [&](int64_t r) {
    for (int64_t g = 0; g < G; g++) {
      const float* src = x + r * K + g * kGroup;
      int8_t* dst = qx + r * K + g * kGroup;
      int sum = 0;
#ifdef KVSERVE_AVX2
      const float amax = quantise_group(src, dst, &sum);
#else
      float amax = 0.f;
      for (int i = 0; i < kGroup; i++) amax = std::fmax(amax, std::fabs(src[i]));
      const float id = amax > 0.f ? 127.f / amax : 0.f;
      for (int i = 0; i < kGroup; i++) {
        const int q = static_cast<int>(std::nearbyint(src[i] * id));
        dst[i] = static_cast<int8_t>(q);
        sum += q;
      }
#endif
      const float d = amax / 127.f;
      dx[r * G + g] = d;
      sx[r * G + g] = d * static_cast<float>(sum);
    }
  };
  // Rows are independent. Threads only for prefill-sized inputs: a decode step makes ~120 of
  // these calls, and even a parallel region that an if() clause keeps to one thread costs.
  if (M * K >= (int64_t{1} << 17)) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) row(r);
  } else {
    for (int64_t r = 0; r < M; r++) row(r);
  }
}

#ifdef KVSERVE_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#endif

// R rows (R <= 4) of x against one weight row: each weight group is loaded (and, for q4,
// unpacked) once and used by all R rows. Writes y[r * ldy] for r < R.
//
// AVX2: groups go in pairs (one 32-byte load holds both groups' nibbles; two lane permutes
// give each group's 32 values), with two accumulators per row (even and odd groups) so that
// one row's FMAs do not wait on each other. The per-group scale products d*dx and the mins'
// term sum_g m*sx are computed vectorised up front, kScaleChunk groups at a time.
constexpr int64_t kScaleChunk = 64;

template <int R>
void dot_q4(const uint8_t* w, const float* d, const float* m, const int8_t* x, const float* dx,
            const float* sx, int64_t K, int64_t G, float* y, int64_t ldy) {
#ifdef KVSERVE_AVX2
  __m256 acc[R][2], tail[R];
  float tail1[R];
  alignas(32) float ds[R][kScaleChunk];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++) {
    acc[r][0] = acc[r][1] = tail[r] = _mm256_setzero_ps();
    tail1[r] = 0.f;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  auto group_dot = [&](__m256i wq, const int8_t* xr) {  // the 32 products as 8 float lanes
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones));
  };
  for (int64_t c0 = 0; c0 < G; c0 += kScaleChunk) {
    const int64_t cn = std::min(kScaleChunk, G - c0);
    for (int r = 0; r < R; r++) {
      const float* dxr = dx + r * G + c0;
      const float* sxr = sx + r * G + c0;
      int64_t j = 0;
      for (; j + 8 <= cn; j += 8) {
        _mm256_store_ps(ds[r] + j, _mm256_mul_ps(_mm256_loadu_ps(d + c0 + j), _mm256_loadu_ps(dxr + j)));
        tail[r] = _mm256_fmadd_ps(_mm256_loadu_ps(m + c0 + j), _mm256_loadu_ps(sxr + j), tail[r]);
      }
      for (; j < cn; j++) {
        ds[r][j] = d[c0 + j] * dxr[j];
        tail1[r] += m[c0 + j] * sxr[j];
      }
    }
    int64_t j = 0;
    for (; j + 2 <= cn; j += 2) {
      const int64_t g = c0 + j;
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 16));
      const __m256i lo = _mm256_and_si256(raw, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      const __m256i w0 = _mm256_permute2x128_si256(lo, hi, 0x20);  // group g: its 32 values
      const __m256i w1 = _mm256_permute2x128_si256(lo, hi, 0x31);  // group g + 1
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        const int8_t* xr = x + r * K + g * 32;
        acc[r][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(ds[r] + j), group_dot(w0, xr), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(ds[r] + j + 1), group_dot(w1, xr + 32),
                                    acc[r][1]);
      }
    }
    if (j < cn) {  // an odd group out
      const int64_t g = c0 + j;
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16));
      const __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm256_castsi256_si128(low4)),
                                          _mm_and_si128(raw, _mm256_castsi256_si128(low4)));
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        acc[r][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(ds[r] + j), group_dot(wq, x + r * K + g * 32),
                                    acc[r][0]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    y[r * ldy] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + (hsum(tail[r]) + tail1[r]);
  }
#else
  for (int r = 0; r < R; r++) {
    float acc = 0.f;
    for (int64_t g = 0; g < G; g++) {
      int s = 0;
      const int8_t* xr = x + r * K + g * 32;
      for (int j = 0; j < 16; j++) {
        s += (w[g * 16 + j] & 0x0F) * xr[j] + (w[g * 16 + j] >> 4) * xr[j + 16];
      }
      acc += d[g] * dx[r * G + g] * static_cast<float>(s) + m[g] * sx[r * G + g];
    }
    y[r * ldy] = acc;
  }
#endif
}

// As dot_q4 for 8-bit weights: kS16 (one d per 16 weights: d[2g], d[2g+1] for the group's
// halves) and kHasM (a min per scale group, added through the activation's sums over the
// same groups: sx per 32, or its half_sums per 16 with kS16).
template <int R, bool kS16, bool kHasM>
void dot_q8(const int8_t* w, const float* d, const float* m, const int8_t* x, const float* dx,
            const float* sx, int64_t K, int64_t G, float* y, int64_t ldy) {
#ifdef KVSERVE_AVX2
  __m256 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; g++) {
    const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 32));
    // maddubs needs one unsigned operand: |w| (a weight of -128 is 128 unsigned, exact) times
    // x with w's sign (|x| <= 127: never overflows), |w| shared by the rows.
    const __m256i wabs = _mm256_abs_epi8(wq);
    // After madd, int32 lanes 0-3 hold elements 0-15 and lanes 4-7 elements 16-31.
    const __m256 dw = kS16 ? _mm256_set_m128(_mm_set1_ps(d[2 * g + 1]), _mm_set1_ps(d[2 * g]))
                           : _mm256_set1_ps(d[g]);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * K + g * 32));
      const __m256i p16 = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xq, wq));
      const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx[r * G + g])), p, acc[r]);
    }
  }
  constexpr int64_t kPer = kS16 ? 2 : 1;  // mins (and activation sums) per group of 32
  for (int r = 0; r < R; r++) {
    float tail = 0.f;
    if constexpr (kHasM) {
      for (int64_t i = 0; i < kPer * G; i++) tail += m[i] * sx[r * kPer * G + i];
    }
    y[r * ldy] = hsum(acc[r]) + tail;
  }
#else
  for (int r = 0; r < R; r++) {
    float acc = 0.f;
    for (int64_t g = 0; g < G; g++) {
      int s0 = 0, s1 = 0;
      for (int j = 0; j < 16; j++) s0 += w[g * 32 + j] * x[r * K + g * 32 + j];
      for (int j = 16; j < 32; j++) s1 += w[g * 32 + j] * x[r * K + g * 32 + j];
      const float part = kS16 ? d[2 * g] * static_cast<float>(s0) + d[2 * g + 1] * static_cast<float>(s1)
                              : d[g] * static_cast<float>(s0 + s1);
      acc += dx[r * G + g] * part;
      if constexpr (kHasM && kS16) {
        acc += m[2 * g] * sx[r * 2 * G + 2 * g] + m[2 * g + 1] * sx[r * 2 * G + 2 * g + 1];
      } else if constexpr (kHasM) {
        acc += m[g] * sx[r * G + g];
      }
    }
    y[r * ldy] = acc;
  }
#endif
}

}  // namespace

namespace kvserve_quant {

QuantisedRows quantise(const at::Tensor& x) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, s;
  const int64_t M = x.size(0), K = x.size(1);
  auto xc = x.contiguous();
  q.resize(M * K);
  d.resize(M * K / kGroup);
  s.resize(M * K / kGroup);
  quantise_rows(xc.data_ptr<float>(), M, K, q.data(), d.data(), s.data());
  return {q.data(), d.data(), s.data()};
}

}  // namespace kvserve_quant

at::Tensor quant_gemm_q4(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2, G = K / kGroup, M = x.size(0);
  check_q4_args(x, qs, d, m);
  const auto xq = kvserve_quant::quantise(x);
  auto y = at::empty({M, N});
  const uint8_t* w = qs.data_ptr<uint8_t>();
  const float *dw = d.data_ptr<float>(), *mw = m.data_ptr<float>();
  const int8_t* xqp = xq.q;
  const float *dx = xq.d, *sx = xq.s;
  float* yp = y.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    row_tiles(M, [&](auto tile, int64_t r0) {
      dot_q4<decltype(tile)::value>(w + n * (K / 2), dw + n * G, mw + n * G, xqp + r0 * K,
                                    dx + r0 * G, sx + r0 * G, K, G, yp + r0 * N + n, N);
    });
  }
  return y;
}

at::Tensor quant_gemm_q8(at::Tensor x, at::Tensor qs, at::Tensor d,
                            c10::optional<at::Tensor> m) {
  const int64_t N = qs.size(0), K = qs.size(1), G = K / kGroup, M = x.size(0);
  const int64_t S = q8_scale_group(qs, d, m);
  check_gemm_args(x, qs, d, K, S);
  const auto xq = kvserve_quant::quantise(x);
  auto y = at::empty({M, N});
  const int8_t* w = qs.data_ptr<int8_t>();
  const float* dw = d.data_ptr<float>();
  const float* mw = m.has_value() ? m->data_ptr<float>() : nullptr;
  const int64_t D = d.size(1);
  const int8_t* xqp = xq.q;
  const float *dx = xq.d, *sx = xq.s;
  thread_local std::vector<float> s16;  // the activations' half_sums, for mins per 16
  if (S == 16 && mw != nullptr) {
    s16.resize(M * K / 16);
    kvserve_quant::half_sums(xqp, dx, M, K, s16.data());
    sx = s16.data();
  }
  const int64_t SX = S == 16 && mw != nullptr ? 2 * G : G;  // activation sums per row
  float* yp = y.data_ptr<float>();
  auto run = [&](auto s16, auto has_m) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      row_tiles(M, [&](auto tile, int64_t r0) {
        dot_q8<decltype(tile)::value, decltype(s16)::value, decltype(has_m)::value>(
            w + n * K, dw + n * D, mw == nullptr ? nullptr : mw + n * D, xqp + r0 * K,
            dx + r0 * G, sx + r0 * SX, K, G, yp + r0 * N + n, N);
      });
    }
  };
  kvserve_quant::dispatch_q8(S, mw != nullptr, run);
  return y;
}

// The alternative design (its comparison, benchmarks/quant_linear.py, is deleted: git has it): no activation
// quantisation; each q4 group is unpacked to 4 x 8 floats in registers (d*q + m) and FMA'd with
// the float activations of up to 4 rows. Exact up to float32 summation order.
at::Tensor quant_gemm_q4_fma(at::Tensor x, at::Tensor qs, at::Tensor d,
                                at::Tensor m) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2, G = K / kGroup, M = x.size(0);
  check_gemm_args(x, qs, d, K);
  auto xc = x.contiguous();
  auto y = at::empty({M, N});
  const uint8_t* w = qs.data_ptr<uint8_t>();
  const float *dw = d.data_ptr<float>(), *mw = m.data_ptr<float>(), *xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const int R = static_cast<int>(std::min<int64_t>(4, M - r0));
#ifdef KVSERVE_AVX2
      __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
      for (int64_t g = 0; g < G; g++) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * (K / 2) + g * 16));
        const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
        const __m256 a = _mm256_set1_ps(dw[n * G + g]), b = _mm256_set1_ps(mw[n * G + g]);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int h = 0; h < 4; h++) {
          const __m256 wf = _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[h])), b);
          const float* xr = xp + r0 * K + g * kGroup + 8 * h;
          acc0 = _mm256_fmadd_ps(wf, _mm256_loadu_ps(xr), acc0);
          if (R > 1) acc1 = _mm256_fmadd_ps(wf, _mm256_loadu_ps(xr + K), acc1);
          if (R > 2) acc2 = _mm256_fmadd_ps(wf, _mm256_loadu_ps(xr + 2 * K), acc2);
          if (R > 3) acc3 = _mm256_fmadd_ps(wf, _mm256_loadu_ps(xr + 3 * K), acc3);
        }
      }
      const __m256 accs[4] = {acc0, acc1, acc2, acc3};
      for (int r = 0; r < R; r++) yp[(r0 + r) * N + n] = hsum(accs[r]);
#else
      for (int r = 0; r < R; r++) {
        float acc = 0.f;
        for (int64_t g = 0; g < G; g++) {
          const float a = dw[n * G + g], b = mw[n * G + g];
          for (int j = 0; j < 16; j++) {
            const uint8_t byte = w[n * (K / 2) + g * 16 + j];
            acc += (a * (byte & 0x0F) + b) * xp[(r0 + r) * K + g * kGroup + j];
            acc += (a * (byte >> 4) + b) * xp[(r0 + r) * K + g * kGroup + j + 16];
          }
        }
        yp[(r0 + r) * N + n] = acc;
      }
#endif
    }
  }
  return y;
}

std::string quant_gemm_isa() {
#ifdef KVSERVE_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}
