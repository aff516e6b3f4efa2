// The tensor-level kernels that other translation units call directly (decode_layers.cpp chains them for one
// decode step without returning to Python between them).
#pragma once

#include <torch/extension.h>

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor rms_norm(torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m,
                           bool float_out, bool int16, bool gated);
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping,
                       bool packed);
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                              int64_t partition_size, bool packed);
