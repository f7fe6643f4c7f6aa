// The int8 tile math of the 4-bit kernels over 8-column blocks, shared by
// quant_gemm_q4_blocked.cpp (weights stored blocked) and quant_gemm_q4_tiled.cpp (weights
// repacked per call into the unpacked form below): per group of 32 k and block of 8 output
// columns, 8 steps of one 32-byte weight register (8 columns x 4 k) against one broadcast of 4
// activation bytes in one _mm256_maddubs_epi16, summed in 16 bits (|sum| <= 16 * 15 * 127 =
// 30480: no overflow), then one widening, one conversion and two FMAs (d*dx and m*sx, 8
// columns at once) add the group in float, in group order. Scalar code without AVX2. Where
// AVX-512 VNNI is built, the kVnni tiles replace each maddubs and 16-bit add by one
// _mm256_dpbusd_epi32 into the int32 group sums (no widening): the same sums, the same floats
// bit for bit, faster from 3 rows on (docs/decisions.md#q4-vnni-tiles); which serves is
// measured at start-up (engine/quantization/probe.py, setting q4_tiles).
//
// Scales come in three formats (Scales): float32 d and m; float16 d and m (a GGUF's own
// Q4_1 scales, exact in float16); float16 d with m = -8 d (Q4_0: no m stored). Each is widened
// to the same float32 values in registers, so the sums do not depend on the format; the
// smaller ones only read fewer bytes (a one-row decode is bound by memory).
#pragma once

#include "torch_lite.h"

#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "prefetch_ahead.h"
#include "quant_common.h"
#include "quant_vnni_common.h"
#include "vec_math.h"

namespace kvserve_q4_tile {

using kvserve_quant::kGroup;

constexpr int kCols = 8;         // output columns per block
constexpr int64_t kBlockBytes = 128;  // packed bytes per block and group

// How d and m are stored (see the header comment).
enum Scales : int { kF32 = 0, kF16 = 1, kF16Q40 = 2 };

// Ahead and prefetch_share: prefetch_ahead.h (a tile's weights are too short a stream for
// the hardware prefetchers: docs/decisions.md#quantised-linears).
using kvserve_prefetch::Ahead;
using kvserve_prefetch::prefetch_share;

// The weights a tile reads: packed nibbles (qs of block b0 on, 128 bytes per block and group)
// or, for tiles of several rows, the same blocks unpacked once per call into bytes (256 per
// block and group: step s's 32 bytes at 32 s, steps 0-3 the low nibbles, 4-7 the high ones).
// d, m: float or c10::Half per the tile's Scales (m unused for kF16Q40). ahead: what the tile
// prefetches for later ones (rows_against: its first row tile only).
struct TileWeights {
  const uint8_t* q;
  const void* d;
  const void* m;
  Ahead ahead = {};
};


// f(std::integral_constant<int, SC>) for a weight's runtime scale format (Scales).
template <typename F>
void with_scales(int sc, F&& f) {
  if (sc == kF16Q40) {
    f(std::integral_constant<int, kF16Q40>{});
  } else if (sc == kF16) {
    f(std::integral_constant<int, kF16>{});
  } else {
    f(std::integral_constant<int, kF32>{});
  }
}

// Scale i of a Scales-format array, as float32 (exact).
template <int SC>
inline float scale_at(const void* p, int64_t i) {
  if constexpr (SC == kF32) {
    return static_cast<const float*>(p)[i];
  } else {
    return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
  }
}

// A column's min: stored, or -8 d for kF16Q40.
template <int SC>
inline float min_at(const void* d, const void* m, int64_t i) {
  if constexpr (SC == kF16Q40) {
    return -8.0f * scale_at<SC>(d, i);
  } else {
    return scale_at<SC>(m, i);
  }
}

#ifdef KVSERVE_AVX2
template <int SC>
inline __m256 load_scales(const void* p, int64_t i) {
  if constexpr (SC == kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  }
}

template <int SC>
inline __m256 load_mins(const void* d, const void* m, int64_t i) {
  if constexpr (SC == kF16Q40) {
    return _mm256_mul_ps(load_scales<SC>(d, i), _mm256_set1_ps(-8.0f));
  } else {
    return load_scales<SC>(m, i);
  }
}
#endif

// Whether the tiles can run on VNNI (kVnni below): built where KVSERVE_VNNI is.
constexpr bool kVnniBuilt =
#ifdef KVSERVE_VNNI
    true;
#else
    false;
#endif

// f(std::bool_constant<V>) for a kernel's runtime choice of the VNNI tiles (an error where
// they are not built: who names the kernel).
template <typename F>
void with_vnni(bool vnni, const char* who, F&& f) {
  TORCH_CHECK(!vnni || kVnniBuilt, who, ": the VNNI tiles are not built for this CPU");
  if constexpr (kVnniBuilt) {
    if (vnni) return f(std::true_type{});
  }
  f(std::false_type{});
}

// R rows x NB blocks (kUnpacked: w.q holds unpacked bytes); y: R rows of NB*8 outputs,
// stride ldy. kVnni (only where kVnniBuilt): each step's 8 columns x 4 k go through one
// _mm256_dpbusd_epi32 into int32 group sums instead of a maddubs and a 16-bit add (and the
// group's widening): the same integer sums, so the same floats, bit for bit.
template <int R, int NB, bool kUnpacked, int SC = kF32, bool kVnni = false>
void tile(const TileWeights& w, int64_t G, const int8_t* x, const float* dx, const float* sx,
          int64_t K, float* y, int64_t ldy) {
  static_assert(!kVnni || kVnniBuilt, "the VNNI tiles are not built");
  const uint8_t* qs = w.q;
  constexpr int64_t bytes = kUnpacked ? 2 * kBlockBytes : kBlockBytes;
#ifdef KVSERVE_AVX2
  __m256 acc[R][NB];
  for (int r = 0; r < R; r++)
    for (int b = 0; b < NB; b++) acc[r][b] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const Ahead& ahead = w.ahead;
  for (int64_t g = 0; g < G; g++) {
    prefetch_share(ahead.q, ahead.q_bytes, g, G);
    prefetch_share(ahead.d, ahead.d_bytes, g, G);
    prefetch_share(ahead.m, ahead.m_bytes, g, G);
    __m256i s[R][NB];
    for (int r = 0; r < R; r++)
      for (int b = 0; b < NB; b++) s[r][b] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int step = 0; step < 8; step++) {  // steps 0-3: low nibbles, 4-7: high nibbles
      const int j = step & 3;
      __m256i wq[NB];
      for (int b = 0; b < NB; b++) {
        if constexpr (kUnpacked) {
          wq[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (b * G + g) * bytes + 32 * step));
        } else {
          const __m256i raw = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(qs + (b * G + g) * bytes + 32 * j));
          wq[b] = _mm256_and_si256(step < 4 ? raw : _mm256_srli_epi16(raw, 4), low4);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        int32_t quad;  // activations k = 4j .. 4j+3 (low) or 16+4j .. 16+4j+3 (high)
        std::memcpy(&quad, x + r * K + g * kGroup + 4 * step, 4);
        const __m256i xb = _mm256_set1_epi32(quad);
        for (int b = 0; b < NB; b++) {
#ifdef KVSERVE_VNNI
          if constexpr (kVnni) {
            s[r][b] = _mm256_dpbusd_epi32(s[r][b], wq[b], xb);
            continue;
          }
#endif
          s[r][b] = _mm256_add_epi16(s[r][b], _mm256_maddubs_epi16(wq[b], xb));
        }
      }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < NB; b++) {
      const __m256 dv = load_scales<SC>(w.d, (b * G + g) * kCols);
      const __m256 mv = load_mins<SC>(w.d, w.m, (b * G + g) * kCols);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        const __m256 p = _mm256_cvtepi32_ps(kVnni ? s[r][b] : _mm256_madd_epi16(s[r][b], ones));
        acc[r][b] = _mm256_fmadd_ps(p, _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * G + g])), acc[r][b]);
        acc[r][b] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sx[r * G + g]), acc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(y + r * ldy + b * kCols, acc[r][b]);
