// Paged decode attention over an int4 pool (engine/kv_storage/formats.py, kind "int4"): the
// CPU kernel of paged_decode_cpu.cpp for rows of q4_0 nibbles. A row of one token and KV head
// is head_dim/2 bytes of nibbles, in groups of g elements (32, or head_dim when head_dim is not
// a multiple of 32; byte i of a group holds element i in its low nibble and element i + g/2 in
// its high one), then one float16 scale per group: element = scale * (nibble - 8).
//
// Contract: exactly the float32 reference over the pool dequantised by dequantize_int4_plain
// (the ROTATED rows y = x R as stored; no rotation here: the caller rotates the query in and
// the output back). fp32 queries, fp32 accumulation.
//
// One task per (sequence, KV head), as paged_decode_cpu.cpp. With AVX2+FMA and head_dim a
// multiple of 32 the task unpacks rows in registers: K rows 8 at a time into an L1 buffer of
// floats (a scale per group cannot be folded into the score as int8's one scale per row is),
// V rows 16 elements (half a group: the low or the high nibbles of its 16 bytes) at a time in
// the weighted sum; an AVX-512 build unpacks 16 lanes per instruction instead of 8. Any other
// head_dim, or a build without AVX2, takes the portable loop.
#include "torch_lite.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "paged_decode_common.h"

