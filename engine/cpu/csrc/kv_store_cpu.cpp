// Writes one step's K and V rows into the paged pools (CPU): pool row slots[t] of k_cache and
// v_cache becomes row t of k and v; a negative slot is skipped (a row with nothing to keep).
// One call for both pools replaces two index_copy_ calls per layer (at decode sizes mostly
// dispatch: docs/decisions.md#kv-store-kernel). Rows are moved as bytes, so float32, bf16,
// int8 (scale in-row) and
// fp8 pools are all served; k/v must have the pool's dtype and row shape. Slots are checked
// against the pool size before anything is written.
#include "torch_lite.h"

#include <cstring>

void store_kv_cpu(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor slots) {
  TORCH_CHECK(k.device().is_cpu() && k_cache.device().is_cpu(), "store_kv_cpu: CPU tensors only");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "store_kv_cpu: rows and pools must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "store_kv_cpu: pools must be contiguous and of one shape");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "slots must be int64 [T]");
  const int64_t T = slots.numel();
  const int64_t row = k_cache.numel() / (k_cache.size(0) * k_cache.size(1));  // kvh * width
  const int64_t pool_rows = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k.numel() == T * row && v.numel() == T * row, "store_kv_cpu: k/v must be [T, ",
              "kv_heads, width] rows of the pool");
  auto kc = k.contiguous(), vc = v.contiguous();
  auto sc = slots.contiguous();
  const int64_t* s = sc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++) {
    TORCH_CHECK(s[t] < pool_rows, "store_kv_cpu: slot ", s[t], " outside the pool");
  }
  const int64_t bytes = row * k.element_size();
  const char *kp = static_cast<const char*>(kc.data_ptr()), *vp = static_cast<const char*>(vc.data_ptr());
  char *kd = static_cast<char*>(k_cache.data_ptr()), *vd = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; t++) {
    if (s[t] < 0) continue;
    std::memcpy(kd + s[t] * bytes, kp + t * bytes, bytes);
    std::memcpy(vd + s[t] * bytes, vp + t * bytes, bytes);
  }
}
