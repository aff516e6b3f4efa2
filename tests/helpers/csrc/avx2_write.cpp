// The quantizing row write (attention/quant_codes.h) as an AVX2-only build compiles it, for a test that runs
// on machines with AVX-512 too (tests/ops/test_quant_write_avx2.py builds this file with -mno-avx512f, and
// attention/kv_affine.cpp beside it: the key/value transform's 8-lane rows, tests/ops/test_kv_affine.py), and the
// logits pass's allowed-token mask (row_mask.h, tests/ops/test_fused_ops.py).
#include <torch/extension.h>

#include "attention/key_feedback.h"
#include "attention/quant_rows.h"
#include "ops.h"  // kv_affine_rows
#include "row_mask.h"

using namespace kvpage::attn;
static_assert(KVPAGE_ISA_AVX2_ONLY, "built without AVX-512: the AVX2 write is what runs");

template <KVCode C, typename IN>
void rows(const torch::Tensor& x, torch::Tensor& out, bool rotate) {
  const int64_t N = x.size(0), D = x.size(1);
  std::vector<float> buf(static_cast<size_t>(D));
  for (int64_t i = 0; i < N; ++i)
    quantize_row<C>(x.data_ptr<IN>() + i * D, out.data_ptr<uint8_t>() + i * (D + kScaleBytes), D, buf.data(), rotate);
}

template <typename IN>
void by_code(const torch::Tensor& x, torch::Tensor& out, at::ScalarType code, bool rotate) {
  if (code == at::kChar) rows<KVCode::kInt8, IN>(x, out, rotate);
  else if (code == at::kFloat8_e4m3fn) rows<KVCode::kE4M3, IN>(x, out, rotate);
  else rows<KVCode::kE5M2, IN>(x, out, rotate);
}

// x [N, D] float32 or bfloat16 -> [N, D + 2] bytes: each row's codes and its bfloat16 scale
torch::Tensor quantize(const torch::Tensor& x, at::ScalarType code, bool rotate) {
  auto out = torch::empty({x.size(0), x.size(1) + kScaleBytes}, torch::kUInt8);
  if (x.scalar_type() == at::kFloat) by_code<float>(x, out, code, rotate);
  else by_code<at::BFloat16>(x, out, code, rotate);
  return out;
}

template <KVCode C, typename IN>
void feedback_rows(const torch::Tensor& x, const torch::Tensor& fb, torch::Tensor& out) {
  const int64_t N = x.size(0), D = x.size(1);
  std::vector<float> t(static_cast<size_t>(D * kFeedbackRows));
  std::vector<uint8_t> codes(static_cast<size_t>(D * kFeedbackRows));
  const IN* src[kFeedbackRows];
  uint8_t* dst[kFeedbackRows];
  for (int64_t i0 = 0; i0 < N; i0 += kFeedbackRows) {
    const int64_t n = std::min(kFeedbackRows, N - i0);
    for (int64_t r = 0; r < n; ++r) {
      src[r] = x.data_ptr<IN>() + (i0 + r) * D;
      dst[r] = out.data_ptr<uint8_t>() + (i0 + r) * (D + kScaleBytes);
    }
    quantize_keys_feedback<C>(src, n, D, fb.data_ptr<float>(), dst, t.data(), codes.data());
  }
}

// key rows x [N, D] with the rounding feedback fb [D, D] (key_feedback.h, 8 rows at a time) -> [N, D + 2] bytes
torch::Tensor quantize_feedback(const torch::Tensor& x, at::ScalarType code, const torch::Tensor& fb) {
  auto out = torch::empty({x.size(0), x.size(1) + kScaleBytes}, torch::kUInt8);
  const bool f32 = x.scalar_type() == at::kFloat;
  if (code == at::kChar) f32 ? feedback_rows<KVCode::kInt8, float>(x, fb, out) : feedback_rows<KVCode::kInt8, at::BFloat16>(x, fb, out);
  else if (code == at::kFloat8_e4m3fn) f32 ? feedback_rows<KVCode::kE4M3, float>(x, fb, out) : feedback_rows<KVCode::kE4M3, at::BFloat16>(x, fb, out);
  else f32 ? feedback_rows<KVCode::kE5M2, float>(x, fb, out) : feedback_rows<KVCode::kE5M2, at::BFloat16>(x, fb, out);
  return out;
}

// x [V] float32 masked in place by int32 words; returns the first index of the largest allowed entry (-1: none)
int64_t mask_row(torch::Tensor x, const torch::Tensor& words) {
  return kvpage::sampling::mask_row(x.data_ptr<float>(), x.numel(), words.data_ptr<int32_t>(), words.numel());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mask_row", &mask_row);
  m.def("quantize", &quantize);
  m.def("quantize_feedback", &quantize_feedback);
  m.def("kv_affine_rows", &kv_affine_rows);
}
