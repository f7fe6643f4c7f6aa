// The faithful packed kernels (issue 65): y[M, N] = x[M, K] @ W^T for packed 4-bit and 8-bit
// weights (engine/quantization/formats.py PackedQ4 / PackedQ8) WITHOUT rounding the activations
// to int8 per group, as quant_gemm_cpu.cpp (llama.cpp's q8 dot products) does. The weights are
// dequantised in registers; the activations stay float32 (AVX2/FMA path, or the scalar path) or
// are rounded once to bfloat16 (AVX-512 BF16 path: vdpbf16ps; bf16 keeps each element's own
// exponent, where int8 groups share one scale amax/127 across 32 elements).
//
// Per output n and activation row r, over the scale groups g of S elements (S = 32 for 4-bit;
// 32 or 16 for 8-bit):
//   y[r, n] = sum_g d[n, g] * sum_j q[n, gS + j] * x[r, gS + j]  +  sum_g m[n, g] * xs[r, g]
// with xs[r, g] the float32 sum of the group's activations (in a fixed order) and q the stored
// integers (0..15 for 4-bit, -128..127 for 8-bit: exact in bf16 and float32). The products
// q * x are exact in float32 for bf16 x (vdpbf16ps multiplies exactly and adds in float32).
//
// Batch invariance: every row goes through the same sequence of instructions whatever M: rows
// in tiles of 1-4 sharing each decoded group, each row with its own accumulators filled in group
// order, the same horizontal reduction; the activation conversion and group sums are per row.
// Threads split the output columns only. So row r's output is bit-identical for any M (and
// any thread count). Built without fp contraction (-ffp-contract=off), so the scalar parts
// compile to the same operations in every tile size.
//
// No torch headers: a plain C ABI (loaded with ctypes by engine/cpu/kernels_faithful.py), so
// this file compiles in seconds and stands apart from the main kernels' build.
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kMaxTile = 4;

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVF_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define KVF_AVX2 1
#endif

inline uint16_t to_bf16(float f) {  // round to nearest even (as vcvtneps2bf16; no NaNs here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// Group sums of each row: xs[r, g] = sum of x[r, gS .. gS + S) in index order.
void group_sums(const float* x, int64_t M, int64_t K, int64_t S, float* xs) {
  const int64_t G = K / S;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* p = x + r * K + g * S;
      float s = 0.f;
      for (int64_t j = 0; j < S; ++j) s += p[j];
      xs[r * G + g] = s;
    }
  }
}

// sum_g m[g] * xs[g] in a fixed order (8 lanes, then the tail, then the lanes in order).
inline float min_term(const float* m, const float* xs, int64_t G) {
  if (m == nullptr) return 0.f;
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += m[g + l] * xs[g + l];
  float s = 0.f;
  for (; g < G; ++g) s += m[g] * xs[g];
  for (int l = 0; l < 8; ++l) s += lanes[l];
  return s;
}

// ---------------------------------------------------------------- scalar path (any CPU)
template <bool Q4>
void tile_scalar(const float* x, int64_t K, int R, const uint8_t* qrow, const float* drow,
                 const float* mrow, int64_t S, const float* xs, float* out, int64_t ldo) {
  const int64_t G = K / S;
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * K;
    float acc = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      float p = 0.f;
      for (int64_t j = 0; j < S; ++j) {
        const int64_t k = g * S + j;
        float q;
        if (Q4) {
          const int64_t grp = k / 32, e = k % 32;
          const uint8_t b = qrow[grp * 16 + (e & 15)];
          q = static_cast<float>(e < 16 ? (b & 15) : (b >> 4));
        } else {
          q = static_cast<float>(reinterpret_cast<const int8_t*>(qrow)[k]);
        }
        p += q * xr[k];
      }
      acc += p * drow[g];
    }
    out[r * ldo] = acc + min_term(mrow, xs + r * G, G);
  }
}

#ifdef KVF_AVX2
// ---------------------------------------------------------------- AVX2 + FMA, float32 x
inline float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// The 32 weights of one 32-element group as 4 x 8 floats, in element order.
template <bool Q4>
inline void decode32_f32(const uint8_t* p, __m256 w[4]) {
  if (Q4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m128i a = _mm256_castsi256_si128(raw), b = _mm256_extracti128_si256(raw, 1);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  }
}

