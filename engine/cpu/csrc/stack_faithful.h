// The decode stack's faithful kinds (decode_stack_cpu.h kFaithfulQ4 / kFaithfulQ8): the
// faithful kernels live in a library of their own (quant_faithful.cpp, loaded by
// engine/cpu/kernels_faithful.py), called here through the address of their C entry points.
#pragma once

#include "torch_lite.h"

#include <cstdint>

#include "decode_stack_cpu.h"

namespace kvserve_stack {

// The faithful kernels' C ABI (quant_faithful.cpp's kvf_gemm_q4 / kvf_gemm_q8).
// Their flags: 1 = bf16 activations, 2 = float16 scales and mins (else float32).
using FaithfulQ4 = void (*)(const float*, int64_t, int64_t, const uint8_t*, const void*,
                            const void*, int64_t, float*, int);
using FaithfulQ8 = void (*)(const float*, int64_t, int64_t, const int8_t*, const void*,
                            const void*, int64_t, int64_t, float*, int);

// y = x @ W^T for a faithful kind, as engine/cpu/kernels_faithful.py gemm calls it.
inline at::Tensor faithful_gemm(const StackLinear& L, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "StackLinear: faithful kinds take [rows, in] inputs");
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous()
                                                       : x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = L.w.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M == 0) return y;
  const void* m = L.m.has_value() ? L.m->data_ptr() : nullptr;
  const int flags = (L.bf16 ? 1 : 0) | (L.d->scalar_type() == at::kHalf ? 2 : 0);
  if (L.kind == kFaithfulQ4) {
    TORCH_CHECK(L.w.size(1) * 2 == K, "StackLinear: a 4-bit weight of another input width");
    reinterpret_cast<FaithfulQ4>(L.fn)(xf.data_ptr<float>(), M, K, L.w.data_ptr<uint8_t>(),
                                       L.d->data_ptr(), m, N, y.data_ptr<float>(), flags);
  } else {
    TORCH_CHECK(L.w.size(1) == K, "StackLinear: an 8-bit weight of another input width");
    reinterpret_cast<FaithfulQ8>(L.fn)(xf.data_ptr<float>(), M, K, L.w.data_ptr<int8_t>(),
                                       L.d->data_ptr(), m, K / L.d->size(1), N,
                                       y.data_ptr<float>(), flags);
  }
  return y;
}

}  // namespace kvserve_stack
