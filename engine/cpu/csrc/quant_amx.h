// The AMX (Advanced Matrix Extensions, int8 tiles) paths of quant_gemm_q8_interleaved
// (quant_gemm_q8_amx.cpp) and quant_gemm_q4_blocked (quant_gemm_q4_amx.cpp): built where the
// compiler targets AMX-TILE and AMX-INT8 with AVX-512 VNNI (-march=native on a Sapphire Rapids
// or later Xeon), used where the kernel's caller asks for it and the OS grants this process
// the tile state (Linux's arch_prctl(ARCH_REQ_XCOMP_PERM), once per process).
#pragma once

#include <cstdint>

#include "quant_vnni_common.h"

#if defined(KVSERVE_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVSERVE_AMX 1
#include <immintrin.h>
#endif

namespace kvserve_amx {

#ifdef KVSERVE_AMX
// The tiles both kernels use: 16 output columns (the C tile's int32 columns) by 16 activation
// rows (the A tile's rows), one scale group of S int8 k at a time.
constexpr int kOut = 16;
constexpr int kTileRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two sets of tiles, so that one scale group's multiply runs while the last one's sums are
// scaled: set 0 is C 0 (16 rows x 16 int32), A 1 (16 rows x S int8), B 2 (S/4 rows x 64
// bytes); set 1 is 3, 4, 5.
inline TileConfig config(int64_t S) {
  TileConfig c;
  for (int set = 0; set < 2; set++) {
    const int t0 = 3 * set;
    c.rows[t0] = kTileRows;
    c.colsb[t0] = kOut * 4;
    c.rows[t0 + 1] = kTileRows;
    c.colsb[t0 + 1] = static_cast<uint16_t>(S);
    c.rows[t0 + 2] = static_cast<uint8_t>(S / 4);
    c.colsb[t0 + 2] = kOut * 4;
  }
  return c;
}

// One scale group's 16 x 16 sums into set `set`'s C tile (GCC's tile intrinsics take literal
// tile numbers): b the weights' S/4 steps of 64 bytes (unsigned), a the 16 rows' S bytes
// (signed, stride lda): TDPBSUD.
inline void multiply(int set, const uint8_t* b, const int8_t* a, int64_t lda) {
  if (set) {
    _tile_loadd(5, b, kOut * 4);
    _tile_loadd(4, a, lda);
    _tile_zero(3);
    _tile_dpbsud(3, 4, 5);
  } else {
    _tile_loadd(2, b, kOut * 4);
    _tile_loadd(1, a, lda);
    _tile_zero(0);
    _tile_dpbsud(0, 1, 2);
  }
}

// Set `set`'s C tile into sums (16 rows x 16 int32, row-major).
inline void store(int set, int32_t* sums) {
  if (set) {
    _tile_stored(3, sums, kOut * 4);
  } else {
    _tile_stored(0, sums, kOut * 4);
  }
}
#endif

// An interleaved 8-bit weight (engine/quantization/interleaved.py) and the activations' int8
// rows and terms of quant_gemm_q8_interleaved (kvserve_quant::quantise, kvserve_vnni::row_terms
// with the +128 offset); y [M, N] is written.
struct Q8Problem {
  const uint8_t* w;
  const void* d;
  const void* m;  // nullptr: no mins
  bool half;      // scales (and mins) stored as float16
  int64_t M, K, N, S;
  const int8_t* qx;
  const float* dx;
  const int32_t* neg;
  const float* sx;
  float* y;
};

// Whether the AMX path is built and the OS lets this process use the tile registers.
bool ready();

// y = x @ W^T on AMX tiles; the floats of the VNNI path bit for bit. Requires ready().
void q8_interleaved(const Q8Problem& p);

// A blocked 4-bit weight (engine/quantization/blocked.py; quant_gemm_q4_blocked.cpp) and the
// activations' int8 rows (kvserve_quant::quantise); y [M, N] is written.
struct Q4Problem {
  const uint8_t* qs;
  const void* d;
  const void* m;  // unused for Q4_0's float16 scales (m = -8 d)
  int scales;     // kvserve_q4_tile::Scales
  int64_t G, M, K, N;
  const int8_t* qx;
  const float* dx;
  const float* sx;
  float* y;
};

// y = x @ W^T on AMX tiles; the floats of quant_gemm_q4_blocked's int8 tiles bit for bit.
// Requires ready().
void q4_blocked(const Q4Problem& p);

}  // namespace kvserve_amx