namespace {

struct Task {
  const float* q;        // [G, D] the query heads of this KV head
  float* out;            // [G, D]
  const uint8_t* k_base; // K pool + h * W (rows are KVH * W bytes apart)
  const uint8_t* v_base;
  const int32_t* table;  // this sequence's block table
  int64_t start, len;    // keys [start, len)
  int64_t G, D, BS, row_stride, group;
  float scale;
};

inline const uint8_t* row_ptr(const uint8_t* base, const Task& t, int64_t pos) {
  return base + (static_cast<int64_t>(t.table[pos / t.BS]) * t.BS + pos % t.BS) * t.row_stride;
}

// The float32 scale of group gi of a row (its float16 bits after the D/2 nibble bytes).
inline float group_scale(const uint8_t* row, int64_t D, int64_t gi) {
  uint16_t bits;
  std::memcpy(&bits, row + D / 2 + 2 * gi, sizeof bits);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

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
void run_generic(const Task& t) {
  const int64_t n = t.len - t.start, D = t.D;
  std::vector<float> scores(t.G * n), row(D), inv(t.G);
  for (int64_t i = 0; i < n; i++) {
    dequant_row(row_ptr(t.k_base, t, t.start + i), D, t.group, row.data());
    for (int64_t g = 0; g < t.G; g++) {
      const float* qg = t.q + g * D;
      float s = 0.0f;
      for (int64_t d = 0; d < D; d++) s += qg[d] * row[d];
      scores[g * n + i] = s * t.scale;
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
    dequant_row(row_ptr(t.v_base, t, t.start + i), D, t.group, row.data());
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

#ifdef KVSERVE_AVX2
using kvserve::hsum8;
using kvserve::kAhead;

// 8 nibbles (the low 8 bytes of x, each 0..15) as (nibble - 8) * s: one FMA n * s + (-8 s),
// rounded once from the exact (n - 8) * s (-8 s is exact), so the same float as the reference.
inline __m256 nibbles8(__m128i x, __m256 s) {
  const __m256 n = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x));
  return _mm256_fmadd_ps(n, s, _mm256_mul_ps(s, _mm256_set1_ps(-8.0f)));
}

// The 16 low (high = false) or high nibbles of the 16 bytes at p.
inline __m128i nibbles16(const uint8_t* p, bool high) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm_and_si128(high ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(15));
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

// out[g] = inv[g] * sum_i w[g][i] * v_i[c .. c+16) for GC query heads at once; the slice is
// the low (c % 32 == 0) or high nibbles of group c / 32, unpacked once for all GC heads.
template <int GC>
void pv_chunk(const uint8_t* const* vrows, const float* vscales, int64_t groups, int64_t n,
              const float* w, int64_t wstride, const float* inv, int64_t c, float* out,
              int64_t D) {
  const int64_t gi = c / 32;
  const bool high = c % 32 != 0;
  __m256 a[GC][2];
  for (int g = 0; g < GC; g++) a[g][0] = a[g][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i++) {
    if (i + kAhead < n)
      _mm_prefetch(reinterpret_cast<const char*>(vrows[i + kAhead] + gi * 16), _MM_HINT_T0);
    const __m256 s = _mm256_set1_ps(vscales[i * groups + gi]);
    const __m128i q = nibbles16(vrows[i] + gi * 16, high);
    const __m256 v0 = nibbles8(q, s), v1 = nibbles8(_mm_srli_si128(q, 8), s);
    for (int g = 0; g < GC; g++) {
      const __m256 wg = _mm256_broadcast_ss(w + g * wstride + i);
      a[g][0] = _mm256_fmadd_ps(wg, v0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(wg, v1, a[g][1]);
    }
  }
  for (int g = 0; g < GC; g++) {
    const __m256 s = _mm256_set1_ps(inv[g]);
    _mm256_storeu_ps(out + g * D + c, _mm256_mul_ps(a[g][0], s));
    _mm256_storeu_ps(out + g * D + c + 8, _mm256_mul_ps(a[g][1], s));
  }
}
#else
// The same two functions on 16 lanes: fewer instructions per row (the 8-lane versions measured
// ~10% slower on AVX-512 (Zen 4), benchmarks/kv_int4_decode_kernel.py, int4 over float16 time
// 0.66 -> 0.59 at batch 1 and 0.64 -> 0.57 at batch 8, pools cold; one thread, machine loaded).
// 16 nibbles (bytes each 0..15) as (nibble - 8) * s.
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

template <int GC>
void pv_chunk(const uint8_t* const* vrows, const float* vscales, int64_t groups, int64_t n,
              const float* w, int64_t wstride, const float* inv, int64_t c, float* out,
              int64_t D) {
  const int64_t gi = c / 32;
  const bool high = c % 32 != 0;
  __m512 a[GC];
  for (int g = 0; g < GC; g++) a[g] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i++) {
    if (i + kAhead < n)
      _mm_prefetch(reinterpret_cast<const char*>(vrows[i + kAhead] + gi * 16), _MM_HINT_T0);
    const __m512 v = nibbles16f(nibbles16(vrows[i] + gi * 16, high),
                                _mm512_set1_ps(vscales[i * groups + gi]));
    for (int g = 0; g < GC; g++)
      a[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * wstride + i]), v, a[g]);
  }
  for (int g = 0; g < GC; g++)
    _mm512_storeu_ps(out + g * D + c, _mm512_mul_ps(a[g], _mm512_set1_ps(inv[g])));
}
#endif  // __AVX512F__

void run_avx2(const Task& t) {
  const int64_t n = t.len - t.start, npad = (n + 7) / 8 * 8, G = t.G, D = t.D;
  const int64_t groups = D / 32, W = D / 2 + 2 * groups;
  std::vector<const uint8_t*> krows(npad), vrows(n);
  std::vector<float> vscales(n * groups);
  for (int64_t i = 0; i < n; i++) {
    krows[i] = row_ptr(t.k_base, t, t.start + i);
    vrows[i] = row_ptr(t.v_base, t, t.start + i);
    for (int64_t gi = 0; gi < groups; gi++) vscales[i * groups + gi] = group_scale(vrows[i], D, gi);
  }
  for (int64_t i = n; i < npad; i++) krows[i] = krows[n - 1];  // padded lanes: ignored below
  std::vector<float> scores(G * npad), inv(G), kbuf(8 * D);
  const __m256 vscale = _mm256_set1_ps(t.scale);
  // Scores, 8 keys at a time: the 8 rows unpacked once into kbuf (L1) for all G query heads,
  // then 8 independent FMA chains per head and one horizontal-sum shuffle.
  for (int64_t i0 = 0; i0 < npad; i0 += 8) {
    if (i0 + kAhead + 8 <= npad) {  // block tables scatter rows: the hardware cannot guess ahead
      for (int j = 0; j < 8; j++) {
        const char* r = reinterpret_cast<const char*>(krows[i0 + kAhead + j]);
        _mm_prefetch(r, _MM_HINT_T0);
        _mm_prefetch(r + W - 1, _MM_HINT_T0);
      }
    }
    for (int j = 0; j < 8; j++) dequant_row32(krows[i0 + j], D, kbuf.data() + j * D);
    for (int64_t g = 0; g < G; g++) {
      const float* qg = t.q + g * D;
      __m256 acc[8];
      for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + c);
        for (int j = 0; j < 8; j++)
          acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kbuf.data() + j * D + c), acc[j]);
      }
      _mm256_storeu_ps(scores.data() + g * npad + i0, _mm256_mul_ps(hsum8(acc), vscale));
    }
  }
  for (int64_t g = 0; g < G; g++) inv[g] = kvserve::softmax_numerators(scores.data() + g * npad, n, npad);
  // Weighted V: query heads in groups of up to 4, head_dim in 16-element slices.
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gc = std::min<int64_t>(4, G - g0);
    const float* w = scores.data() + g0 * npad;
    float* out = t.out + g0 * D;
    const float* iv = inv.data() + g0;
    for (int64_t c = 0; c < D; c += 16) {
      const auto* vr = vrows.data();
      const float* vs = vscales.data();
      switch (gc) {
        case 1: pv_chunk<1>(vr, vs, groups, n, w, npad, iv, c, out, D); break;
        case 2: pv_chunk<2>(vr, vs, groups, n, w, npad, iv, c, out, D); break;
        case 3: pv_chunk<3>(vr, vs, groups, n, w, npad, iv, c, out, D); break;
        default: pv_chunk<4>(vr, vs, groups, n, w, npad, iv, c, out, D); break;
      }
    }
  }
}
#endif

}  // namespace

