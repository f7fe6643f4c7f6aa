// The faithful packed kernels (issue 65): y[M, N] = x[M, K] @ W^T for packed 4-bit and 8-bit
// weights (engine/quantization/formats.py PackedQ4 / PackedQ8) WITHOUT rounding the activations
// to int8 per group, as quant_gemm_cpu.cpp (llama.cpp's q8 dot products) does. The weights are
// dequantised in registers; the activations stay float32 (AVX-512F, AVX2/FMA or scalar paths)
// or are rounded once to bfloat16 (AVX-512 BF16 path: vdpbf16ps; bf16 keeps each element's own
// exponent, where int8 groups share one scale amax/127 across 32 elements).
//
// AVX-512F, float32 activations (the default's path, section KVF_F512): each weight is
// w = d * q + m (one fma, as the float model dequantises; w = d * q without mins): a 4-bit
// group's 16 possible values built once, each nibble looked up by vpermps; an 8-bit chunk
// widened and scaled. Then acc += w * x per 16-lane chunk in element order, the lanes reduced
// at the end. Tiles of up to 4 rows x 4 columns (decode) or 8 x 2 (more rows); the column tile
// 8 ahead is prefetched into L2 a line per step (decode is otherwise bound by memory latency).
//
// The other paths, per output n and activation row r, over the scale groups g of S elements
// (S = 32 for 4-bit; 32 or 16 for 8-bit):
//   y[r, n] = sum_g d[n, g] * sum_j q[n, gS + j] * x[r, gS + j]  +  sum_g m[n, g] * xs[r, g]
// with xs[r, g] the float32 sum of the group's activations (in a fixed order) and q the stored
// integers (0..15 for 4-bit, -128..127 for 8-bit: exact in bf16 and float32). The products
// q * x are exact in float32 for bf16 x (vdpbf16ps multiplies exactly and adds in float32).
//
// Scales and mins are float32, or float16 (flag 2: a GGUF's, widened exactly in the kernel).
//
// Batch invariance: every row goes through the same sequence of instructions whatever M: each
// (row, column) with its own accumulators filled in element (group) order, the same
// reduction; tiles only decide which rows share a decoded chunk and which columns share an
// activation load; the activation conversion and group sums are per row. Threads split the
// output columns only. So row r's output is bit-identical for any M (and any thread count).
// Built without fp contraction (-ffp-contract=off), so the scalar parts compile to the same
// operations in every tile size.
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
#if defined(__AVX512F__)
#define KVF_F512 1
#endif

inline uint16_t to_bf16(float f) {  // round to nearest even (as vcvtneps2bf16; no NaNs here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// A float16 bit pattern as float32 (exact; no F16C needed).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400) == 0) {
      man <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
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

#ifdef KVF_F512
// ---------------------------------------------------------------- AVX-512F, float32 x
// Each weight dequantised in registers exactly as the float model does (w = d * q + m, one
// rounding: fma), then acc += x * w per 16-lane chunk, in element order. A tile is R rows
// (1..4) by C output columns (1..4): the rows share each decoded chunk, the columns share each
// activation load; every (row, column) has its own accumulator, so a row's arithmetic is the
// same whatever R and C (batch invariance) and no group sums or min terms are needed.
alignas(64) const float kIota16[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// Bytes [p, p + n) prefetched into L2 (a tile's weights are too short a stream for the
// hardware prefetchers to learn before it ends: prefetch_ahead.h says the same of the int8
// kernels).
inline void prefetch_range(const void* p, int64_t n) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n);
  for (uintptr_t a = first; a < end; a += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);
}

