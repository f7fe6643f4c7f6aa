// quant_gemm_q4_blocked on AMX int8 tiles (quant_amx.h): a prefill's rows (and a decode
// batch's, from a row count the start-up probe measured) against a blocked 4-bit weight, where
// the VNNI tiles are bound by arithmetic (a prefill chunk of 2,048 rows: every weight byte
// meets 2,048 activation rows).
//
// A tile is 16 output columns (two of the layout's 8-column blocks). Its weights are unpacked
// into AMX's B operand, one scale group at a time: 8 rows of 64 bytes, row j (k = 4j .. 4j+3
// of the group: the low nibbles of the blocked layout's quad j for j < 4, the high nibbles of
// quad j - 4 after) holding both blocks' 4 bytes of each column side by side, as the blocked
// layout already keeps them per block. The activations' int8 rows (padded with zeros to a
// multiple of 16) are packed group by group, a block of 16 rows' group contiguous (16 x 32
// bytes: one tile load reads 8 whole cache lines, faster than the rows' own stride), and
// are the A tile; TDPBSUD (signed activations x unsigned nibbles 0..15) gives the group's
// 16 x 16 exact int32 sums, the sums the VNNI tiles (quant_q4_tile.h) take. The float epilogue
// is theirs, operation for operation and in group order, 16 columns a register:
// acc = fma(float(sum), d * dx, acc), then acc = fma(m, sx, acc). So the outputs are
// quant_gemm_q4_blocked's floats bit for bit, each from its own row of x and of W whatever the
// other rows (batch-invariant).
//
// Up to 256 rows (a decode batch, a short prefill) each thread unpacks a tile into its own
// buffer just before running its rows (faster than unpacking the whole weight first:
// docs/decisions.md#quantised-linears). More rows go in slabs of 64 tiles (1,024 columns):
// threads first unpack
// the slab's tiles (a static split; the buffer, 1,024 x K bytes, bounds the memory a big head
// would take), then split (chunk of 256 rows, tile) pairs chunk by chunk: a chunk's
// activations (256 x K bytes) stay in L2 while a thread runs the slab's tiles over them, and
// the slab's unpacked weights are read once per chunk. Within a block of 16 rows, group
// g + 1's multiply is issued into the second set of tiles before group g's sums are stored and
// scaled; the block's 16 accumulators stay in registers.
#include "torch_lite.h"  // first: the build's precompiled header (engine/cpu/pch.py)
#include "quant_amx.h"

#include "torch_lite.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_common.h"
#include "quant_q4_tile.h"

namespace kvserve_amx {

#ifdef KVSERVE_AMX
namespace {

using kvserve_q4_tile::kBlockBytes;
using kvserve_q4_tile::kCols;

constexpr int64_t kS = 32;                    // k per scale group (one B tile: 8 rows)
constexpr int64_t kGroupTile = kS * kOut;     // one group's B tile: 512 bytes
constexpr int64_t kChunkBlocks = 16;          // row blocks of 16 per chunk (256 rows)
constexpr int64_t kSlabTiles = 64;            // tiles unpacked at a time (1,024 columns)

// n bytes of v from a 64-byte boundary (tile rows then start on a cache line).
template <typename T>
T* aligned64(std::vector<T>& v, int64_t n) {
  v.resize(n + 64);
  const auto at = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((at + 63) & ~static_cast<uintptr_t>(63));
}

// Tile t's (blocks 2t, 2t + 1) groups into B tiles at out (G x 512 bytes); a missing second
// block (an odd block count) gives zero weights.
void unpack_tile(const uint8_t* qs, int64_t b0, bool two, int64_t G, uint8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* s0 = qs + (b0 * G + g) * kBlockBytes;
    const uint8_t* s1 = qs + ((b0 + 1) * G + g) * kBlockBytes;
    uint8_t* o = out + g * kGroupTile;
    for (int j = 0; j < 4; j++) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s0 + 32 * j));
      const __m256i hi = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s1 + 32 * j))
                             : _mm256_setzero_si256();
      const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      _mm512_storeu_si512(o + 64 * j, _mm512_and_si512(z, low4));
      _mm512_storeu_si512(o + 64 * (j + 4), _mm512_and_si512(_mm512_srli_epi16(z, 4), low4));
    }
  }
}

// Block b0's 8 columns, then block b0 + 1's, in one register.
inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// The 16 columns' scales and mins of group g (first scale index i0 of block b0, i1 of b0 + 1),
// widened by quant_q4_tile.h's own loads.
template <int SC>
inline __m512 scales16(const void* d, int64_t i0, int64_t i1, bool two) {
  return join(kvserve_q4_tile::load_scales<SC>(d, i0),
              two ? kvserve_q4_tile::load_scales<SC>(d, i1) : _mm256_setzero_ps());
}

template <int SC>
inline __m512 mins16(const void* d, const void* m, int64_t i0, int64_t i1, bool two) {
  return join(kvserve_q4_tile::load_mins<SC>(d, m, i0),
              two ? kvserve_q4_tile::load_mins<SC>(d, m, i1) : _mm256_setzero_ps());
}

