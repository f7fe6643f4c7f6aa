// y[M, N] = x[M, K] @ W^T for 4-bit packed weights (the q4 format of quant_gemm_cpu.cpp) at
// batch and prefill sizes: the decode kernel's integer math (each activation row rounded to int8 per group
// of 32; per group d*dx*sum(q*qx) + m*sx), laid out for throughput instead of for one row.
//
// The decode kernel (quant_gemm_q4) puts one weight row's group in a register and needs, per row
// and group, a maddubs, a widening, a float conversion and a scalar-scale FMA: ~5 vector ops
// per 32 multiply-adds. Here, per call, each block of 8 output columns is repacked (into a
// per-thread buffer, 4 bytes per 4 weights: nibbles widened to bytes) so that one 256-bit register
// holds 4 consecutive k of 8 columns; one broadcast of 4 activation bytes and one
// _mm256_maddubs_epi16 then give 8 columns x 4 k of products as 16-bit pair sums. A group's 8
// such steps add up in 16 bits (|sum| <= 16 * 15 * 127 = 30480: no overflow), and only then one
// _mm256_madd_epi16 widens to the 8 columns' int32 group sums, one conversion and two FMAs (the
// scale d*dx and the min m*sx, 8 columns at once) add the group in float: ~2 ops per 32
// multiply-adds. Tiles of 3 rows x 16 columns share each weight and activation load (vnni: 3
// rows x 32 columns on quant_q4_tile.h's VNNI tiles, the same sums and floats).
//
// Per output element, the same integer sums as quant_gemm_q4 (exactly), added in float in
// group order (the decode kernel's order differs): equal up to float summation order. The
// repack (an 8x8 transpose of 32-bit quads per group in registers) costs about one pass over
// the weight per call: against the decode kernel it loses at one row and wins from 2-3 rows
// (docs/decisions.md#quantised-linears). AVX2; without it the same math runs in scalar code.
// Whether it serves prefill (against dequantised panels) and decode batches of 3+ rows (against
// the decode kernel) is measured at start-up (engine/models/quant_probe.py). The tile math after
// the repack is quant_q4_tile.h's, shared with quant_gemm_q4_blocked.cpp (weights stored in
// that form for good).
#include "torch_lite.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "quant_common.h"
#include "quant_q4_tile.h"
#include "vec_math.h"

using kvserve_q4_tile::rows_against;
using kvserve_quant::kGroup;

namespace {

using kvserve_q4_tile::kCols;  // output columns per block (one 256-bit register of int32)
constexpr int kRows = 3;    // activation rows per tile
// Blocks per tile: 2 on AVX2, 4 on the VNNI tiles (quant_q4_tile.h; measured fastest each).
template <bool kVnni>
constexpr int kBlocks = kVnni ? 4 : 2;

// Block of columns n0 .. n0+cols-1 (cols <= 8; missing ones zero): wb [G][8 quads][8 cols][4]
// bytes (q in 0..15; quad j of a group is its elements 4j..4j+3), db/mb [G][8] scales and mins.
void repack_block(const uint8_t* qs, const float* d, const float* m, int64_t n0, int cols,
                  int64_t K, uint8_t* wb, float* db, float* mb) {
  const int64_t G = K / kGroup;
  if (cols < kCols) {
    std::memset(wb, 0, G * 256);
    std::fill(db, db + G * kCols, 0.f);
    std::fill(mb, mb + G * kCols, 0.f);
  }
#ifdef KVSERVE_AVX2
  if (cols == kCols) {  // a whole block: the 8 columns' quads transposed in registers
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < G; g++) {
      __m256i r[kCols];  // column c: its 8 quads (4 low-nibble ones, then 4 high-nibble ones)
      for (int c = 0; c < kCols; c++) {
        const __m128i raw = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(qs + (n0 + c) * (K / 2) + g * 16));
        r[c] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4),
                                _mm_and_si128(raw, low4));
        db[g * kCols + c] = d[(n0 + c) * G + g];
        mb[g * kCols + c] = m[(n0 + c) * G + g];
      }
      // 8x8 transpose of 32-bit quads: out[j] = quad j of columns 0..7.
      __m256i t[kCols], u[kCols];
      for (int h = 0; h < 2; h++) {
        const int c = 4 * h;
        t[c] = _mm256_unpacklo_epi32(r[c], r[c + 1]);
        t[c + 1] = _mm256_unpackhi_epi32(r[c], r[c + 1]);
        t[c + 2] = _mm256_unpacklo_epi32(r[c + 2], r[c + 3]);
        t[c + 3] = _mm256_unpackhi_epi32(r[c + 2], r[c + 3]);
        u[c] = _mm256_unpacklo_epi64(t[c], t[c + 2]);      // quads 0 | 4 of 4 columns
        u[c + 1] = _mm256_unpackhi_epi64(t[c], t[c + 2]);  // 1 | 5
        u[c + 2] = _mm256_unpacklo_epi64(t[c + 1], t[c + 3]);  // 2 | 6
        u[c + 3] = _mm256_unpackhi_epi64(t[c + 1], t[c + 3]);  // 3 | 7
      }
      auto* dst = reinterpret_cast<__m256i*>(wb + g * 256);
      for (int j = 0; j < 4; j++) {
        _mm256_storeu_si256(dst + j, _mm256_permute2x128_si256(u[j], u[j + 4], 0x20));
        _mm256_storeu_si256(dst + j + 4, _mm256_permute2x128_si256(u[j], u[j + 4], 0x31));
      }
    }
    return;
  }
