// The paged-attention kernel every CPU pool format shares (paged_decode_cpu.cpp: float32,
// float16, bfloat16, int8, fp8; paged_decode_cpu_int4.cpp: int4): one query token per row,
// reading K/V straight from the block pool through the block table (no gather copy), fp32
// queries and accumulation.
//
// Work is split into one task per (group of query rows, KV head): the task computes the scores
// of that KV head's G query heads, their softmax, and the weighted V sum. A group is one decode
// row, or up to 8 consecutive rows of one prompt (the rows batch-invariant serving sends here,
// each over keys 0 .. its position), which then share every K and V row they read; a row's
// arithmetic is the same in any group, so its output does not depend on the batch. With
// AVX2+FMA and a head_dim the format's vector path takes, the task runs on the vector path
// below (register tiles sized for AVX-512VL's 32 vector registers where the compiler has
// them); anything else takes the format's portable loop (run_generic), one row at a time.
//
// A source includes this header after defining, for its pool element type T (inside the
// anonymous namespace; ordinary lookup finds them):
//   float row_scale(const T* row, int64_t D)     (8-bit rows) a row's dequantisation scale
//                                                (int8: its own; fp8: 1, the head's is apart)
//   int64_t row_width(const T*, int64_t D)       elements of T in one pool row
//   bool vector_head_dim(const T*, int64_t D)    whether the vector path takes this head_dim
//   constexpr bool direct_keys(const T*)         whether a lone row's scores read K rows as
//                                                they are (load8) rather than widened into a
//                                                float buffer first (widen_rows)
//   constexpr bool direct_values(const T*)       the same for its weighted V (pv_row)
//   __m256 load8(const T*, const float* lut)     (AVX2) 8 elements as floats, where the
//                                                generic widen_rows or direct loads use it
//   widen_rows(const T* const*, ...),            (AVX2, optional) overloads for rows that are
//   pv_row(const T* const*, ...)                 not 8-element loads (int4's groups)
// and afterwards defines run_generic<T> (the portable path) for each T it instantiates.
#pragma once

#include "torch_lite.h"

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
  const T* k_base;       // K pool + h * W  (rows are KVH * W apart; W = row_width(T, D))
  const T* v_base;
  const int32_t* table;  // this sequence's block table
  int64_t start, len;    // keys [start, len)
  int64_t G, D, BS, row_stride;
  float scale;
  const float* lut;      // fp8 pools: the 256 byte values as floats (else unused)
  float k_head, v_head;  // fp8 pools: this KV head's scales (else 1)
  float softcap;         // > 0: scores soft-capped, cap * tanh(s / cap) (Gemma 2)
};

template <typename T>
inline const T* row_ptr(const T* base, const Task<T>& t, int64_t pos) {
  return base + (static_cast<int64_t>(t.table[pos / t.BS]) * t.BS + pos % t.BS) * t.row_stride;
}


// The portable path over one (row, KV head): any head_dim, any ISA. Defined by each source
// for its element types.
template <typename T>
void run_generic(const Task<T>& t);

#ifdef KVSERVE_AVX2
using kvserve::kAhead;
using kvserve::kLine;

// 8 consecutive floats (float32 pools, and rows widened into a buffer).
inline __m256 load8(const float* p, const float*) { return _mm256_loadu_ps(p); }

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
  float softcap;  // > 0: scores soft-capped (Task's)
};

// Register tiles: with AVX-512VL's 32 vector registers, 4 heads x 4 keys of scores and 4 heads
// x 32 columns of weighted V at once; with AVX2's 16, 2 heads x 4 keys and 4 heads x 16 columns.
#ifdef __AVX512VL__
constexpr int kQKHeads = 4;
constexpr int kPVCols = 4;  // in vectors of 8
#else
constexpr int kQKHeads = 2;
constexpr int kPVCols = 2;
#endif  // KVSERVE_AVX2

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

// One row's scores against 8 keys already widened to floats (rows[0, 8)) for all G heads, a
// head at a time: 8 FMA chains and one kvserve::hsum8 per head, the arithmetic of qk_tile and
// hsum4 per score, bit for bit. For a lone row over widened keys (int4 rows): there no tile of
// heads shares a key load, and 8 independent chains per head keep the FMA units busy where
// qk_block's 4-key tiles of narrow heads did not. Out of line: inlined, it slowed the prompt
// rows' loop around it (docs/decisions.md#paged-decode-key-loads).
[[maybe_unused]] __attribute__((noinline)) void qk_block8(const float* q, int64_t G, int64_t D,
                                                         const float* const* rows, const float* rs,
                                                         float* sc, int64_t stride) {
  const __m256 r8 = _mm256_loadu_ps(rs);
  for (int64_t g = 0; g < G; g++) {
    const float* qg = q + g * D;
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 qv = _mm256_loadu_ps(qg + c);
      for (int j = 0; j < 8; j++)
        acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[j] + c), acc[j]);
    }
    _mm256_storeu_ps(sc + g * stride, _mm256_mul_ps(kvserve::hsum8(acc), r8));
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

