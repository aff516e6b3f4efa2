// The quantized caches' key/value transforms (attention/kv_transform.py) as one pass over a layer's rows.
//
// Why: a layer whose int8 / fp8 pages keep a transform maps its queries, keys and values in, and the attention
// output back: per-channel centres and powers of two, and the keys' Walsh-Hadamard rotation. As torch operators
// (casts, subtractions, products, a [D, D] matrix product each way) that was ~14 calls and as many passes over
// the rows per layer: 7.3 s of a 79 s offline run of Gemma 3 270M (sharegpt, int8 pages, AMX Xeon, 2026-12-02),
// whose int8 engine then served 0.92x the bf16 one. Here each row is read once, mapped in registers and written
// once, the rotation as fwht's butterflies (2 log2(D) adds a value instead of D multiply-adds).
//
// y = (x - sub) * mul, then rotated, then + add: each part optional, in float32 in that order and with no fused
// multiply-add (so the bits equal kv_transform.py affine_rows, the torch oracle), rounded once to x's dtype.
#include "tensor.h"

#include "ops.h"
#include <ATen/Parallel.h>

#include "attention/quant_rows.h"  // fwht, RowLanes

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

struct RowParams {
  const float* sub;  // [H, D] or null
  const float* mul;
  const float* add;
  bool rotate;
};

// One row (head h): scalar, for any D (fwht rotates blocks of the largest power of two dividing D).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void affine_row_scalar(const T* x, T* y, int64_t D, int64_t h,
                                                                    const RowParams& p, float* buf) {
  for (int64_t j = 0; j < D; ++j) {
    float v = static_cast<float>(x[j]);
    if (p.sub != nullptr) v = v - p.sub[h * D + j];
    if (p.mul != nullptr) v = v * p.mul[h * D + j];
    buf[j] = v;
  }
  if (p.rotate) kvpage::attn::fwht(buf, D);
  for (int64_t j = 0; j < D; ++j) y[j] = static_cast<T>(p.add != nullptr ? buf[j] + p.add[h * D + j] : buf[j]);
}

#if KVPAGE_ISA_AVX2
// The same for D a power of two from kW to 256, a vector of lanes at a time.
template <class V, typename T>
__attribute__((optimize("fp-contract=off"))) void affine_row_lanes(const T* x, T* y, int64_t D, int64_t h,
                                                                   const RowParams& p) {
  typename V::F r[256 / V::kW];
  const int64_t n = D / V::kW;
  for (int64_t i = 0; i < n; ++i) {
    r[i] = V::load(x + V::kW * i);
    if (p.sub != nullptr) r[i] = V::sub(r[i], V::load(p.sub + h * D + V::kW * i));
    if (p.mul != nullptr) r[i] = V::mul(r[i], V::load(p.mul + h * D + V::kW * i));
  }
  if (p.rotate) kvpage::attn::fwht_lanes<V>(r, n);
  for (int64_t i = 0; i < n; ++i) {
    if (p.add != nullptr) r[i] = V::add(r[i], V::load(p.add + h * D + V::kW * i));
    V::store(y + V::kW * i, r[i]);
  }
}
#endif

const float* param(const c10::optional<torch::Tensor>& t, int64_t H, int64_t D, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == H &&
                  t->size(1) == D,
              name, " must be a contiguous float32 [", H, ", ", D, "] tensor");
  return t->data_ptr<float>();
}

template <typename T>
void affine_rows_typed(const torch::Tensor& x, torch::Tensor& y, const RowParams& p) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
#if KVPAGE_ISA_AVX2
  const bool lanes = D >= kvpage::attn::RowLanes::kW && D <= 256 && (D & (D - 1)) == 0;
#endif
  // ~16K values a task: one decode token's rows stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / D);
  at::parallel_for(0, T_ * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(D);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / H, h = r % H;
      const T* src = xp + t * s0 + h * s1;
      T* dst = yp + r * D;
#if KVPAGE_ISA_AVX2
      if (lanes) {
        affine_row_lanes<kvpage::attn::RowLanes>(src, dst, D, h, p);
        continue;
      }
#endif
      affine_row_scalar(src, dst, D, h, p, buf.data());
    }
  });
}

}  // namespace

torch::Tensor kv_affine_rows(torch::Tensor x, c10::optional<torch::Tensor> sub, c10::optional<torch::Tensor> mul,
                             bool rotate, c10::optional<torch::Tensor> add) {
  TORCH_CHECK(x.dim() == 3, "x must be [tokens, heads, head_dim], got ", x.dim(), " dimensions");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  if (x.stride(2) != 1) x = x.contiguous();
  const int64_t H = x.size(1), D = x.size(2);
  const RowParams p{param(sub, H, D, "sub"), param(mul, H, D, "mul"), param(add, H, D, "add"), rotate};
  auto y = at::empty({x.size(0), H, D}, x.options());
  if (y.numel() == 0) return y;
  if (x.scalar_type() == at::kFloat)
    affine_rows_typed<float>(x, y, p);
  else
    affine_rows_typed<at::BFloat16>(x, y, p);
  return y;
}