template <bool Q4, int R>
inline void group_avx2(const float* x, int64_t K, const uint8_t* qrow, const float* drow,
                       int64_t S, int64_t g, __m256 acc[R]) {
  const int64_t bytes = Q4 ? 16 : 32;
  __m256 w[4];
  decode32_f32<Q4>(qrow + g * bytes, w);
  if (S == 32) {
    const __m256 dv = _mm256_set1_ps(drow[g]);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + g * 32;
      __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
      p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), p);
      p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), p);
      p = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), p);
      acc[r] = _mm256_fmadd_ps(p, dv, acc[r]);
    }
  } else {  // S == 16: two scales per 32
    const __m256 d0 = _mm256_set1_ps(drow[2 * g]), d1 = _mm256_set1_ps(drow[2 * g + 1]);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + g * 32;
      __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
      p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), p);
      __m256 t = _mm256_mul_ps(w[2], _mm256_loadu_ps(xr + 16));
      t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), t);
      acc[r] = _mm256_fmadd_ps(p, d0, acc[r]);
      acc[r] = _mm256_fmadd_ps(t, d1, acc[r]);
    }
  }
}

template <bool Q4, int R>
void tile_avx2(const float* x, int64_t K, const uint8_t* qrow, const float* drow,
               const float* mrow, int64_t S, const float* xs, float* out, int64_t ldo) {
  const int64_t G32 = K / 32, G = K / S;
  // Even and odd groups in two accumulators per row: two independent chains.
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= G32; g += 2) {
    group_avx2<Q4, R>(x, K, qrow, drow, S, g, acc0);
    group_avx2<Q4, R>(x, K, qrow, drow, S, g + 1, acc1);
  }
  if (g < G32) group_avx2<Q4, R>(x, K, qrow, drow, S, g, acc0);
  for (int r = 0; r < R; ++r)
    out[r * ldo] = hsum256(_mm256_add_ps(acc0[r], acc1[r])) + min_term(mrow, xs + r * G, G);
}
#endif  // KVF_AVX2

#ifdef KVF_BF16
// ---------------------------------------------------------------- AVX-512 BF16, bf16 x
// bf16 bit patterns of 0..15 (lanes 16..31 unused).
alignas(64) const uint16_t kNibbleBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

template <bool Q4>
inline __m512bh decode32_bf16(const uint8_t* p, __m512i table) {
  if (Q4) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i low4 = _mm256_set1_epi16(0x0F);
    const __m512i idx = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(b, low4)), _mm256_srli_epi16(b, 4), 1);
    return (__m512bh)_mm512_permutexvar_epi16(idx, table);
  }
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
  return _mm512_cvtne2ps_pbh(hi, lo);  // elements 0..15 from lo, 16..31 from hi
}

template <bool Q4>
inline __m512 scales_bf16(const float* drow, int64_t g, int64_t S) {
  // Lanes 0..7 hold elements 0..15's pair sums, lanes 8..15 elements 16..31's.
  return S == 32 ? _mm512_set1_ps(drow[g])
                 : _mm512_insertf32x8(_mm512_set1_ps(drow[2 * g]),
                                      _mm256_set1_ps(drow[2 * g + 1]), 1);
}

// sum_g m[g] * xs[g], 16 lanes then their reduction (a fixed order; masked tail).
inline float min_term512(const float* m, const float* xs, int64_t G) {
  if (m == nullptr) return 0.f;
  __m512 a = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= G; g += 16)
    a = _mm512_fmadd_ps(_mm512_loadu_ps(m + g), _mm512_loadu_ps(xs + g), a);
  if (g < G) {
    const __mmask16 k = static_cast<__mmask16>((1u << (G - g)) - 1);
    a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + g), _mm512_maskz_loadu_ps(k, xs + g), a);
  }
  return _mm512_reduce_add_ps(a);
}

template <bool Q4, int R>
void tile_bf16(const uint16_t* xb, int64_t K, const uint8_t* qrow, const float* drow,
               const float* mrow, int64_t S, const float* xs, float* out, int64_t ldo) {
  const int64_t G32 = K / 32, G = K / S;
  const int64_t bytes = Q4 ? 16 : 32;
  const __m512i table = _mm512_load_si512(kNibbleBf16);
  // Even and odd groups in two accumulators per row: two independent chains.
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= G32; g += 2) {
    const __m512bh w0 = decode32_bf16<Q4>(qrow + g * bytes, table);
    const __m512bh w1 = decode32_bf16<Q4>(qrow + (g + 1) * bytes, table);
    const __m512 d0 = scales_bf16<Q4>(drow, g, S), d1 = scales_bf16<Q4>(drow, g + 1, S);
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = xb + r * K + g * 32;
      const __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0,
                                         (__m512bh)_mm512_loadu_si512(xr));
      const __m512 p1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), w1,
                                         (__m512bh)_mm512_loadu_si512(xr + 32));
      acc0[r] = _mm512_fmadd_ps(p0, d0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(p1, d1, acc1[r]);
    }
  }
  if (g < G32) {
    const __m512bh w0 = decode32_bf16<Q4>(qrow + g * bytes, table);
    const __m512 d0 = scales_bf16<Q4>(drow, g, S);
    for (int r = 0; r < R; ++r) {
      const __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0,
                                         (__m512bh)_mm512_loadu_si512(xb + r * K + g * 32));
      acc0[r] = _mm512_fmadd_ps(p0, d0, acc0[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r])) +
                   min_term512(mrow, xs + r * G, G);
}