// One block of up to 16 rows (r0 ..) against tile t's unpacked weights wt.
template <int SC>
void block(const Q4Problem& p, const int8_t* qa, const uint8_t* wt, int64_t t, int64_t blocks,
           int64_t r0, int32_t* sums) {
  const int64_t G = p.G, K = p.K, N = p.N, b0 = 2 * t, n0 = t * kOut;
  const bool two = b0 + 1 < blocks;
  const int64_t rows = std::min<int64_t>(kTileRows, p.M - r0);
  const __mmask16 live =
      static_cast<__mmask16>((1u << std::min<int64_t>(kOut, N - n0)) - 1);
  const int8_t* ab = qa + r0 * K;  // the block's groups, 16 rows x 32 bytes each (packed)
  __m512 acc[kTileRows];
#pragma GCC unroll 16
  for (int i = 0; i < kTileRows; i++) acc[i] = _mm512_setzero_ps();
  multiply(0, wt, ab, kS);
  for (int64_t g = 0; g < G; g++) {
    if (g + 1 < G) {
      multiply(static_cast<int>((g + 1) & 1), wt + (g + 1) * kGroupTile,
               ab + (g + 1) * kTileRows * kS, kS);
    }
    store(static_cast<int>(g & 1), sums);
    const int64_t i0 = (b0 * G + g) * kCols, i1 = ((b0 + 1) * G + g) * kCols;
    const __m512 dv = scales16<SC>(p.d, i0, i1, two);
    const __m512 mv = mins16<SC>(p.d, p.m, i0, i1, two);
#pragma GCC unroll 16
    for (int i = 0; i < kTileRows; i++) {
      if (i < rows) {
        const int64_t r = r0 + i;
        const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(sums + i * kOut));
        acc[i] = _mm512_fmadd_ps(s, _mm512_mul_ps(dv, _mm512_set1_ps(p.dx[r * G + g])), acc[i]);
        acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(p.sx[r * G + g]), acc[i]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < kTileRows; i++) {
    if (i < rows) _mm512_mask_storeu_ps(p.y + (r0 + i) * N + n0, live, acc[i]);
  }
}

template <int SC>
void run(const Q4Problem& p) {
  const int64_t M = p.M, K = p.K, G = p.G;
  const int64_t blocks = (p.N + kCols - 1) / kCols, T = (blocks + 1) / 2;
  const int64_t rblocks = (M + kTileRows - 1) / kTileRows, Mp = rblocks * kTileRows;
  const int64_t chunks = (rblocks + kChunkBlocks - 1) / kChunkBlocks;
  // The A tiles: each block of 16 rows (the last padded with zeros) stored group by group,
  // a group's 16 rows x 32 bytes contiguous (one tile load reads 8 whole cache lines).
  thread_local std::vector<int8_t> packed;
  int8_t* qa = aligned64(packed, Mp * K);
  thread_local std::vector<uint8_t> unpacked;  // the calling thread's; shared by the team
  uint8_t* wb = chunks > 1 ? aligned64(unpacked, std::min(T, kSlabTiles) * G * kGroupTile)
                           : nullptr;
  const TileConfig cfg = config(kS);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t rb = 0; rb < rblocks; rb++) {
      for (int64_t i = 0; i < kTileRows; i++) {
        const int64_t r = rb * kTileRows + i;
        for (int64_t g = 0; g < G; g++) {
          int8_t* dst = qa + ((rb * G + g) * kTileRows + i) * kS;
          if (r < M) {
            std::memcpy(dst, p.qx + r * K + g * kS, kS);
          } else {
            std::memset(dst, 0, kS);
          }
        }
      }
    }
    _tile_loadconfig(&cfg);
    alignas(64) int32_t sums[kTileRows * kOut];
    if (chunks == 1) {  // a decode batch: each thread unpacks a tile just before its rows
      thread_local std::vector<uint8_t> own;
      uint8_t* mine = aligned64(own, G * kGroupTile);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; t++) {
        unpack_tile(p.qs, 2 * t, 2 * t + 1 < blocks, G, mine);
        for (int64_t rb = 0; rb < rblocks; rb++) {
          block<SC>(p, qa, mine, t, blocks, rb * kTileRows, sums);
        }
      }
    } else {  // slabs of tiles, chunks of rows
      for (int64_t slab = 0; slab < T; slab += kSlabTiles) {
        const int64_t ts = std::min(kSlabTiles, T - slab);
#pragma omp for schedule(static)
        for (int64_t t = slab; t < slab + ts; t++) {
          unpack_tile(p.qs, 2 * t, 2 * t + 1 < blocks, G, wb + (t - slab) * G * kGroupTile);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < chunks * ts; i++) {
          const int64_t c = i / ts, t = slab + i % ts;
          const int64_t last = std::min(rblocks, (c + 1) * kChunkBlocks);
          for (int64_t rb = c * kChunkBlocks; rb < last; rb++) {
            block<SC>(p, qa, wb + (t - slab) * G * kGroupTile, t, blocks, rb * kTileRows, sums);
          }
        }
      }
    }
    _tile_release();
  }
}

}  // namespace

void q4_blocked(const Q4Problem& p) {
  TORCH_CHECK(ready(), "quant_gemm_q4_blocked: AMX tiles are not available");
  kvserve_q4_tile::with_scales(p.scales, [&](auto sc) { run<decltype(sc)::value>(p); });
}

#else

void q4_blocked(const Q4Problem&) {
  TORCH_CHECK(false, "quant_gemm_q4_blocked: AMX tiles are not built for this CPU");
}

#endif

}  // namespace kvserve_amx
