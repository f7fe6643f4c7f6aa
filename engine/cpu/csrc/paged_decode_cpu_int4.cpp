// Paged decode attention over an int4 pool (engine/kv_storage/formats.py, kind "int4"): the
// kernel of paged_decode_vec.h (shared with paged_decode_cpu.cpp) over rows of q4_0 nibbles.
// A row of one token and KV head is head_dim/2 bytes of nibbles, in groups of g elements (32,
// or head_dim when head_dim is not a multiple of 32; byte i of a group holds element i in its
// low nibble and element i + g/2 in its high one), then one float16 scale per group:
// element = scale * (nibble - 8).
//
// Contract: exactly the float32 reference over the pool dequantised by dequantize_int4_plain
// (the ROTATED rows y = x R as stored; no rotation here: the caller rotates the query in and
// the output back). fp32 queries, fp32 accumulation.
//
// With AVX2+FMA and head_dim a multiple of 32 the vector path unpacks each block of 8 K rows
// and each chunk of V rows once into an L1 buffer of floats (16 lanes per instruction on an
// AVX-512 build, 8 on AVX2), shared by every query head and every row of a prompt's group; the
// register tiles then run over floats. A scale per group of 32 cannot be folded into the score
// as int8's one scale per row is. Any other head_dim, or a build without AVX2, takes the
// portable loop.
#include "torch_lite.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "paged_decode_common.h"

namespace {

// The int4 pool's bytes: a row of head_dim D is row_width(D) of them.
struct Int4 {
  uint8_t byte;
};

inline int64_t int4_group(int64_t D) { return D % 32 == 0 ? 32 : D; }

inline int64_t row_width(const Int4*, int64_t D) { return D / 2 + 2 * (D / int4_group(D)); }

inline bool vector_head_dim(const Int4*, int64_t D) { return D % 32 == 0; }

// K rows are unpacked into a buffer (once per block of 8 keys, for every query head); a lone
// row's V rows are unpacked in registers (pv_row below), several rows' into a buffer.
constexpr bool direct_keys(const Int4*) { return false; }
constexpr bool direct_values(const Int4*) { return true; }

// The float32 scale of group gi of a row (its float16 bits after the D/2 nibble bytes; the
// conversion is exact, F16C's instruction where the build has it).
inline float group_scale(const uint8_t* row, int64_t D, int64_t gi) {
  uint16_t bits;
  std::memcpy(&bits, row + D / 2 + 2 * gi, sizeof bits);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

#ifdef KVSERVE_AVX2
// The 16 low (high = false) or high nibbles of the 16 bytes at p.
inline __m128i nibbles16(const uint8_t* p, bool high) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm_and_si128(high ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(15));
}

// 8 nibbles (the low 8 bytes of x, each 0..15) as (nibble - 8) * s: one FMA n * s + (-8 s),
// rounded once from the exact (n - 8) * s (-8 s is exact), so the same float as the reference.
inline __m256 nibbles8(__m128i x, __m256 s) {
  const __m256 n = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x));
  return _mm256_fmadd_ps(n, s, _mm256_mul_ps(s, _mm256_set1_ps(-8.0f)));
}

#ifndef __AVX512F__
// A row of D (a multiple of 32) elements as floats into out.
inline void dequant_row32(const uint8_t* row, int64_t D, float* out) {
  for (int64_t gi = 0; gi < D / 32; gi++) {
    const __m256 s = _mm256_set1_ps(group_scale(row, D, gi));
    const __m128i lo = nibbles16(row + gi * 16, false), hi = nibbles16(row + gi * 16, true);
    float* o = out + gi * 32;
    _mm256_storeu_ps(o, nibbles8(lo, s));
    _mm256_storeu_ps(o + 8, nibbles8(_mm_srli_si128(lo, 8), s));
    _mm256_storeu_ps(o + 16, nibbles8(hi, s));
    _mm256_storeu_ps(o + 24, nibbles8(_mm_srli_si128(hi, 8), s));
  }
}
#else
// The same on 16 lanes: fewer instructions per row. 16 nibbles as (nibble - 8) * s.
inline __m512 nibbles16f(__m128i x, __m512 s) {
  const __m512 n = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
  return _mm512_fmadd_ps(n, s, _mm512_mul_ps(s, _mm512_set1_ps(-8.0f)));
}

