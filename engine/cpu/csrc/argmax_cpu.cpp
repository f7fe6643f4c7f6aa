// The greedy token in one call: per row of a float32 [rows, width] matrix, the index of the
// first maximal value: torch.argmax's index, ties to the first, and for a row holding a NaN
// the first NaN's (NaN counts as the maximum there, as in PyTorch).
//
// Why a kernel: right after the logits head has streamed its weights through the caches,
// every PyTorch op runs cold, and the two-pass argmax of ATen ops (engine/sampling/argmax.py)
// is several small ops (figures: docs/decisions.md#greedy-argmax). One call scans each row
// once: the row in segments of 32,768 logits split over
// the threads, each segment's lanes keeping their first maximum and its index (a later value
// replaces it only when strictly greater), then the lanes and the segments combined in order
// (the largest value; among equal ones, the lowest index): the first maximal index of the row.
// -0.0 and 0.0 compare equal, as in argmax.
#include "torch_lite.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kSegment = 32768;

struct Best {
  float value;
  int64_t index;
  bool nan;  // index: the segment's first NaN
};

Best first_nan(const float* x, int64_t begin, int64_t end) {
  int64_t i = begin;
  while (i < end && !std::isnan(x[i])) i++;
  return {0.0f, i, true};
}

Best scan(const float* x, int64_t begin, int64_t end) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = begin;
  int64_t i = begin;
#ifdef KVSERVE_AVX2
  constexpr int kLanes = 8, kTrack = 4, kStep = kLanes * kTrack;
  if (end - begin >= kStep) {
    // kTrack independent 8-lane trackers over consecutive 8-logit vectors.
    const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 m[kTrack], nan = _mm256_setzero_ps();
    __m256i at_lane[kTrack], idx[kTrack];
    for (int t = 0; t < kTrack; t++) {
      m[t] = ninf;
      at_lane[t] = _mm256_set1_epi32(-1);
      idx[t] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                _mm256_set1_epi32(t * kLanes));
    }
    const __m256i step = _mm256_set1_epi32(kStep);
    const float* base = x + begin;
    const int64_t n = (end - begin) / kStep * kStep;
    for (int64_t j = 0; j < n; j += kStep) {
#pragma GCC unroll 4
      for (int t = 0; t < kTrack; t++) {
        const __m256 v = _mm256_loadu_ps(base + j + t * kLanes);
        const __m256 gt = _mm256_cmp_ps(v, m[t], _CMP_GT_OQ);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m[t] = _mm256_blendv_ps(m[t], v, gt);
        at_lane[t] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at_lane[t]),
                                                          _mm256_castsi256_ps(idx[t]), gt));
        idx[t] = _mm256_add_epi32(idx[t], step);
      }
    }
    if (_mm256_movemask_ps(nan) != 0) return first_nan(x, begin, end);
    alignas(32) float mv[kStep];
    alignas(32) int32_t iv[kStep];
    for (int t = 0; t < kTrack; t++) {
      _mm256_store_ps(mv + t * kLanes, m[t]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(iv + t * kLanes), at_lane[t]);
    }
    int64_t first = -1;
    for (int l = 0; l < kStep; l++) {
      if (iv[l] < 0) continue;  // a lane that saw only -inf
      if (first < 0 || mv[l] > best || (mv[l] == best && iv[l] < first)) {
        best = mv[l];
        first = iv[l];
      }
    }
    at = first < 0 ? begin : begin + first;  // all -inf: the first logit
    i = begin + n;
  }
#endif
  for (; i < end; i++) {
    const float v = x[i];
    if (std::isnan(v)) return first_nan(x, begin, end);
    if (v > best) {
      best = v;
      at = i;
    }
  }
  return {best, at, false};
}

}  // namespace

at::Tensor first_argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "first_argmax_rows: a contiguous 2-D float32 CPU tensor");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(width > 0, "first_argmax_rows: rows of at least one logit");
  const int64_t segs = (width + kSegment - 1) / kSegment, items = rows * segs;
  std::vector<Best> found(items);
  const float* p = x.data_ptr<float>();
#pragma omp parallel for schedule(static) if (items > 1)
  for (int64_t k = 0; k < items; k++) {
    const int64_t r = k / segs, s = k % segs;
    const int64_t begin = s * kSegment, end = std::min(width, begin + kSegment);
    found[k] = scan(p + r * width, begin, end);
  }
  auto out = at::empty({rows}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; r++) {
    Best b = found[r * segs];
    for (int64_t s = 1; s < segs && !b.nan; s++) {
      const Best c = found[r * segs + s];
      if (c.nan || c.value > b.value) b = c;  // equal: the earlier segment stays
    }
    o[r] = b.index;
  }
  return out;
}