template <int R, int C>
void tile_f512_q4(const float* x, int64_t K, const uint8_t* q, int64_t ldq, const float* d,
                  const float* m, int64_t ldd, float* out, int64_t ldo, const uint8_t* pf,
                  int64_t pf_lines) {
  const int64_t G = K / 32;
  const __m512 iota = _mm512_load_ps(kIota16);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (g < pf_lines) __builtin_prefetch(pf + 64 * g, 0, 2);
    __m512 lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      // table[v] = d * v + m: the 16 values a nibble of this group stands for
      const __m512 dv = _mm512_set1_ps(d[c * ldd + g]);
      const __m512 table = m == nullptr ? _mm512_mul_ps(iota, dv)
                                        : _mm512_fmadd_ps(iota, dv,
                                                          _mm512_set1_ps(m[c * ldd + g]));
      const __m512i raw = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * ldq + g * 16)));
      lo[c] = _mm512_permutexvar_ps(raw, table);  // vpermps reads the low 4 bits
      hi[c] = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_loadu_ps(x + r * K + g * 32);
      const __m512 x1 = _mm512_loadu_ps(x + r * K + g * 32 + 16);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(lo[c], x0, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(hi[c], x1, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// 8-bit: S = 32 or 16 elements per scale; every 16-lane chunk has one scale.
template <int R, int C>
void tile_f512_q8(const float* x, int64_t K, const int8_t* q, int64_t ldq, const float* d,
                  const float* m, int64_t ldd, int64_t S, float* out, int64_t ldo,
                  const uint8_t* pf, int64_t pf_lines) {
  const int64_t J = K / 16, per = S / 16;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < J; ++j) {
    // 8-bit rows are twice a 4-bit row's bytes: two lines per step of 16
    if (2 * j < pf_lines) __builtin_prefetch(pf + 128 * j, 0, 2);
    if (2 * j + 1 < pf_lines) __builtin_prefetch(pf + 128 * j + 64, 0, 2);
    const int64_t g = j / per;
    __m512 w[C];
    for (int c = 0; c < C; ++c) {
      const __m512 qv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * ldq + j * 16))));
      const __m512 dv = _mm512_set1_ps(d[c * ldd + g]);
      w[c] = m == nullptr ? _mm512_mul_ps(qv, dv)
                          : _mm512_fmadd_ps(qv, dv, _mm512_set1_ps(m[c * ldd + g]));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + j * 16);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <bool Q4, int R, int C>
void tile_f512(const float* x, int64_t K, const uint8_t* q, int64_t ldq, const float* d,
               const float* m, int64_t ldd, int64_t S, float* out, int64_t ldo,
               const uint8_t* pf, int64_t pf_lines) {
  if (Q4)
    tile_f512_q4<R, C>(x, K, q, ldq, d, m, ldd, out, ldo, pf, pf_lines);
  else
    tile_f512_q8<R, C>(x, K, reinterpret_cast<const int8_t*>(q), ldq, d, m, ldd, S, out, ldo,
                       pf, pf_lines);
}

template <bool Q4, int C>
void rows_f512(const float* x, int64_t K, int R, const uint8_t* q, int64_t ldq, const float* d,
               const float* m, int64_t ldd, int64_t S, float* out, int64_t ldo,
               const uint8_t* pf, int64_t pf_lines) {
  switch (R) {
    case 1: return tile_f512<Q4, 1, C>(x, K, q, ldq, d, m, ldd, S, out, ldo, pf, pf_lines);
    case 2: return tile_f512<Q4, 2, C>(x, K, q, ldq, d, m, ldd, S, out, ldo, pf, pf_lines);
    case 3: return tile_f512<Q4, 3, C>(x, K, q, ldq, d, m, ldd, S, out, ldo, pf, pf_lines);
    case 4: return tile_f512<Q4, 4, C>(x, K, q, ldq, d, m, ldd, S, out, ldo, pf, pf_lines);
    default: break;
  }
  if constexpr (C <= 2) {  // 5..8 rows: tiles of two columns (the accumulators' registers)
    switch (R) {
      case 5: return tile_f512<Q4, 5, C>(x, K, q, ldq, d, m, ldd, S, out, ldo, pf, pf_lines);
      case 6: return tile_f512<Q4, 6, C>(x, K, q, ldq, d, m, ldd, S, out, ldo, pf, pf_lines);
      case 7: return tile_f512<Q4, 7, C>(x, K, q, ldq, d, m, ldd, S, out, ldo, pf, pf_lines);
      default: return tile_f512<Q4, 8, C>(x, K, q, ldq, d, m, ldd, S, out, ldo, pf, pf_lines);
    }
  }
}