at::Tensor paged_decode_cpu_int4(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                 at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                 int64_t window) {
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kByte &&
                  v_cache.dtype() == at::kByte,
              "paged_decode_cpu_int4: float32 queries over an int4 (uint8) pool");
  TORCH_CHECK(block_tables.dtype() == at::kInt && seq_lens.dtype() == at::kInt,
              "paged_decode_cpu_int4: int32 block tables and seq lens");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), W = k_cache.size(3);
  const int64_t MB = block_tables.size(1), G = H / KVH;
  TORCH_CHECK(D % 2 == 0, "paged_decode_cpu_int4: an even head_dim; got ", D);
  const int64_t group = D % 32 == 0 ? 32 : D;
  TORCH_CHECK(W == D / 2 + 2 * (D / group), "paged_decode_cpu_int4: pool rows of ", W,
              " bytes for head_dim ", D);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_decode_cpu_int4: K and V pools differ");
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const uint8_t* kp = k_cache.data_ptr<uint8_t>();
  const uint8_t* vp = v_cache.data_ptr<uint8_t>();
  const int32_t* btp = block_tables.data_ptr<int32_t>();
  const int32_t* slp = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();

#pragma omp parallel for schedule(dynamic)
  for (int64_t task = 0; task < B * KVH; task++) {
    const int64_t b = task / KVH, h = task % KVH;
    const int64_t len = slp[b];
    const Task t{qp + (b * H + h * G) * D, op + (b * H + h * G) * D, kp + h * W, vp + h * W,
                 btp + b * MB, window > 0 ? std::max<int64_t>(0, len - window) : 0, len,
                 G, D, BS, KVH * W, group, static_cast<float>(scale)};
    if (len <= t.start) {
      std::fill(t.out, t.out + G * D, 0.0f);
      continue;
    }
#ifdef KVSERVE_AVX2
    if (D % 32 == 0) {
      run_avx2(t);
      continue;
    }
#endif
    run_generic(t);
  }
  return out;
}
