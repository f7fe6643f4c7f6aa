// y[M, N] = x[M, K] @ W^T for 8-bit weights (the q8 format of quant_gemm_cpu.cpp, rows layout:
// int8 values, a scale per 32 or per 16, an optional min per scale group) at decode-batch sizes,
// on AVX-512 VNNI: the decode kernels' integer math (each activation row rounded to int8 per
// group of 32, dx = amax/127; per scale group d*dx*sum(q*qx), plus m*sx with mins), with the
// batch's rows in the 16 int32 lanes instead of the weight's k.
//
// The decode kernel (quant_gemm_q8_vnni) puts 64 weights of one output in a register: per row
// and 64 weights it needs a sign fix, a dpbusd, a per-lane scale vector (a permute), a
// conversion and an FMA, and a horizontal sum per output at the end, per row: slow for a large
// head at 16 rows. Here the activations of 16 rows are
// interleaved once per call (one register: 4 consecutive k of each of the 16 rows), and each 4
// weights of an output are broadcast to all lanes (plus 128, an XOR: vpdpbusd multiplies
// unsigned by signed bytes; the 128 * sum(qx) this adds is subtracted up front, per row and
// scale group, exactly), so one vpdpbusd does 16 rows x 4 k; a scale group's 4 or 8 of them
// sum in int32, then one conversion and one FMA with the lanes' d*dx add the group in float,
// in group order, for 16 rows at once (docs/decisions.md#quantised-linears). The mins' m*sx add
// up in a second accumulator, added last. Four outputs share each activation load; rows go in
// blocks of 16, lanes past the last row are zero and not stored. A block costs about the same
// whatever its rows, so the decode kernel stays faster for a few rows (below ~6).
//
// Per output element the same integer sums as quant_gemm_q8 / quant_gemm_q8_vnni (exactly), in
// another float order (equal up to float summation order), and its own fixed order: an output
// depends only on its row of x and its row of W, whatever the other rows (so the restricted
// logits head can gather weight rows on this route, as on the decode kernels'). Compiled only
// where the VNNI kernels are (quant_vnni_common.h); whether it serves decode batches is
// measured at start-up (engine/quantization/probe.py, q8_batch).
#include "torch_lite.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_common.h"
#include "quant_vnni_common.h"

using kvserve_quant::kGroup;

#ifdef KVSERVE_VNNI
namespace {

constexpr int kLanes = 16;  // activation rows per block: the int32 lanes of a register
constexpr int kCols = 4;    // outputs sharing each activation load
constexpr int kTile = 16;   // outputs per thread's task

// One block of up to 16 activation rows, interleaved for the lanes (padding rows all zero):
// xi [K/4][16] int32 (4 bytes of row r, k = 4i .. 4i+3, in lane r); neg [SG][16] int32 =
// -128 * sum(qx) of each scale group (SG = K / S); dx [G][16]; sx [SG][16] (mins only: the
// activation sums per scale group).
struct Block {
  std::vector<int32_t> xi, neg;
  std::vector<float> dx, sx;
};

void interleave(const kvserve_quant::QuantisedRows& rows, const kvserve_vnni::RowTerms& t,
                int64_t r0, int64_t rn, int64_t K, int64_t S, bool mins, Block& b) {
  const int64_t G = K / kGroup, SG = K / S, Q = K / 4;
  b.xi.assign(Q * kLanes, 0);
  b.neg.assign(SG * kLanes, 0);
  b.dx.assign(G * kLanes, 0.f);
  b.sx.assign(mins ? SG * kLanes : 0, 0.f);
  for (int64_t r = 0; r < rn; r++) {
    const int8_t* q = rows.q + (r0 + r) * K;
    for (int64_t i = 0; i < Q; i++) std::memcpy(&b.xi[i * kLanes + r], q + 4 * i, 4);
    for (int64_t h = 0; h < SG; h++) {
      b.neg[h * kLanes + r] = t.neg[(r0 + r) * SG + h];
      if (mins) b.sx[h * kLanes + r] = t.sx[(r0 + r) * SG + h];
    }
    for (int64_t g = 0; g < G; g++) b.dx[g * kLanes + r] = rows.d[(r0 + r) * G + g];
  }
}

// C outputs (weight rows w, w + K, ...) against one block; y: the block's first row, output 0.
template <int C, bool kS16, bool kHasM>
void outputs(const int8_t* w, const float* d, const float* m, int64_t D, const Block& b,
             int64_t K, float* y, int64_t ldy, __mmask16 live) {
  constexpr int kSteps = kS16 ? 4 : 8;  // 4-byte steps per scale group
  const int64_t SG = K / (kS16 ? 16 : 32);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[C], accm[C];
  for (int c = 0; c < C; c++) acc[c] = accm[c] = _mm512_setzero_ps();
  for (int64_t h = 0; h < SG; h++) {
    const __m512i neg = _mm512_loadu_si512(&b.neg[h * kLanes]);
    __m512i s[C];
    for (int c = 0; c < C; c++) s[c] = neg;
    const int64_t i0 = h * kSteps;  // the group's first 4-byte step
#pragma GCC unroll 8
    for (int j = 0; j < kSteps; j++) {
      const __m512i xa = _mm512_loadu_si512(&b.xi[(i0 + j) * kLanes]);
      for (int c = 0; c < C; c++) {
        int32_t quad;
        std::memcpy(&quad, w + c * K + 4 * (i0 + j), 4);
        const __m512i wb = _mm512_xor_si512(_mm512_set1_epi32(quad), flip);
        s[c] = _mm512_dpbusd_epi32(s[c], wb, xa);
      }
    }
    const __m512 dx = _mm512_loadu_ps(&b.dx[(kS16 ? h / 2 : h) * kLanes]);
    for (int c = 0; c < C; c++) {
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(d[c * D + h]), dx);
      acc[c] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s[c]), acc[c]);
      if constexpr (kHasM) {
        accm[c] = _mm512_fmadd_ps(_mm512_set1_ps(m[c * D + h]),
                                  _mm512_loadu_ps(&b.sx[h * kLanes]), accm[c]);
      }
    }
  }
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int32_t>(ldy)));
  for (int c = 0; c < C; c++) {
    const __m512 out = kHasM ? _mm512_add_ps(acc[c], accm[c]) : acc[c];
    _mm512_mask_i32scatter_ps(y + c, live, rows, out, 4);
  }
}

}  // namespace
#endif

