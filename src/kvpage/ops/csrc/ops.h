// The C++ surface of kvpage's kernels: every function the Python package calls (bindings.cpp binds exactly
// these) and the ones other translation units chain (decode_layers.cpp runs a decode step's layers without
// returning to Python). Grouped by concern; each group's source file is named beside it.
#pragma once

#include "tensor.h"

#include "attention/plan.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

// Norms, RoPE, the gated activation, logits (fused_ops.cpp).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor rms_norm(torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gu);
torch::Tensor gelu_mul(torch::Tensor gu);
torch::Tensor norm_add_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w1, torch::Tensor w2, double eps,
                            bool bf16_out);
std::vector<torch::Tensor> qk_norm_rope(torch::Tensor qkv, torch::Tensor q_weight, torch::Tensor k_weight, double eps,
                                        torch::Tensor cos, torch::Tensor sin, int64_t hq, int64_t hk);
std::vector<torch::Tensor> logits_postprocess(std::vector<torch::Tensor> parts, torch::Tensor hidden,
                                              torch::Tensor weight, bool with_logits,
                                              c10::optional<torch::Tensor> out_buf);
// The logits pass drawing each row's token as it goes (temperature 0: the argmax), row b limited to the tokens
// its mask masks[mask_of[b]] allows when mask_of[b] >= 0: (tokens [rows, draws], argmax).
std::vector<torch::Tensor> logits_draw(std::vector<torch::Tensor> parts, torch::Tensor hidden, torch::Tensor weight,
                                       torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                                       torch::Tensor min_p, torch::Tensor uniforms,
                                       c10::optional<torch::Tensor> mask_of, c10::optional<torch::Tensor> masks);
void logits_scan(torch::Tensor part, int64_t start, int64_t vocab, torch::Tensor hidden, torch::Tensor weight,
                 torch::Tensor row_max, torch::Tensor best_value, torch::Tensor best_index,
                 c10::optional<torch::Tensor> out);
std::vector<torch::Tensor> logits_finish(torch::Tensor out, torch::Tensor hidden, torch::Tensor weight,
                                         torch::Tensor row_max, bool bf16_logits);

// Paged attention over the KV cache (attention/paged_attention.cpp; the step's plan: attention/plan.{h,cpp}).
torch::Tensor paged_attention_planned(torch::Tensor query, torch::Tensor kv_cache,
                                      const kvpage::attn::AttentionPlan& plan, double scale, bool packed,
                                      bool amx_decode, bool avx2_row_decode);
// key_feedback (quantized pages only): the keys' rounding feedback [kv_heads, D, D] (attention/key_feedback.h).
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping,
                       bool packed, c10::optional<torch::Tensor> key_feedback = c10::nullopt);
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                              int64_t partition_size, bool packed, bool split_short, bool amx_decode,
                              bool avx2_row_decode);
// Quantized KV pages: int8 / fp8 codes with a bfloat16 scale per row (attention/paged_attention_quant.cpp);
// packed: int8 pages in the packed layout (attention/packed_int8.h); amx_decode: decode tasks over them may take
// AMX byte tiles (attention/amx_int8.h). paged_attention_quant returns the name of the main loop it ran.
bool is_quantized_kv(const torch::Tensor& kv_cache);
const char* paged_attention_quant(const torch::Tensor& query, const torch::Tensor& kv_cache,
                                  const kvpage::attn::AttentionPlan& plan, double scale, bool packed, bool amx_decode,
                                  torch::Tensor& out);
void reshape_and_cache_quant(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
                             const torch::Tensor& slot_mapping, bool packed,
                             const c10::optional<torch::Tensor>& key_feedback);
// A quantized cache's key/value transform, one pass over [tokens, heads, D] rows (attention/kv_affine.cpp):
// (x - sub) * mul, Walsh-Hadamard rotated if `rotate`, + add, in float32 and rounded once to x's dtype; each
// [heads, D] float32 part optional.
torch::Tensor kv_affine_rows(torch::Tensor x, c10::optional<torch::Tensor> sub, c10::optional<torch::Tensor> mul,
                             bool rotate, c10::optional<torch::Tensor> add);
// int8 pages with keys per channel (attention/paged_attention_channel.cpp, attention/channel_keys.h).
void reshape_and_cache_channel(torch::Tensor key, torch::Tensor value, torch::Tensor pages, torch::Tensor slot_mapping,
                               torch::Tensor residual_slots, int64_t block_size);
torch::Tensor paged_attention_channel(torch::Tensor query, torch::Tensor pages, const kvpage::attn::AttentionPlan& plan,
                                      torch::Tensor residual_tables, double scale);
std::string last_decode_kernel();
// Kernels other than paged_attention's own (paged_attention_channel) say here which loop served them.
void note_decode_kernel(const char* name);
bool has_packed_layout();
bool has_packed_int8_layout();
bool amx_decode_available();
bool amx_int8_decode_available();

