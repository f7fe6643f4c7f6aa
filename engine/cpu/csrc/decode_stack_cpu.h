// The decode-step layer stack (decode_stack_cpu.cpp): its linears, layers and the stack itself,
// declared for the bindings.
#pragma once

#include "torch_lite.h"

#include <array>
#include <optional>
#include <vector>

#include "weight_prefetch.h"

namespace kvserve_stack {

// What computes a linear: a float weight (at::linear), 4-bit or 8-bit groups (each on the base
// or the AVX-512 VNNI kernel), 4-bit groups stored blocked (quant_gemm_q4_blocked), or the AVX2
// panel kernel over pre-packed float panels; kQ5: 5-bit groups (quant_gemm_q5.cpp);
// kQ8Interleaved: 8-bit groups stored interleaved (quant_gemm_q8_interleaved, every row count).
// kConcat: the outputs of parts side by side (a projection whose parts differ in format).
// kFaithfulQ4 / kFaithfulQ8: 4-bit / 8-bit groups in the rows layout times float32 or bf16
// activations, by the faithful kernels (quant_faithful.cpp, a library of its own: fn is the
// address of its kvf_gemm_q4 / kvf_gemm_q8, bf16 its last argument).
enum Kind : int64_t {
  kFloat = 0, kQ4 = 1, kQ4Vnni = 2, kQ8 = 3, kPanels = 4, kQ8Vnni = 5, kQ4Blocked = 6,
  kConcat = 7, kQ5 = 8, kQ8Interleaved = 9, kFaithfulQ4 = 10, kFaithfulQ8 = 11
};

// y = x @ W^T (+ bias). w: the float weight, the packed qs, or the panels; d/m: scales and
// mins of packed weights; bias: for kPanels the panel-padded copy the kernel adds itself;
// tiles_from (0: never): inputs of at least that many rows run quant_gemm_q4_tiled (4-bit
// kinds) or quant_gemm_q8_batch (8-bit kinds) instead of the decode kernel, or for
// kQ8Interleaved and kQ4Blocked their kernel's AMX tiles, as QuantLinear does (its tiles_from,
// lanes_from, amx_from); tiles_vnni: the 4-bit tiles (those and
// quant_gemm_q4_blocked's) run on VNNI (QuantLinear.q4_tiles; the same floats).
struct StackLinear {
  StackLinear(int64_t kind, at::Tensor w, std::optional<at::Tensor> d,
              std::optional<at::Tensor> m, std::optional<at::Tensor> bias,
              int64_t out_features, int64_t tiles_from = 0, bool tiles_vnni = false,
              int64_t fn = 0, bool bf16 = false);
  // A kConcat of parts (each a packed kind).
  explicit StackLinear(std::vector<StackLinear> parts);
  at::Tensor operator()(const at::Tensor& x) const;
  // Whether x's rows take the batch kernel (tiles_from, above).
  bool batched(const at::Tensor& x) const { return tiles_from > 0 && x.size(0) >= tiles_from; }
  // Whether the outputs do not depend on how many threads compute them: the packed kernels
  // give each output column to one thread whole (float GEMMs may split their sums by thread).
  bool thread_invariant() const;

