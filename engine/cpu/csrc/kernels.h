// The CPU kernels' entry points (each defined in its own .cpp): for the bindings and for the
// decode stack, which calls them directly.
#pragma once

#include <torch/extension.h>

#include <string>

torch::Tensor paged_decode_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                               int64_t window);
torch::Tensor paged_decode_cpu_int8(torch::Tensor q, torch::Tensor k_cache,
                                    torch::Tensor v_cache, torch::Tensor block_tables,
                                    torch::Tensor seq_lens, double scale, int64_t window);
torch::Tensor paged_decode_cpu_fp8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor seq_lens,
                                   double scale, int64_t window, torch::Tensor lut,
                                   torch::Tensor k_scales, torch::Tensor v_scales);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                            double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor small_gemm_pack(torch::Tensor w);
bool small_gemm_supported();
torch::Tensor small_gemm(torch::Tensor x, torch::Tensor panels, int64_t N,
                         c10::optional<torch::Tensor> bias);
torch::Tensor quant_gemm_q4(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m);
torch::Tensor quant_gemm_q8(torch::Tensor x, torch::Tensor qs, torch::Tensor d,
                            c10::optional<torch::Tensor> m);
torch::Tensor quant_gemm_q4_fma(torch::Tensor x, torch::Tensor qs, torch::Tensor d,
                                torch::Tensor m);
torch::Tensor quant_dequant_q4(torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                               torch::Tensor rows, bool bf16);
torch::Tensor quant_dequant_q8(torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m,
                               torch::Tensor rows, bool bf16);
std::string quant_gemm_isa();
torch::Tensor quant_gemm_q4_tiled(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m);
torch::Tensor quant_gemm_q4_blocked(torch::Tensor x, torch::Tensor qs, torch::Tensor d,
                                    torch::Tensor m, int64_t N);
torch::Tensor quant_dequant_q4_blocked(torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                                       torch::Tensor rows, bool bf16);
torch::Tensor quant_gemm_q4_vnni(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m);
bool quant_gemm_q4_vnni_available();
torch::Tensor quant_gemm_q8_vnni(torch::Tensor x, torch::Tensor qs, torch::Tensor d,
                                 c10::optional<torch::Tensor> m);
void store_kv_cpu(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor slots);
