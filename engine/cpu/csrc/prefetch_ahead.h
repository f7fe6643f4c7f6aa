// Weights a kernel's tile prefetches into L2 for a later tile while it computes.
//
// A decode step of a few rows reads each weight once and is bound by memory; where a thread's
// tiles are short streams (the blocked 4-bit layout's 4 blocks of G x 128 bytes) the hardware
// prefetchers do not learn them before they end, and where they are one long stream (the
// interleaved 8-bit head's tiles, 16 x K bytes each, one after another) they still leave it
// slower than with these prefetches (docs/decisions.md#quantised-linears). Nothing is
// computed from the prefetched bytes: results are
// unchanged bit for bit, only where the bytes wait changes.
#pragma once

#include <cstdint>

namespace kvserve_prefetch {

// Contiguous byte ranges (weights, scales, mins; 0 bytes: none) a tile loads for a later one.
struct Ahead {
  const uint8_t* q = nullptr;
  int64_t q_bytes = 0;
  const uint8_t* d = nullptr;
  int64_t d_bytes = 0;
  const uint8_t* m = nullptr;
  int64_t m_bytes = 0;
};

// Group g's share (of G) of the cache lines of bytes [p, p + n), prefetched into L2; n = 0:
// none. (No test of p against null: with one, GCC 12 at -O1 and above deleted the prefetches,
// as the assembly shows; so an empty range is told by n.)
inline void prefetch_share(const uint8_t* p, int64_t n, int64_t g, int64_t G) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const int64_t lines =
      n > 0 ? static_cast<int64_t>((reinterpret_cast<uintptr_t>(p) + n - first + 63) / 64) : 0;
  for (int64_t l = g * lines / G, end = (g + 1) * lines / G; l < end; l++) {
    __builtin_prefetch(reinterpret_cast<const void*>(first + 64 * l), 0, 2);
  }
}

}  // namespace kvserve_prefetch
