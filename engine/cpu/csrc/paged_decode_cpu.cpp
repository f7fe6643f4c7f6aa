// Paged decode attention for the CPU path: one query token per sequence, reading K/V straight
// from the block pool through the block table (no gather copy). fp32 queries, fp32
// accumulation, over a float32 pool, a 16-bit float pool (float16 or bfloat16 rows widened to
// float32 in registers, F16C's conversion for float16) or an int8 pool (engine/kv_cache/kv_quant.py: a row is
// head_dim int8 values then the float16 bits of its scale; the scale of a K row multiplies its
// score, the scale of a V row its softmax weight, so rows are dequantised in registers only),
// or an fp8 pool read as bytes (each byte's value from a 256-entry table, the KV head's scales
// folded in the same way).
//
// Work is split into one task per (sequence, KV head): the task computes the scores of that KV
// head's G query heads, their softmax, and the weighted V sum. With AVX2+FMA and head_dim a
// multiple of 16 the task runs on the vector path below; anything else takes the portable loop.
#include "torch_lite.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "paged_decode_common.h"

namespace {

template <typename T>
struct Task {
  const float* q;        // [G, D] the query heads of this KV head
  float* out;            // [G, D]
  const T* k_base;       // K pool + h * W  (rows are KVH * W apart; W = D, or D + 2 for int8)
  const T* v_base;
  const int32_t* table;  // this sequence's block table
  int64_t start, len;    // keys [start, len)
  int64_t G, D, BS, row_stride;
  float scale;
  const float* lut;      // fp8 pools: the 256 byte values as floats (else unused)
  float k_head, v_head;  // fp8 pools: this KV head's scales (else 1)
};

template <typename T>
inline const T* row_ptr(const T* base, const Task<T>& t, int64_t pos) {
  return base + (static_cast<int64_t>(t.table[pos / t.BS]) * t.BS + pos % t.BS) * t.row_stride;
}

// The dequantisation scale of a pool row: 1 for float rows, the trailing float16 for int8.
inline float row_scale(const float*, int64_t) { return 1.0f; }
inline float row_scale(const c10::Half*, int64_t) { return 1.0f; }
inline float row_scale(const c10::BFloat16*, int64_t) { return 1.0f; }
inline float row_scale(const uint8_t*, int64_t) { return 1.0f; }  // fp8: per head, not per row
inline float row_scale(const int8_t* row, int64_t D) {
  uint16_t bits;
  std::memcpy(&bits, row + D, sizeof bits);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// One element as a float: fp8 bytes through the lookup table.
inline float to_float(float x, const float*) { return x; }
inline float to_float(c10::Half x, const float*) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x, const float*) { return static_cast<float>(x); }
inline float to_float(int8_t x, const float*) { return static_cast<float>(x); }
inline float to_float(uint8_t x, const float* lut) { return lut[x]; }

// Portable path: any head_dim, any ISA.
template <typename T>
void run_generic(const Task<T>& t) {
  const int64_t n = t.len - t.start;
  std::vector<float> scores(t.G * n);
  for (int64_t i = 0; i < n; i++) {
    const T* kr = row_ptr(t.k_base, t, t.start + i);
    const float ks = row_scale(kr, t.D) * t.k_head * t.scale;
    for (int64_t g = 0; g < t.G; g++) {
      const float* qg = t.q + g * t.D;
      float s = 0.0f;
      for (int64_t d = 0; d < t.D; d++) s += qg[d] * to_float(kr[d], t.lut);
      scores[g * n + i] = s * ks;
    }
  }
  for (int64_t g = 0; g < t.G; g++) {
    float* sg = scores.data() + g * n;
    const float m = *std::max_element(sg, sg + n);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += (sg[i] = std::exp(sg[i] - m));
    float* o = t.out + g * t.D;
    std::fill(o, o + t.D, 0.0f);
    for (int64_t i = 0; i < n; i++) {
      const T* vr = row_ptr(t.v_base, t, t.start + i);
      const float w = sg[i] / sum * row_scale(vr, t.D) * t.v_head;
      for (int64_t d = 0; d < t.D; d++) o[d] += w * to_float(vr[d], t.lut);
    }
  }
}

#ifdef KVSERVE_AVX2
using kvserve::hsum8;
using kvserve::kAhead;
using kvserve::kLine;

// 8 consecutive elements of a row as floats.
inline __m256 load8(const float* p, const float*) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p, const float*) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[8];
  for (int i = 0; i < 8; i++) f[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(f);
#endif
}
inline __m256 load8(const c10::BFloat16* p, const float*) {  // bfloat16 = float32's top half
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
inline __m256 load8(const int8_t* p, const float*) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const uint8_t* p, const float* lut) {  // fp8 bytes: a table gather
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_i32gather_ps(lut, idx, 4);
}