void to_bf16_rows(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  for (; i < n; ++i) out[i] = to_bf16(x[i]);
}
#endif  // KVF_BF16

// One tile of R rows (1..4) of one output column, on the chosen path.
template <bool Q4>
void run_tile(int path, const float* x, const uint16_t* xb, int64_t K, int R,
              const uint8_t* qrow, const float* drow, const float* mrow, int64_t S,
              const float* xs, float* out, int64_t ldo) {
#ifdef KVF_BF16
  if (path == 2) {
    switch (R) {
      case 1: return tile_bf16<Q4, 1>(xb, K, qrow, drow, mrow, S, xs, out, ldo);
      case 2: return tile_bf16<Q4, 2>(xb, K, qrow, drow, mrow, S, xs, out, ldo);
      case 3: return tile_bf16<Q4, 3>(xb, K, qrow, drow, mrow, S, xs, out, ldo);
      default: return tile_bf16<Q4, 4>(xb, K, qrow, drow, mrow, S, xs, out, ldo);
    }
  }
#endif
#ifdef KVF_AVX2
  if (path == 1) {
    switch (R) {
      case 1: return tile_avx2<Q4, 1>(x, K, qrow, drow, mrow, S, xs, out, ldo);
      case 2: return tile_avx2<Q4, 2>(x, K, qrow, drow, mrow, S, xs, out, ldo);
      case 3: return tile_avx2<Q4, 3>(x, K, qrow, drow, mrow, S, xs, out, ldo);
      default: return tile_avx2<Q4, 4>(x, K, qrow, drow, mrow, S, xs, out, ldo);
    }
  }
#endif
  (void)xb;
  tile_scalar<Q4>(x, K, R, qrow, drow, mrow, S, xs, out, ldo);
}

int best_path(int want_bf16) {
#ifdef KVF_BF16
  if (want_bf16) return 2;
#endif
  (void)want_bf16;
#ifdef KVF_AVX2
  return 1;
#else
  return 0;
#endif
}

template <bool Q4>
void gemm(const float* x, int64_t M, int64_t K, const uint8_t* qs, const float* d,
          const float* m, int64_t S, int64_t N, float* out, int want_bf16) {
  const int path = best_path(want_bf16);
  const int64_t G = K / S;
  std::vector<float> xs(static_cast<size_t>(M * G));
  group_sums(x, M, K, S, xs.data());
  std::vector<uint16_t> xb;
#ifdef KVF_BF16
  if (path == 2) {
    xb.resize(static_cast<size_t>(M * K));
    to_bf16_rows(x, M * K, xb.data());
  }
#endif
  const int64_t row_bytes = Q4 ? K / 2 : K;
  const int64_t chunk = 8;  // output columns per scheduling unit
  const int64_t nchunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qrow = qs + n * row_bytes;
      const float* drow = d + n * G;
      const float* mrow = m == nullptr ? nullptr : m + n * G;
      for (int64_t r0 = 0; r0 < M; r0 += kMaxTile) {
        const int R = static_cast<int>(M - r0 < kMaxTile ? M - r0 : kMaxTile);
        run_tile<Q4>(path, x + r0 * K, xb.empty() ? nullptr : xb.data() + r0 * K, K, R, qrow,
                     drow, mrow, S, xs.data() + r0 * G, out + r0 * N + n, N);
      }
    }
  }
}

}  // namespace

extern "C" {

// 2: AVX-512 BF16 (bf16 activations) and AVX2 built; 1: AVX2 + FMA (float32 activations);
// 0: scalar only.
int kvf_isa() { return best_path(1); }

// 4-bit (PackedQ4): qs uint8 [N, K/2], d and m float32 [N, K/32]. out float32 [M, N].
void kvf_gemm_q4(const float* x, int64_t M, int64_t K, const uint8_t* qs, const float* d,
                 const float* m, int64_t N, float* out, int bf16) {
  gemm<true>(x, M, K, qs, d, m, 32, N, out, bf16);
}

// 8-bit (PackedQ8): qs int8 [N, K], d float32 [N, K/S] (S 32 or 16), m like d or null.
void kvf_gemm_q8(const float* x, int64_t M, int64_t K, const int8_t* qs, const float* d,
                 const float* m, int64_t S, int64_t N, float* out, int bf16) {
  gemm<false>(x, M, K, reinterpret_cast<const uint8_t*>(qs), d, m, S, N, out, bf16);
}

}  // extern "C"
