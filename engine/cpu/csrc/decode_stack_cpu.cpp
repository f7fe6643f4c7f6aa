// The decoder layer stack of a decode step in one call (CPU, float32): for a step whose rows
// are all decode rows (one new token per sequence, or the few rows of a short query against a
// cached context), the Python layer loop's module calls, views and argument checks are a
// large share of the step (docs/decisions.md#decode-stack); this runs the same loop in C++.
//
// It calls exactly the kernels the Python path calls, in the same order, on the same tensors
// (engine/models/llama.py DecoderLayer.forward with FusedCpuOps and the torch attention
// backend's CPU decode kernel), so its output is bit-identical to that path; the tests hold it
// to torch.equal. What it does not cover (prefill rows, fp8 KV pools, tensor parallelism,
// oneDNN-only linears) stays on the Python path; the Python side
// (engine/models/cpu_decode_stack.py) decides per step.
//
// Per layer, as DecoderLayer.forward:
//   h = rms_norm(x) (first layer, residual = x) or add_rms_norm_(x, residual)
//   qkv = L_qkv(h); RoPE in place on the Q and K heads (after per-head RMSNorm where the model
//   has q_norm/k_norm); K/V rows stored into the pool slots; attn = paged decode over the pool
//   (an int4 pool: rows of the rotated K/V, the query rotated in and the output back);
//   x = L_down(silu_mul(L_gate_up(add_rms_norm_(L_o(attn), residual))))
// and after the last layer the final norm: add_rms_norm_(x, residual).
// A Gemma layer (engine/models/gemma.py GemmaDecoderLayer.forward) ends instead with
//   h = add_rms_norm_(rms_norm(L_o(attn)), residual); x = rms_norm(L_down(gelu_tanh_mul(..)))
// its norms' (1 + w) scales stored as such at load; a hybrid KV cache gives each layer its
// group's slots and block tables, and Gemma 3's local layers their own RoPE table. A
// mixture-of-experts layer (engine/models/moe_model.py) replaces L_down(silu_mul(L_gate_up(h)))
// by its MoeBlock's routing and grouped experts, op for op (moe_forward).
#include "torch_lite.h"

#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>

#include <omp.h>

#include <chrono>
#include <exception>
#include <optional>
#include <vector>

#include "decode_stack_cpu.h"
#include "kernels.h"
#include "stack_faithful.h"
#include "weight_prefetch.h"