// out[g] += sum_i w[g][i] * v_i[c .. c+16) for GC query heads at once: 2*GC accumulators in
// registers, each V row's 64-byte slice loaded once for all GC heads.
template <int GC, typename T>
void pv_chunk(const T* const* vrows, int64_t n, const float* w, int64_t wstride,
              const float* inv, int64_t c, float* out, int64_t D, const float* lut) {
  __m256 a[GC][2];
  for (int g = 0; g < GC; g++) a[g][0] = a[g][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i++) {
    if (i + kAhead < n) _mm_prefetch(reinterpret_cast<const char*>(vrows[i + kAhead] + c), _MM_HINT_T0);
    const __m256 v0 = load8(vrows[i] + c, lut), v1 = load8(vrows[i] + c + 8, lut);
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

template <typename T>
void run_avx2(const Task<T>& t) {
  // kWiden: rows that are not float32 are widened to floats once per block of 8 keys.
  // kScaled: 8-bit rows carry a scale (int8: per row; fp8: per head), folded into scores and
  // weights; 16-bit float rows need none.
  constexpr bool kWiden = !std::is_same<T, float>::value;
  constexpr bool kScaled = std::is_same<T, int8_t>::value || std::is_same<T, uint8_t>::value;
  const int64_t n = t.len - t.start, npad = (n + 7) / 8 * 8, G = t.G, D = t.D;
  std::vector<const T*> krows(npad), vrows(n);
  std::vector<float> kscale(kScaled ? npad : 0), vscale_rows(kScaled ? n : 0);
  for (int64_t i = 0; i < n; i++) {
    krows[i] = row_ptr(t.k_base, t, t.start + i);
    vrows[i] = row_ptr(t.v_base, t, t.start + i);
    if (kScaled) {
      kscale[i] = row_scale(krows[i], D) * t.k_head * t.scale;
      vscale_rows[i] = row_scale(vrows[i], D) * t.v_head;
    }
  }
  for (int64_t i = n; i < npad; i++) {  // padded lanes: ignored below
    krows[i] = krows[n - 1];
    if (kScaled) kscale[i] = 0.0f;
  }
  std::vector<float> scores(G * npad), inv(G);
  const __m256 vscale = _mm256_set1_ps(t.scale);
  // Scores, 8 keys at a time: 8 independent FMA chains, one horizontal-sum shuffle per 8 keys.
  // Narrow rows are widened once per block of 8 keys into kbuf (L1), not once per query head.
  std::vector<float> kbuf(kWiden ? 8 * D : 0);
  for (int64_t i0 = 0; i0 < npad; i0 += 8) {
    const float* rows[8];
    if constexpr (kWiden) {
      for (int j = 0; j < 8; j++) {
        for (int64_t c = 0; c < D; c += 8)
          _mm256_storeu_ps(kbuf.data() + j * D + c, load8(krows[i0 + j] + c, t.lut));
        rows[j] = kbuf.data() + j * D;
      }
    } else {
      for (int j = 0; j < 8; j++) rows[j] = krows[i0 + j];
    }
    const __m256 rs = kScaled ? _mm256_loadu_ps(kscale.data() + i0) : vscale;
    if (i0 + kAhead + 8 <= npad) {  // block tables scatter rows: the hardware cannot guess ahead
      for (int j = 0; j < 8; j++)
        for (int64_t c = 0; c < D; c += kLine / static_cast<int64_t>(sizeof(T)))
          _mm_prefetch(reinterpret_cast<const char*>(krows[i0 + kAhead + j] + c), _MM_HINT_T0);
    }
    for (int64_t g = 0; g < G; g++) {
      const float* qg = t.q + g * D;
      __m256 acc[8];
      for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + c);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[j] + c), acc[j]);
      }
      _mm256_storeu_ps(scores.data() + g * npad + i0, _mm256_mul_ps(hsum8(acc), rs));
    }
  }
  // Softmax numerators in place; the 1/sum is applied to the output instead of every weight.
  for (int64_t g = 0; g < G; g++) {
    float* sg = scores.data() + g * npad;
    inv[g] = kvserve::softmax_numerators(sg, n, npad);
    if (kScaled)  // a V row's scale rides on its weight (after the sum, which it must not touch)
      for (int64_t i = 0; i < n; i++) sg[i] *= vscale_rows[i];
  }
  // Weighted V: query heads in groups of up to 4, head_dim in 16-float (one cache line) slices.
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gc = std::min<int64_t>(4, G - g0);
    const float* w = scores.data() + g0 * npad;
    float* out = t.out + g0 * D;
    for (int64_t c = 0; c < D; c += 16) {
      switch (gc) {
        case 1: pv_chunk<1, T>(vrows.data(), n, w, npad, inv.data() + g0, c, out, D, t.lut); break;
        case 2: pv_chunk<2, T>(vrows.data(), n, w, npad, inv.data() + g0, c, out, D, t.lut); break;
        case 3: pv_chunk<3, T>(vrows.data(), n, w, npad, inv.data() + g0, c, out, D, t.lut); break;
        default: pv_chunk<4, T>(vrows.data(), n, w, npad, inv.data() + g0, c, out, D, t.lut); break;
      }
    }
  }
}
#endif

