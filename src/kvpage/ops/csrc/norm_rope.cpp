// Per-token norm and RoPE kernels of the fast paths: each replaces several small torch dispatches (a parallel
// region, a conversion pass and a temporary apiece).
//
//   rms_norm(residual, weight, eps) -> out                  out = norm(residual) * w
//   add_rms_norm(x, residual, weight, eps) -> out           residual += x (float32), out = norm(residual) * w
//   rotary_(q, k, cos, sin)                                 in place, rotate-half convention
//   norm_add_norm(x, residual, w1, w2, eps, bf16_out)       Gemma's sandwich norms around a sublayer:
//                                                           residual += norm(x) * w1, out = norm(residual) * w2
//   qk_norm_rope(qkv, q_w, k_w, eps, cos, sin, hq, hk)      Gemma's QK-norm, then RoPE: new q and k
//
// The residual stream is float32; outputs take the weight's dtype (the projections' input dtype), or the one
// asked for. The fused forms compute what the separate kernels compute in sequence, to the bit: the same row
// arithmetic (norm_row) and the same roundings between the steps.

#include "tensor.h"
#include <ATen/Parallel.h>

#include "common.h"
#include "ops.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float f32(float x) { return x; }
inline float f32(at::BFloat16 x) { return kvpage::to_float(x); }

// Sum of squares of a float32 row in one fixed order (16 lanes of fused multiply-adds, then across the lanes),
// so that every kernel here computes a row's norm to the same bits.
inline float sum_squares(const float* x, int64_t H) {
#if KVPAGE_ISA_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(kvpage::tail_mask(H - i), x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  return ss;
#endif
}

// One row: x (float32, in place) += add where given, then o = w * (x / rms(x)), rounded once to OUT.
template <typename IN, typename W, typename OUT>
inline void norm_row(float* x, const IN* add, const W* w, OUT* o, int64_t H, float eps) {
  if (add != nullptr)
    for (int64_t i = 0; i < H; ++i) x[i] += f32(add[i]);
  const float inv = 1.f / std::sqrt(sum_squares(x, H) / static_cast<float>(H) + eps);
  int64_t i = 0;
#if KVPAGE_ISA_AVX512
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; i < H; i += 16) {
    const __mmask16 k = kvpage::tail_mask(H - i);
    const __m512 v = _mm512_mul_ps(kvpage::load16(w + i, k), _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), vinv));
    kvpage::store16(o + i, v, k);
  }
#endif
  for (; i < H; ++i) o[i] = static_cast<OUT>(f32(w[i]) * (x[i] * inv));
}

template <typename IN, typename W>
void norm_rows(float* res, const IN* add, const W* w, W* out, int64_t rows, int64_t H, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      norm_row(res + r * H, add != nullptr ? add + r * H : nullptr, w, out + r * H, H, static_cast<float>(eps));
  });
}

// One token's heads rotated in place: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (float32
// arithmetic, rounded once per element to T, as the scalar loop does).
template <typename T>
inline void rotate_heads(T* v0, int64_t heads, int64_t D, const float* c, const float* s) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* v = v0 + h * D;
    int64_t i = 0;
#if KVPAGE_ISA_AVX512
    for (; i < half; i += 16) {  // 16 lanes at a time (bf16 widened in registers), masked tail
      const __mmask16 k = kvpage::tail_mask(half - i);
      const __m512 a = kvpage::load16(v + i, k), bb = kvpage::load16(v + i + half, k);
      const __m512 lo = _mm512_fmsub_ps(a, _mm512_maskz_loadu_ps(k, c + i),
                                        _mm512_mul_ps(bb, _mm512_maskz_loadu_ps(k, s + i)));
      const __m512 hi = _mm512_fmadd_ps(bb, _mm512_maskz_loadu_ps(k, c + i + half),
                                        _mm512_mul_ps(a, _mm512_maskz_loadu_ps(k, s + i + half)));
      kvpage::store16(v + i, lo, k);
      kvpage::store16(v + i + half, hi, k);
    }
#endif
    for (; i < half; ++i) {
      const float a = f32(v[i]), bb = f32(v[i + half]);
      v[i] = static_cast<T>(a * c[i] - bb * s[i]);
      v[i + half] = static_cast<T>(bb * c[i + half] + a * s[i + half]);
    }
  }
}