inline void dequant_row32(const uint8_t* row, int64_t D, float* out) {
  for (int64_t gi = 0; gi < D / 32; gi++) {
    const __m512 s = _mm512_set1_ps(group_scale(row, D, gi));
    _mm512_storeu_ps(out + gi * 32, nibbles16f(nibbles16(row + gi * 16, false), s));
    _mm512_storeu_ps(out + gi * 32 + 16, nibbles16f(nibbles16(row + gi * 16, true), s));
  }
}
#endif  // __AVX512F__

// Weighted V of a lone row straight from its int4 rows (no buffer): out[g][c .. c + 16) (+)=
// sum_i w[g][i] * v_i[c .. c + 16) for GC query heads, accumulated over calls as pv_tile does;
// the slice is the low (c % 32 == 0) or high nibbles of group c / 32, unpacked once for all GC
// heads. Each lane's chain (one FMA per key, in order) is pv_tile's over the widened rows.
template <int GC>
inline void pv_nibbles(const Int4* const* rows, int64_t n, const float* w, int64_t wstride,
                       int64_t c, float* out, int64_t D, bool first) {
  const int64_t gi = c / 32;
  const bool high = c % 32 != 0;
  float* o[GC];
  for (int g = 0; g < GC; g++) o[g] = out + g * D + c;
#ifdef __AVX512F__
  __m512 a[GC];
  for (int g = 0; g < GC; g++) a[g] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o[g]);
  for (int64_t i = 0; i < n; i++) {
    const uint8_t* r = &rows[i]->byte;
    const __m512 v = nibbles16f(nibbles16(r + gi * 16, high), _mm512_set1_ps(group_scale(r, D, gi)));
    for (int g = 0; g < GC; g++)
      a[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * wstride + i]), v, a[g]);
  }
  for (int g = 0; g < GC; g++) _mm512_storeu_ps(o[g], a[g]);
#else
  __m256 a[GC][2];
  for (int g = 0; g < GC; g++)
    for (int u = 0; u < 2; u++)
      a[g][u] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o[g] + 8 * u);
  for (int64_t i = 0; i < n; i++) {
    const uint8_t* r = &rows[i]->byte;
    const __m256 s = _mm256_set1_ps(group_scale(r, D, gi));
    const __m128i q = nibbles16(r + gi * 16, high);
    const __m256 v0 = nibbles8(q, s), v1 = nibbles8(_mm_srli_si128(q, 8), s);
    for (int g = 0; g < GC; g++) {
      const __m256 wg = _mm256_broadcast_ss(w + g * wstride + i);
      a[g][0] = _mm256_fmadd_ps(wg, v0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(wg, v1, a[g][1]);
    }
  }
  for (int g = 0; g < GC; g++)
    for (int u = 0; u < 2; u++) _mm256_storeu_ps(o[g] + 8 * u, a[g][u]);
#endif
}

// The kernel's weighted V over int4 rows for a lone row: heads in groups of up to 4, head_dim
// in slices of 16.
inline void pv_row(const Int4* const* rows, int64_t n, const float*, const float* w,
                   int64_t wstride, float* out, int64_t G, int64_t D, bool first) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gc = std::min<int64_t>(4, G - g0);
    const float* wg = w + g0 * wstride;
    float* og = out + g0 * D;
    for (int64_t c = 0; c < D; c += 16) {
      switch (gc) {
        case 1: pv_nibbles<1>(rows, n, wg, wstride, c, og, D, first); break;
        case 2: pv_nibbles<2>(rows, n, wg, wstride, c, og, D, first); break;
        case 3: pv_nibbles<3>(rows, n, wg, wstride, c, og, D, first); break;
        default: pv_nibbles<4>(rows, n, wg, wstride, c, og, D, first); break;
      }
    }
  }
}

