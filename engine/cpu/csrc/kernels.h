// The CPU kernels' entry points (each defined in its own .cpp): for the bindings and for the
// decode stack, which calls them directly.
#pragma once

#include "torch_lite.h"

#include <string>
#include <vector>

// softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax
// (Gemma 2's attention logit soft-capping); 0: off.
at::Tensor paged_decode_cpu(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor block_tables, at::Tensor seq_lens, double scale,
                               int64_t window, double softcap = 0.0);
at::Tensor paged_decode_cpu_int8(at::Tensor q, at::Tensor k_cache,
                                    at::Tensor v_cache, at::Tensor block_tables,
                                    at::Tensor seq_lens, double scale, int64_t window,
                                    double softcap = 0.0);
at::Tensor paged_decode_cpu_fp8(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor block_tables, at::Tensor seq_lens,
                                   double scale, int64_t window, at::Tensor lut,
                                   at::Tensor k_scales, at::Tensor v_scales,
                                   double softcap = 0.0);
at::Tensor paged_decode_cpu_int4(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                 at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                 int64_t window, double softcap = 0.0);
// int4 rows (int4_rows_cpu.cpp): formats.int4_rotate and quantize_rows(int4), bit for bit.
at::Tensor int4_rotate_cpu(at::Tensor x);
at::Tensor int4_quantize_rows_cpu(at::Tensor x);
// argmax_cpu.cpp: per row the first maximal index (a NaN counting as the maximum).
at::Tensor first_argmax_rows(at::Tensor x);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight,
                            double eps);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor gelu_tanh_mul(at::Tensor gate_up);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin);
// lora_cpu.cpp: out += the LoRA delta of each row's adapter slot (-1: none), per part; b holds
// each part's B transposed, [S, R, O_p].
void lora_apply_(at::Tensor out, at::Tensor x, at::Tensor slots, at::Tensor a,
                 std::vector<at::Tensor> b, at::Tensor ranks, std::vector<int64_t> offsets);
at::Tensor small_gemm_pack(at::Tensor w);
bool small_gemm_supported();
at::Tensor small_gemm(at::Tensor x, at::Tensor panels, int64_t N,
                         c10::optional<at::Tensor> bias);
at::Tensor quant_gemm_q4(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m);
at::Tensor quant_gemm_q8(at::Tensor x, at::Tensor qs, at::Tensor d,
                            c10::optional<at::Tensor> m);
at::Tensor quant_gemm_q4_fma(at::Tensor x, at::Tensor qs, at::Tensor d,
                                at::Tensor m);
at::Tensor quant_dequant_q4(at::Tensor qs, at::Tensor d, at::Tensor m,
                               at::Tensor rows, bool bf16);
at::Tensor quant_dequant_q8(at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                               at::Tensor rows, bool bf16);
std::string quant_gemm_isa();
at::Tensor quant_gemm_q5(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m);
at::Tensor quant_dequant_q5(at::Tensor qs, at::Tensor d, at::Tensor m, at::Tensor rows,
                            bool bf16);
at::Tensor quant_gemm_q4_tiled(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m,
                               bool vnni = false);
at::Tensor quant_gemm_q4_blocked(at::Tensor x, at::Tensor qs, at::Tensor d,
                                    at::Tensor m, int64_t N,
                                    bool vnni = false, bool amx = false);
at::Tensor quant_dequant_q4_blocked(at::Tensor qs, at::Tensor d, at::Tensor m,
                                       at::Tensor rows, bool bf16);
at::Tensor quant_gemm_q4_vnni(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m);
bool quant_gemm_q4_vnni_available();
at::Tensor quant_gemm_q8_batch(at::Tensor x, at::Tensor qs, at::Tensor d,
                               c10::optional<at::Tensor> m);
at::Tensor quant_gemm_q8_interleaved(at::Tensor x, at::Tensor qs, at::Tensor d,
                                     c10::optional<at::Tensor> m, int64_t N, bool avx2 = false,
                                     bool amx = false);
bool quant_gemm_q8_interleaved_available();
bool quant_gemm_q8_amx_available();
at::Tensor quant_gemm_q8_vnni(at::Tensor x, at::Tensor qs, at::Tensor d,
                                 c10::optional<at::Tensor> m);
void store_kv_cpu(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor slots);