// q and k of every token in one pass over the threads.
template <typename T>
void rotate_qk(T* q, T* k, const float* cos, const float* sin, int64_t tokens, int64_t hq, int64_t hk, int64_t D,
               int64_t q_stride, int64_t k_stride) {
  at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      rotate_heads(q + t * q_stride, hq, D, cos + t * D, sin + t * D);
      rotate_heads(k + t * k_stride, hk, D, cos + t * D, sin + t * D);
    }
  });
}

// Gemma's sandwich: per row, n = norm(x) * w1 (float32, as rms_norm of x widened), residual += n, out =
// norm(residual) * w2 rounded to OUT (as add_rms_norm, then the cast).
template <typename IN, typename OUT>
void norm_add_norm_rows(const IN* x, float* res, const float* w1, const float* w2, OUT* out, int64_t rows, int64_t H,
                        float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    std::vector<float> a(static_cast<size_t>(H)), n(static_cast<size_t>(H));
    for (int64_t r = b; r < e; ++r) {
      for (int64_t i = 0; i < H; ++i) a[i] = f32(x[r * H + i]);
      norm_row<float, float, float>(a.data(), nullptr, w1, n.data(), H, eps);
      norm_row<float, float, OUT>(res + r * H, n.data(), w2, out + r * H, H, eps);
    }
  });
}

// Per token, each of the hq + hk head rows at the front of qkv: norm times its weight (float32), rounded to T
// into q or k, then rotated there (rotate_heads on the rounded values, as rms_norm, the cast and rotary_ do).
template <typename T>
void qk_norm_rope_rows(const T* qkv, int64_t stride, const float* qw, const float* kw, float eps, const float* cos,
                       const float* sin, T* q, T* k, int64_t tokens, int64_t hq, int64_t hk, int64_t D) {
  at::parallel_for(0, tokens, 8, [&](int64_t b, int64_t e) {
    std::vector<float> x(static_cast<size_t>(D));
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < hq + hk; ++h) {
        const T* src = qkv + t * stride + h * D;
        T* dst = h < hq ? q + (t * hq + h) * D : k + (t * hk + h - hq) * D;
        for (int64_t i = 0; i < D; ++i) x[i] = f32(src[i]);
        norm_row<float, float, T>(x.data(), nullptr, h < hq ? qw : kw, dst, D, eps);
        rotate_heads(dst, 1, D, cos + t * D, sin + t * D);
      }
  });
}

}  // namespace

// A norm's weight is read H wide for every row: a shorter one would be read past its end.
static void check_norm_weight(const torch::Tensor& weight, int64_t H) {
  TORCH_CHECK(H > 0 && weight.is_contiguous() && weight.numel() == H, "norm weight must be contiguous with ", H,
              " elements (the rows' width), got ", weight.sizes());
}

// RoPE's cos/sin tables: every token's row is read D wide, so they must be [T, D] float32, dense.
static void check_rope_table(const torch::Tensor& cos, const torch::Tensor& sin, int64_t T, int64_t D) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == T &&
                  cos.size(1) == D,
              "cos/sin must be [", T, ", ", D, "] contiguous float32, got ", cos.sizes(), " and ", sin.sizes());
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous(), "residual must be contiguous float32");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  x = x.contiguous();
  const int64_t H = residual.size(-1);
  check_norm_weight(weight, H);
  const int64_t rows = residual.numel() / H;
  auto out = at::empty(residual.sizes(), residual.options().dtype(weight.scalar_type()));
  if (weight.scalar_type() == at::kBFloat16) {
    if (x.scalar_type() == at::kBFloat16)
      norm_rows<at::BFloat16, at::BFloat16>(residual.data_ptr<float>(), x.data_ptr<at::BFloat16>(),
                                            weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, H, eps);
    else
      norm_rows<float, at::BFloat16>(residual.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<at::BFloat16>(),
                                     out.data_ptr<at::BFloat16>(), rows, H, eps);
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kFloat, "weight must be float32 or bfloat16");
    if (x.scalar_type() == at::kBFloat16)
      norm_rows<at::BFloat16, float>(residual.data_ptr<float>(), x.data_ptr<at::BFloat16>(), weight.data_ptr<float>(),
                                     out.data_ptr<float>(), rows, H, eps);
    else
      norm_rows<float, float>(residual.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(),
                              out.data_ptr<float>(), rows, H, eps);
  }
  return out;
}

