// DecodeLayers (decode_layers.h): the decoder layer stack of a decode-only step in one call.

#include "decode_layers.h"

#include "ops.h"

namespace kvpage {

torch::Tensor QuantMat::operator()(const torch::Tensor& x, bool int16, bool gated) const {
  return quant_linear(x, qs, d, m, false, int16, gated);
}

torch::Tensor AmxMat::operator()(const torch::Tensor& x, bool gated) const {
  return amx::amx_linear(x, wp, bias, gated ? act : amx::kActNone, false);
}

// output rows of the product: qs is [N, bytes], or [N / 16, K, bytes] for panels (QuantWeight.as_panels); the
// packed AMX operand is [N, K]
int64_t LayerMat::out_rows() const {
  if (on_amx()) return amx.wp.size(0);
  return quant.qs.dim() == 3 ? quant.qs.size(0) * 16 : quant.qs.size(0);
}

DecodeLayers::DecodeLayers(torch::Tensor first_norm, double first_eps, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, double scale, bool amx_decode,
                           bool avx2_row_decode)
    : first_norm_(std::move(first_norm)), first_eps_(first_eps), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
      head_dim_(head_dim), scale_(scale), amx_decode_(amx_decode), avx2_row_decode_(avx2_row_decode) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && num_heads % num_kv_heads == 0,
              "bad head counts");
}

void DecodeLayers::add_layer(const std::vector<c10::optional<torch::Tensor>>& mats, torch::Tensor post_norm, double eps,
                             torch::Tensor next_norm, double next_eps) {
  TORCH_CHECK(mats.size() == 12, "add_layer needs qs, d, m for qkv, o, gate_up and down (12 entries)");
  LayerMat m[4];
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(mats[3 * i].has_value() && mats[3 * i + 1].has_value(), "matrix ", i, " lacks qs or d");
    m[i].quant = QuantMat{*mats[3 * i], *mats[3 * i + 1], mats[3 * i + 2]};
  }
  push_layer(m, std::move(post_norm), eps, std::move(next_norm), next_eps);
}

void DecodeLayers::add_amx_layer(const std::vector<c10::optional<torch::Tensor>>& mats, int64_t act,
                                 torch::Tensor post_norm, double eps, torch::Tensor next_norm, double next_eps) {
  TORCH_CHECK(mats.size() == 8, "add_amx_layer needs the packed operand and bias of qkv, o, gate_up and down (8 entries)");
  TORCH_CHECK(act == amx::kActSilu || act == amx::kActGeluTanh, "gate_up's act must be 1 (SiLU) or 2 (GELU-tanh)");
  TORCH_CHECK(!mats[5].has_value(), "a gated product (gate_up) takes no bias");
  LayerMat m[4];
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(mats[2 * i].has_value() && mats[2 * i].value().dim() == 2, "matrix ", i, " lacks its packed operand");
    m[i].amx = AmxMat{*mats[2 * i], mats[2 * i + 1], i == 2 ? act : amx::kActNone};
  }
  push_layer(m, std::move(post_norm), eps, std::move(next_norm), next_eps);
}

void DecodeLayers::push_layer(const LayerMat (&m)[4], torch::Tensor post_norm, double eps, torch::Tensor next_norm,
                              double next_eps) {
  const int64_t q_out = num_heads_ * head_dim_, kv_out = num_kv_heads_ * head_dim_;
  TORCH_CHECK(m[0].out_rows() == q_out + 2 * kv_out, "qkv has ", m[0].out_rows(), " rows, expected ",
              q_out + 2 * kv_out);
  TORCH_CHECK(m[1].out_rows() == post_norm.size(0), "o's rows differ from the hidden size");
  TORCH_CHECK(layers_.empty() || layers_.front().qkv.on_amx() == m[0].on_amx(),
              "a stack's layers are all quantized or all on the tile GEMM");
  layers_.push_back(DecodeLayer{m[0], m[1], m[2], m[3], std::move(post_norm), std::move(next_norm), eps, next_eps});
}

torch::Tensor DecodeLayers::run(torch::Tensor residual, const torch::Tensor& cos, const torch::Tensor& sin,
                                const std::vector<torch::Tensor>& kv_caches, const torch::Tensor& slot_mapping,
                                const attn::AttentionPlan& plan, bool int16, bool packed,
                                const std::vector<c10::optional<torch::Tensor>>& key_feedback) const {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "got ", kv_caches.size(), " KV caches for ", layers_.size(),
              " layers");
  TORCH_CHECK(key_feedback.empty() || key_feedback.size() == layers_.size(), "got ", key_feedback.size(),
              " key feedback entries for ", layers_.size(), " layers");
  const int64_t T = residual.size(0);
  const int64_t q_out = num_heads_ * head_dim_, kv_out = num_kv_heads_ * head_dim_;
  torch::Tensor h = rms_norm(residual, first_norm_, first_eps_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecodeLayer& L = layers_[i];
    const torch::Tensor qkv = L.qkv(h, int16);
    const torch::Tensor q = qkv.narrow(1, 0, q_out).view({T, num_heads_, head_dim_});
    const torch::Tensor k = qkv.narrow(1, q_out, kv_out).view({T, num_kv_heads_, head_dim_});
    const torch::Tensor v = qkv.narrow(1, q_out + kv_out, kv_out).view({T, num_kv_heads_, head_dim_});
    rotary_(q, k, cos, sin);
    reshape_and_cache(k, v, kv_caches[i], slot_mapping, packed,
                      key_feedback.empty() ? c10::nullopt : key_feedback[i]);
    const torch::Tensor a = paged_attention_planned(q, kv_caches[i], plan, scale_, packed, amx_decode_,
                                                          avx2_row_decode_);
    h = add_rms_norm(L.o(a.view({T, q_out}), int16), residual, L.post_norm, L.eps);
    h = add_rms_norm(L.down(L.gate_up(h, int16, true), int16), residual, L.next_norm, L.next_eps);
  }
  return h;
}

}  // namespace kvpage
