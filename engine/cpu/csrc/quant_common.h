// Shared by the packed-weight kernels (quant_gemm_cpu.cpp, quant_dequant_cpu.cpp): the group
// size and the checks of a q8 weight's layout (see quant_gemm_cpu.cpp for the formats).
#pragma once

#include <torch/extension.h>

#include <type_traits>

namespace kvserve_quant {

constexpr int64_t kGroup = 32;

// The scale group of a q8 weight (16 or 32, from d's width) and its optional min, checked.
inline int64_t q8_scale_group(const torch::Tensor& qs, const torch::Tensor& d,
                              const c10::optional<torch::Tensor>& m) {
  TORCH_CHECK(qs.dim() == 2 && d.dim() == 2 && d.size(1) > 0, "malformed q8 weight");
  const int64_t K = qs.size(1);
  TORCH_CHECK(qs.scalar_type() == torch::kInt8 && (d.size(1) * 16 == K || d.size(1) * 32 == K),
              "malformed q8 weight: int8 values and one scale per 16 or 32 of them");
  const int64_t S = K / d.size(1);
  if (m.has_value()) {
    TORCH_CHECK(S == kGroup && m->is_contiguous() && m->scalar_type() == torch::kFloat32 &&
                    m->sizes() == d.sizes(),
                "malformed q8 weight: a min needs one per group of 32, like its scale");
  }
  return S;
}

// Calls f.template operator()<R>(r0) for row tiles of 4 (the last one 1..3 rows).
template <typename F>
void row_tiles(int64_t M, F&& f) {
  int64_t r0 = 0;
  for (; r0 + 4 <= M; r0 += 4) f(std::integral_constant<int, 4>{}, r0);
  switch (M - r0) {
    case 3: f(std::integral_constant<int, 3>{}, r0); break;
    case 2: f(std::integral_constant<int, 2>{}, r0); break;
    case 1: f(std::integral_constant<int, 1>{}, r0); break;
    default: break;
  }
}

}  // namespace kvserve_quant
