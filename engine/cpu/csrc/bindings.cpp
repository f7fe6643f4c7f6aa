// The Python module of the CPU kernels (built on first use by engine/cpu/kernels.py).
#include <torch/extension.h>

#include <string>

#include "decode_stack_cpu.h"
#include "kernels.h"

// Every tensor kernel runs without the GIL (py::call_guard): the server's event loop thread
// can format and send tokens while the engine thread computes, instead of queueing for the GIL
// behind a kernel (and then holding the engine thread up when it gets it).
using nogil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The paged decode kernels; softcap (Gemma 2's soft-capped scores) optional, 0 = off.
#define KVSERVE_PAGED_ARGS                                                                  \
  py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),         \
      py::arg("seq_lens"), py::arg("scale"), py::arg("window")
  m.def("paged_decode_cpu", &paged_decode_cpu,
        "paged decode attention (CPU, fp32 queries; fp32/fp16/bf16 pool)", KVSERVE_PAGED_ARGS,
        py::arg("softcap") = 0.0, nogil());
  m.def("paged_decode_cpu_int8", &paged_decode_cpu_int8,
        "paged decode attention over an int8 pool (rows: int8 x D, float16 scale)",
        KVSERVE_PAGED_ARGS, py::arg("softcap") = 0.0, nogil());
  m.def("paged_decode_cpu_fp8", &paged_decode_cpu_fp8,
        "paged decode attention over an fp8 pool (uint8 view, byte table, per-head scales)",
        KVSERVE_PAGED_ARGS, py::arg("lut"), py::arg("k_scales"), py::arg("v_scales"),
        py::arg("softcap") = 0.0, nogil());
  m.def("paged_decode_cpu_int4", &paged_decode_cpu_int4,
        "paged decode attention over an int4 pool (q4_0 nibbles, float16 scale per group; no "
        "rotation)", KVSERVE_PAGED_ARGS, py::arg("softcap") = 0.0, nogil());
