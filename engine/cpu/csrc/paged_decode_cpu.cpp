// Paged decode attention for the CPU path over a float32 pool, a 16-bit float pool (float16 or
// bfloat16 rows widened to float32 in registers, F16C's conversion for float16), an int8 pool
// (engine/kv_cache/kv_quant.py: a row is head_dim int8 values then the float16 bits of its
// scale; the scale of a K row multiplies its score, the scale of a V row its softmax weight,
// so rows are dequantised in registers only), or an fp8 pool read as bytes (each byte's value
// from a 256-entry table, the KV head's scales folded in the same way). The kernel itself,
// shared with the int4 pool's, is paged_decode_vec.h; this file gives it these formats' rows.
#include "torch_lite.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "paged_decode_common.h"

namespace {

// The dequantisation scale of a pool row: 1 for float rows, the trailing float16 for int8.
inline float row_scale(const float*, int64_t) { return 1.0f; }
inline float row_scale(const c10::Half*, int64_t) { return 1.0f; }
inline float row_scale(const c10::BFloat16*, int64_t) { return 1.0f; }
inline float row_scale(const uint8_t*, int64_t) { return 1.0f; }  // fp8: per head, not per row
inline float row_scale(const int8_t* row, int64_t D) {
  uint16_t bits;
  std::memcpy(&bits, row + D, sizeof bits);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// One element as a float: fp8 bytes through the lookup table.
inline float to_float(float x, const float*) { return x; }
inline float to_float(c10::Half x, const float*) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x, const float*) { return static_cast<float>(x); }
inline float to_float(int8_t x, const float*) { return static_cast<float>(x); }
inline float to_float(uint8_t x, const float* lut) { return lut[x]; }

// Elements of T in one pool row: head_dim, and int8's two bytes of scale after it.
template <typename T>
constexpr int64_t row_width(const T*, int64_t D) {
  return std::is_same<T, int8_t>::value ? D + 2 : D;
}

// The vector path takes head_dims in multiples of 16.
template <typename T>
constexpr bool vector_head_dim(const T*, int64_t D) { return D % 16 == 0; }

// float32 and 16-bit float rows are read as they are; 8-bit rows (whose widening costs more)
// are widened into a buffer first, K and V alike.
template <typename T>
constexpr bool direct_keys(const T*) {
  return !std::is_same<T, int8_t>::value && !std::is_same<T, uint8_t>::value;
}
template <typename T>
constexpr bool direct_values(const T* p) { return direct_keys(p); }

#ifdef KVSERVE_AVX2
// 8 consecutive elements of a row as floats (float32's: paged_decode_vec.h).
inline __m256 load8(const c10::Half* p, const float*) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[8];
  for (int i = 0; i < 8; i++) f[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(f);
#endif
}
inline __m256 load8(const c10::BFloat16* p, const float*) {  // bfloat16 = float32's top half
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
inline __m256 load8(const int8_t* p, const float*) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const uint8_t* p, const float* lut) {  // fp8 bytes: a table gather
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_i32gather_ps(lut, idx, 4);
}
#endif  // KVSERVE_AVX2

}  // namespace

#include "paged_decode_vec.h"

namespace {

// Portable path: any head_dim, any ISA.
template <typename T>
void run_generic(const Task<T>& t) {
  const int64_t n = t.len - t.start;
  std::vector<float> scores(t.G * n);
  for (int64_t i = 0; i < n; i++) {
    const T* kr = row_ptr(t.k_base, t, t.start + i);
    const float ks = row_scale(kr, t.D) * t.k_head * t.scale;
    for (int64_t g = 0; g < t.G; g++) {
      const float* qg = t.q + g * t.D;
      float s = 0.0f;
      for (int64_t d = 0; d < t.D; d++) s += qg[d] * to_float(kr[d], t.lut);
      scores[g * n + i] = t.softcap > 0.0f ? kvserve::softcap(s * ks, t.softcap) : s * ks;
    }
  }
  for (int64_t g = 0; g < t.G; g++) {
    float* sg = scores.data() + g * n;
    const float m = *std::max_element(sg, sg + n);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += (sg[i] = std::exp(sg[i] - m));
    float* o = t.out + g * t.D;
    std::fill(o, o + t.D, 0.0f);
    for (int64_t i = 0; i < n; i++) {
      const T* vr = row_ptr(t.v_base, t, t.start + i);
      const float w = sg[i] / sum * row_scale(vr, t.D) * t.v_head;
      for (int64_t d = 0; d < t.D; d++) o[d] += w * to_float(vr[d], t.lut);
    }
  }
}

}  // namespace

at::Tensor paged_decode_cpu(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor block_tables, at::Tensor seq_lens, double scale,
                               int64_t window, double softcap) {
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == v_cache.dtype(),
              "paged_decode_cpu: float32 queries, K and V pools of one dtype");
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      return paged_decode_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                      softcap);
    case at::kHalf:
      return paged_decode_impl<c10::Half>(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                          window, softcap);
    case at::kBFloat16:
      return paged_decode_impl<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                              window, softcap);
    default:
      TORCH_CHECK(false, "paged_decode_cpu: float32, float16 or bfloat16 pools; got ",
                  k_cache.scalar_type());
  }
}

at::Tensor paged_decode_cpu_int8(at::Tensor q, at::Tensor k_cache,
                                    at::Tensor v_cache, at::Tensor block_tables,
                                    at::Tensor seq_lens, double scale, int64_t window,
                                    double softcap) {
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kChar &&
              v_cache.dtype() == at::kChar,
              "paged_decode_cpu_int8: float32 queries over an int8 pool");
  return paged_decode_impl<int8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                   softcap);
}

at::Tensor paged_decode_cpu_fp8(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor block_tables, at::Tensor seq_lens,
                                   double scale, int64_t window, at::Tensor lut,
                                   at::Tensor k_scales, at::Tensor v_scales, double softcap) {
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kByte &&
              v_cache.dtype() == at::kByte,
              "paged_decode_cpu_fp8: float32 queries over an fp8 pool's uint8 view");
  TORCH_CHECK(lut.dtype() == at::kFloat && lut.numel() == 256 && lut.is_contiguous(),
              "paged_decode_cpu_fp8: a contiguous float32 table of the 256 byte values");
  k_scales = k_scales.to(at::kFloat).contiguous();
  v_scales = v_scales.to(at::kFloat).contiguous();
  TORCH_CHECK(k_scales.numel() == k_cache.size(2) && v_scales.numel() == k_cache.size(2),
              "paged_decode_cpu_fp8: one K and one V scale per KV head");
  return paged_decode_impl<uint8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                    softcap, lut.data_ptr<float>(), k_scales.data_ptr<float>(),
                                    v_scales.data_ptr<float>());
}
