// Paged decode attention for the CPU path: one query token per sequence, reading K/V straight
// from the block pool through the block table (no gather copy). fp32 queries, fp32
// accumulation, over a float32 pool, a 16-bit float pool (float16 or bfloat16 rows widened to
// float32 in registers, F16C's conversion for float16) or an int8 pool (engine/kv_cache/kv_quant.py: a row is
// head_dim int8 values then the float16 bits of its scale; the scale of a K row multiplies its
// score, the scale of a V row its softmax weight, so rows are dequantised in registers only),
// or an fp8 pool read as bytes (each byte's value from a 256-entry table, the KV head's scales
// folded in the same way).
//
// Work is split into one task per (group of query rows, KV head): the task computes the scores
// of that KV head's G query heads, their softmax, and the weighted V sum. A group is one decode
// row, or up to 8 consecutive rows of one prompt (the rows batch-invariant serving sends here,
// each over keys 0 .. its position), which then share every K and V row they read; a row's
// arithmetic is the same in any group, so its output does not depend on the batch. With
// AVX2+FMA and head_dim a multiple of 16 the task runs on the vector path below (register tiles
// sized for AVX-512VL's 32 vector registers where the compiler has them); anything else takes
// the portable loop, one row at a time.
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

// A group's rows: R consecutive query rows of one sequence (one block table) and one KV head,
// row r attending keys [start[r], len[r]) with its G query heads. Decodes are groups of one row;
// the rows of a prompt (batch-invariant serving: every row a decode row) come in groups of up to
// kMaxRows, so each K and V row read from the pool (and widened) serves all of them.
constexpr int64_t kMaxRows = 8;
constexpr int64_t kChunk = 16;  // keys widened at once in the weighted-V pass

template <typename T>
struct Group {
  const float* q;        // row r's head g: q + r * row + g * D
  float* out;            // same layout
  int64_t row;           // H * D
  const T* k_base;       // K pool + h * W
  const T* v_base;
  const int32_t* table;  // the rows' common block table
  const int64_t* start;  // [R] first key of each row
  const int64_t* len;    // [R] one past its last key
  int64_t R, G, D, BS, row_stride;
  float scale;
  const float* lut;
  float k_head, v_head;
};

// Register tiles: with AVX-512VL's 32 vector registers, 4 heads x 4 keys of scores and 4 heads
// x 32 columns of weighted V at once; with AVX2's 16, 2 heads x 4 keys and 4 heads x 16 columns.
#ifdef __AVX512VL__
constexpr int kQKHeads = 4;
constexpr int kPVCols = 4;  // in vectors of 8
#else
constexpr int kQKHeads = 2;
constexpr int kPVCols = 2;
#endif

