// The LoRA delta of the rows that run under an adapter, added to a projection's output (CPU,
// float32): one call per projection serves every row of the step, each row reading its own
// adapter slot's weights (punica's bgmv idea; engine/lora/weights.py holds the layout).
//
//   for each row t with s = slots[t] >= 0, for each part p of the projection:
//     y = A[s, p*R : p*R + r] x[t]          (r = ranks[s, p]; 0: the adapter lacks the part)
//     out[t, off_p : off_p + O_p] += y[0] Bt_p[s, 0] + ... + y[r-1] Bt_p[s, r-1]
//
// B is stored transposed (Bt_p [S, R, O_p]): the expand is r contiguous multiply-adds over the
// part's outputs, not O_p dot products of length r.
// The scale is folded into B. Each row's arithmetic is its own, in a fixed order, whatever the
// other rows and the thread that computes it: a row's delta is the same at any row count (the
// engine's batch invariance), and the decode stack calls this very function, so its output stays
// bit-identical to the Python layer loop's.
#include "torch_lite.h"

#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
  return acc;
}

}  // namespace

void lora_apply_(at::Tensor out, at::Tensor x, at::Tensor slots, at::Tensor a,
                 std::vector<at::Tensor> b, at::Tensor ranks, std::vector<int64_t> offsets) {
  TORCH_CHECK(out.dtype() == at::kFloat && x.dtype() == at::kFloat && a.dtype() == at::kFloat,
              "lora_apply_: float32 rows and weights");
  TORCH_CHECK(slots.dtype() == at::kInt && ranks.dtype() == at::kInt,
              "lora_apply_: int32 slots and ranks");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) &&
                  slots.numel() == x.size(0),
              "lora_apply_: x [T, K], out [T, O], slots [T]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "lora_apply_: rows of unit stride");
  const auto P = static_cast<int64_t>(b.size());
  TORCH_CHECK(P >= 1 && static_cast<int64_t>(offsets.size()) == P && a.dim() == 3 &&
                  a.is_contiguous() && a.size(1) % P == 0 && a.size(2) == x.size(1) &&
                  ranks.dim() == 2 && ranks.size(0) == a.size(0) && ranks.size(1) == P &&
                  ranks.is_contiguous() && slots.is_contiguous(),
              "lora_apply_: A [S, P*R, K], P parts of Bt, ranks [S, P]");
  const int64_t T = x.size(0), K = x.size(1), S = a.size(0), R = a.size(1) / P;
  for (int64_t p = 0; p < P; p++) {
    TORCH_CHECK(b[p].dtype() == at::kFloat && b[p].is_contiguous() && b[p].dim() == 3 &&
                    b[p].size(0) == S && b[p].size(1) == R &&
                    offsets[p] >= 0 && offsets[p] + b[p].size(2) <= out.size(1),
                "lora_apply_: part ", p, " Bt [S, R, O_p] within the output");
  }
  const int32_t* slot = slots.data_ptr<int32_t>();
  const int32_t* rank = ranks.data_ptr<int32_t>();
  const float* A = a.data_ptr<float>();
  std::vector<const float*> B(P);
  std::vector<int64_t> O(P);
  for (int64_t p = 0; p < P; p++) {
    B[p] = b[p].data_ptr<float>();
    O[p] = b[p].size(2);
  }
  const float* X = x.data_ptr<float>();
  float* Y = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = out.stride(0);
  int64_t active = 0;
  for (int64_t t = 0; t < T; t++) {
    TORCH_CHECK(slot[t] < S, "lora_apply_: row ", t, " has slot ", slot[t], " of ", S);
    active += slot[t] >= 0;
  }
  if (active == 0) return;
#pragma omp parallel for schedule(static) if (active > 1)
  for (int64_t t = 0; t < T; t++) {
    const int64_t s = slot[t];
    if (s < 0) continue;
    std::vector<float> y(P * R);
    const float* xt = X + t * ldx;
    for (int64_t p = 0; p < P; p++) {
      const int64_t r = rank[s * P + p];
      const float* Ap = A + (s * P * R + p * R) * K;
      for (int64_t j = 0; j < r; j++) y[p * R + j] = dot(xt, Ap + j * K, K);
    }
    float* yt = Y + t * ldy;
    for (int64_t p = 0; p < P; p++) {
      const int64_t r = rank[s * P + p];
      if (r == 0) continue;
      const int64_t n = O[p];
      float* __restrict dst = yt + offsets[p];
      for (int64_t j = 0; j < r; j++) {
        const float yj = y[p * R + j];
        const float* __restrict row = B[p] + (s * R + j) * n;
#pragma omp simd
        for (int64_t o = 0; o < n; o++) dst[o] += yj * row[o];
      }
    }
  }
}