#else
  for (int r = 0; r < R; r++) {
    for (int b = 0; b < NB; b++) {
      for (int c = 0; c < kCols; c++) {
        float acc = 0.f;
        for (int64_t g = 0; g < G; g++) {
          const uint8_t* blk = qs + (b * G + g) * bytes;
          const int8_t* xg = x + r * K + g * kGroup;
          int32_t sum = 0;
          for (int j = 0; j < 4; j++) {
            for (int i = 0; i < 4; i++) {
              const int lo = kUnpacked ? blk[32 * j + 4 * c + i] : blk[32 * j + 4 * c + i] & 0x0F;
              const int hi = kUnpacked ? blk[32 * (j + 4) + 4 * c + i] : blk[32 * j + 4 * c + i] >> 4;
              sum += lo * xg[4 * j + i] + hi * xg[16 + 4 * j + i];
            }
          }
          const int64_t k = (b * G + g) * kCols + c;
          acc = std::fma(static_cast<float>(sum), scale_at<SC>(w.d, k) * dx[r * G + g], acc);
          acc = std::fma(min_at<SC>(w.d, w.m, k), sx[r * G + g], acc);
        }
        y[r * ldy + b * kCols + c] = acc;
      }
    }
  }
#endif
}

// All M rows against one tile's NB blocks: rows in tiles of RT, the rest one at a time; the
// first row tile prefetches w.ahead.
template <int RT, int NB, bool kU, int SC = kF32, bool kVnni = false>
void rows_against(const TileWeights& w, int64_t G, const int8_t* x, const float* dx,
                  const float* sx, int64_t M, int64_t K, float* y, int64_t ldy) {
  TileWeights t = w;
  int64_t r0 = 0;
  for (; r0 + RT <= M; r0 += RT) {
    tile<RT, NB, kU, SC, kVnni>(t, G, x + r0 * K, dx + r0 * G, sx + r0 * G, K, y + r0 * ldy, ldy);
    t.ahead = {};
  }
  for (; r0 < M; r0++) {
    tile<1, NB, kU, SC, kVnni>(t, G, x + r0 * K, dx + r0 * G, sx + r0 * G, K, y + r0 * ldy, ldy);
    t.ahead = {};
  }
}

}  // namespace kvserve_q4_tile
