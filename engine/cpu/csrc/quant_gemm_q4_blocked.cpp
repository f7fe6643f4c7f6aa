// y[M, N] = x[M, K] @ W^T for 4-bit weights kept in the BLOCKED layout, at every row count.
//
// Layout (engine/models/quant_blocked.py converts the rows layout of quant_gemm_cpu.cpp to it
// and back, losslessly):
//   qs uint8 [NB, G, 128], NB = ceil(N / 8): block b holds output columns 8b .. 8b+7 (the last
//     block's missing columns are zero), group g its k = 32g .. 32g+31. Byte 32j + 4c + i
//     (j, i in 0..3; c in 0..7) is byte 4j + i of column 8b+c's group g in the rows layout, so
//     its low nibble is q[32g + 4j + i] and its high nibble q[32g + 16 + 4j + i].
//   d, m float32 [NB, G, 8]: the scale and min of column 8b+c's group g; w = d * q + m.
//     Or float16 [NB, G, 8] both (exact copies of float16 scales: a GGUF's), or d float16
//     [NB, G, 8] and m float16 [NB, G, 0]: m = -8 d (Q4_0's offset), nothing stored; the
//     kernel widens either to the same float32 values (quant_q4_tile.h Scales).
//
// The math is quant_gemm_q4's (each activation row rounded to int8 per group of 32; per group
// d*dx*sum(q*qx) + m*sx; the same integer sums), laid out as quant_gemm_q4_tiled lays it out,
// but without its per-call repack: one 32-byte load gives 8 columns x 4 k of packed nibbles;
// one AND gives their low halves, a shift and an AND their high halves, and each meets one
// broadcast of 4 activation bytes in one _mm256_maddubs_epi16. A group's 8 such products add
// up in 16 bits (|sum| <= 16 * 15 * 127 = 30480: no overflow), then one widening, one
// conversion and two FMAs per 8 columns add the group in float (group order, as the tiled
// kernel: equal to quant_gemm_q4 up to float summation order). ~4 vector ops per 32
// multiply-adds at one row, where quant_gemm_q4 needs ~9: the one-row decode that the rows
// layout leaves bound by arithmetic becomes bound by memory.
//
// Tiles: one or two rows take 4 blocks (32 columns) at a time, more rows go 3 rows x 2 blocks
// (vnni: 3 rows x 4 blocks, on quant_q4_tile.h's VNNI tiles: the same sums and floats; one or
// two rows stay on AVX2); threads split the column tiles. AVX2; without it the same math runs
// in scalar code.
#include "torch_lite.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_amx.h"
#include "quant_common.h"
#include "quant_q4_tile.h"
#include "vec_math.h"

using kvserve_quant::kGroup;

namespace {

using kvserve_q4_tile::kBlockBytes;
using kvserve_q4_tile::kCols;
using kvserve_q4_tile::rows_against;
using kvserve_q4_tile::TileWeights;

using kvserve_q4_tile::kF16;
using kvserve_q4_tile::kF16Q40;
using kvserve_q4_tile::kF32;
using kvserve_q4_tile::with_scales;

struct Blocked {
  const uint8_t* qs;
  const void* d;
  const void* m;
  int64_t G;
  int scales;  // kvserve_q4_tile::Scales
};

// One column tile of nb (1 .. NB) blocks, all rows, into y (stride ldy).
template <int RT, int NB, bool kU, int SC, bool kV>
void column_tile(const TileWeights& w, int nb, int64_t G, const int8_t* x, const float* dx,
                 const float* sx, int64_t M, int64_t K, float* y, int64_t ldy) {
  if constexpr (NB > 1) {
    if (nb < NB) return column_tile<RT, NB - 1, kU, SC, kV>(w, nb, G, x, dx, sx, M, K, y, ldy);
  }
  rows_against<RT, NB, kU, SC, kV>(w, G, x, dx, sx, M, K, y, ldy);
}

// Scales' element size in bytes (their offsets advance in elements).
inline int64_t scale_bytes(int sc) { return sc == kF32 ? 4 : 2; }

// nb blocks of packed nibbles -> the unpacked bytes of TileWeights (the same 8 steps a packed
// tile derives per row tile, derived once).
void unpack(const uint8_t* qs, int nb, int64_t G, uint8_t* out) {
  for (int64_t bg = 0; bg < nb * G; bg++) {
    const uint8_t* src = qs + bg * kBlockBytes;
    uint8_t* dst = out + bg * 2 * kBlockBytes;
#ifdef KVSERVE_AVX2
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * j), _mm256_and_si256(raw, low4));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * (j + 4)),
                          _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4));
    }
