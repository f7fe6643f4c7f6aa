// y[M, N] = x[M, K] @ W^T for 8-bit weights stored interleaved (engine/quantization/
// interleaved.py): the outputs in tiles of 16, each tile's weights 4 bytes of each of its 16
// outputs per 64-byte step (k = 4i .. 4i+3 of output o at byte 64i + 4o of the tile), plus 128
// (an XOR of the int8 value's sign bit: vpdpbusd multiplies unsigned by signed bytes), the
// scales (and mins) as [tile][scale group][16] float32, or float16 where every one of them is
// a float16 value (a GGUF Q8_0's: 34 bytes per 32 weights read instead of 36; widened here to
// the same float32 values). Outputs past N in the last tile have zero weights and scales and
// are not stored.
//
// The same integer math as the decode kernels (each activation row rounded to int8 per group
// of 32, dx = amax/127) and the same float order as quant_gemm_q8_batch, bit for bit: per output
// and scale group an exact int32 sum (started at -128 * sum(qx), which the weights' +128 adds
// back), then acc = fma(d * dx, float(sum), acc) in group order from zero, and the mins'
// m * sx in a second accumulator added last. Here a register holds 16 outputs of one row (the
// lanes kernel: 16 rows of one output), so a row is one vpdpbusd per 64 weight bytes with its
// 4 activation bytes broadcast, and a row alone costs what its weights take to stream: the
// one layout serves a single stream (as the decode kernel does) and batches (as the lanes do),
// and every output depends only on its row of x and its row of W, whatever the other rows
// (batch-invariant serving can use it at every row count). Rows go in blocks of up to 8
// sharing each weight load; threads split the tiles.
// With a block of rows or fewer (a decode step), each tile prefetches into L2 the weights and
// scales of the tile kLead ahead, spread over its scale groups (prefetch_ahead.h), same floats
// (docs/decisions.md#quantised-linears).
//
// AVX2 (no vpdpbusd; also where VNNI is built, with avx2=true): a register holds 8 outputs
// (half a tile: two registers per 64-byte step), the weights' sign bit flipped back, and each
// 32 bytes meet one row's 4 activation bytes in _mm256_maddubs_epi16(|w|, x with w's sign)
// (|w| <= 128 unsigned, |x| <= 127: a pair of products stays within int16, and a weight of
// -128 is exact), widened by _mm256_madd_epi16 and added as int32: the same exact sums from
// zero, then the same float operations in the same order, so the same floats bit for bit.
// Rows in blocks of up to 4, |w| shared by them.
#include "torch_lite.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "prefetch_ahead.h"
#include "quant_amx.h"
#include "quant_common.h"
#include "quant_vnni_common.h"
#include "vec_math.h"

using kvserve_quant::kGroup;

#ifdef KVSERVE_AVX2
namespace {

constexpr int kOut = 16;     // outputs per tile (the float lanes of an AVX-512 register)
constexpr int kHalf = 8;     // outputs per AVX2 register: half a tile
constexpr int kRows = 8;     // activation rows sharing each weight load (AVX-512 VNNI)
constexpr int64_t kLead = 2;  // tiles ahead that a few rows' tile prefetches (VNNI)
constexpr int kRowsAvx2 = 4; // the same on AVX2 (measured against 2 and 3, and against 4 rows
                             // of each half tile in turn)

// 8 floats of a tile's scales (or mins), float32 or float16 (widened exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// R rows against one tile on AVX2, its two halves in two registers (each 64-byte step one
// cache line): wt, dt, mt the tile's weights, scales and mins; q the rows' int8 activations;
// y the first row's first output, live of the tile's 16 stored. Out of line: inlined into the
// threads' loop it kept fewer of its values in registers (measured slower).
template <int R, bool kS16, bool kHasM, typename S>
__attribute__((noinline)) void tile_rows_avx2(const uint8_t* wt, const S* dt, const S* mt,
                                              const int8_t* q, const float* dx, const float* sx,
                                              int64_t K, float* y, int64_t ldy, int live) {
  constexpr int kSteps = kS16 ? 4 : 8;  // 64-byte steps per scale group
  constexpr int P = kOut / kHalf;        // registers per tile
  const int64_t G = K / kGroup, SG = K / (kS16 ? 16 : 32);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][P], accm[R][P];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
    for (int p = 0; p < P; p++) acc[r][p] = accm[r][p] = _mm256_setzero_ps();
  for (int64_t h = 0; h < SG; h++) {
    __m256i s[R][P];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
      for (int p = 0; p < P; p++) s[r][p] = _mm256_setzero_si256();
    const int64_t i0 = h * kSteps;
    // Not unrolled: unrolled, GCC adds a group's 8 steps as a tree and spills the products
    // (16 registers), measured slower.
#pragma GCC unroll 1
    for (int j = 0; j < kSteps; j++) {
      __m256i w[P], wabs[P];
      for (int p = 0; p < P; p++) {
        w[p] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                    wt + (i0 + j) * kOut * 4 + p * kHalf * 4)),
                                flip);
        wabs[p] = _mm256_abs_epi8(w[p]);  // -128 -> 0x80: 128 as the unsigned operand
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        int32_t quad;
        std::memcpy(&quad, q + r * K + 4 * (i0 + j), 4);
        const __m256i xb = _mm256_set1_epi32(quad);
        for (int p = 0; p < P; p++) {
          const __m256i prod = _mm256_maddubs_epi16(wabs[p], _mm256_sign_epi8(xb, w[p]));
          s[r][p] = _mm256_add_epi32(s[r][p], _mm256_madd_epi16(prod, ones));
        }
      }
    }