#undef KVSERVE_PAGED_ARGS
  m.def("first_argmax_rows", &first_argmax_rows,
        "per row the first maximal index of a float32 matrix (argmax; NaN the maximum)", nogil());
  m.def("int4_rotate_cpu", &int4_rotate_cpu, "formats.int4_rotate, bit for bit (float32)", nogil());
  m.def("int4_quantize_rows_cpu", &int4_quantize_rows_cpu,
        "formats.quantize_rows for an int4 pool, bit for bit (uint8 rows)", nogil());
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU, fp32)", nogil());
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; RMSNorm(residual) (CPU, fp32)", nogil());
  m.def("silu_mul", &silu_mul, "silu(gate) * up over [gate | up] (CPU, fp32)", nogil());
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up over [gate | up] (CPU, fp32)",
        nogil());
  m.def("rotary_", &rotary_, "rotate-half RoPE in place (CPU, fp32)", nogil());
  m.def("lora_apply_", &lora_apply_,
        "out += each row's LoRA delta: B_p[s] (A_p[s] x), s = slots[t] >= 0 (CPU, fp32)", nogil());
  m.def("small_gemm_pack", &small_gemm_pack, "pack W [N, K] into 16-column panels", nogil());
  m.def("small_gemm_supported", &small_gemm_supported, "built with AVX2+FMA");
  m.def("small_gemm", &small_gemm, "x @ W^T (+ b) for few rows (CPU, fp32, AVX2)", nogil());
  m.def("quant_gemm_q4", &quant_gemm_q4, "x @ W^T, W 4-bit groups of 32 (d*q+m)", nogil());
  m.def("quant_gemm_q4_fma", &quant_gemm_q4_fma, "q4 x float activations, float FMA (benchmark)", nogil());
  m.def("quant_gemm_q8", &quant_gemm_q8, "x @ W^T, W 8-bit groups of 32 (d*q [+ m]; d per 16 or 32)", nogil());
  m.def("quant_dequant_q4", &quant_dequant_q4, "float32 (bf16=True: bfloat16) rows of a 4-bit packed weight",
        py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("rows"), py::arg("bf16") = false, nogil());
  m.def("quant_dequant_q8", &quant_dequant_q8, "float32 (bf16=True: bfloat16) rows of an 8-bit packed weight",
        py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("rows"), py::arg("bf16") = false, nogil());
  m.def("quant_gemm_q5", &quant_gemm_q5, "x @ W^T, W 5-bit groups of 32 (d*q+m; Q5_0/Q5_1)", nogil());
  m.def("quant_dequant_q5", &quant_dequant_q5, "float32 (bf16=True: bfloat16) rows of a 5-bit packed weight",
        py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("rows"), py::arg("bf16") = false, nogil());
  m.def("quant_gemm_isa", &quant_gemm_isa, "the instruction set the quant kernels use");
  m.def("quant_gemm_q4_tiled", &quant_gemm_q4_tiled,
        "quant_gemm_q4's math for batches and prefill (8-column blocks repacked per call; "
        "vnni=True: on the AVX-512 VNNI tiles, the same floats)",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("vnni") = false, nogil());
  m.def("quant_gemm_q4_blocked", &quant_gemm_q4_blocked,
        "quant_gemm_q4's math over the blocked 4-bit layout (engine/quantization/blocked.py), any "
        "rows (vnni=True: on the AVX-512 VNNI tiles; amx=True: on AMX int8 tiles, where "
        "quant_gemm_q8_amx_available(); the same floats)",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("N"),
        py::arg("vnni") = false, py::arg("amx") = false, nogil());
  m.def("quant_dequant_q4_blocked", &quant_dequant_q4_blocked,
        "float32 (bf16=True: bfloat16) rows of a blocked 4-bit weight", nogil());
  m.def("quant_gemm_q4_vnni", &quant_gemm_q4_vnni, "quant_gemm_q4 on AVX-512 VNNI (two groups per step)", nogil());
  m.def("quant_gemm_q8_vnni", &quant_gemm_q8_vnni, "quant_gemm_q8 on AVX-512 VNNI (64 weights per step)", nogil());
  m.def("quant_gemm_q8_batch", &quant_gemm_q8_batch,
        "quant_gemm_q8's math for decode batches on AVX-512 VNNI (16 rows in the lanes)", nogil());
  m.def("quant_gemm_q8_interleaved", &quant_gemm_q8_interleaved,
        "quant_gemm_q8_batch's floats over an interleaved 8-bit weight (16 outputs in the lanes; "
        "every row count; AVX-512 VNNI where built unless avx2, else AVX2; amx: AMX int8 "
        "tiles, where quant_gemm_q8_amx_available(): the same floats)",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("N"),
        py::arg("avx2") = false, py::arg("amx") = false, nogil());
  m.def("quant_gemm_q8_interleaved_available", &quant_gemm_q8_interleaved_available,
        "whether quant_gemm_q8_interleaved was built (AVX2 targeted)");
  m.def("quant_gemm_q8_amx_available", &quant_gemm_q8_amx_available,
        "whether quant_gemm_q8_interleaved's AMX tiles were built (AMX-INT8 targeted) and the "
        "OS grants this process the tile state");
  m.def("store_kv_cpu", &store_kv_cpu, "k/v rows into pool slots (negative: skipped), as bytes",
        nogil());
  m.def("quant_gemm_q4_vnni_available", &quant_gemm_q4_vnni_available,
        "whether quant_gemm_q4_vnni was built (AVX-512 BW/VL + VNNI targeted)");
  using kvserve_stack::StackLayer;
  using kvserve_stack::StackLinear;
  using kvserve_stack::StackMoe;
  py::class_<StackLinear>(m, "StackLinear", "one linear of a DecodeStack layer")
      .def(py::init<int64_t, torch::Tensor, std::optional<torch::Tensor>,
                    std::optional<torch::Tensor>, std::optional<torch::Tensor>, int64_t,
                    int64_t, bool, int64_t, bool>(),
           py::arg("kind"), py::arg("w"), py::arg("d"), py::arg("m"), py::arg("bias"),
           py::arg("out_features"), py::arg("tiles_from") = 0, py::arg("tiles_vnni") = false,
           py::arg("fn") = 0, py::arg("bf16") = false)
      .def(py::init<std::vector<StackLinear>>(), py::arg("parts"));
  m.def("time_stack_linears", &kvserve_stack::time_stack_linears,
        "seconds of each pass calling linears[i](xs[i]) in order", py::arg("linears"),
        py::arg("xs"), py::arg("passes"), nogil());
  py::class_<StackLayer>(m, "StackLayer", "one decoder layer of a DecodeStack")
      .def(py::init([](torch::Tensor input_norm, torch::Tensor post_norm, double eps,
                       StackLinear qkv, StackLinear o, std::optional<StackLinear> gate_up,
                       std::optional<StackLinear> down,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t window,
                       double scale, std::optional<torch::Tensor> q_norm,
                       std::optional<torch::Tensor> k_norm,
                       std::optional<torch::Tensor> pre_ff_norm,
                       std::optional<torch::Tensor> post_ff_norm, int64_t act, int64_t rope,
                       std::optional<StackMoe> moe, double softcap) {
             return StackLayer{input_norm, post_norm, eps, qkv, o, gate_up, down, num_heads,
                               num_kv_heads, head_dim, window, scale, q_norm, k_norm,
                               pre_ff_norm, post_ff_norm, act, rope, moe, softcap};
           }),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("window"), py::arg("scale"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("pre_ff_norm") = py::none(),
           py::arg("post_ff_norm") = py::none(), py::arg("act") = 0, py::arg("rope") = 0,
           py::arg("moe") = py::none(), py::arg("softcap") = 0.0);
  py::class_<StackMoe>(m, "StackMoe", "a mixture-of-experts MLP of a DecodeStack layer")
      .def(py::init([](torch::Tensor router, int64_t top_k, bool normalise,
                       std::vector<StackLinear> gate_up, std::vector<StackLinear> down,
                       bool concurrent) {
             for (const auto* linears : {&gate_up, &down}) {
               for (const auto& l : *linears) concurrent = concurrent && l.thread_invariant();
             }
             return StackMoe{router, top_k, normalise, std::move(gate_up), std::move(down),
                             concurrent};
           }),
           py::arg("router"), py::arg("top_k"), py::arg("normalise"), py::arg("gate_up"),
           py::arg("down"), py::arg("concurrent") = true);
  py::class_<DecodeStack>(m, "DecodeStack", "a decode step's layer stack in one call")
      .def(py::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_kv_caches", &DecodeStack::set_kv_caches)
      .def("set_layer_groups", &DecodeStack::set_layer_groups)
      .def("set_lora", &DecodeStack::set_lora)
      .def("forward", &DecodeStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"),
           py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("final_norm"), py::arg("final_eps"), py::arg("lora_rows") = py::none(),
           nogil())
      .def("set_prefetch", &DecodeStack::set_prefetch)
      .def_property_readonly("prefetch", &DecodeStack::prefetch)
      .def_property_readonly("prefetched_bytes", &DecodeStack::prefetched_bytes)
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
}