#else
    for (int i = 0; i < kBlockBytes; i++) {
      dst[i] = src[i] & 0x0F;
      dst[i + kBlockBytes] = src[i] >> 4;
    }
#endif
  }
}

// Blocks [from, to)'s weight bytes (TileWeights::ahead).
template <int SC>
kvserve_q4_tile::Ahead blocks_ahead(const Blocked& w, int64_t from, int64_t to) {
  if (to <= from) return {};
  const int64_t G = w.G, so = from * G * kCols * scale_bytes(SC);
  const int64_t scales = (to - from) * G * kCols * scale_bytes(SC);
  return {w.qs + from * G * kBlockBytes, (to - from) * G * kBlockBytes,
          static_cast<const uint8_t*>(w.d) + so, scales,
          SC == kF16Q40 ? nullptr : static_cast<const uint8_t*>(w.m) + so,
          SC == kF16Q40 ? 0 : scales};
}

// Threads split the column tiles (NB blocks each); with kUnpack each thread first unpacks its
// tile's nibbles into a buffer it keeps across calls (worth it from a few rows on). Each tile
// prefetches the tile kLead ahead of it (a thread's first tile: the kLead after it), which a
// static schedule makes the same thread's next ones (the lead per row count:
// docs/decisions.md#quantised-linears).
template <int RT, int NB, bool kUnpack, int SC, bool kV = false>
void gemm(const Blocked& w, int64_t N, const int8_t* x, const float* dx, const float* sx,
          int64_t M, int64_t K, float* y) {
  constexpr int64_t kLead = kUnpack ? 1 : 2;
  const int64_t sb = scale_bytes(SC);
  const int64_t G = w.G;
  const int64_t blocks = (N + kCols - 1) / kCols;
  const int64_t tiles = (blocks + NB - 1) / NB;
#pragma omp parallel
  {
    thread_local std::vector<uint8_t> buf;
    if (kUnpack) buf.resize(NB * G * 2 * kBlockBytes);
    bool first = true;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t b0 = t * NB;
      const int nb = static_cast<int>(std::min<int64_t>(NB, blocks - b0));
      const int64_t n0 = b0 * kCols, cols = std::min<int64_t>(nb * kCols, N - n0);
      const int64_t so = b0 * G * kCols * sb;  // the tile's first scale, in bytes
      TileWeights tw{w.qs + b0 * G * kBlockBytes, static_cast<const uint8_t*>(w.d) + so,
                     SC == kF16Q40 ? nullptr : static_cast<const uint8_t*>(w.m) + so};
      tw.ahead = blocks_ahead<SC>(w, b0 + (first ? 1 : kLead) * NB,
                                  std::min(blocks, b0 + (kLead + 1) * NB));
      first = false;
      if (kUnpack) {
        unpack(tw.q, nb, G, buf.data());
        tw.q = buf.data();
      }
      if (cols == nb * kCols) {
        column_tile<RT, NB, kUnpack, SC, kV>(tw, nb, G, x, dx, sx, M, K, y + n0, N);
        continue;
      }
      // The last, padded block: its columns beyond N go to a scratch row, one row at a time.
      float part[NB * kCols];
      for (int64_t r = 0; r < M; r++) {
        column_tile<1, NB, kUnpack, SC, kV>(tw, nb, G, x + r * K, dx + r * G, sx + r * G, 1, K,
                                            part, 0);
        std::memcpy(y + r * N + n0, part, cols * sizeof(float));
      }
    }
  }
}

Blocked check_blocked(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                      const at::Tensor& m, int64_t N) {
  TORCH_CHECK(qs.dtype() == at::kByte && qs.dim() == 3 && qs.size(2) == kBlockBytes &&
                  qs.is_contiguous(),
              "quant_gemm_q4_blocked: qs must be contiguous uint8 [NB, G, 128]");
  const int64_t NB = qs.size(0), G = qs.size(1);
  TORCH_CHECK(N > (NB - 1) * kCols && N <= NB * kCols,
              "quant_gemm_q4_blocked: ", NB, " blocks cannot hold ", N, " columns");
  const bool q40 = d.dtype() == at::kHalf && m.dtype() == at::kHalf && m.dim() == 3 &&
                   m.size(0) == NB && m.size(1) == G && m.size(2) == 0;
  TORCH_CHECK((d.dtype() == at::kFloat || d.dtype() == at::kHalf) &&
                  (q40 || m.dtype() == d.dtype()),
              "quant_gemm_q4_blocked: d and m float32, or float16 (m [NB, G, 0]: m = -8 d)");
  for (const auto* t : {&d, &m}) {
    if (q40 && t == &m) continue;
    TORCH_CHECK(t->is_contiguous() && t->dim() == 3 && t->size(0) == NB && t->size(1) == G &&
                    t->size(2) == kCols,
                "quant_gemm_q4_blocked: d and m must be contiguous [NB, G, 8]");
  }
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == G * kGroup,
              "quant_gemm_q4_blocked: x must be float32 [M, ", G * kGroup, "]");
  const int sc = q40 ? kF16Q40 : d.dtype() == at::kHalf ? kF16 : kF32;
  return {qs.data_ptr<uint8_t>(), d.data_ptr(), q40 ? nullptr : m.data_ptr(), G, sc};
}