at::Tensor quant_gemm_q8_batch(at::Tensor x, at::Tensor qs, at::Tensor d,
                               c10::optional<at::Tensor> m) {
#ifdef KVSERVE_VNNI
  const int64_t N = qs.size(0), K = qs.size(1), M = x.size(0);
  const int64_t S = kvserve_quant::q8_scale_group(qs, d, m);
  kvserve_quant::check_gemm_args(x, qs, d, K, S);
  TORCH_CHECK(M * N < (int64_t{1} << 31), "quant_gemm_q8_batch: output too large");
  const auto rows = kvserve_quant::quantise(x);
  const bool mins = m.has_value();
  thread_local kvserve_vnni::RowTerms terms;
  kvserve_vnni::row_terms(rows, M, K, S, mins, terms);
  const int64_t nblocks = (M + kLanes - 1) / kLanes;
  thread_local std::vector<Block> blocks;
  blocks.resize(nblocks);
  for (int64_t bi = 0; bi < nblocks; bi++) {
    interleave(rows, terms, bi * kLanes, std::min<int64_t>(kLanes, M - bi * kLanes), K, S, mins,
               blocks[bi]);
  }
  auto y = at::empty({M, N});
  const int8_t* w = qs.data_ptr<int8_t>();
  const float* dw = d.data_ptr<float>();
  const float* mw = mins ? m->data_ptr<float>() : nullptr;
  const int64_t D = d.size(1);
  float* yp = y.data_ptr<float>();
  const Block* bp = blocks.data();
  auto run = [&](auto s16t, auto has_m) {
    constexpr bool kS = decltype(s16t)::value, kM = decltype(has_m)::value;
    const int64_t tiles = (N + kTile - 1) / kTile;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t t0 = t * kTile, tn = std::min<int64_t>(kTile, N - t0);
      for (int64_t bi = 0; bi < nblocks; bi++) {
        const int64_t rn = std::min<int64_t>(kLanes, M - bi * kLanes);
        const __mmask16 live = static_cast<__mmask16>((1u << rn) - 1);
        int64_t n = t0;
        for (; n + kCols <= t0 + tn; n += kCols) {
          outputs<kCols, kS, kM>(w + n * K, dw + n * D, mw ? mw + n * D : nullptr, D, bp[bi], K,
                                 yp + bi * kLanes * N + n, N, live);
        }
        for (; n < t0 + tn; n++) {
          outputs<1, kS, kM>(w + n * K, dw + n * D, mw ? mw + n * D : nullptr, D, bp[bi], K,
                             yp + bi * kLanes * N + n, N, live);
        }
      }
    }
  };
  kvserve_quant::dispatch_q8(S, mins, run);
  return y;
#else
  TORCH_CHECK(false, "quant_gemm_q8_batch: not built for this CPU (needs AVX-512 BW/VL and VNNI)");
  return x;
#endif
}