namespace kvserve_stack {

StackLinear::StackLinear(int64_t kind, at::Tensor w, std::optional<at::Tensor> d,
                         std::optional<at::Tensor> m, std::optional<at::Tensor> bias,
                         int64_t out_features, int64_t tiles_from, bool tiles_vnni,
                         int64_t fn, bool bf16)
    : kind(kind), w(std::move(w)), d(std::move(d)), m(std::move(m)), bias(std::move(bias)),
      out_features(out_features), tiles_from(tiles_from), tiles_vnni(tiles_vnni), fn(fn),
      bf16(bf16) {
  TORCH_CHECK(kind >= kFloat && kind <= kFaithfulQ8 && kind != kConcat,
              "StackLinear: unknown kind ", kind);
  const bool quant = kind != kFloat && kind != kPanels;
  TORCH_CHECK(!quant || this->d.has_value(), "StackLinear: a packed weight needs its scales");
  TORCH_CHECK(kind != kQ4 && kind != kQ4Vnni && kind != kQ4Blocked && kind != kQ5 &&
                  kind != kFaithfulQ4 || this->m.has_value(),
              "StackLinear: a 4-bit or 5-bit weight needs its mins");
  const bool faithful = kind == kFaithfulQ4 || kind == kFaithfulQ8;
  TORCH_CHECK(!faithful || fn != 0, "StackLinear: a faithful kind needs its kernel");
  TORCH_CHECK(!faithful || (this->w.is_contiguous() && this->d->is_contiguous() &&
                            (this->d->scalar_type() == at::kFloat ||
                             this->d->scalar_type() == at::kHalf) &&
                            (!this->m.has_value() ||
                             (this->m->is_contiguous() &&
                              this->m->scalar_type() == this->d->scalar_type()))),
              "StackLinear: a faithful kind needs contiguous weights and float32 or float16 "
              "scales (mins of the same dtype)");
}

StackLinear::StackLinear(std::vector<StackLinear> parts)
    : kind(kConcat), out_features(0), parts(std::move(parts)) {
  TORCH_CHECK(!this->parts.empty(), "StackLinear: a concatenation needs parts");
  for (const auto& p : this->parts) {
    TORCH_CHECK(p.kind != kConcat, "StackLinear: concatenations do not nest");
    out_features += p.out_features;
  }
}

at::Tensor StackLinear::operator()(const at::Tensor& x) const {
  at::Tensor y;
  switch (kind) {
    case kConcat: {  // as QuantConcat.forward: torch.cat of the parts' outputs
      std::vector<at::Tensor> outs;
      outs.reserve(parts.size());
      for (const auto& p : parts) outs.push_back(p(x));
      return at::cat(outs, -1);
    }
    case kFloat:
      return at::linear(x, w, bias);
    case kPanels:  // bias: the panel-padded copy, added by the kernel
      return small_gemm(x.stride(-1) == 1 ? x : x.contiguous(), w, out_features, bias);
    case kQ4:
    case kQ4Vnni:
      if (batched(x)) {
        y = quant_gemm_q4_tiled(x, w, *d, *m, tiles_vnni);
      } else {
        y = kind == kQ4 ? quant_gemm_q4(x, w, *d, *m) : quant_gemm_q4_vnni(x, w, *d, *m);
      }
      break;
    case kQ8Vnni:
      y = batched(x) ? quant_gemm_q8_batch(x, w, *d, m) : quant_gemm_q8_vnni(x, w, *d, m);
      break;
    case kQ4Blocked:  // batched: on AMX tiles (the same floats)
      y = quant_gemm_q4_blocked(x, w, *d, *m, out_features, tiles_vnni, batched(x));
      break;
    case kQ5:
      y = quant_gemm_q5(x, w, *d, *m);
      break;
    case kQ8Interleaved:  // batched: on AMX tiles (the same floats)
      y = quant_gemm_q8_interleaved(x, w, *d, m, out_features, /*avx2=*/false, batched(x));
      break;
    case kFaithfulQ4:
    case kFaithfulQ8:  // every row count on the one kernel (batch-invariant)
      y = faithful_gemm(*this, x);
      break;
    default:  // kQ8
      y = batched(x) ? quant_gemm_q8_batch(x, w, *d, m) : quant_gemm_q8(x, w, *d, m);
  }
  if (bias.has_value()) y.add_(*bias);
  return y;
}

bool StackLinear::thread_invariant() const {
  if (kind == kConcat) {
    for (const auto& p : parts) {
      if (!p.thread_invariant()) return false;
    }
    return true;
  }
  return kind != kFloat && kind != kPanels;
}

namespace {

// K or V rows [T, KVH, D] as int8 pool rows [T, KVH, D + 2]: engine/kv_cache/kv_quant.py
// quantize_rows, op for op (the same ATen kernels, so the same bytes): a float16 scale
// amax/127 (at least floor) and round-half-away values in -127..127, the scale's bytes last.
at::Tensor int8_rows(const at::Tensor& x, double floor) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor s = xf.abs().amax({-1}, true).div(127.0).clamp_min_(floor);
  const at::Tensor s16 = s.to(at::kHalf);
  const at::Tensor y = xf / s16.to(at::kFloat);
  const at::Tensor q =
      y.abs().add(0.5).floor_().mul_(y.sign()).clamp_(-127, 127).to(at::kChar);
  return at::cat({q, s16.view(at::kChar)}, -1);
}

// The MLP's activation over [gate | up], as the Python paths: FusedCpuOps.silu_mul or
// FusedCpuOps.gelu_tanh_mul (the same kernels, so the same bits).
at::Tensor activation(const at::Tensor& gate_up, int64_t act) {
  return act == 0 ? silu_mul(gate_up) : gelu_tanh_mul(gate_up);
}

// MoeBlock.forward with the grouped experts (engine/models/moe.py route and grouped_moe), the
// same ATen ops in the same order: the same bits. With M.concurrent the experts that got rows
// run one per thread (each kernel call then has its thread alone: nested OpenMP regions get a
// team of one), instead of one after another on every thread: a decode step's experts are
// products of 1-2 rows with a barrier after each (see docs/decisions.md#moe-experts-one-per-thread).
// Each output column is one
// thread's arithmetic either way (StackLinear::thread_invariant), and the routed outputs are
// added in ascending expert order afterwards, so the bits do not change.
at::Tensor moe_forward(const StackMoe& M, const at::Tensor& x) {
  const at::Tensor probs = at::softmax(at::linear(x, M.router), -1, at::kFloat);
  auto [weights, ids] = at::topk(probs, M.top_k, -1);
  if (M.normalise) weights = weights / weights.sum(-1, true);
  const int64_t k = ids.size(1);
  const at::Tensor flat = ids.reshape(-1);
  const at::Tensor order = flat.argsort(/*stable=*/true);
  const int64_t E = static_cast<int64_t>(M.gate_up.size());
  const at::Tensor counts = flat.bincount({}, E).contiguous();
  const at::Tensor tokens = order.floor_divide(k);
  const at::Tensor w_sorted = weights.reshape(-1).index_select(0, order);
  const int64_t* n_of = counts.data_ptr<int64_t>();
  std::vector<int64_t> used, starts;
  for (int64_t e = 0, start = 0; e < E; start += n_of[e], e++) {
    if (n_of[e] == 0) continue;
    used.push_back(e);
    starts.push_back(start);
  }
  const int64_t U = static_cast<int64_t>(used.size());
  std::vector<at::Tensor> rows(U), parts(U);
  auto run = [&](int64_t i) {
    const int64_t e = used[i], n = n_of[e];
    rows[i] = tokens.narrow(0, starts[i], n);
    const at::Tensor h = M.down[e](silu_mul(M.gate_up[e](x.index_select(0, rows[i]))));
    parts[i] = (h * w_sorted.narrow(0, starts[i], n).unsqueeze(1)).to(x.scalar_type());
  };
  std::exception_ptr failure;
  // One expert per thread, or a plain loop outside any OpenMP region: inside even an inactive
  // region every kernel call is slower (its team no longer the pooled one;
  // docs/decisions.md#moe-experts-one-per-thread).
  if (M.concurrent && U > 1 && !omp_in_parallel()) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < U; i++) {
      try {
        run(i);
      } catch (...) {
#pragma omp critical(kvserve_moe_failure)
        if (!failure) failure = std::current_exception();
      }
    }
  } else {
    for (int64_t i = 0; i < U; i++) run(i);
  }
  if (failure) std::rethrow_exception(failure);
  at::Tensor out = at::zeros(x.sizes(), x.options());
  for (int64_t i = 0; i < U; i++) out.index_add_(0, rows[i], parts[i]);
  return out;
}

}  // namespace