// Prefetch every cache line of rows[i], i in [from, to), rows of `width` elements, into L2: the
// pool's blocks lie scattered, so the hardware cannot run ahead of them (L2, not L1). Byte rows
// (int8's D + 2, int4's D / 2 + D / 16) need not start on a line: the lines from their first
// byte's to their last's, each once. Float rows keep the plain stride. Each choice was the
// faster one measured (docs/decisions.md#paged-decode-key-loads).
template <typename T>
inline void prefetch_rows(const T* const* rows, int64_t from, int64_t to, int64_t width) {
  if constexpr (sizeof(T) == 1) {
    for (int64_t i = from; i < to; i++) {
      const uintptr_t first = reinterpret_cast<uintptr_t>(rows[i]);
      for (uintptr_t a = first & ~uintptr_t(kLine - 1); a < first + width; a += kLine)
        _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T2);
    }
  } else {
    for (int64_t i = from; i < to; i++)
      for (int64_t c = 0; c < width; c += kLine / static_cast<int64_t>(sizeof(T)))
        _mm_prefetch(reinterpret_cast<const char*>(rows[i] + c), _MM_HINT_T2);
  }
}

template <typename T>
void run_avx2(const Group<T>& t) {
  // kWiden: rows that are not float32 become floats (in registers where the format loads
  // directly, or once per block of keys into a buffer, below). kScaled: 8-bit rows carry a
  // scale (int8: per row; fp8: per head), folded into scores and weights; 16-bit float rows
  // need none, int4 rows apply theirs as they widen.
  constexpr bool kWiden = !std::is_same<T, float>::value;
  constexpr bool kDirectK = direct_keys(static_cast<const T*>(nullptr));
  constexpr bool kDirectV = direct_values(static_cast<const T*>(nullptr));
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
  if constexpr (kScaled) {
    for (int64_t i = 0; i < n; i++) {
      kscale[i] = row_scale(krows[i], D) * t.k_head * t.scale;
      vscale_rows[i] = row_scale(vrows[i], D) * t.v_head;
    }
    std::fill(kscale.begin() + n, kscale.end(), 0.0f);  // padded lanes: ignored below
  }
  for (int64_t i = n; i < npad; i++) krows[i] = krows[n - 1];
  // Scores of row r, head g: key start[r] + j at sc[(r * G + g) * SR + 8 + j], j in [0, n_r),
  // room for n_r rounded up to 8 after it and 8 floats of slack before (blocks of 8 keys are
  // aligned at lo, not at the row's first key; lanes outside the row are overwritten below).
  const int64_t SR = npad + 16;
  std::vector<float> sc(R * G * SR), inv(R * G);
  // Scores, 8 keys at a time. One row (a decode) widens 16-bit rows as it loads them;
  // several rows (or 8-bit and 4-bit rows, whose widening costs more) widen each block of 8
  // keys once into kbuf (L1) for all rows and heads.
  const bool widen_k = kWiden && (R > 1 || !kDirectK);
  std::vector<float> kbuf(widen_k ? 8 * D : 0);
  alignas(32) float scale8[8];
  std::fill(scale8, scale8 + 8, t.scale);
  const int64_t width = row_width(t.k_base, D);
  prefetch_rows(krows.data(), 0, std::min(n, kAhead), width);
  prefetch_rows(vrows.data(), 0, std::min(n, kAhead), width);
  for (int64_t i0 = 0; i0 < npad; i0 += 8) {
    if (i0 + kAhead + 8 <= n) {  // V too: the weighted sum reads it next, in the same order
      prefetch_rows(krows.data(), i0 + kAhead, i0 + kAhead + 8, width);
      prefetch_rows(vrows.data(), i0 + kAhead, i0 + kAhead + 8, width);
    }
    const float* fr[8];
    if (widen_k) widen_rows(krows.data() + i0, 8, D, t.lut, kbuf.data(), fr);
    const float* rs = kScaled ? kscale.data() + i0 : scale8;
    for (int64_t r = 0; r < R; r++) {
      const int64_t off = lo + i0 - t.start[r];  // the block's first key, in row r's scores
      if (t.len[r] <= t.start[r] || off + 8 <= 0 || lo + i0 >= t.len[r]) continue;
      float* dst = sc.data() + r * G * SR + 8 + off;
      if constexpr (kDirectK) {
        if (!widen_k) {
          qk_block(t.q + r * t.row, G, D, krows.data() + i0, t.lut, rs, dst, SR);
          continue;
        }
      } else if (R == 1) {  // a lone row over keys widened for it alone
        qk_block8(t.q, G, D, fr, rs, dst, SR);
        continue;
      }
      qk_block(t.q + r * t.row, G, D, fr, t.lut, rs, dst, SR);
    }
  }
  // Softmax numerators in place; the 1/sum is applied to the output instead of every weight.
  for (int64_t r = 0; r < R; r++) {
    const int64_t nr = t.len[r] - t.start[r], nrpad = (nr + 7) / 8 * 8;
    if (nr <= 0) continue;
    for (int64_t g = 0; g < G; g++) {
      float* sg = sc.data() + (r * G + g) * SR + 8;
      if (t.softcap > 0.0f) kvserve::softcap_scores(sg, nr, t.softcap);
      inv[r * G + g] = kvserve::softmax_numerators(sg, nr, nrpad);
      if (kScaled)  // a V row's scale rides on its weight (after the sum, which it must not touch)
        for (int64_t i = 0; i < nr; i++) sg[i] *= vscale_rows[t.start[r] - lo + i];
    }
  }
  // Weighted V, kChunk keys at a time, accumulated in `out`; rows widened once per chunk
  // into vbuf when several rows (or 8-bit or 4-bit rows) use them.
  const bool widen_v = kWiden && (R > 1 || !kDirectV);
  std::vector<float> vbuf(widen_v ? kChunk * D : 0);
  const float* vr[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
    prefetch_rows(vrows.data(), std::min(n, i0 + kAhead), std::min(n, i0 + kAhead + m), width);
    if (widen_v) widen_rows(vrows.data() + i0, m, D, t.lut, vbuf.data(), vr);
    for (int64_t r = 0; r < R; r++) {
      const int64_t a = std::max(lo + i0, t.start[r]), b = std::min(lo + i0 + m, t.len[r]);
      if (a >= b) continue;
      const float* w = sc.data() + r * G * SR + 8 + (a - t.start[r]);
      const int64_t j0 = a - lo - i0;
      if constexpr (kDirectV) {
        if (!widen_v) {
          pv_row(vrows.data() + i0 + j0, b - a, t.lut, w, SR, t.out + r * t.row, G, D,
                 a == t.start[r]);
          continue;
        }
      }
      pv_row(vr + j0, b - a, t.lut, w, SR, t.out + r * t.row, G, D, a == t.start[r]);
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

// The whole kernel over a pool of T (checked by the caller: dtypes, K and V alike): rows
// grouped, one task per (group, KV head) over OpenMP, each on the vector path where it
// applies (vector_head_dim), else the format's portable loop. lut, k_heads, v_heads: fp8's.
template <typename T>
at::Tensor paged_decode_impl(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                int64_t window, double softcap, const float* lut = nullptr,
                                const float* k_heads = nullptr, const float* v_heads = nullptr) {
  TORCH_CHECK(softcap >= 0.0, "paged_decode_cpu: a soft-cap > 0 (0: off); got ", softcap);
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
  const T* kp = static_cast<const T*>(k_cache.data_ptr());
  const T* vp = static_cast<const T*>(v_cache.data_ptr());
  TORCH_CHECK(W == row_width(kp, D), "paged_decode_cpu: pool rows of ", W,
              " elements for head_dim ", D);
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const int32_t* btp = block_tables.data_ptr<int32_t>();
  const int32_t* slp = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  std::vector<int64_t> starts(B), lens(B);
  for (int64_t b = 0; b < B; b++) {
    lens[b] = slp[b];
    starts[b] = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
  }
#ifdef KVSERVE_AVX2
  const bool vector_path = vector_head_dim(kp, D);
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
                 k_heads ? k_heads[h] : 1.0f, v_heads ? v_heads[h] : 1.0f,
                 static_cast<float>(softcap)};
      run_avx2(t);
      continue;
    }
#endif
    const int64_t b = gi;
    Task<T> t{qp + (b * H + h * G) * D, op + (b * H + h * G) * D, kp + h * W, vp + h * W,
              btp + b * MB, starts[b], lens[b], G, D, BS, KVH * W, static_cast<float>(scale),
              lut, k_heads ? k_heads[h] : 1.0f, v_heads ? v_heads[h] : 1.0f,
              static_cast<float>(softcap)};
    if (lens[b] <= starts[b]) {
      std::fill(t.out, t.out + G * D, 0.0f);
      continue;
    }
    run_generic(t);
  }
  return out;
}

}  // namespace
