// y = x @ W^T (+ b) for the few rows of a decode step (float32, AVX2+FMA).
//
// At 16-64 rows a linear layer is a stream over its weight: every weight element is used by
// only that many rows. BLAS libraries tile for large row counts and reach ~1/3 of the FMA peak
// here. This kernel packs W once into 16-column panels ([N/16][K][16], zero-padded), so the
// stream is contiguous, and computes up to 6 rows x 16 columns per pass with 12 accumulators in
// registers (2 weight loads + 6 broadcasts per 12 FMAs); a panel stays in L2 while every row
// tile uses it, so DRAM sees the weight once. Threads split the panels.
#include "torch_lite.h"

#include <algorithm>

#include "vec_math.h"

namespace {

constexpr int64_t kPanel = 16;

#ifdef KVSERVE_AVX2
// Named accumulators, not an array: GCC keeps an array of vectors on the stack and reloads it
// every iteration (slower).
#define KV_ROW(i)                                                          \
  if constexpr (MR > i) {                                                  \
    const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);               \
    c##i##a = _mm256_fmadd_ps(xv, w0, c##i##a);                            \
    c##i##b = _mm256_fmadd_ps(xv, w1, c##i##b);                            \
  }

template <int MR>
void micro(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
           float* y, int64_t ldy, int64_t ncols, const float* bias) {
  __m256 c0a = _mm256_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a;
  __m256 c3a = c0a, c3b = c0a, c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a;
  for (int64_t k = 0; k < K; k++) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    KV_ROW(0) KV_ROW(1) KV_ROW(2) KV_ROW(3) KV_ROW(4) KV_ROW(5)
  }
  const __m256 acc[6][2] = {{c0a, c0b}, {c1a, c1b}, {c2a, c2b},
                            {c3a, c3b}, {c4a, c4b}, {c5a, c5b}};
  float tmp[kPanel];
  for (int m = 0; m < MR; m++) {
    __m256 lo = acc[m][0], hi = acc[m][1];
    if (bias != nullptr) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    }
    float* dst = ncols == kPanel ? y + m * ldy : tmp;
    _mm256_storeu_ps(dst, lo);
    _mm256_storeu_ps(dst + 8, hi);
    if (ncols != kPanel) std::copy(tmp, tmp + ncols, y + m * ldy);
  }
}
#undef KV_ROW
#endif

}  // namespace

// w [N, K] -> panels [ceil(N/16), K, 16]; columns beyond N are zero.
at::Tensor small_gemm_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == at::kFloat, "small_gemm_pack: float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  auto padded = at::zeros({P * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

bool small_gemm_supported() {
#ifdef KVSERVE_AVX2
  return true;
#else
  return false;
#endif
}

// x [M, K] (rows contiguous), panels from small_gemm_pack, N the true output width, bias (if
// any) zero-padded to the panels' width.
at::Tensor small_gemm(at::Tensor x, at::Tensor panels, int64_t N,
                         c10::optional<at::Tensor> bias) {
  TORCH_CHECK(small_gemm_supported(), "small_gemm: built without AVX2/FMA");
  TORCH_CHECK(x.dim() == 2 && x.dtype() == at::kFloat && x.stride(1) == 1,
              "small_gemm: x must be float32 [M, K] with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) == x.size(1) && panels.size(2) == kPanel &&
              panels.size(0) * kPanel >= N, "small_gemm: panels do not match x / N");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), ldx = x.stride(0);
  auto y = at::empty({M, N}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.dtype() == at::kFloat && b.numel() == P * kPanel,
                "small_gemm: bias must be float32, zero-padded to the panels' width");
  }
#ifdef KVSERVE_AVX2
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; p++) {
    const float* panel = pp + p * K * kPanel;
    const int64_t n0 = p * kPanel, ncols = std::min(kPanel, N - n0);
    const float* bias_p = bp != nullptr ? bp + n0 : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += 6) {
      const float* xm = xp + m0 * ldx;
      float* ym = yp + m0 * N + n0;
      switch (std::min<int64_t>(6, M - m0)) {
        case 1: micro<1>(xm, ldx, panel, K, ym, N, ncols, bias_p); break;
        case 2: micro<2>(xm, ldx, panel, K, ym, N, ncols, bias_p); break;
        case 3: micro<3>(xm, ldx, panel, K, ym, N, ncols, bias_p); break;
        case 4: micro<4>(xm, ldx, panel, K, ym, N, ncols, bias_p); break;
        case 5: micro<5>(xm, ldx, panel, K, ym, N, ncols, bias_p); break;
        default: micro<6>(xm, ldx, panel, K, ym, N, ncols, bias_p); break;
      }
    }
  }
#endif
  return y;
}
