// int4 KV rows in C++ (engine/kv_storage/formats.py: int4_rotate and _quantize_int4), for the
// decode stack's stores and its query/output rotations. Bit-identical to the Python functions
// (tests/kernels/cpu/test_cpu_int4_rows.py holds them to torch.equal): the same float32 operations in
// the same order, each rounded to float32 as torch rounds it.
//
//   rotate:   per group of g elements (g = 32, or head_dim when head_dim % 32 != 0), the fast
//             Walsh-Hadamard butterflies h = 1, 2, 4, ... < g, pairs (a, b) h apart in blocks
//             of 2h becoming (a + b, a - b), then one multiplication by float32(1/sqrt(g));
//             nothing when g is not a power of two.
//   quantise: per group, m = the element of largest magnitude (the first on ties, as argmax);
//             scale = float16(m / -8) (round to nearest even); inv = scale == 0 ? 0 : 1/scale;
//             q = clamp(floor((y * inv) + 8 + 0.5), 0, 15); byte i of the group = q[i] |
//             q[i + g/2] << 4; after the D/2 nibble bytes, the groups' float16 scales.
#include "torch_lite.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

int64_t group_of(int64_t D) {
  TORCH_CHECK(D % 2 == 0, "int4 rows: an even head_dim; got ", D);
  return D % 32 == 0 ? 32 : D;
}

// x as computed, in float32 memory: keeps the compiler from contracting it with a following
// add into one FMA (torch rounds the product before it adds).
inline float rounded(float x) {
  volatile float v = x;
  return v;
}

}  // namespace

at::Tensor int4_rotate_cpu(at::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "int4_rotate_cpu: a CPU tensor [..., D]");
  const int64_t D = x.size(-1), g = group_of(D);
  at::Tensor y = x.to(at::kFloat);
  if (g & (g - 1)) return y;  // not a power of two: R is the identity
  y = y.contiguous().clone();
  // float32(1/sqrt(g)) as formats.INT4_ROTATION_NORM computes it (in double, then rounded)
  const float norm = static_cast<float>(1.0 / std::pow(static_cast<double>(g), 0.5));
  float* p = y.data_ptr<float>();
  const int64_t groups = y.numel() / g;
  for (int64_t r = 0; r < groups; r++) {
    float* v = p + r * g;
    for (int64_t h = 1; h < g; h *= 2) {
      for (int64_t b0 = 0; b0 < g; b0 += 2 * h) {
        for (int64_t j = b0; j < b0 + h; j++) {
          const float a = v[j], b = v[j + h];
          v[j] = a + b;
          v[j + h] = a - b;
        }
      }
    }
    for (int64_t j = 0; j < g; j++) v[j] *= norm;
  }
  return y;
}

at::Tensor int4_quantize_rows_cpu(at::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "int4_quantize_rows_cpu: a CPU tensor [..., D]");
  const int64_t D = x.size(-1), g = group_of(D), G = D / g, W = D / 2 + 2 * G;
  const at::Tensor y = int4_rotate_cpu(x).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = W;
  at::Tensor out = at::empty(shape, x.options().dtype(at::kByte));
  const float* yp = y.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t rows = D ? y.numel() / D : 0;
  std::vector<uint8_t> q(g);
  for (int64_t r = 0; r < rows; r++) {
    const float* yr = yp + r * D;
    uint8_t* orow = op + r * W;
    for (int64_t gi = 0; gi < G; gi++) {
      const float* v = yr + gi * g;
      int64_t idx = 0;
      for (int64_t j = 1; j < g; j++)
        if (std::fabs(v[j]) > std::fabs(v[idx])) idx = j;
      const c10::Half scale(v[idx] / -8.0f);
      const float sf = static_cast<float>(scale);
      const float inv = sf == 0.0f ? 0.0f : 1.0f / sf;
      for (int64_t j = 0; j < g; j++) {
        const float shifted = rounded(v[j] * inv) + 8.0f;
        const float level = std::floor(shifted + 0.5f);
        q[j] = static_cast<uint8_t>(std::min(std::max(level, 0.0f), 15.0f));
      }
      for (int64_t j = 0; j < g / 2; j++)
        orow[gi * g / 2 + j] = static_cast<uint8_t>(q[j] | (q[j + g / 2] << 4));
      const uint16_t bits = scale.x;
      std::memcpy(orow + D / 2 + 2 * gi, &bits, sizeof bits);
    }
  }
  return out;
}
