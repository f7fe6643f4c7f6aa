// quant_gemm_q8_interleaved on AMX int8 tiles (quant_amx.h): where a decode batch's rows make
// the VNNI path compute-bound (a large head at 16 rows), one tile multiply does what 128
// vpdpbusd do. A scale group of 32 is a K of 32, half a tile multiply's 64, and each group's
// sums leave the tile to be scaled, so AMX wins only from some row count on and loses below it
// (figures: docs/decisions.md#quantised-linears); the caller sends batches from a row count
// the start-up probe measured (engine/quantization/probe.py, q8_tiles and q8_amx_from).
//
// The interleaved layout is AMX's B operand as stored: a tile of 16 outputs keeps 4 bytes of
// each output per 64-byte step, so a scale group's S weights (S/4 steps, contiguous) load as
// one B tile of S/4 rows x 64 bytes, and the activations' rows (int8, padded to 16 rows) as
// the A tile of 16 rows x S bytes. TDPBSUD (signed activations x unsigned weights + 128) gives
// the scale group's 16 x 16 exact int32 sums; the +128 is cancelled by the rows' neg terms, and
// the float epilogue is the VNNI path's, operation for operation and in the same order:
// acc = fma(d * dx, float(sum + neg), acc) from zero over the scale groups, the mins'
// fma(m, sx, accm) in a second accumulator added last. So the outputs are the VNNI path's bit
// for bit, each from its own row of x and of W whatever the other rows (batch-invariant).
//
// Threads split the tiles; each loads the tile configuration once (the registers are per
// thread) and releases the tile state when done. A thread runs a tile's row blocks of 16 in
// turn, each block's 16 accumulators in registers (the tile's weights, K x 16 bytes, are
// fetched from memory for the first block and from cache after it); within a block group
// h + 1's multiply is issued into the second set of tiles before group h's sums are stored
// and scaled; the tile two ahead is prefetched into L2 meanwhile (prefetch_ahead.h).
#include "torch_lite.h"  // first: the build's precompiled header (engine/cpu/pch.py)
#include "quant_amx.h"

#include "torch_lite.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "prefetch_ahead.h"
#include "quant_common.h"
#include "quant_vnni_common.h"

#ifdef KVSERVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvserve_amx {