// n float16 values (bit patterns) at p as float32 (exact).
inline void widen_half(const uint8_t* p, int64_t n, float* out) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(h + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(h[i]);
}

// Column tiles ahead whose bytes a tile prefetches (measured: 4 or 16 no better than 8).
constexpr int64_t kLeadTiles = 8;

// Output columns [n0, n1) for every row, in tiles of up to 4 rows x 4 columns (M <= 4) or 8
// rows x 2 columns (the rows share each decoded chunk of weights, the columns each activation
// load; 8 rows decode half as often, which measured faster from 16 rows), row tile by row tile,
// each over every column of [n0, n1): a caller passes few enough columns (prefill) for their
// weights to stay in L1 while the row tiles pass, or a decode step's whole share (one stream).
// Every (row, column) is the same sequence of operations whatever M.
template <bool Q4>
void columns_f512(const float* x, int64_t M, int64_t K, const uint8_t* qs, const void* d_,
                  const void* m_, bool half, int64_t S, int64_t N, int64_t n0, int64_t n1,
                  float* out) {
  const int64_t ldq = Q4 ? K / 2 : K, ldd = K / S;
  const int64_t width = M <= 4 ? 4 : 2, tile_rows = M <= 4 ? 4 : 8;
  const int64_t scale_bytes = half ? 2 : 4;
  const uint8_t* d = static_cast<const uint8_t*>(d_);
  const uint8_t* m = static_cast<const uint8_t*>(m_);
  // float16 scales: a column tile's scales and mins widened here (exactly) before its loop
  std::vector<float> wide(half ? static_cast<size_t>(2 * width * ldd) : 0);
  {  // the first kLeadTiles column tiles (the first row tile prefetches each later one)
    const int64_t end = n0 + width * kLeadTiles < n1 ? n0 + width * kLeadTiles : n1;
    prefetch_range(qs + n0 * ldq, (end - n0) * ldq);
    prefetch_range(d + n0 * ldd * scale_bytes, (end - n0) * ldd * scale_bytes);
    if (m != nullptr) prefetch_range(m + n0 * ldd * scale_bytes, (end - n0) * ldd * scale_bytes);
  }
  for (int64_t r0 = 0; r0 < M; r0 += tile_rows) {
    const int R = static_cast<int>(M - r0 < tile_rows ? M - r0 : tile_rows);
    for (int64_t n = n0; n < n1; n += width) {
      const int C = static_cast<int>(n1 - n < width ? n1 - n : width);
      const uint8_t* q = qs + n * ldq;
      const float* dn = reinterpret_cast<const float*>(d + n * ldd * scale_bytes);
      const float* mn =
          m == nullptr ? nullptr : reinterpret_cast<const float*>(m + n * ldd * scale_bytes);
      if (half) {
        widen_half(d + n * ldd * 2, C * ldd, wide.data());
        dn = wide.data();
        if (m != nullptr) {
          widen_half(m + n * ldd * 2, C * ldd, wide.data() + width * ldd);
          mn = wide.data() + width * ldd;
        }
      }
      // The first row tile brings the column tile kLeadTiles ahead (of these columns) into
      // L2: its scales and mins now, its weights a line per step of the tile's loop.
      const int64_t na = n + width * kLeadTiles;
      const uint8_t* pf = qs;
      int64_t lines = 0;
      if (r0 == 0 && na < n1) {
        const int64_t ca = n1 - na < width ? n1 - na : width;
        pf = qs + na * ldq;
        lines = (ca * ldq + 63) / 64;
        prefetch_range(d + na * ldd * scale_bytes, ca * ldd * scale_bytes);
        if (m != nullptr) prefetch_range(m + na * ldd * scale_bytes, ca * ldd * scale_bytes);
      }
      const float* xr = x + r0 * K;
      float* o = out + r0 * N + n;
      switch (C) {
        case 1: rows_f512<Q4, 1>(xr, K, R, q, ldq, dn, mn, ldd, S, o, N, pf, lines); break;
        case 2: rows_f512<Q4, 2>(xr, K, R, q, ldq, dn, mn, ldd, S, o, N, pf, lines); break;
        case 3: rows_f512<Q4, 3>(xr, K, R, q, ldq, dn, mn, ldd, S, o, N, pf, lines); break;
        default: rows_f512<Q4, 4>(xr, K, R, q, ldq, dn, mn, ldd, S, o, N, pf, lines); break;
      }
    }
  }
}
#endif  // KVF_F512

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
#ifdef KVF_F512
  return 3;