  int64_t kind;
  at::Tensor w;
  std::optional<at::Tensor> d, m, bias;
  int64_t out_features;
  int64_t tiles_from = 0;
  bool tiles_vnni = false;
  int64_t fn = 0;     // the faithful kinds' kernel (a C function's address)
  bool bf16 = false;  // the faithful kinds: bf16 activations
  std::vector<StackLinear> parts;
};

// Seconds of each of `passes` passes, each calling linears[i](xs[i]) for every i in order:
// the linears as a decode step calls them, timed without Python between the calls
// (--activation-precision auto's measurement, engine/weight_prep/activation_measure.py).
std::vector<double> time_stack_linears(const std::vector<StackLinear>& linears,
                                       const std::vector<at::Tensor>& xs, int64_t passes);

// A mixture-of-experts MLP (engine/models/moe.py MoeBlock with the grouped path): the
// router [E, H] applied as F.linear, softmax in float32, top_k (renormalised when normalise),
// then each expert that got rows runs gate_up, SiLU x up and down on those rows only, weighted
// and index_add_-ed into the output, experts in id order.
struct StackMoe {
  at::Tensor router;
  int64_t top_k;
  bool normalise;
  std::vector<StackLinear> gate_up, down;  // per expert
  // The experts one per thread (moe_forward), not one after another on every thread: set at
  // construction when asked for and every expert's linears are thread_invariant.
  bool concurrent = true;
};

// A Llama-style layer, or a Gemma one (sandwich norms: pre_ff_norm and post_ff_norm set;
// post_norm then normalises the attention output). act: 0 SiLU x up, 1 GeGLU (gelu_tanh x up).
// rope: which of forward's cos/sin tables the layer rotates with (Gemma 3's local layers: 1).
// moe: the layer's MLP is a mixture of experts (then gate_up and down are unset).
// softcap > 0: attention scores soft-capped, softcap * tanh(s / softcap) (Gemma 2).
struct StackLayer {
  at::Tensor input_norm, post_norm;
  double eps;
  StackLinear qkv, o;
  std::optional<StackLinear> gate_up, down;
  int64_t num_heads, num_kv_heads, head_dim, window;
  double scale;
  std::optional<at::Tensor> q_norm, k_norm;
  std::optional<at::Tensor> pre_ff_norm, post_ff_norm;
  int64_t act = 0;
  int64_t rope = 0;
  std::optional<StackMoe> moe;
  double softcap = 0.0;
};

// One projection's LoRA slots (lora_cpu.cpp lora_apply_'s weights): A [S, P*R, K], P parts of
// B transposed [S, R, O_p], ranks [S, P], each part's output offset. The tensors are shared with the
// Python side, which writes adapters into them between steps.
struct StackLoRA {
  at::Tensor a;
  std::vector<at::Tensor> b;
  at::Tensor ranks;
  std::vector<int64_t> offsets;
};

}  // namespace kvserve_stack

class DecodeStack {
 public:
  void add_layer(kvserve_stack::StackLayer layer);
  // The KV pools, one K and one V per layer, kept until set again: float32, float16 or
  // bfloat16 rows, int8 rows of head_dim values and a float16 scale (int8_scale_floor: the
  // smallest scale stored), or int4 (uint8) rows (engine/kv_storage/formats.py).
  void set_kv_caches(std::vector<at::Tensor> k, std::vector<at::Tensor> v,
                     double int8_scale_floor);
  // Which KV group each layer attends with (a hybrid KV cache: index into forward's slots,
  // block_tables and seq_lens); every layer group 0 until set.
  void set_layer_groups(std::vector<int64_t> groups);
  // LoRA slots of layer `layer`'s projection `module` (0 qkv, 1 o, 2 gate_up, 3 down): with
  // forward's lora_rows, each row's adapter delta is added to that projection's output, by the
  // same kernel as the Python path (engine/lora/weights.py).
  void set_lora(int64_t layer, int64_t module, at::Tensor a, std::vector<at::Tensor> b,
                at::Tensor ranks, std::vector<int64_t> offsets);
  // Final hidden states [T, hidden] of decode rows x [T, hidden] (the embedding output, which
  // becomes the residual stream and is overwritten, as in the Python path). cos/sin: the RoPE
  // tables (StackLayer::rope indexes them); slots/block_tables/seq_lens: one per KV group.
  at::Tensor forward(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                     std::vector<at::Tensor> slots, std::vector<at::Tensor> block_tables,
                     std::vector<at::Tensor> seq_lens, at::Tensor final_norm, double final_eps,
                     std::optional<at::Tensor> lora_rows = std::nullopt);
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // While one thread does a serial part of the step, the other loads the next linears'
  // weights, at most ahead_bytes past the next one's start (weight_prefetch.h); 0: off.
  void set_prefetch(int64_t ahead_bytes);
  int64_t prefetch() const { return static_cast<int64_t>(stream_.ahead()); }
  int64_t prefetched_bytes() const { return static_cast<int64_t>(stream_.loaded_bytes()); }

 private:
  std::vector<kvserve_stack::StackLayer> layers_;
  std::vector<std::array<std::optional<kvserve_stack::StackLoRA>, 4>> loras_;  // per layer
  std::vector<int64_t> groups_;  // per layer
  std::vector<at::Tensor> k_caches_, v_caches_;
  bool int8_ = false;
  bool int4_ = false;
  at::ScalarType pool_dtype_ = at::kFloat;
  double int8_floor_ = 0.0;
  // The linears' bytes in the order a step reads them (a mixture of experts' MLP left out),
  // and each layer's o projection's index in it (where the attention's loads start); built
  // at the first forward after add_layer.
  void index_weights();
  kvserve_stack::WeightStream stream_;
  std::vector<int> o_linear_;
  size_t indexed_ = 0;
};
