// Paged decode attention for the CPU path: one query token per sequence, reading K/V straight
// from the block pool through the block table (no gather copy), each row once for all heads.
// fp32 in, fp32 accumulation.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

// Eight independent partial sums: breaks the add dependency chain so the compiler keeps the
// loop in vector registers (a single running sum is latency-bound and ~8x slower).
static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int j = 0; j < 8; j++) part[j] += a[d + j] * b[d + j];
  }
  float s = 0.0f;
  for (; d < n; d++) s += a[d] * b[d];
  for (int j = 0; j < 8; j++) s += part[j];
  return s;
}

torch::Tensor paged_decode_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                               int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "paged_decode_cpu: float32 only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32,
              "paged_decode_cpu: int32 block tables and seq lens");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = block_tables.size(1);
  const int64_t G = H / KVH;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* btp = block_tables.data_ptr<int32_t>();
  const int32_t* slp = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One task per sequence, all its KV heads together: a token's K (or V) row of every head is
  // one contiguous KVH * D run, read once from memory instead of once per head.
#pragma omp parallel for schedule(dynamic)
  for (int64_t b = 0; b < B; b++) {
    const int64_t len = slp[b];
    const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t n = len - start;
    std::vector<float> scores(H * n);  // [H][n], head hq = h * G + g
    std::vector<float> acc(H * D, 0.0f);
    const float* qb = qp + b * H * D;
    for (int64_t j = start / BS; j * BS < len; j++) {
      const float* kb = kp + static_cast<int64_t>(btp[b * MB + j]) * BS * KVH * D;
      const int64_t lo = std::max(start, j * BS), hi = std::min(len, (j + 1) * BS);
      for (int64_t t = lo; t < hi; t++) {
        const float* krow = kb + (t - j * BS) * KVH * D;
        for (int64_t hq = 0; hq < H; hq++) {
          scores[hq * n + (t - start)] = dot(qb + hq * D, krow + (hq / G) * D, D) * fscale;
        }
      }
    }
    for (int64_t hq = 0; hq < H; hq++) {
      float* sg = scores.data() + hq * n;
      float m = -INFINITY;
      for (int64_t i = 0; i < n; i++) m = std::max(m, sg[i]);
      float sum = 0.0f;
      for (int64_t i = 0; i < n; i++) {
        sg[i] = std::exp(sg[i] - m);
        sum += sg[i];
      }
      const float inv = 1.0f / sum;
      for (int64_t i = 0; i < n; i++) sg[i] *= inv;
    }
    for (int64_t j = start / BS; j * BS < len; j++) {
      const float* vb = vp + static_cast<int64_t>(btp[b * MB + j]) * BS * KVH * D;
      const int64_t lo = std::max(start, j * BS), hi = std::min(len, (j + 1) * BS);
      for (int64_t t = lo; t < hi; t++) {
        const float* vrow = vb + (t - j * BS) * KVH * D;
        for (int64_t hq = 0; hq < H; hq++) {
          const float w = scores[hq * n + (t - start)];
          const float* __restrict vr = vrow + (hq / G) * D;
          float* __restrict a = acc.data() + hq * D;
          for (int64_t d = 0; d < D; d++) a[d] += w * vr[d];
        }
      }
    }
    std::copy(acc.begin(), acc.end(), op + b * H * D);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_cpu", &paged_decode_cpu, "paged decode attention (CPU, fp32)");
}