std::vector<double> time_stack_linears(const std::vector<StackLinear>& linears,
                                       const std::vector<at::Tensor>& xs, int64_t passes) {
  TORCH_CHECK(linears.size() == xs.size(), "time_stack_linears: one input per linear");
  std::vector<double> out;
  for (int64_t p = 0; p < passes; p++) {
    const auto start = std::chrono::steady_clock::now();
    for (size_t i = 0; i < linears.size(); i++) linears[i](xs[i]);
    out.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                      .count());
  }
  return out;
}

}  // namespace kvserve_stack

using kvserve_stack::StackLayer;

void DecodeStack::add_layer(StackLayer layer) {
  TORCH_CHECK(layer.num_heads % layer.num_kv_heads == 0,
              "DecodeStack: heads must be a multiple of KV heads");
  TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(),
              "DecodeStack: q_norm and k_norm come together");
  TORCH_CHECK(layer.pre_ff_norm.has_value() == layer.post_ff_norm.has_value(),
              "DecodeStack: pre_ff_norm and post_ff_norm come together");
  TORCH_CHECK(layer.act == 0 || layer.act == 1, "DecodeStack: act 0 (SiLU) or 1 (GeGLU)");
  TORCH_CHECK(layer.rope >= 0, "DecodeStack: a RoPE table index");
  TORCH_CHECK(layer.moe.has_value() != (layer.gate_up.has_value() && layer.down.has_value()),
              "DecodeStack: a layer's MLP is gate_up and down, or a mixture of experts");
  TORCH_CHECK(!layer.moe.has_value() ||
                  (!layer.pre_ff_norm.has_value() && layer.act == 0 &&
                   layer.moe->gate_up.size() == layer.moe->down.size() &&
                   !layer.moe->gate_up.empty() && layer.moe->top_k > 0),
              "DecodeStack: a mixture of experts needs one gate_up and one down per expert");
  layers_.push_back(std::move(layer));
  groups_.push_back(0);
}

void DecodeStack::set_layer_groups(std::vector<int64_t> groups) {
  TORCH_CHECK(groups.size() == layers_.size(), "DecodeStack: one KV group per layer");
  for (const int64_t g : groups) TORCH_CHECK(g >= 0, "DecodeStack: a KV group index");
  groups_ = std::move(groups);
}