// Rows ``rows`` of a blocked weight as float32 (bf16: bfloat16): each column's group gathered
// back to its rows-layout bytes (4 quads, 32 bytes apart) and dequantised as quant_dequant_q4
// does, so both layouts give the same values.
template <typename T, int SC>
void dequant_rows(const Blocked& w, const int64_t* ids, int64_t R, T* out) {
  const int64_t G = w.G, K = G * kGroup;
#pragma omp parallel for schedule(static) if (R * K > 65536)
  for (int64_t r = 0; r < R; r++) {
    const int64_t b = ids[r] / kCols, c = ids[r] % kCols;
    for (int64_t g = 0; g < G; g++) {
      const uint8_t* blk = w.qs + (b * G + g) * kBlockBytes;
      uint8_t bytes[16];
      for (int j = 0; j < 4; j++) std::memcpy(bytes + 4 * j, blk + 32 * j + 4 * c, 4);
      const int64_t s = (b * G + g) * kCols + c;
      kvserve_quant::dequant_q4_group(bytes, kvserve_q4_tile::scale_at<SC>(w.d, s),
                                      kvserve_q4_tile::min_at<SC>(w.d, w.m, s),
                                      out + r * K + g * kGroup);
    }
  }
}

}  // namespace

at::Tensor quant_gemm_q4_blocked(at::Tensor x, at::Tensor qs, at::Tensor d,
                                    at::Tensor m, int64_t N, bool vnni, bool amx) {
  const Blocked w = check_blocked(x, qs, d, m, N);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(!amx || kvserve_amx::ready(),
              "quant_gemm_q4_blocked: AMX tiles are not available on this CPU");
  const auto rows = kvserve_quant::quantise(x);
  auto y = at::empty({M, N});
  float* yp = y.data_ptr<float>();
  if (amx) {  // quant_gemm_q4_amx.cpp: the same floats
    kvserve_amx::q4_blocked({w.qs, w.d, w.m, w.scales, w.G, M, K, N, rows.q, rows.d, rows.s, yp});
    return y;
  }
  with_scales(w.scales, [&](auto sc) {
    constexpr int SC = decltype(sc)::value;
    kvserve_q4_tile::with_vnni(vnni, "quant_gemm_q4_blocked", [&](auto v) {
      constexpr bool V = decltype(v)::value;
      // One or two rows stay on AVX2 (the same floats): there a step is bound by memory, and
      // the VNNI tiles measured no faster (docs/decisions.md).
      if (M == 1) {
        gemm<1, 4, false, SC, false>(w, N, rows.q, rows.d, rows.s, M, K, yp);
      } else if (M == 2) {
        gemm<2, 2, false, SC, false>(w, N, rows.q, rows.d, rows.s, M, K, yp);
      } else {  // VNNI leaves registers for 3 rows x 4 blocks (AVX2: 3 x 2, the faster there)
        gemm<3, V ? 4 : 2, true, SC, V>(w, N, rows.q, rows.d, rows.s, M, K, yp);
      }
    });
  });
  return y;
}


at::Tensor quant_dequant_q4_blocked(at::Tensor qs, at::Tensor d, at::Tensor m,
                                       at::Tensor rows, bool bf16) {
  const int64_t NB = qs.size(0);
  const Blocked w = check_blocked(at::empty({0, qs.size(1) * kGroup}), qs, d, m, NB * kCols);
  const auto ids = rows.to(at::kLong).contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t R = ids.numel();
  for (int64_t r = 0; r < R; r++) {
    TORCH_CHECK(ip[r] >= 0 && ip[r] < NB * kCols, "quant_dequant_q4_blocked: row ", ip[r],
                " outside the weight");
  }
  auto out = at::empty({R, w.G * kGroup}, bf16 ? at::kBFloat16 : at::kFloat);
  with_scales(w.scales, [&](auto sc) {
    constexpr int SC = decltype(sc)::value;
    if (bf16) {
      dequant_rows<c10::BFloat16, SC>(w, ip, R, out.data_ptr<c10::BFloat16>());
    } else {
      dequant_rows<float, SC>(w, ip, R, out.data_ptr<float>());
    }
  });
  return out;
}
