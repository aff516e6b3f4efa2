// The decoder layer stack of a decode-only few-token step (one stream, small batches), in one call.
//
// At one token per step each layer is ~10 kernel calls of 10-100 us, and from Python every call costs a few
// microseconds of dispatch plus the slicing and views around it: one stream ran at 100 tok/s through the
// Python loop and 119 tok/s through this call, side by side on a 2-core Zen 3 (docs/benchmarks/history.md, 2026-11-23).
// DecodeLayers holds every layer's quantized weights and norms (registered once at load) and runs
//
//   h = rms_norm(residual)                                   (first layer's input norm)
//   per layer: qkv = h . Wqkv^T; RoPE(q, k); write k, v to the cache; a = paged attention(q)
//              h = add_rms_norm(a . Wo^T, residual); h = add_rms_norm(down(silu(gate) * up), residual)
//
// with the same kernels, in the same order, as the Python layer loop (LlamaForCausalLM._fast_forward), so its
// results are bit-identical to that loop's.

#include "ops.h"

#include <cstdint>
#include <vector>

namespace {

struct QuantMat {
  torch::Tensor qs, d;
  c10::optional<torch::Tensor> m;

  torch::Tensor operator()(const torch::Tensor& x, bool int16, bool gated = false) const {
    return quant_linear(x, qs, d, m, false, int16, gated);
  }
};

struct Layer {
  QuantMat qkv, o, gate_up, down;
  torch::Tensor post_norm, next_norm;
  double eps, next_eps;
};

class DecodeLayers {
 public:
  DecodeLayers(torch::Tensor first_norm, double first_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               double scale, int64_t partition_size)
      : first_norm_(std::move(first_norm)), first_eps_(first_eps), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
        head_dim_(head_dim), scale_(scale), partition_size_(partition_size) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && num_heads % num_kv_heads == 0,
                "bad head counts");
  }

  // mats: qs, d, m of qkv, o, gate_up, down in that order (m None for Q8).
  void add_layer(const std::vector<c10::optional<torch::Tensor>>& mats, torch::Tensor post_norm, double eps,
                 torch::Tensor next_norm, double next_eps) {
    TORCH_CHECK(mats.size() == 12, "add_layer needs qs, d, m for qkv, o, gate_up and down (12 entries)");
    QuantMat q[4];
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(mats[3 * i].has_value() && mats[3 * i + 1].has_value(), "matrix ", i, " lacks qs or d");
      q[i] = QuantMat{*mats[3 * i], *mats[3 * i + 1], mats[3 * i + 2]};
    }
    const int64_t q_out = num_heads_ * head_dim_, kv_out = num_kv_heads_ * head_dim_;
    TORCH_CHECK(q[0].qs.size(0) == q_out + 2 * kv_out, "qkv has ", q[0].qs.size(0), " rows, expected ",
                q_out + 2 * kv_out);
    TORCH_CHECK(q[1].qs.size(0) == post_norm.size(0), "o's rows differ from the hidden size");
    layers_.push_back(Layer{q[0], q[1], q[2], q[3], std::move(post_norm), std::move(next_norm), eps, next_eps});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // residual [T, H] float32 (updated in place); cos/sin [T, head_dim]; returns the last layer's output after
  // the final norm (next_norm of the last layer).
  torch::Tensor run(torch::Tensor residual, const torch::Tensor& cos, const torch::Tensor& sin,
                    const std::vector<torch::Tensor>& kv_caches, const torch::Tensor& slot_mapping,
                    const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                    const torch::Tensor& seq_lens, bool int16, bool packed) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "got ", kv_caches.size(), " KV caches for ", layers_.size(),
                " layers");
    const int64_t T = residual.size(0);
    const int64_t q_out = num_heads_ * head_dim_, kv_out = num_kv_heads_ * head_dim_;
    torch::Tensor h = rms_norm(residual, first_norm_, first_eps_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      const torch::Tensor qkv = L.qkv(h, int16);
      const torch::Tensor q = qkv.narrow(1, 0, q_out).view({T, num_heads_, head_dim_});
      const torch::Tensor k = qkv.narrow(1, q_out, kv_out).view({T, num_kv_heads_, head_dim_});
      const torch::Tensor v = qkv.narrow(1, q_out + kv_out, kv_out).view({T, num_kv_heads_, head_dim_});
      rotary_(q, k, cos, sin);
      reshape_and_cache(k, v, kv_caches[i], slot_mapping, packed);
      const torch::Tensor a = paged_attention(q, kv_caches[i], block_tables, query_start_loc, seq_lens, scale_,
                                              partition_size_, packed);
      h = add_rms_norm(L.o(a.view({T, q_out}), int16), residual, L.post_norm, L.eps);
      h = add_rms_norm(L.down(L.gate_up(h, int16, true), int16), residual, L.next_norm, L.next_eps);
    }
    return h;
  }

 private:
  torch::Tensor first_norm_;
  double first_eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  int64_t partition_size_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decode_ops(pybind11::module& m) {
  pybind11::class_<DecodeLayers>(m, "DecodeLayers",
                                 "a decode-only few-token step's decoder layers in one call (quantized weights)")
      .def(pybind11::init<torch::Tensor, double, int64_t, int64_t, int64_t, double, int64_t>(),
           pybind11::arg("first_norm"), pybind11::arg("first_eps"), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("scale"),
           pybind11::arg("partition_size"))
      .def("add_layer", &DecodeLayers::add_layer, pybind11::arg("mats"), pybind11::arg("post_norm"),
           pybind11::arg("eps"), pybind11::arg("next_norm"), pybind11::arg("next_eps"))
      .def("num_layers", &DecodeLayers::num_layers)
      .def("run", &DecodeLayers::run, pybind11::arg("residual"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("kv_caches"), pybind11::arg("slot_mapping"), pybind11::arg("block_tables"),
           pybind11::arg("query_start_loc"), pybind11::arg("seq_lens"), pybind11::arg("int16"),
           pybind11::arg("packed"));
}