#endif
  auto* wb32 = reinterpret_cast<uint32_t*>(wb);
  for (int c = 0; c < cols; c++) {
    const uint8_t* src = qs + (n0 + c) * (K / 2);
    for (int64_t g = 0; g < G; g++) {
      db[g * kCols + c] = d[(n0 + c) * G + g];
      mb[g * kCols + c] = m[(n0 + c) * G + g];
      // Elements 0..15 are the low nibbles of the group's 16 bytes, 16..31 the high ones.
      uint32_t quads[8];
#ifdef KVSERVE_AVX2
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + g * 16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(quads), _mm_and_si128(raw, _mm_set1_epi8(0x0F)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(quads + 4),
                       _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
#else
      uint8_t bytes[32];
      for (int j = 0; j < 16; j++) {
        bytes[j] = src[g * 16 + j] & 0x0F;
        bytes[j + 16] = src[g * 16 + j] >> 4;
      }
      std::memcpy(quads, bytes, 32);
#endif
      for (int j = 0; j < 8; j++) wb32[(g * 8 + j) * kCols + c] = quads[j];
    }
  }
}

// Threads split the column tiles (NB blocks each); each repacks its tile, then all rows run
// against it.
template <int NB, bool kVnni>
void gemm(const uint8_t* w, const float* dw, const float* mw, int64_t N, int64_t K,
          const kvserve_quant::QuantisedRows& rows, int64_t M, float* yp) {
  const int64_t G = K / kGroup;
  const int8_t* xq = rows.q;
  const float *dx = rows.d, *sx = rows.s;
  constexpr int64_t kTileCols = kCols * NB;
  const int64_t tiles = (N + kTileCols - 1) / kTileCols;
#pragma omp parallel
  {
    // Each thread's repacked blocks, kept for its next call (decode batches call ~100 times a
    // step); part: the last tile's outputs when N is not a multiple of the tile's columns.
    thread_local std::vector<uint8_t> wb;
    thread_local std::vector<float> db, mb, part;
    wb.resize(NB * G * 256);
    db.resize(NB * G * kCols);
    mb.resize(NB * G * kCols);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t n0 = t * kTileCols;
      const int64_t cols = std::min(kTileCols, N - n0);
      for (int b = 0; b < NB; b++) {
        const int bc = static_cast<int>(std::clamp<int64_t>(cols - b * kCols, 0, kCols));
        repack_block(w, dw, mw, n0 + b * kCols, bc, K, wb.data() + b * G * 256,
                     db.data() + b * G * kCols, mb.data() + b * G * kCols);
      }
      // The repacked blocks are the unpacked form of quant_q4_tile.h (its TileWeights).
      const kvserve_q4_tile::TileWeights tw{wb.data(), db.data(), mb.data()};
      if (cols == kTileCols) {
        rows_against<kRows, NB, true, kvserve_q4_tile::kF32, kVnni>(tw, G, xq, dx, sx, M, K,
                                                                    yp + n0, N);
      } else {
        part.resize(M * kTileCols);
        rows_against<kRows, NB, true, kvserve_q4_tile::kF32, kVnni>(tw, G, xq, dx, sx, M, K,
                                                                    part.data(), kTileCols);
        for (int64_t r = 0; r < M; r++) {
          std::memcpy(yp + r * N + n0, part.data() + r * kTileCols, cols * sizeof(float));
        }
      }
    }
  }
}

}  // namespace

at::Tensor quant_gemm_q4_tiled(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m,
                               bool vnni) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2, M = x.size(0);
  kvserve_quant::check_q4_args(x, qs, d, m);
  const auto rows = kvserve_quant::quantise(x);
  auto y = at::empty({M, N});
  kvserve_q4_tile::with_vnni(vnni, "quant_gemm_q4_tiled", [&](auto v) {
    constexpr bool V = decltype(v)::value;
    gemm<kBlocks<V>, V>(qs.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), N, K,
                        rows, M, y.data_ptr<float>());
  });
  return y;
}