template <typename T>
at::Tensor paged_decode_impl(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                int64_t window, const float* lut = nullptr,
                                const float* k_heads = nullptr, const float* v_heads = nullptr) {
  TORCH_CHECK(block_tables.dtype() == at::kInt && seq_lens.dtype() == at::kInt,
              "paged_decode_cpu: int32 block tables and seq lens");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), W = k_cache.size(3);
  const int64_t MB = block_tables.size(1), G = H / KVH;
  TORCH_CHECK(W == (std::is_same<T, int8_t>::value ? D + 2 : D),
              "paged_decode_cpu: pool rows of ", W, " elements for head_dim ", D);
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* btp = block_tables.data_ptr<int32_t>();
  const int32_t* slp = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
#ifdef KVSERVE_AVX2
  const bool vector_path = D % 16 == 0;
#endif

#pragma omp parallel for schedule(dynamic)
  for (int64_t task = 0; task < B * KVH; task++) {
    const int64_t b = task / KVH, h = task % KVH;
    const int64_t len = slp[b];
    Task<T> t{qp + (b * H + h * G) * D, op + (b * H + h * G) * D, kp + h * W, vp + h * W,
              btp + b * MB, window > 0 ? std::max<int64_t>(0, len - window) : 0, len,
              G, D, BS, KVH * W, static_cast<float>(scale), lut,
              k_heads ? k_heads[h] : 1.0f, v_heads ? v_heads[h] : 1.0f};
    if (len <= t.start) {
      std::fill(t.out, t.out + G * D, 0.0f);
      continue;
    }
#ifdef KVSERVE_AVX2
    if (vector_path) {
      run_avx2(t);
      continue;
    }
#endif
    run_generic(t);
  }
  return out;
}

}  // namespace

at::Tensor paged_decode_cpu(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor block_tables, at::Tensor seq_lens, double scale,
                               int64_t window) {
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == v_cache.dtype(),
              "paged_decode_cpu: float32 queries, K and V pools of one dtype");
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      return paged_decode_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, window);
    case at::kHalf:
      return paged_decode_impl<c10::Half>(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                          window);
    case at::kBFloat16:
      return paged_decode_impl<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                              window);
    default:
      TORCH_CHECK(false, "paged_decode_cpu: float32, float16 or bfloat16 pools; got ",
                  k_cache.scalar_type());
  }
}

at::Tensor paged_decode_cpu_int8(at::Tensor q, at::Tensor k_cache,
                                    at::Tensor v_cache, at::Tensor block_tables,
                                    at::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kChar &&
              v_cache.dtype() == at::kChar,
              "paged_decode_cpu_int8: float32 queries over an int8 pool");
  return paged_decode_impl<int8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, window);
}

at::Tensor paged_decode_cpu_fp8(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor block_tables, at::Tensor seq_lens,
                                   double scale, int64_t window, at::Tensor lut,
                                   at::Tensor k_scales, at::Tensor v_scales) {
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kByte &&
              v_cache.dtype() == at::kByte,
              "paged_decode_cpu_fp8: float32 queries over an fp8 pool's uint8 view");
  TORCH_CHECK(lut.dtype() == at::kFloat && lut.numel() == 256 && lut.is_contiguous(),
              "paged_decode_cpu_fp8: a contiguous float32 table of the 256 byte values");
  k_scales = k_scales.to(at::kFloat).contiguous();
  v_scales = v_scales.to(at::kFloat).contiguous();
  TORCH_CHECK(k_scales.numel() == k_cache.size(2) && v_scales.numel() == k_cache.size(2),
              "paged_decode_cpu_fp8: one K and one V scale per KV head");
  return paged_decode_impl<uint8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                    lut.data_ptr<float>(), k_scales.data_ptr<float>(),
                                    v_scales.data_ptr<float>());
}