void DecodeStack::set_kv_caches(std::vector<at::Tensor> k, std::vector<at::Tensor> v,
                                double int8_scale_floor) {
  TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size() && !k.empty(),
              "DecodeStack: one K and one V pool per layer");
  const auto dtype = k[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 ||
                  dtype == at::kChar || dtype == at::kByte,
              "DecodeStack: float32, float16, bfloat16, int8 or int4 (uint8) KV pools only");
  for (size_t i = 0; i < k.size(); i++) {
    TORCH_CHECK(k[i].scalar_type() == dtype && v[i].scalar_type() == dtype,
                "DecodeStack: every pool of one dtype");
  }
  k_caches_ = std::move(k);
  v_caches_ = std::move(v);
  int8_ = dtype == at::kChar;
  int4_ = dtype == at::kByte;
  pool_dtype_ = dtype;
  int8_floor_ = int8_scale_floor;
}

void DecodeStack::set_prefetch(int64_t ahead_bytes) {
  TORCH_CHECK(ahead_bytes >= 0, "DecodeStack: prefetch distance must be >= 0");
  stream_.set_ahead(static_cast<size_t>(ahead_bytes));
}

namespace kvserve_stack {
namespace {

void add_bytes(WeightStream& s, const at::Tensor& t) {
  s.add(t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
}

// The bytes a linear reads, as its kernel reads them (parts in order).
void add_linear_bytes(WeightStream& s, const StackLinear& L) {
  if (L.kind == kConcat) {
    for (const auto& p : L.parts) add_linear_bytes(s, p);
    return;
  }
  add_bytes(s, L.w);
  if (L.d.has_value()) add_bytes(s, *L.d);
  if (L.m.has_value()) add_bytes(s, *L.m);
}

}  // namespace
}  // namespace kvserve_stack

void DecodeStack::index_weights() {
  using kvserve_stack::add_linear_bytes;
  stream_.clear();
  o_linear_.assign(layers_.size(), 0);
  for (size_t i = 0; i < layers_.size(); i++) {
    const StackLayer& L = layers_[i];
    stream_.begin_linear();
    add_linear_bytes(stream_, L.qkv);
    o_linear_[i] = stream_.begin_linear();
    add_linear_bytes(stream_, L.o);
    if (L.gate_up.has_value()) {  // experts: which ones run is not known ahead
      stream_.begin_linear();
      add_linear_bytes(stream_, *L.gate_up);
      stream_.begin_linear();
      add_linear_bytes(stream_, *L.down);
    }
  }
  indexed_ = layers_.size();
}

void DecodeStack::set_lora(int64_t layer, int64_t module, at::Tensor a,
                           std::vector<at::Tensor> b, at::Tensor ranks,
                           std::vector<int64_t> offsets) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && module >= 0 &&
                  module < 4,
              "DecodeStack::set_lora: layer ", layer, " module ", module);
  if (loras_.size() < layers_.size()) loras_.resize(layers_.size());
  loras_[layer][module] = kvserve_stack::StackLoRA{std::move(a), std::move(b), std::move(ranks),
                                                   std::move(offsets)};
}