torch::Tensor rms_norm(torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous(), "residual must be contiguous float32");
  const int64_t H = residual.size(-1);
  check_norm_weight(weight, H);
  const int64_t rows = residual.numel() / H;
  auto out = at::empty(residual.sizes(), residual.options().dtype(weight.scalar_type()));
  if (weight.scalar_type() == at::kBFloat16)
    norm_rows<float, at::BFloat16>(residual.data_ptr<float>(), nullptr, weight.data_ptr<at::BFloat16>(),
                                   out.data_ptr<at::BFloat16>(), rows, H, eps);
  else
    norm_rows<float, float>(residual.data_ptr<float>(), nullptr, weight.data_ptr<float>(), out.data_ptr<float>(), rows,
                            H, eps);
  return out;
}

void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  // q: [T, Hq, D], k: [T, Hk, D] (views with a row stride), cos/sin: [T, D] float32
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "q/k heads must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D, "k must have q's tokens and head size");
  check_rope_table(cos, sin, T, D);
  if (q.scalar_type() == at::kBFloat16)
    rotate_qk(q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), cos.data_ptr<float>(), sin.data_ptr<float>(), T,
              q.size(1), k.size(1), D, q.stride(0), k.stride(0));
  else
    rotate_qk(q.data_ptr<float>(), k.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), T, q.size(1),
              k.size(1), D, q.stride(0), k.stride(0));
}


torch::Tensor norm_add_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w1, torch::Tensor w2, double eps,
                            bool bf16_out) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous(), "residual must be contiguous float32");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  TORCH_CHECK(w1.scalar_type() == at::kFloat && w2.scalar_type() == at::kFloat && w1.is_contiguous() &&
                  w2.is_contiguous(), "norm weights must be contiguous float32");
  x = x.contiguous();
  const int64_t H = residual.size(-1);
  check_norm_weight(w1, H);
  check_norm_weight(w2, H);
  const int64_t rows = residual.numel() / H;
  auto out = at::empty(residual.sizes(), residual.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const float e = static_cast<float>(eps);
  float* res = residual.data_ptr<float>();
  const float *a = w1.data_ptr<float>(), *b = w2.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
    if (bf16_out) norm_add_norm_rows(x.data_ptr<at::BFloat16>(), res, a, b, out.data_ptr<at::BFloat16>(), rows, H, e);
    else norm_add_norm_rows(x.data_ptr<at::BFloat16>(), res, a, b, out.data_ptr<float>(), rows, H, e);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
    if (bf16_out) norm_add_norm_rows(x.data_ptr<float>(), res, a, b, out.data_ptr<at::BFloat16>(), rows, H, e);
    else norm_add_norm_rows(x.data_ptr<float>(), res, a, b, out.data_ptr<float>(), rows, H, e);
  }
  return out;
}

std::vector<torch::Tensor> qk_norm_rope(torch::Tensor qkv, torch::Tensor q_weight, torch::Tensor k_weight, double eps,
                                        torch::Tensor cos, torch::Tensor sin, int64_t hq, int64_t hk) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [tokens, width] with dense rows");
  const int64_t T = qkv.size(0), D = q_weight.numel();
  TORCH_CHECK(q_weight.scalar_type() == at::kFloat && k_weight.scalar_type() == at::kFloat &&
                  q_weight.is_contiguous() && k_weight.is_contiguous() && k_weight.numel() == D,
              "q/k norm weights: contiguous float32 of the head size");
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) >= (hq + hk) * D, "qkv holds fewer than ", hq + hk, " heads of ", D);
  check_rope_table(cos, sin, T, D);
  auto q = at::empty({T, hq, D}, qkv.options());
  auto k = at::empty({T, hk, D}, qkv.options());
  const float e = static_cast<float>(eps);
  if (qkv.scalar_type() == at::kBFloat16)
    qk_norm_rope_rows(qkv.data_ptr<at::BFloat16>(), qkv.stride(0), q_weight.data_ptr<float>(),
                      k_weight.data_ptr<float>(), e, cos.data_ptr<float>(), sin.data_ptr<float>(),
                      q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), T, hq, hk, D);
  else {
    TORCH_CHECK(qkv.scalar_type() == at::kFloat, "qkv must be float32 or bfloat16");
    qk_norm_rope_rows(qkv.data_ptr<float>(), qkv.stride(0), q_weight.data_ptr<float>(), k_weight.data_ptr<float>(), e,
                      cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(), k.data_ptr<float>(), T, hq,
                      hk, D);
  }
  return {q, k};
}
