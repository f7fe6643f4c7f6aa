// Fused element-wise ops of the Llama layer for the CPU path (float32). Each replaces a chain of
// PyTorch ops that would each stream the activations through memory once:
//   rms_norm        y = w * x / sqrt(mean(x^2) + eps)                    (pow, mean, rsqrt, 2 muls)
//   add_rms_norm_   r += x;  y = rms_norm(r)                             (+ the residual add)
//   silu_mul        y = silu(gate) * up  over a fused [gate | up] row    (silu, mul, a split copy)
//   gelu_tanh_mul   y = gelu_tanh(gate) * up, the same (Gemma's GeGLU)    (gelu, mul, a split copy)
//   rotary_         rotate-half RoPE on Q and K heads, in place           (cat, neg, 2 muls, add)
// The arithmetic is HF's (float32 throughout); only summation order and FMA contraction differ.
#include "torch_lite.h"

#include <cmath>

#include "vec_math.h"

namespace {

inline void check_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.device().is_cpu(), what, ": float32 CPU only");
}

inline void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_f32(x, "rms_norm");
  check_f32(weight, "rms_norm");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#pragma omp parallel for if (rows > 16)
  for (int64_t r = 0; r < rows; r++) norm_row(xp + r * n, wp, yp + r * n, n, static_cast<float>(eps));
  return y;
}

// residual += x (in place), returns rms_norm(residual).
at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight,
                            double eps) {
  check_f32(x, "add_rms_norm_");
  check_f32(residual, "add_rms_norm_");
  TORCH_CHECK(residual.is_contiguous() && x.sizes() == residual.sizes(),
              "add_rms_norm_: residual must be contiguous and shaped like x");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *rp = residual.data_ptr<float>(), *yp = y.data_ptr<float>();
#pragma omp parallel for if (rows > 16)
  for (int64_t r = 0; r < rows; r++) {
    float* rr = rp + r * n;
    const float* xr = xp + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) rr[i] += xr[i];
    norm_row(rr, wp, yp + r * n, n, static_cast<float>(eps));
  }
  return y;
}

namespace {

// gate_up [T, 2I] -> act(gate) * up [T, I], act(g) = g / (1 + exp(-c(g) g)): SiLU with c = 1,
// GELU's tanh form with c = 2 sqrt(2/pi) (1 + 0.044715 g^2) (0.5 (1 + tanh(z)) is the sigmoid
// of 2z, so gelu_tanh(g) = g sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3))).
template <bool kGelu>
at::Tensor act_mul(at::Tensor gate_up, const char* what) {
  check_f32(gate_up, what);
  gate_up = gate_up.contiguous();
  const int64_t two_i = gate_up.size(-1), inter = two_i / 2, rows = gate_up.numel() / two_i;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto y = at::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr float kBeta = 1.5957691216057308f;  // 2 sqrt(2/pi)
  constexpr float kKappa = 0.044715f;
#pragma omp parallel for if (rows > 16)
  for (int64_t r = 0; r < rows; r++) {
    const float* g = gp + r * two_i;
    const float* u = g + inter;
    float* o = yp + r * inter;
    int64_t i = 0;
#ifdef KVSERVE_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= inter; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      __m256 z = gv;  // the sigmoid's argument
      if constexpr (kGelu) {
        const __m256 g2 = _mm256_mul_ps(gv, gv);
        z = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(kBeta), gv),
                          _mm256_fmadd_ps(_mm256_set1_ps(kKappa), g2, one));
      }
      const __m256 den = _mm256_add_ps(one, kvserve::exp256(_mm256_sub_ps(_mm256_setzero_ps(), z)));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; i++) {
      const float z = kGelu ? kBeta * g[i] * (1.0f + kKappa * g[i] * g[i]) : g[i];
      o[i] = g[i] / (1.0f + std::exp(-z)) * u[i];
    }
  }
  return y;
}

}  // namespace

// gate_up [T, 2I] -> silu(gate) * up  [T, I]
at::Tensor silu_mul(at::Tensor gate_up) { return act_mul<false>(gate_up, "silu_mul"); }

// gate_up [T, 2I] -> gelu_tanh(gate) * up  [T, I] (equal to PyTorch's up to rounding)
at::Tensor gelu_tanh_mul(at::Tensor gate_up) { return act_mul<true>(gate_up, "gelu_tanh_mul"); }

// x: [T, heads, D] view (any row stride, heads and D contiguous); cos, sin: [T, D] contiguous.
// x[j] = x[j] cos[j] - x[j + D/2] sin[j];  x[j + D/2] = x[j + D/2] cos[j + D/2] + x[j] sin[j + D/2]
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_f32(x, "rotary_");
  check_f32(cos, "rotary_");
  check_f32(sin, "rotary_");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_: x must be [T, heads, D] with contiguous heads");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, ts = x.stride(0);
  TORCH_CHECK(cos.size(0) == T && cos.size(-1) == D, "rotary_: cos/sin must be [T, D]");
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
#pragma omp parallel for if (T > 16)
  for (int64_t t = 0; t < T; t++) {
    const float* c = cp + t * D;
    const float* s = sp + t * D;
    for (int64_t h = 0; h < H; h++) {
      float* a = xp + t * ts + h * D;
      float* b = a + half;
#pragma omp simd
      for (int64_t j = 0; j < half; j++) {
        const float x1 = a[j], x2 = b[j];
        a[j] = x1 * c[j] - x2 * s[j];
        b[j] = x2 * c[j + half] + x1 * s[j + half];
      }
    }
  }
}