// rows[0, m) as floats into buf (m rows of D), their new addresses into out[0, m): the
// kernel's widening of int4 rows (head_dim a multiple of 32, vector_head_dim).
inline void widen_rows(const Int4* const* rows, int64_t m, int64_t D, const float*, float* buf,
                       const float** out) {
  for (int64_t j = 0; j < m; j++) {
    dequant_row32(&rows[j]->byte, D, buf + j * D);
    out[j] = buf + j * D;
  }
}
#endif  // KVSERVE_AVX2

}  // namespace

#include "paged_decode_vec.h"

namespace {

// A whole row as D floats, as dequantize_int4_plain computes it: (nibble - 8) * scale.
void dequant_row(const uint8_t* row, int64_t D, int64_t g, float* out) {
  for (int64_t gi = 0; gi < D / g; gi++) {
    const float s = group_scale(row, D, gi);
    const uint8_t* p = row + gi * g / 2;
    float* o = out + gi * g;
    for (int64_t i = 0; i < g / 2; i++) {
      o[i] = static_cast<float>((p[i] & 15) - 8) * s;
      o[i + g / 2] = static_cast<float>((p[i] >> 4) - 8) * s;
    }
  }
}

// Portable path: any even head_dim, any ISA.
template <>
void run_generic<Int4>(const Task<Int4>& t) {
  const int64_t n = t.len - t.start, D = t.D, group = int4_group(D);
  std::vector<float> scores(t.G * n), row(D), inv(t.G);
  for (int64_t i = 0; i < n; i++) {
    dequant_row(&row_ptr(t.k_base, t, t.start + i)->byte, D, group, row.data());
    for (int64_t g = 0; g < t.G; g++) {
      const float* qg = t.q + g * D;
      float s = 0.0f;
      for (int64_t d = 0; d < D; d++) s += qg[d] * row[d];
      scores[g * n + i] = t.softcap > 0.0f ? kvserve::softcap(s * t.scale, t.softcap)
                                           : s * t.scale;
    }
  }
  for (int64_t g = 0; g < t.G; g++) {
    float* sg = scores.data() + g * n;
    const float m = *std::max_element(sg, sg + n);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += (sg[i] = std::exp(sg[i] - m));
    inv[g] = 1.0f / sum;
    std::fill(t.out + g * D, t.out + (g + 1) * D, 0.0f);
  }
  for (int64_t i = 0; i < n; i++) {  // each V row dequantised once for all G heads
    dequant_row(&row_ptr(t.v_base, t, t.start + i)->byte, D, group, row.data());
    for (int64_t g = 0; g < t.G; g++) {
      const float* sg = scores.data() + g * n;
      float* o = t.out + g * D;
      const float w = sg[i];
      for (int64_t d = 0; d < D; d++) o[d] += w * row[d];
    }
  }
  for (int64_t g = 0; g < t.G; g++)
    for (int64_t d = 0; d < D; d++) t.out[g * D + d] *= inv[g];
}

}  // namespace

at::Tensor paged_decode_cpu_int4(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                 at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                 int64_t window, double softcap) {
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kByte &&
                  v_cache.dtype() == at::kByte,
              "paged_decode_cpu_int4: float32 queries over an int4 (uint8) pool");
  const int64_t D = q.size(2), W = k_cache.size(3);
  TORCH_CHECK(D % 2 == 0, "paged_decode_cpu_int4: an even head_dim; got ", D);
  TORCH_CHECK(W == row_width(static_cast<const Int4*>(nullptr), D),
              "paged_decode_cpu_int4: pool rows of ", W, " bytes for head_dim ", D);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_decode_cpu_int4: K and V pools differ");
  return paged_decode_impl<Int4>(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                 softcap);
}
