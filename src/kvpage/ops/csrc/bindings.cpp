// The Python module of kvpage's kernels: every binding in one place (the kernels are declared in ops.h).
// kvpage/ops/__init__.py wraps these in typed functions; nothing else in the package calls them directly.

#include <torch/extension.h>

#include "decode_layers.h"
#include "ops.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel that computes runs without the GIL (call_guard): the server's event loop thread keeps
  // answering clients while a step computes, instead of stopping the engine thread between kernels to get
  // the interpreter. Arguments are converted, and results returned, with the GIL held.

  // fused_ops.cpp
  m.def("add_rms_norm", &add_rms_norm, "residual += x; return rms_norm(residual) * weight", py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up for [gate | up] rows", py::call_guard<py::gil_scoped_release>());
  m.def("norm_add_norm", &norm_add_norm, "residual += rms_norm(x) * w1; return rms_norm(residual) * w2",
        py::call_guard<py::gil_scoped_release>());
  m.def("qk_norm_rope", &qk_norm_rope, "per-head rms_norm of qkv's q and k heads, then RoPE: new q, k",
        py::call_guard<py::gil_scoped_release>());
  m.def("gelu_mul", &gelu_mul, "gelu_tanh(gate) * up for [gate | up] rows", py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "rms_norm(residual) * weight", py::call_guard<py::gil_scoped_release>());
  m.def("rotary_", &rotary_, "in-place rotate-half RoPE on q and k", py::call_guard<py::gil_scoped_release>());
  m.def("logits_postprocess", &logits_postprocess, "float32 logits with exact near-max entries, argmax, logsumexp",
        py::arg("parts"), py::arg("hidden"), py::arg("weight"), py::arg("with_logits") = true,
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("logits_draw", &logits_draw, "the logits pass with each row's token drawn in it (sample_rows' draw, or the argmax)",
        py::arg("parts"), py::arg("hidden"), py::arg("weight"), py::arg("temperature"), py::arg("top_k"),
        py::arg("top_p"), py::arg("min_p"), py::arg("uniforms"), py::arg("mask_of") = py::none(),
        py::arg("masks") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("logits_scan", &logits_scan, "one vocabulary slice of the logits pass (widen into out, or the running argmax)",
        py::call_guard<py::gil_scoped_release>());
  m.def("logits_finish", &logits_finish, "end of the logits pass over out: exact near-max entries, argmax, logsumexp",
        py::call_guard<py::gil_scoped_release>());

  // attention/plan.cpp, attention/paged_attention.cpp
  // module_local: a second build of these kernels (the portable one the tests load beside the native one)
  // registers its own types.
  py::class_<kvpage::attn::AttentionPlan, std::shared_ptr<kvpage::attn::AttentionPlan>>(
      m, "AttentionPlan", "one step's paged-attention tasks, planned once and run for every layer", py::module_local())
      .def_property_readonly("num_tasks", &kvpage::attn::AttentionPlan::num_tasks)
      .def_readonly("partition_size", &kvpage::attn::AttentionPlan::partition_size)
      .def_readonly("num_rows", &kvpage::attn::AttentionPlan::num_rows)
      .def_readonly("num_heads", &kvpage::attn::AttentionPlan::num_heads)
      .def_readonly("window", &kvpage::attn::AttentionPlan::window);
  m.def("plan_attention", &kvpage::attn::plan_attention, "a step's paged-attention plan, checked against the cache",
        py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("num_heads"),
        py::arg("num_blocks"), py::arg("block_size"), py::arg("partition_size"), py::arg("split_short") = true,
        py::arg("window") = 0, py::arg("invariant") = false);
  m.def("paged_attention_planned", &paged_attention_planned, "paged_attention of one layer under a step's plan",
        py::arg("query"), py::arg("kv_cache"), py::arg("plan"), py::arg("scale"), py::arg("packed") = false,
        py::arg("amx_decode") = true, py::arg("avx2_row_decode") = false, py::call_guard<py::gil_scoped_release>());
  m.def("reshape_and_cache", &reshape_and_cache, "scatter new K/V rows to their slots", py::arg("key"),
        py::arg("value"), py::arg("kv_cache"), py::arg("slot_mapping"), py::arg("packed") = false,
        py::arg("key_feedback") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("kv_affine_rows", &kv_affine_rows, "a quantized cache's key/value transform over [tokens, heads, D] rows",
        py::arg("x"), py::arg("sub") = py::none(), py::arg("mul") = py::none(), py::arg("rotate") = false,
        py::arg("add") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("reshape_and_cache_channel", &reshape_and_cache_channel,
        "int8 pages with keys per channel: values as rows, keys to the residual, complete blocks rounded",
        py::arg("key"), py::arg("value"), py::arg("pages"), py::arg("slot_mapping"), py::arg("residual_slots"),
        py::arg("block_size"), py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention_channel", &paged_attention_channel,
        "paged attention over int8 pages with keys per channel, filling blocks read from their residual blocks",
        py::arg("query"), py::arg("pages"), py::arg("plan"), py::arg("residual_tables"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, "varlen causal attention over a paged KV cache", py::arg("query"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("partition_size"), py::arg("packed") = false, py::arg("split_short") = true,
        py::arg("amx_decode") = true, py::arg("avx2_row_decode") = false, py::call_guard<py::gil_scoped_release>());
  m.def("last_decode_kernel", &last_decode_kernel, "the kernel that served the last paged_attention call's decode tasks");
  m.def("has_packed_layout", &has_packed_layout, "whether this build has the packed bf16 KV layout (packed_kv.h)");
  m.def("has_packed_int8_layout", &has_packed_int8_layout,
        "whether this build has the packed int8 KV layout (packed_int8.h)");
  m.def("amx_decode_available", &amx_decode_available, "whether decode tasks can use AMX tiles on this build and OS");
  m.def("amx_int8_decode_available", &amx_int8_decode_available,
        "whether decode over packed int8 pages can use AMX byte tiles on this build and OS (amx_int8.h)");

  // attention/prefill_amx.cpp
  m.def("prefill_amx_available", &kvpage::prefill::prefill_amx_available,
        "whether prefill_attention can run on this CPU/OS");
  m.def("prefill_attention", &kvpage::prefill::prefill_attention,
        "causal attention of whole fresh prompts (bf16, head size 64, 128 or 256; window > 0: a sliding window) "
        "with AMX tiles, written into out",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("out"), py::arg("starts"), py::arg("lengths"),
        py::arg("scale"), py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention_paged", &kvpage::prefill::prefill_attention_paged,
        "causal attention of prompts or prompt chunks whose keys (a cached prefix and their own) are in the packed "
        "bf16 cache (head size 64, 128 or 256; window > 0: a sliding window) with AMX tiles, written into out",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("out"), py::arg("starts"),
        py::arg("lengths"), py::arg("seq_lens"), py::arg("seqs"), py::arg("scale"),
        py::arg("max_scratch_bytes") = int64_t{64} << 20, py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());

  // linear/quant_linear.cpp
  m.def("quant_linear", &quant_linear,
        "x . W^T from Q4 / Q8 block-quantized weights (few-token steps, py::call_guard<py::gil_scoped_release>()); gated: silu(x . Wg^T) * (x . Wu^T) for "
        "W = [Wg; Wu]",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m") = py::none(), py::arg("float_out") = false,
        py::arg("int16") = false, py::arg("gated") = false);
  m.def("quant_int16_available", &quant_int16_available,
        "quant_linear(..., int16=True) has 16-bit integer dot products here (AVX2 builds); elsewhere ignored");

  // linear/linear_amx.cpp
  m.def("amx_linear_available", &kvpage::amx::amx_linear_available, "whether amx_linear can run on this CPU/OS");
  m.def("amx_pack_weight", &kvpage::amx::amx_pack_weight, "a bf16 [N, K] weight in amx_linear's operand order");
  m.def("amx_linear", &kvpage::amx::amx_linear, "x . W^T (+ bias) with AMX tile products from a packed bf16 weight",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("act") = 0, py::arg("stream") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_pack_gate_up", &kvpage::amx::amx_pack_gate_up,
        "a bf16 [gate; up] weight packed for amx_linear(act=1 or 2)");

  // linear/gemm_f32.cpp
  m.def("f32_gemm_available", &kvpage::gemm::f32_gemm_available,
        "whether f32_linear runs in this build (AVX2 + FMA, no AVX-512)");
  m.def("f32_pack_weight", &kvpage::gemm::f32_pack_weight, "a float32 [N, K] weight in 16-column panels for f32_linear");
  m.def("f32_linear", &kvpage::gemm::f32_linear, "float32 x . W^T (+ bias) from a panel-packed weight", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());

  // linear/lm_screen.cpp
  m.def("lm_screen_prepare", &kvpage::gemm::lm_screen_prepare,
        "a float32 lm head as int8 codes per row: codes, scale, code_sum, err_norm, w_norm",
        py::call_guard<py::gil_scoped_release>());
  m.def("lm_screen_argmax", &kvpage::gemm::lm_screen_argmax,
        "each row's argmax of hidden . W^T as the float32 panel GEMM's bits, from an int8 screen with exact bounds",
        py::call_guard<py::gil_scoped_release>());

  // linear/gemm_bf16.cpp
  m.def("bf16_gemm_available", &kvpage::gemm::bf16_gemm_available, "whether bf16_linear runs in this build (AVX512_BF16)");
  m.def("bf16_pack_weight", &kvpage::gemm::bf16_pack_weight,
        "a bf16 [N, K] weight in 16-column panels of k pairs for bf16_linear (gated: [gate; up], panels interleaved)",
        py::arg("w"), py::arg("gated") = false);
  m.def("bf16_linear", &kvpage::gemm::bf16_linear,
        "bf16 x . W^T (+ bias) from a panel-packed weight; act 1 / 2 (gated packing): silu / gelu_tanh(gate) * up",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::arg("act") = 0,
        py::call_guard<py::gil_scoped_release>());

  // linear/gemm_i8.cpp
  m.def("i8_gemm_available", &kvpage::gemm_i8::i8_gemm_available,
        "whether i8_linear runs in this build (AVX-512 VNNI)");
  m.def("i8_pack_weight", &kvpage::gemm_i8::i8_pack_weight,
        "Q4 / Q8 blocks as i8_linear's panels: (codes, scales)", py::arg("qs"), py::arg("d"), py::arg("m") = py::none(),
        py::arg("gated") = false);
  m.def("i8_linear", &kvpage::gemm_i8::i8_linear,
        "x . W^T from Q4 / Q8 panels with int8 activation codes per 32-block (VNNI products)", py::arg("x"),
        py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("gated") = false,
        py::arg("bias") = py::none(), py::arg("stream") = false, py::call_guard<py::gil_scoped_release>());

  // sampler.cpp
  m.def("apply_penalties_", &apply_penalties_, "repetition, presence and frequency penalties in place, per row",
        py::call_guard<py::gil_scoped_release>());
  m.def("sample_rows", &sample_rows, "inverse-CDF draws under temperature / top-k / top-p / min-p, per row",
        py::call_guard<py::gil_scoped_release>());

  // decode_layers.cpp
  py::class_<kvpage::DecodeLayers>(m, "DecodeLayers",
                                   "a decode-only step's decoder layers in one call (quantized weights, or the "
                                   "AMX tile GEMM's packed operands)",
                                   py::module_local())
      .def(py::init<torch::Tensor, double, int64_t, int64_t, int64_t, double, bool, bool>(),
           py::arg("first_norm"), py::arg("first_eps"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("scale"), py::arg("amx_decode") = true, py::arg("avx2_row_decode") = false)
      .def("add_layer", &kvpage::DecodeLayers::add_layer, py::arg("mats"), py::arg("post_norm"), py::arg("eps"),
           py::arg("next_norm"), py::arg("next_eps"))
      .def("add_amx_layer", &kvpage::DecodeLayers::add_amx_layer, py::arg("mats"), py::arg("act"),
           py::arg("post_norm"), py::arg("eps"), py::arg("next_norm"), py::arg("next_eps"))
      .def("num_layers", &kvpage::DecodeLayers::num_layers)
      .def("run", &kvpage::DecodeLayers::run, py::arg("residual"), py::arg("cos"), py::arg("sin"),
           py::arg("kv_caches"), py::arg("slot_mapping"), py::arg("plan"), py::arg("int16"), py::arg("packed"),
           py::arg("key_feedback") = std::vector<c10::optional<torch::Tensor>>{},
           py::call_guard<py::gil_scoped_release>());
}