#ifdef KVSERVE_AMX
namespace {

constexpr int64_t kLead = 2;  // tiles ahead prefetched into L2

// Linux: a process asks once for the AMX tile data state (arch/x86/include/uapi/asm/prctl.h).
constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

using kvserve_vnni::load16;

template <bool kS16, bool kHasM, typename Sc>
void run(const Q8Problem& p, const Sc* dw, const Sc* mw) {
  constexpr int64_t S = kS16 ? 16 : 32;
  const int64_t M = p.M, K = p.K, N = p.N, T = (N + kOut - 1) / kOut, SG = K / S,
                G = K / kvserve_quant::kGroup;
  const int64_t blocks = (M + kTileRows - 1) / kTileRows, Mp = blocks * kTileRows;
  // The A tiles read 16 rows: the rows padded with zeros to a multiple of 16 (not stored).
  const int8_t* qa = p.qx;
  thread_local std::vector<int8_t> padded;
  if (Mp != M) {
    padded.assign(Mp * K, 0);
    std::memcpy(padded.data(), p.qx, M * K);
    qa = padded.data();
  }
  const TileConfig cfg = config(S);
  const int64_t tile_bytes = K * kOut, sbytes = SG * kOut * static_cast<int64_t>(sizeof(Sc));
#pragma omp parallel
  {
    _tile_loadconfig(&cfg);
    alignas(64) int32_t sums[kTileRows * kOut];
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      const uint8_t* wt = p.w + t * tile_bytes;
      const Sc* dt = dw + t * SG * kOut;
      const Sc* mt = kHasM ? mw + t * SG * kOut : nullptr;
      const int64_t n0 = t * kOut, live_n = std::min<int64_t>(kOut, N - n0);
      const __mmask16 live = static_cast<__mmask16>((1u << live_n) - 1);
      // The tile kLead ahead into L2 meanwhile (spread over the first row block's groups).
      kvserve_prefetch::Ahead ahead;
      if (t + kLead < T) {
        const int64_t ta = t + kLead;
        ahead = {p.w + ta * tile_bytes, tile_bytes,
                 reinterpret_cast<const uint8_t*>(dw + ta * SG * kOut), sbytes,
                 kHasM ? reinterpret_cast<const uint8_t*>(mw + ta * SG * kOut) : nullptr,
                 kHasM ? sbytes : 0};
      }
      for (int64_t b = 0; b < blocks; b++) {
        const int64_t r0 = b * kTileRows, rows = std::min<int64_t>(kTileRows, M - r0);
        const int8_t* ab = qa + r0 * K;
        // The block's accumulators stay in registers: the row loops are unrolled in full,
        // each row under its `i < rows` test.
        __m512 acc[kTileRows], accm[kTileRows];
#pragma GCC unroll 16
        for (int i = 0; i < kTileRows; i++) acc[i] = accm[i] = _mm512_setzero_ps();
        multiply(0, wt, ab, K);
        for (int64_t h = 0; h < SG; h++) {
          if (b == 0) {
            kvserve_prefetch::prefetch_share(ahead.q, ahead.q_bytes, h, SG);
            kvserve_prefetch::prefetch_share(ahead.d, ahead.d_bytes, h, SG);
            kvserve_prefetch::prefetch_share(ahead.m, ahead.m_bytes, h, SG);
          }
          // group h + 1's multiply into the other set, then group h's sums
          if (h + 1 < SG) multiply(static_cast<int>((h + 1) & 1), wt + (h + 1) * S * kOut,
                                   ab + (h + 1) * S, K);
          store(static_cast<int>(h & 1), sums);
          const __m512 dv = load16(dt + h * kOut);
#pragma GCC unroll 16
          for (int i = 0; i < kTileRows; i++) {
            if (i < rows) {
              const int64_t r = r0 + i;
              const __m512i s = _mm512_add_epi32(_mm512_load_si512(sums + i * kOut),
                                                 _mm512_set1_epi32(p.neg[r * SG + h]));
              const __m512 sc =
                  _mm512_mul_ps(dv, _mm512_set1_ps(p.dx[r * G + (kS16 ? h / 2 : h)]));
              acc[i] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(s), acc[i]);
            }
          }
          if constexpr (kHasM) {
            const __m512 mv = load16(mt + h * kOut);
#pragma GCC unroll 16
            for (int i = 0; i < kTileRows; i++) {
              if (i < rows) {
                accm[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(p.sx[(r0 + i) * SG + h]), accm[i]);
              }
            }
          }
        }
#pragma GCC unroll 16
        for (int i = 0; i < kTileRows; i++) {
          if (i < rows) {
            _mm512_mask_storeu_ps(p.y + (r0 + i) * N + n0, live,
                                  kHasM ? _mm512_add_ps(acc[i], accm[i]) : acc[i]);
          }
        }
      }
    }
    _tile_release();
  }
}

}  // namespace

bool ready() {
  static const bool granted = [] {
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &features) != 0) return false;
    return (features & (1ul << kXfeatureXtiledata)) != 0;
  }();
  return granted;
}

void q8_interleaved(const Q8Problem& p) {
  TORCH_CHECK(ready(), "quant_gemm_q8_interleaved: AMX tiles are not available");
  kvserve_quant::dispatch_q8(p.S, p.m != nullptr, [&](auto s16, auto has_m) {
    constexpr bool kS = decltype(s16)::value, kM = decltype(has_m)::value;
    if (p.half) {
      run<kS, kM>(p, static_cast<const c10::Half*>(p.d), static_cast<const c10::Half*>(p.m));
    } else {
      run<kS, kM>(p, static_cast<const float*>(p.d), static_cast<const float*>(p.m));
    }
  });
}

#else

bool ready() { return false; }

void q8_interleaved(const Q8Problem&) {
  TORCH_CHECK(false, "quant_gemm_q8_interleaved: AMX tiles are not built for this CPU");
}

#endif

}  // namespace kvserve_amx
