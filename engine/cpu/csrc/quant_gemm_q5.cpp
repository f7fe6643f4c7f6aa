// y[M, N] = x[M, K] @ W^T and float rows of W for 5-bit packed weights (GGUF's Q5_0 / Q5_1,
// kept at 7 bits per weight instead of being widened to the 8-bit form's 9-10).
//
// Format (engine/models/quant_formats.py PackedQ5; K a multiple of 32): qs uint8 [N, K/32 * 20],
// d and m float32 [N, K/32]; w = d * q + m with q in 0..31. Group g of row n is the 20 bytes at
// qs[n, 20g]: bytes 0-15 hold q[j] & 15 in their low nibble and q[j + 16] & 15 in their high
// nibble (Q4_0's order), bytes 16-19 a little-endian uint32 whose bit j is q[j] >> 4.
//
// The GEMM is quant_gemm_q4's math (quant_gemm_cpu.cpp): each activation row is rounded to int8
// per group of 32 (dx = amax/127) by kvserve_quant::quantise, then per group
//   sum_k w*x = d*dx*sum(q*qx) + m*dx*sum(qx)
// with integer sums. A group's 32 weights are unpacked into one 256-bit register (nibbles, plus
// 16 where the fifth bit is set: the bit of byte j picked by a byte shuffle and a bit mask), and
// its 32 products summed by one vpdpbusd where the compiler targets AVX-512 VNNI, else by
// maddubs + madd (no saturation: 31 * 127 * 2 < 2^15): the same int32 either way. Rows go in
// tiles of up to 4 that share each unpacked group; each row has its own accumulators, filled in
// the same group order whatever the tile, so a row's result does not depend on M (batch
// invariant). Threads split the output columns.
#include "torch_lite.h"

#include <cstring>

#include "quant_common.h"
#include "quant_vnni_common.h"
#include "vec_math.h"

using kvserve_quant::kGroup;
using kvserve_quant::row_tiles;

namespace {

constexpr int64_t kBytes = 20;  // per group of 32

inline uint32_t fifth_bits(const uint8_t* group) {
  uint32_t h;
  std::memcpy(&h, group + 16, 4);
  return h;
}

#ifdef KVSERVE_AVX2
// The 32 values q (0..31) of one group, element j in byte j.
inline __m256i unpack_q5(const uint8_t* group) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4),
                                       _mm_and_si128(raw, low4));
  // Byte j <- byte j / 8 of the bits (shuffles stay within 128-bit lanes; every lane holds all
  // four bytes), then keep bit j % 8.
  const __m256i bytes = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(fifth_bits(group))),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
  return _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

// sum(q * qx) of one group as 8 int32 lanes, converted to float.
inline __m256 group_dot(__m256i wq, const int8_t* xr) {
  const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
#ifdef KVSERVE_VNNI
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xq));
#else
  return _mm256_cvtepi32_ps(
      _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), _mm256_set1_epi16(1)));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// R rows (R <= 4) of x against one weight row; writes y[r * ldy]. Groups go in pairs, each
// into its own accumulator per row (even groups, odd groups), so that consecutive FMAs of a
// row do not wait on each other; a row's order of operations is the same whatever R.
template <int R>
void dot_q5(const uint8_t* w, const float* d, const float* m, const int8_t* x, const float* dx,
            const float* sx, int64_t K, int64_t G, float* y, int64_t ldy) {
#ifdef KVSERVE_AVX2
  __m256 acc0[R], acc1[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    const __m256i w0 = unpack_q5(w + g * kBytes), w1 = unpack_q5(w + (g + 1) * kBytes);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      const int8_t* xr = x + r * K + g * kGroup;
      const float* dxr = dx + r * G + g;
      acc0[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[g] * dxr[0]), group_dot(w0, xr), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[g + 1] * dxr[1]), group_dot(w1, xr + kGroup),
                                acc1[r]);
    }
  }
  if (g < G) {  // an odd last group
    const __m256i w0 = unpack_q5(w + g * kBytes);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      acc0[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[g] * dx[r * G + g]),
                                group_dot(w0, x + r * K + g * kGroup), acc0[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    float tail = 0.f;
    for (int64_t j = 0; j < G; j++) tail += m[j] * sx[r * G + j];
    y[r * ldy] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + tail;
  }
#else
  for (int r = 0; r < R; r++) {
    float acc = 0.f;
    for (int64_t g = 0; g < G; g++) {
      const uint8_t* grp = w + g * kBytes;
      const uint32_t h = fifth_bits(grp);
      const int8_t* xr = x + r * K + g * kGroup;
      int s = 0;
      for (int j = 0; j < 16; j++) {
        s += ((grp[j] & 0x0F) | (((h >> j) & 1) << 4)) * xr[j];
        s += ((grp[j] >> 4) | (((h >> (j + 16)) & 1) << 4)) * xr[j + 16];
      }
      acc += d[g] * dx[r * G + g] * static_cast<float>(s) + m[g] * sx[r * G + g];
    }
    y[r * ldy] = acc;
  }
#endif
}