#endif
#ifdef KVF_AVX2
  return 1;
#else
  return 0;
#endif
}

// The flags of the C entry points.
constexpr int kFlagBf16 = 1;       // bf16 activations where built
constexpr int kFlagHalfScales = 2;  // d and m are float16 (bit patterns), not float32

template <bool Q4>
void gemm(const float* x, int64_t M, int64_t K, const uint8_t* qs, const void* d_,
          const void* m_, int64_t S, int64_t N, float* out, int flags) {
  const int path = best_path(flags & kFlagBf16);
  const bool half = (flags & kFlagHalfScales) != 0;
  const int64_t chunk = 8;  // output columns per scheduling unit
#ifdef KVF_F512
  if (path == 3) {
    if (M <= 4) {  // decode: each thread one contiguous range of columns (one stream)
#pragma omp parallel if (N * K >= 65536)
      {
        const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t n0 = (N * t / T) & ~int64_t{7};
        const int64_t n1 = t + 1 == T ? N : (N * (t + 1) / T) & ~int64_t{7};
        if (n0 < n1) columns_f512<Q4>(x, M, K, qs, d_, m_, half, S, N, n0, n1, out);
      }
      return;
    }
    constexpr int64_t kPrefillCols = 32;  // their weights stay in L1 while the rows pass
    const int64_t nchunks = (N + kPrefillCols - 1) / kPrefillCols;
#pragma omp parallel for schedule(static) if (N * K >= 65536)
    for (int64_t c = 0; c < nchunks; ++c)
      columns_f512<Q4>(x, M, K, qs, d_, m_, half, S, N, c * kPrefillCols,
                       (c + 1) * kPrefillCols < N ? (c + 1) * kPrefillCols : N, out);
    return;
  }
#endif
  const int64_t nchunks = (N + chunk - 1) / chunk;
  const int64_t G = K / S;
  // The other paths read float32 scales: float16 ones widened first (exactly).
  std::vector<float> d32, m32;
  const float* d = static_cast<const float*>(d_);
  const float* m = static_cast<const float*>(m_);
  if (half) {
    d32.resize(static_cast<size_t>(N * G));
    for (int64_t i = 0; i < N * G; ++i) d32[i] = half_to_float(static_cast<const uint16_t*>(d_)[i]);
    d = d32.data();
    if (m_ != nullptr) {
      m32.resize(static_cast<size_t>(N * G));
      for (int64_t i = 0; i < N * G; ++i)
        m32[i] = half_to_float(static_cast<const uint16_t*>(m_)[i]);
      m = m32.data();
    }
  }
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

// 2: AVX-512 BF16 (bf16 activations; float32 ones on AVX-512F); 3: AVX-512F (float32
// activations); 1: AVX2 + FMA (float32 activations); 0: scalar only.
int kvf_isa() { return best_path(1); }

// flags: 1 = bf16 activations (where built), 2 = d and m are float16, not float32.
// 4-bit (PackedQ4): qs uint8 [N, K/2], d and m [N, K/32]. out float32 [M, N].
void kvf_gemm_q4(const float* x, int64_t M, int64_t K, const uint8_t* qs, const void* d,
                 const void* m, int64_t N, float* out, int flags) {
  gemm<true>(x, M, K, qs, d, m, 32, N, out, flags);
}

// 8-bit (PackedQ8): qs int8 [N, K], d [N, K/S] (S 32 or 16), m like d or null.
void kvf_gemm_q8(const float* x, int64_t M, int64_t K, const int8_t* qs, const void* d,
                 const void* m, int64_t S, int64_t N, float* out, int flags) {
  gemm<false>(x, M, K, reinterpret_cast<const uint8_t*>(qs), d, m, S, N, out, flags);
}

}  // extern "C"