at::Tensor DecodeStack::forward(at::Tensor x, std::vector<at::Tensor> cos_tables,
                                std::vector<at::Tensor> sin_tables,
                                std::vector<at::Tensor> group_slots,
                                std::vector<at::Tensor> group_tables,
                                std::vector<at::Tensor> group_lens, at::Tensor final_norm,
                                double final_eps, std::optional<at::Tensor> lora_rows) {
  TORCH_CHECK(!layers_.empty() && k_caches_.size() == layers_.size(),
              "DecodeStack: layers and KV pools must be set before forward");
  TORCH_CHECK(cos_tables.size() == sin_tables.size() && group_slots.size() == group_tables.size() &&
                  group_slots.size() == group_lens.size(),
              "DecodeStack: cos/sin tables in pairs; slots, tables and lengths per group");
  if (indexed_ != layers_.size()) index_weights();
  auto& S = stream_;
  const int64_t t = x.size(0);
  const size_t n = layers_.size();
  at::Tensor residual, h, out;
  S.at_linear(0);  // a new step: loads start over
  // The first layer's input norm; later ones are computed with the previous layer's end.
  residual = x;
  h = rms_norm(x, layers_[0].input_norm, layers_[0].eps);
  for (size_t i = 0; i < n; i++) {
    const StackLayer& L = layers_[i];
    const auto g = static_cast<size_t>(groups_[i]);
    const auto r = static_cast<size_t>(L.rope);
    TORCH_CHECK(g < group_slots.size() && r < cos_tables.size(),
                "DecodeStack: layer ", i, " needs KV group ", g, " and RoPE table ", r);
    const at::Tensor &cos = cos_tables[r], &sin = sin_tables[r];
    const at::Tensor &slots = group_slots[g], &block_tables = group_tables[g],
                     &seq_lens = group_lens[g];
    const int64_t H = L.num_heads, KVH = L.num_kv_heads, D = L.head_dim;
    const int64_t q_size = H * D, kv_size = KVH * D;
    // Each projection's output gains its rows' LoRA delta where the step has adapter rows.
    auto lora = [&](int m, const at::Tensor& in, const at::Tensor& y) {
      if (!lora_rows.has_value() || i >= loras_.size() || !loras_[i][m].has_value()) return;
      const auto& l = *loras_[i][m];
      lora_apply_(y, in, *lora_rows, l.a, l.b, l.ranks, l.offsets);
    };
    const at::Tensor qkv = L.qkv(h);
    lora(0, h, qkv);
    S.at_linear(o_linear_[i]);
    at::Tensor q, attn;
    // Q/K norms, RoPE, the KV store and the attention. The attention runs one task per
    // (sequence, KV head): a single task is one thread's work, so the step's longest serial
    // part, and the other thread loads the next linears' weights meanwhile (weight_prefetch.h;
    // measured: shorter serial parts gain less than a parallel region costs). More tasks run
    // on every thread, as before.
    auto store = [&] {
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, KVH, D});
      at::Tensor k;
      if (L.q_norm.has_value()) {
        q = rms_norm(qkv.narrow(1, 0, q_size).reshape({t, H, D}), *L.q_norm, L.eps);
        rotary_(q, cos, sin);
        k = rms_norm(qkv.narrow(1, q_size, kv_size).reshape({t, KVH, D}), *L.k_norm, L.eps);
        rotary_(k, cos, sin);
      } else {
        const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({t, H + KVH, D});
        rotary_(qk, cos, sin);
        q = qk.narrow(1, 0, H);
        k = qk.narrow(1, H, KVH);
      }
      if (int8_) {
        store_kv_cpu(kvserve_stack::int8_rows(k, int8_floor_),
                     kvserve_stack::int8_rows(v, int8_floor_), k_caches_[i], v_caches_[i], slots);
      } else if (int4_) {
        store_kv_cpu(int4_quantize_rows_cpu(k), int4_quantize_rows_cpu(v), k_caches_[i],
                     v_caches_[i], slots);
      } else {  // float rows, rounded to a 16-bit pool's dtype as quantize_rows does (.to)
        store_kv_cpu(k.to(pool_dtype_), v.to(pool_dtype_), k_caches_[i], v_caches_[i], slots);
      }
    };
    auto attend = [&] {
      if (int8_) {
        attn = paged_decode_cpu_int8(q, k_caches_[i], v_caches_[i], block_tables, seq_lens,
                                     L.scale, L.window, L.softcap);
      } else if (int4_) {  // as the torch backend: rows of K R and V R; q rotated in, out back
        attn = int4_rotate_cpu(paged_decode_cpu_int4(int4_rotate_cpu(q), k_caches_[i],
                                                     v_caches_[i], block_tables, seq_lens,
                                                     L.scale, L.window, L.softcap));
      } else {
        attn = paged_decode_cpu(q, k_caches_[i], v_caches_[i], block_tables, seq_lens, L.scale,
                                L.window, L.softcap);
      }
    };
    if (block_tables.size(0) * KVH <= 1) {
      S.serial([&] {
        store();
        attend();
      });
    } else {
      store();
      attend();
    }
    const at::Tensor attn_rows = attn.reshape({t, q_size});
    const at::Tensor o = L.o(attn_rows);
    lora(1, attn_rows, o);
    if (L.moe.has_value()) {
      x = kvserve_stack::moe_forward(*L.moe, add_rms_norm_(o, residual, L.post_norm, L.eps));
    } else {
      h = L.pre_ff_norm.has_value()  // Gemma's sandwich
              ? add_rms_norm_(rms_norm(o, L.post_norm, L.eps), residual, *L.pre_ff_norm, L.eps)
              : add_rms_norm_(o, residual, L.post_norm, L.eps);
      const at::Tensor gate_up = (*L.gate_up)(h);
      lora(2, h, gate_up);
      const at::Tensor act = kvserve_stack::activation(gate_up, L.act);
      x = (*L.down)(act);
      lora(3, act, x);
    }
    // The layer's end and the next layer's input norm (or the final norm).
    if (L.post_ff_norm.has_value()) x = rms_norm(x, *L.post_ff_norm, L.eps);
    if (i + 1 < n) {
      h = add_rms_norm_(x, residual, layers_[i + 1].input_norm, layers_[i + 1].eps);
    } else {
      out = add_rms_norm_(x, residual, final_norm, final_eps);
    }
  }
  return out;
}