// Lanes 0-3: the horizontal sums of a[0..3], each by the tree kvserve::hsum8 uses for a lane.
inline __m128 hsum4(const __m256* a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Scores of GT query heads (q + g * D) against 4 keys (rows[0..4), S elements widened as they
// load): sc[g * stride + j] = (q_g . k_j) * rs[j]. Each dot product is one 8-lane FMA chain
// over head_dim, then hsum4: the same arithmetic, bit for bit, whatever the tile.
template <int GT, typename S>
inline void qk_tile(const float* q, int64_t D, const S* const* rows, const float* lut,
                    __m128 rs, float* sc, int64_t stride) {
  __m256 acc[GT][4];
  for (int g = 0; g < GT; g++)
    for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    __m256 k[4];
    for (int j = 0; j < 4; j++) k[j] = load8(rows[j] + c, lut);
    for (int g = 0; g < GT; g++) {
      const __m256 qv = _mm256_loadu_ps(q + g * D + c);
      for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(qv, k[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GT; g++) _mm_storeu_ps(sc + g * stride, _mm_mul_ps(hsum4(acc[g]), rs));
}

// out[g][c .. c + 8 NC) (+)= sum_i w[g][i] * v_i[c .. c + 8 NC) for GC query heads, accumulated
// over calls (loaded from `out` unless `first`): each V slice loaded (widened) once for all GC
// heads. Keys in order, one FMA per key and lane: the chain of one output lane does not
// depend on how the keys were split into calls or the columns into slices.
template <int GC, int NC, typename S>
inline void pv_tile(const S* const* vrows, int64_t n, const float* lut, const float* w,
                    int64_t wstride, int64_t c, float* out, int64_t D, bool first) {
  __m256 a[GC][NC];
  for (int g = 0; g < GC; g++)
    for (int u = 0; u < NC; u++)
      a[g][u] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + g * D + c + 8 * u);
  for (int64_t i = 0; i < n; i++) {
    __m256 v[NC];
    for (int u = 0; u < NC; u++) v[u] = load8(vrows[i] + c + 8 * u, lut);
    for (int g = 0; g < GC; g++) {
      const __m256 wg = _mm256_broadcast_ss(w + g * wstride + i);
      for (int u = 0; u < NC; u++) a[g][u] = _mm256_fmadd_ps(wg, v[u], a[g][u]);
    }
  }
  for (int g = 0; g < GC; g++)
    for (int u = 0; u < NC; u++) _mm256_storeu_ps(out + g * D + c + 8 * u, a[g][u]);
}

// One row's weighted V over keys rows[0, n) for all G heads: heads in groups of up to 4,
// head_dim in slices of 8 * kPVCols columns (head_dim is a multiple of 16: a narrower last
// slice where it is not a multiple of the wide one).
template <typename S>
void pv_row(const S* const* rows, int64_t n, const float* lut, const float* w, int64_t wstride,
            float* out, int64_t G, int64_t D, bool first) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gc = std::min<int64_t>(4, G - g0);
    float* o = out + g0 * D;
    const float* wg = w + g0 * wstride;
    int64_t c = 0;
    for (; c + 8 * kPVCols <= D; c += 8 * kPVCols) {
      switch (gc) {
        case 1: pv_tile<1, kPVCols>(rows, n, lut, wg, wstride, c, o, D, first); break;
        case 2: pv_tile<2, kPVCols>(rows, n, lut, wg, wstride, c, o, D, first); break;
        case 3: pv_tile<3, kPVCols>(rows, n, lut, wg, wstride, c, o, D, first); break;
        default: pv_tile<4, kPVCols>(rows, n, lut, wg, wstride, c, o, D, first); break;
      }
    }
    for (; c < D; c += 16) {
      switch (gc) {
        case 1: pv_tile<1, 2>(rows, n, lut, wg, wstride, c, o, D, first); break;
        case 2: pv_tile<2, 2>(rows, n, lut, wg, wstride, c, o, D, first); break;
        case 3: pv_tile<3, 2>(rows, n, lut, wg, wstride, c, o, D, first); break;
        default: pv_tile<4, 2>(rows, n, lut, wg, wstride, c, o, D, first); break;
      }
    }
  }
}

// One row's scores against the 8 keys rows[0, 8) for all G heads, in tiles of kQKHeads.
template <typename S>
void qk_block(const float* q, int64_t G, int64_t D, const S* const* rows, const float* lut,
              const float* rs, float* sc, int64_t stride) {
  for (int half = 0; half < 2; half++) {
    const __m128 r4 = _mm_loadu_ps(rs + 4 * half);
    int64_t g = 0;
    for (; g + kQKHeads <= G; g += kQKHeads)
      qk_tile<kQKHeads>(q + g * D, D, rows + 4 * half, lut, r4, sc + g * stride + 4 * half, stride);
    float* o = sc + g * stride + 4 * half;
    switch (G - g) {  // the heads left over: one narrower tile
      case 0: break;
      case 1: qk_tile<1>(q + g * D, D, rows + 4 * half, lut, r4, o, stride); break;
      case 2: qk_tile<2>(q + g * D, D, rows + 4 * half, lut, r4, o, stride); break;
      default: qk_tile<3>(q + g * D, D, rows + 4 * half, lut, r4, o, stride); break;
    }
  }
}

// rows[0, m) as floats into buf (m rows of D), their new addresses into out[0, m).
template <typename T>
inline void widen_rows(const T* const* rows, int64_t m, int64_t D, const float* lut, float* buf,
                       const float** out) {
  for (int64_t j = 0; j < m; j++) {
    for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(buf + j * D + c, load8(rows[j] + c, lut));
    out[j] = buf + j * D;
  }
}

// Prefetch every line of rows[i], i in [from, to), into L2: the pool's blocks lie scattered,
// so the hardware cannot run ahead of them (into L1 instead, decode steps of 16 sequences were
// ~1.2x slower: AMD EPYC Zen 4, 2026-12-04).
template <typename T>
inline void prefetch_rows(const T* const* rows, int64_t from, int64_t to, int64_t D) {
  for (int64_t i = from; i < to; i++)
    for (int64_t c = 0; c < D; c += kLine / static_cast<int64_t>(sizeof(T)))
      _mm_prefetch(reinterpret_cast<const char*>(rows[i] + c), _MM_HINT_T2);
}

template <typename T>
void run_avx2(const Group<T>& t) {
  // kWiden: rows that are not float32 become floats (in registers, or once per block of keys
  // into a buffer, below). kScaled: 8-bit rows carry a scale (int8: per row; fp8: per head),
  // folded into scores and weights; 16-bit float rows need none.
  constexpr bool kWiden = !std::is_same<T, float>::value;
  constexpr bool kScaled = std::is_same<T, int8_t>::value || std::is_same<T, uint8_t>::value;
  const int64_t R = t.R, G = t.G, D = t.D;
  int64_t lo = INT64_MAX, hi = 0;
  for (int64_t r = 0; r < R; r++) {
    if (t.len[r] <= t.start[r]) {  // nothing to attend: zeros
      std::fill(t.out + r * t.row, t.out + r * t.row + G * D, 0.0f);
      continue;
    }
    lo = std::min(lo, t.start[r]);
    hi = std::max(hi, t.len[r]);
  }
  if (hi <= lo) return;
  const int64_t n = hi - lo, npad = (n + 7) / 8 * 8;
  // Row pointers of keys lo .. hi, block by block (no division per key).
  std::vector<const T*> krows(npad), vrows(n);
  {
    int64_t blk = lo / t.BS, off = lo % t.BS;
    for (int64_t i = 0; i < n; i++) {
      const int64_t at = (static_cast<int64_t>(t.table[blk]) * t.BS + off) * t.row_stride;
      krows[i] = t.k_base + at;
      vrows[i] = t.v_base + at;
      if (++off == t.BS) off = 0, blk++;
    }
  }
  std::vector<float> kscale(kScaled ? npad : 0), vscale_rows(kScaled ? n : 0);
  if (kScaled) {
    for (int64_t i = 0; i < n; i++) {
      kscale[i] = row_scale(krows[i], D) * t.k_head * t.scale;
      vscale_rows[i] = row_scale(vrows[i], D) * t.v_head;
    }
  }
  for (int64_t i = n; i < npad; i++) {  // padded lanes: ignored below
    krows[i] = krows[n - 1];
    if (kScaled) kscale[i] = 0.0f;
  }
  // Scores of row r, head g: key start[r] + j at sc[(r * G + g) * SR + 8 + j], j in [0, n_r),
  // room for n_r rounded up to 8 after it and 8 floats of slack before (blocks of 8 keys are
  // aligned at lo, not at the row's first key; lanes outside the row are overwritten below).
  const int64_t SR = npad + 16;
  std::vector<float> sc(R * G * SR), inv(R * G);
  // Scores, 8 keys at a time. One row (a decode) widens 16-bit rows as it loads them;
  // several rows (or 8-bit rows, whose widening costs more) widen each block of 8 keys once
  // into kbuf (L1) for all rows and heads.
  const bool widen = kWiden && (R > 1 || kScaled);
  std::vector<float> kbuf(widen ? 8 * D : 0);
  alignas(32) float scale8[8];
  std::fill(scale8, scale8 + 8, t.scale);
  prefetch_rows(krows.data(), 0, std::min(n, kAhead), D);
  prefetch_rows(vrows.data(), 0, std::min(n, kAhead), D);
  for (int64_t i0 = 0; i0 < npad; i0 += 8) {
    if (i0 + kAhead + 8 <= n) {  // V too: the weighted sum reads it next, in the same order
      prefetch_rows(krows.data(), i0 + kAhead, i0 + kAhead + 8, D);
      prefetch_rows(vrows.data(), i0 + kAhead, i0 + kAhead + 8, D);
    }
    const float* fr[8];
    if (widen) widen_rows(krows.data() + i0, 8, D, t.lut, kbuf.data(), fr);
    const float* rs = kScaled ? kscale.data() + i0 : scale8;
    for (int64_t r = 0; r < R; r++) {
      const int64_t off = lo + i0 - t.start[r];  // the block's first key, in row r's scores
      if (t.len[r] <= t.start[r] || off + 8 <= 0 || lo + i0 >= t.len[r]) continue;
      float* dst = sc.data() + r * G * SR + 8 + off;
      if (widen)
        qk_block(t.q + r * t.row, G, D, fr, t.lut, rs, dst, SR);
      else
        qk_block(t.q + r * t.row, G, D, krows.data() + i0, t.lut, rs, dst, SR);
    }
  }
  // Softmax numerators in place; the 1/sum is applied to the output instead of every weight.
  for (int64_t r = 0; r < R; r++) {
    const int64_t nr = t.len[r] - t.start[r], nrpad = (nr + 7) / 8 * 8;
    if (nr <= 0) continue;
    for (int64_t g = 0; g < G; g++) {
      float* sg = sc.data() + (r * G + g) * SR + 8;
      inv[r * G + g] = kvserve::softmax_numerators(sg, nr, nrpad);
      if (kScaled)  // a V row's scale rides on its weight (after the sum, which it must not touch)
        for (int64_t i = 0; i < nr; i++) sg[i] *= vscale_rows[t.start[r] - lo + i];
    }
  }
  // Weighted V, kChunk keys at a time, accumulated in `out`; rows widened once per chunk
  // into vbuf when several rows (or 8-bit rows) use them.
  std::vector<float> vbuf(widen ? kChunk * D : 0);
  const float* vr[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
    prefetch_rows(vrows.data(), std::min(n, i0 + kAhead), std::min(n, i0 + kAhead + m), D);
    if (widen) widen_rows(vrows.data() + i0, m, D, t.lut, vbuf.data(), vr);
    for (int64_t r = 0; r < R; r++) {
      const int64_t a = std::max(lo + i0, t.start[r]), b = std::min(lo + i0 + m, t.len[r]);
      if (a >= b) continue;
      const float* w = sc.data() + r * G * SR + 8 + (a - t.start[r]);
      const int64_t j0 = a - lo - i0;
      if (widen)
        pv_row(vr + j0, b - a, t.lut, w, SR, t.out + r * t.row, G, D, a == t.start[r]);
      else
        pv_row(vrows.data() + i0 + j0, b - a, t.lut, w, SR, t.out + r * t.row, G, D,
               a == t.start[r]);
    }
  }
  for (int64_t r = 0; r < R; r++) {
    if (t.len[r] <= t.start[r]) continue;
    for (int64_t g = 0; g < G; g++) {
      const __m256 s = _mm256_set1_ps(inv[r * G + g]);
      float* o = t.out + r * t.row + g * D;
      for (int64_t c = 0; c < D; c += 8)
        _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), s));
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
  std::vector<int64_t> starts(B), lens(B);
  for (int64_t b = 0; b < B; b++) {
    lens[b] = slp[b];
    starts[b] = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
  }
#ifdef KVSERVE_AVX2
  const bool vector_path = D % 16 == 0;
  // Groups of rows that share a block table and follow one another by one key (a prompt's
  // rows): first row of each group, then B. Each row's arithmetic is the same in any group.
  std::vector<int64_t> first_row;
  for (int64_t b = 0; b < B; b++) {
    const int64_t b0 = first_row.empty() ? -1 : first_row.back();
    const int64_t need = std::min<int64_t>(MB, (lens[b] + BS - 1) / BS);
    const bool joins = vector_path && b0 >= 0 && b - b0 < kMaxRows && lens[b] == lens[b - 1] + 1 &&
                       std::equal(btp + b * MB, btp + b * MB + need, btp + b0 * MB);
    if (!joins) first_row.push_back(b);
  }
  const int64_t NG = static_cast<int64_t>(first_row.size());
  first_row.push_back(B);
#else
  const int64_t NG = B;
#endif

#pragma omp parallel for schedule(dynamic)
  for (int64_t task = 0; task < NG * KVH; task++) {
    const int64_t gi = task / KVH, h = task % KVH;
#ifdef KVSERVE_AVX2
    if (vector_path) {
      const int64_t b = first_row[gi];
      Group<T> t{qp + (b * H + h * G) * D, op + (b * H + h * G) * D, H * D, kp + h * W,
                 vp + h * W, btp + b * MB, starts.data() + b, lens.data() + b,
                 first_row[gi + 1] - b, G, D, BS, KVH * W, static_cast<float>(scale), lut,
                 k_heads ? k_heads[h] : 1.0f, v_heads ? v_heads[h] : 1.0f};
      run_avx2(t);
      continue;
    }
#endif
    const int64_t b = gi;
    Task<T> t{qp + (b * H + h * G) * D, op + (b * H + h * G) * D, kp + h * W, vp + h * W,
              btp + b * MB, starts[b], lens[b], G, D, BS, KVH * W, static_cast<float>(scale),
              lut, k_heads ? k_heads[h] : 1.0f, v_heads ? v_heads[h] : 1.0f};
    if (lens[b] <= starts[b]) {
      std::fill(t.out, t.out + G * D, 0.0f);
      continue;
    }
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