// Prompt attention with AMX tiles (attention/prefill_amx.cpp).
namespace kvpage::prefill {
bool prefill_amx_available();
void prefill_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                       torch::Tensor& out, const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths,
                       double scale, int64_t window);
void prefill_attention_paged(const torch::Tensor& query, const torch::Tensor& kv_cache,
                             const torch::Tensor& block_tables, torch::Tensor& out, const std::vector<int64_t>& starts,
                             const std::vector<int64_t>& lengths, const std::vector<int64_t>& seq_lens,
                             const std::vector<int64_t>& seqs, double scale, int64_t max_scratch_bytes,
                             int64_t window);
}  // namespace kvpage::prefill

// Linear layers: quantized GGUF blocks (linear/quant_linear.cpp), AMX tiles (linear/linear_amx.cpp), the
// float32 panel GEMM (linear/gemm_f32.cpp), 8-bit integer products from Q4 / Q8 blocks (linear/gemm_i8.cpp).
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m,
                           bool float_out, bool int16, bool gated);
bool quant_int16_available();
// The same blocks in the float32 panel GEMM's order and sums (linear/quant_panels.cpp).
torch::Tensor quant_panel_linear(torch::Tensor x, const torch::Tensor& codes, const torch::Tensor& d,
                                 const c10::optional<torch::Tensor>& m, const c10::optional<torch::Tensor>& bias,
                                 bool gated);
namespace kvpage::amx {
// amx_linear's act: the plain product, or [gate; up] (amx_pack_gate_up) with the gated MLP half in the epilogue
constexpr int64_t kActNone = 0, kActSilu = 1, kActGeluTanh = 2;
bool amx_linear_available();
torch::Tensor amx_pack_weight(const torch::Tensor& w);
torch::Tensor amx_pack_gate_up(const torch::Tensor& w);
// stream: the output written with non-temporal stores (an output read once, from memory, afterwards: logits)
torch::Tensor amx_linear(const torch::Tensor& x_in, const torch::Tensor& wp, const c10::optional<torch::Tensor>& bias_in,
                         int64_t act, bool stream);
}  // namespace kvpage::amx
namespace kvpage::gemm {
bool f32_gemm_available();
torch::Tensor f32_pack_weight(const torch::Tensor& w);
torch::Tensor f32_linear(torch::Tensor x, const torch::Tensor& packed, int64_t N, c10::optional<torch::Tensor> bias);
// linear/lm_screen.cpp: greedy argmax of a float32 lm head from int8 codes and exact bounds
std::vector<torch::Tensor> lm_screen_prepare(const torch::Tensor& w);
std::vector<torch::Tensor> lm_screen_argmax(torch::Tensor hidden, const torch::Tensor& weight,
                                            const torch::Tensor& codes, const torch::Tensor& scale,
                                            const torch::Tensor& code_sum, const torch::Tensor& err_norm,
                                            const torch::Tensor& w_norm, const torch::Tensor& outliers,
                                            const torch::Tensor& w_out);
bool bf16_gemm_available();
// gated: w = [gate; up] with its panels interleaved (gate 16j.., up 16j..), for bf16_linear's act
torch::Tensor bf16_pack_weight(const torch::Tensor& w, bool gated);
// act (kvpage::amx::kActNone / kActSilu / kActGeluTanh): the plain product, or from a gated packing the MLP's
// act(x Wg^T) * (x Wu^T), [M, N / 2], with the bits of the plain product followed by silu_mul / gelu_mul
torch::Tensor bf16_linear(torch::Tensor x, const torch::Tensor& packed, int64_t N, c10::optional<torch::Tensor> bias,
                          int64_t act);
}  // namespace kvpage::gemm
namespace kvpage::gemm_i8 {
bool i8_gemm_available();
std::tuple<torch::Tensor, torch::Tensor> i8_pack_weight(const torch::Tensor& qs, const torch::Tensor& d,
                                                        const c10::optional<torch::Tensor>& m, bool gated);
// stream: a plain product's output written with non-temporal stores (as amx_linear's)
torch::Tensor i8_linear(torch::Tensor x, const torch::Tensor& codes, const torch::Tensor& scales, int64_t N,
                        bool gated, const c10::optional<torch::Tensor>& bias, bool stream);
}  // namespace kvpage::gemm_i8

// Sampling (sampler.cpp).
void apply_penalties_(torch::Tensor logits, torch::Tensor rows, torch::Tensor prompt_ids, torch::Tensor prompt_offsets,
                      torch::Tensor output_ids, torch::Tensor output_offsets, torch::Tensor repetition,
                      torch::Tensor presence, torch::Tensor frequency);
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor rows, torch::Tensor temperature, torch::Tensor top_k,
                          torch::Tensor top_p, torch::Tensor min_p, torch::Tensor uniforms);