void check_q5(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous() &&
                  qs.size(1) % kBytes == 0,
              "malformed q5 weight: uint8 rows of 20-byte groups");
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kFloat && d.dim() == 2 &&
                  d.size(0) == qs.size(0) && d.size(1) == qs.size(1) / kBytes &&
                  m.is_contiguous() && m.scalar_type() == at::kFloat && m.sizes() == d.sizes(),
              "malformed q5 weight: one float32 scale and min per group");
}

template <typename T>
void dequant_rows(const uint8_t* w, const float* dw, const float* mw, const int64_t* ids,
                  int64_t R, int64_t K, T* o) {
  const int64_t G = K / kGroup;
#pragma omp parallel for schedule(static) if (R * K > 65536)
  for (int64_t i = 0; i < R; i++) {
    const int64_t n = ids[i];
    for (int64_t g = 0; g < G; g++) {
      const uint8_t* grp = w + n * G * kBytes + g * kBytes;
      const float a = dw[n * G + g], b = mw[n * G + g];
      T* dst = o + i * K + g * kGroup;
#ifdef KVSERVE_AVX2
      alignas(32) uint8_t q[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), unpack_q5(grp));
      const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
      for (int h = 0; h < 4; h++) {
        const __m256 qf = _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h))));
        kvserve::store8(dst + 8 * h, _mm256_fmadd_ps(av, qf, bv));
      }
#else
      const uint32_t h = fifth_bits(grp);
      for (int j = 0; j < 16; j++) {
        const int lo = (grp[j] & 0x0F) | (((h >> j) & 1) << 4);
        const int hi = (grp[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
        dst[j] = static_cast<T>(a * static_cast<float>(lo) + b);
        dst[j + 16] = static_cast<T>(a * static_cast<float>(hi) + b);
      }
#endif
    }
  }
}

}  // namespace

at::Tensor quant_gemm_q5(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m) {
  check_q5(qs, d, m);
  const int64_t N = qs.size(0), G = d.size(1), K = G * kGroup, M = x.size(0);
  kvserve_quant::check_gemm_args(x, qs, d, K);
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
      dot_q5<decltype(tile)::value>(w + n * G * kBytes, dw + n * G, mw + n * G, xqp + r0 * K,
                                    dx + r0 * G, sx + r0 * G, K, G, yp + r0 * N + n, N);
    });
  }
  return y;
}

at::Tensor quant_dequant_q5(at::Tensor qs, at::Tensor d, at::Tensor m, at::Tensor rows,
                            bool bf16) {
  check_q5(qs, d, m);
  const int64_t K = d.size(1) * kGroup;
  const at::Tensor ids = rows.to(at::kLong).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); i++) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < qs.size(0), "row index out of range");
  }
  auto out = at::empty({ids.numel(), K}, bf16 ? at::kBFloat16 : at::kFloat);
  const uint8_t* w = qs.data_ptr<uint8_t>();
  const float *dw = d.data_ptr<float>(), *mw = m.data_ptr<float>();
  if (bf16) {
    dequant_rows<c10::BFloat16>(w, dw, mw, idp, ids.numel(), K, out.data_ptr<c10::BFloat16>());
  } else {
    dequant_rows<float>(w, dw, mw, idp, ids.numel(), K, out.data_ptr<float>());
  }
  return out;
}