#pragma GCC unroll 2
    for (int p = 0; p < P; p++) {
      const __m256 dv = load8(dt + h * kOut + p * kHalf);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * G + (kS16 ? h / 2 : h)]));
        acc[r][p] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s[r][p]), acc[r][p]);
        if constexpr (kHasM) {
          accm[r][p] = _mm256_fmadd_ps(load8(mt + h * kOut + p * kHalf),
                                       _mm256_set1_ps(sx[r * SG + h]), accm[r][p]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; r++) {
    float out[P * kHalf];
    for (int p = 0; p < P; p++) {
      _mm256_storeu_ps(out + p * kHalf, kHasM ? _mm256_add_ps(acc[r][p], accm[r][p]) : acc[r][p]);
    }
    std::memcpy(y + r * ldy, out, live * sizeof(float));
  }
}

}  // namespace
#endif

#ifdef KVSERVE_VNNI
namespace {

using kvserve_vnni::load16;

// R rows (from q, K int8 each) against one tile; y: the first row's first output of the tile.
template <int R, bool kS16, bool kHasM, typename S>
void tile_rows(const uint8_t* wt, const S* dt, const S* mt, const int8_t* q,
               const float* dx, const int32_t* neg, const float* sx, int64_t K, float* y,
               int64_t ldy, __mmask16 live, const kvserve_prefetch::Ahead& ahead) {
  constexpr int kSteps = kS16 ? 4 : 8;  // 64-byte steps per scale group
  const int64_t G = K / kGroup, SG = K / (kS16 ? 16 : 32);
  __m512 acc[R], accm[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm512_setzero_ps();
  // Independent int32 chains per row (a few rows would otherwise wait on one vpdpbusd
  // after another), summed at the group's end: integer sums, so the same result.
  constexpr int kChains = R == 1 ? 4 : R == 2 ? 2 : 1;
  for (int64_t h = 0; h < SG; h++) {
    __m512i s[R][kChains];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      s[r][0] = _mm512_set1_epi32(neg[r * SG + h]);
      for (int c = 1; c < kChains; c++) s[r][c] = _mm512_setzero_si512();
    }
    const int64_t i0 = h * kSteps;
    kvserve_prefetch::prefetch_share(ahead.q, ahead.q_bytes, h, SG);
    kvserve_prefetch::prefetch_share(ahead.d, ahead.d_bytes, h, SG);
    kvserve_prefetch::prefetch_share(ahead.m, ahead.m_bytes, h, SG);
#pragma GCC unroll 8
    for (int j = 0; j < kSteps; j++) {
      const __m512i w = _mm512_loadu_si512(wt + (i0 + j) * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; r++) {
        int32_t quad;
        std::memcpy(&quad, q + r * K + 4 * (i0 + j), 4);
        __m512i& chain = s[r][j % kChains];
        chain = _mm512_dpbusd_epi32(chain, w, _mm512_set1_epi32(quad));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      for (int c = 1; c < kChains; c++) s[r][0] = _mm512_add_epi32(s[r][0], s[r][c]);
    }
    const __m512 dv = load16(dt + h * kOut);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * G + (kS16 ? h / 2 : h)]));
      acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s[r][0]), acc[r]);
      if constexpr (kHasM) {
        accm[r] = _mm512_fmadd_ps(load16(mt + h * kOut), _mm512_set1_ps(sx[r * SG + h]), accm[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) {
    _mm512_mask_storeu_ps(y + r * ldy, live, kHasM ? _mm512_add_ps(acc[r], accm[r]) : acc[r]);
  }
}

}  // namespace
#endif

