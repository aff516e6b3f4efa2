// The decoder layer stack of a decode-only step, in one call.
//
// At one token per step each layer is ~10 kernel calls of 10-100 us, and from Python every call costs a few
// microseconds of dispatch plus the slicing and views around it: one stream ran at 100 tok/s through the
// Python loop and 119 tok/s through this call, side by side on a 2-core Zen 3 (docs/benchmarks/history.md, 2026-11-23).
// Batched decode steps on the AMX tile GEMM pay the same Python per layer (~2 ms of a 55-85 ms step of 60-128
// sequences, with the GIL held and the second core idle), so a stack can hold the tile GEMM's packed operands
// instead of the quantized blocks. DecodeLayers holds every layer's weights and norms (registered once at load)
// and runs
//
//   h = rms_norm(residual)                                   (first layer's input norm)
//   per layer: qkv = h . Wqkv^T; RoPE(q, k); write k, v to the cache; a = paged attention(q)
//              h = add_rms_norm(a . Wo^T, residual); h = add_rms_norm(down(silu(gate) * up), residual)
//
// with the same kernels, in the same order, as the Python layer loop (model/fast_path.py FastPath.__call__), so its
// results are bit-identical to that loop's.

#pragma once

#include "tensor.h"

#include "attention/plan.h"

#include <cstdint>
#include <vector>

namespace kvpage {

struct QuantMat {
  torch::Tensor qs, d;
  c10::optional<torch::Tensor> m;

  torch::Tensor operator()(const torch::Tensor& x, bool int16, bool gated = false) const;
};

// A projection on the AMX tile GEMM: its packed operand (amx_pack_weight, or amx_pack_gate_up for a gated one
// whose epilogue applies act) and an optional float32 bias.
struct AmxMat {
  torch::Tensor wp;
  c10::optional<torch::Tensor> bias;
  int64_t act = 0;

  torch::Tensor operator()(const torch::Tensor& x, bool gated = false) const;
};

// One of the two, as the stack was built (the tile GEMM's when its packed operand is set).
struct LayerMat {
  QuantMat quant;
  AmxMat amx;

  bool on_amx() const { return amx.wp.defined(); }
  torch::Tensor operator()(const torch::Tensor& x, bool int16, bool gated = false) const {
    return on_amx() ? amx(x, gated) : quant(x, int16, gated);
  }
  int64_t out_rows() const;
};

struct DecodeLayer {
  LayerMat qkv, o, gate_up, down;
  torch::Tensor post_norm, next_norm;
  double eps, next_eps;
};

class DecodeLayers {
 public:
  // amx_decode, avx2_row_decode: the attention options of the kernel configuration (paged_attention_planned's).
  DecodeLayers(torch::Tensor first_norm, double first_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               double scale, bool amx_decode, bool avx2_row_decode);

  // mats: qs, d, m of qkv, o, gate_up, down in that order (m None for Q8).
  void add_layer(const std::vector<c10::optional<torch::Tensor>>& mats, torch::Tensor post_norm, double eps,
                 torch::Tensor next_norm, double next_eps);
  // mats: the packed operand and bias (None for none) of qkv, o, gate_up, down in that order; act: gate_up's.
  void add_amx_layer(const std::vector<c10::optional<torch::Tensor>>& mats, int64_t act, torch::Tensor post_norm,
                     double eps, torch::Tensor next_norm, double next_eps);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // residual [T, H] float32 (updated in place); cos/sin [T, head_dim]; plan: the step's attention plan (every
  // layer runs it); returns the last layer's output after the final norm (next_norm of the last layer).
  // key_feedback: empty, or each layer's keys' rounding feedback for its quantized pages (None: plain rounding).
  torch::Tensor run(torch::Tensor residual, const torch::Tensor& cos, const torch::Tensor& sin,
                    const std::vector<torch::Tensor>& kv_caches, const torch::Tensor& slot_mapping,
                    const attn::AttentionPlan& plan, bool int16, bool packed,
                    const std::vector<c10::optional<torch::Tensor>>& key_feedback = {}) const;

 private:
  torch::Tensor first_norm_;
  double first_eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  bool amx_decode_, avx2_row_decode_;
  void push_layer(const LayerMat (&m)[4], torch::Tensor post_norm, double eps, torch::Tensor next_norm,
                  double next_eps);

  std::vector<DecodeLayer> layers_;
};

}  // namespace kvpage
