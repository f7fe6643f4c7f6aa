// The AMX (Advanced Matrix Extensions, int8 tiles) path of quant_gemm_q8_interleaved: built
// where the compiler targets AMX-TILE and AMX-INT8 with AVX-512 VNNI (-march=native on a
// Sapphire Rapids or later Xeon), used where the kernel's caller asks for it and the OS grants
// this process the tile state (Linux's arch_prctl(ARCH_REQ_XCOMP_PERM), once per process).
#pragma once

#include <cstdint>

namespace kvserve_amx {

// An interleaved 8-bit weight (engine/quantization/interleaved.py) and the activations' int8
// rows and terms of quant_gemm_q8_interleaved (kvserve_quant::quantise, kvserve_vnni::row_terms
// with the +128 offset); y [M, N] is written.
struct Q8Problem {
  const uint8_t* w;
  const void* d;
  const void* m;  // nullptr: no mins
  bool half;      // scales (and mins) stored as float16
  int64_t M, K, N, S;
  const int8_t* qx;
  const float* dx;
  const int32_t* neg;
  const float* sx;
  float* y;
};

// Whether the AMX path is built and the OS lets this process use the tile registers.
bool ready();

// y = x @ W^T on AMX tiles; the floats of the VNNI path bit for bit. Requires ready().
void q8_interleaved(const Q8Problem& p);

}  // namespace kvserve_amx