at::Tensor quant_gemm_q8_interleaved(at::Tensor x, at::Tensor qs, at::Tensor d,
                                     c10::optional<at::Tensor> m, int64_t N, bool avx2,
                                     bool amx) {
#ifdef KVSERVE_AVX2
  const int64_t M = x.size(0), K = x.size(1), T = (N + kOut - 1) / kOut;
  const bool half = d.scalar_type() == at::kHalf;
  TORCH_CHECK(qs.dim() == 2 && d.dim() == 2 && qs.scalar_type() == at::kByte &&
                  qs.is_contiguous() && d.is_contiguous() &&
                  (half || d.scalar_type() == at::kFloat),
              "quant_gemm_q8_interleaved: malformed interleaved weight");
  TORCH_CHECK(qs.size(0) == T && d.size(0) == T && qs.size(1) == K * kOut && K % kGroup == 0,
              "quant_gemm_q8_interleaved: x has ", K, " columns; the weight has ",
              qs.size(1) / kOut, " in ", qs.size(0), " tiles (", T, " for ", N, " outputs)");
  const int64_t SG = d.size(1) / kOut, S = SG > 0 ? K / SG : 0;
  TORCH_CHECK(d.size(1) % kOut == 0 && (S == 16 || S == 32) && SG * S == K,
              "quant_gemm_q8_interleaved: one scale per 16 or 32 weights");
  const bool mins = m.has_value();
  if (mins) {
    TORCH_CHECK(m->is_contiguous() && m->scalar_type() == d.scalar_type() &&
                    m->sizes() == d.sizes(),
                "quant_gemm_q8_interleaved: a min per scale group, like its scale");
  }
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
#ifdef KVSERVE_VNNI
  const bool vnni = !avx2;
#else
  const bool vnni = false;
#endif
  TORCH_CHECK(!amx || (vnni && kvserve_amx::ready()),
              "quant_gemm_q8_interleaved: AMX tiles are not available on this CPU");
  const auto rows = kvserve_quant::quantise(x);
  thread_local kvserve_vnni::RowTerms terms;
  kvserve_vnni::row_terms(rows, M, K, S, mins, terms, /*offset=*/vnni);
  auto y = at::empty({M, N});
  const uint8_t* w = qs.data_ptr<uint8_t>();
  const int8_t* qx = rows.q;
  const float* dx = rows.d;
  const int32_t* neg = terms.neg.data();
  const float* sx = mins ? terms.sx.data() : nullptr;
  const int64_t G = K / kGroup;
  float* yp = y.data_ptr<float>();
  if (amx) {
    kvserve_amx::q8_interleaved({w, d.data_ptr(), mins ? m->data_ptr() : nullptr, half, M, K, N,
                                 S, qx, dx, neg, sx, yp});
    return y;
  }
  auto tiles = [&](auto s16, auto has_m, const auto* dw, const auto* mw) {
    constexpr bool kS = decltype(s16)::value, kM = decltype(has_m)::value;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      const int64_t n0 = t * kOut, live_n = std::min<int64_t>(kOut, N - n0);
      const auto* dt = dw + t * SG * kOut;
      const auto* mt = kM ? mw + t * SG * kOut : nullptr;
#ifdef KVSERVE_VNNI
      if (vnni) {
        const __mmask16 live = static_cast<__mmask16>((1u << live_n) - 1);
        // A few rows: the tile two ahead (this thread's next but one) into L2 meanwhile.
        kvserve_prefetch::Ahead ahead;
        const int64_t ta = t + kLead;
        if (M <= kRows && ta < T) {
          const int64_t sbytes = SG * kOut * static_cast<int64_t>(sizeof(*dw));
          ahead = {w + ta * K * kOut, K * kOut,
                   reinterpret_cast<const uint8_t*>(dw + ta * SG * kOut), sbytes,
                   kM ? reinterpret_cast<const uint8_t*>(mw + ta * SG * kOut) : nullptr,
                   kM ? sbytes : 0};
        }
        kvserve_quant::row_tiles<kRows>(M, [&](auto block, int64_t r0) {
          tile_rows<decltype(block)::value, kS, kM>(
              w + t * K * kOut, dt, mt, qx + r0 * K, dx + r0 * G, neg + r0 * SG,
              kM ? sx + r0 * SG : nullptr, K, yp + r0 * N + n0, N, live,
              r0 == 0 ? ahead : kvserve_prefetch::Ahead{});
        });
        continue;
      }
#endif
      kvserve_quant::row_tiles<kRowsAvx2>(M, [&](auto block, int64_t r0) {
        tile_rows_avx2<decltype(block)::value, kS, kM>(
            w + t * K * kOut, dt, mt, qx + r0 * K, dx + r0 * G, kM ? sx + r0 * SG : nullptr, K,
            yp + r0 * N + n0, N, static_cast<int>(live_n));
      });
    }
  };
  kvserve_quant::dispatch_q8(S, mins, [&](auto s16, auto has_m) {
    if (half) {
      tiles(s16, has_m, d.data_ptr<c10::Half>(), mins ? m->data_ptr<c10::Half>() : nullptr);
    } else {
      tiles(s16, has_m, d.data_ptr<float>(), mins ? m->data_ptr<float>() : nullptr);
    }
  });
  return y;
#else
  TORCH_CHECK(false, "quant_gemm_q8_interleaved: not built for this CPU (needs AVX2)");
  return x;
#endif
}

bool quant_gemm_q8_amx_available() { return kvserve_amx::ready(); }

bool quant_gemm_q8_interleaved_available() {
#ifdef KVSERVE_AVX2
  return true;
#else
  return false;
#endif
}
