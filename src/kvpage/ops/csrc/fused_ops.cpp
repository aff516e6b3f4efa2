// Fused per-token operations for the bf16 fast path: each replaces several small torch dispatches.
//
//   logits_postprocess(parts, hidden, weight)           float32 logits, exact near-max entries, argmax, lse
//   logits_draw(parts, hidden, weight, draw settings)   each row's token drawn in the same pass, no logits kept
//
// The residual stream is float32; outputs take the weight's dtype (the projections' input dtype).

#include "tensor.h"
#include <ATen/Parallel.h>

#include "common.h"
#include "ops.h"
#include "sampler.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float f32(float x) { return x; }
inline float f32(at::BFloat16 x) { return kvpage::to_float(x); }

}  // namespace

// Row passes of logits_postprocess, 16 lanes at a time where the CPU has AVX-512 (a plain loop otherwise):
// widen to float32 while taking the max; visit entries >= a threshold; max; sum of exp(x - mx).
#if KVPAGE_ISA_AVX512
using kvpage::tail_mask;
using kvpage::load16;
using kvpage::store16;
#endif

template <typename L>
float widen_max(const L* x, float* o, int64_t V) {
#if KVPAGE_ISA_AVX512
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 k = tail_mask(V - v);
    const __m512 a = load16(x + v, k);
    _mm512_mask_storeu_ps(o + v, k, a);
    m = _mm512_mask_max_ps(m, k, m, a);
  }
  return _mm512_reduce_max_ps(m);
#else
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) {
    o[v] = f32(x[v]);
    mx = std::max(mx, o[v]);
  }
  return mx;
#endif
}

template <typename L>
float max_of(const L* o, int64_t V) {
#if KVPAGE_ISA_AVX512
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 k = tail_mask(V - v);
    m = _mm512_mask_max_ps(m, k, m, load16(o + v, k));
  }
  return _mm512_reduce_max_ps(m);
#else
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, f32(o[v]));
  return mx;
#endif
}

// float32 rows: common.h's; bf16 ones (the head's raw output) here.
using kvpage::for_each_at_least;
template <typename F>
void for_each_at_least(const at::BFloat16* o, int64_t V, float threshold, F&& fn) {
#if KVPAGE_ISA_AVX512
  const __m512 t = _mm512_set1_ps(threshold);
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 k = tail_mask(V - v);
    uint32_t hits = _mm512_mask_cmp_ps_mask(k, load16(o + v, k), t, _CMP_GE_OQ);
    while (hits != 0) {
      fn(v + __builtin_ctz(hits));
      hits &= hits - 1;
    }
  }
#else
  for (int64_t v = 0; v < V; ++v)
    if (f32(o[v]) >= threshold) fn(v);
#endif
}

inline float exp_sum(const float* o, int64_t V, float mx) {
#if KVPAGE_ISA_AVX512
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 k = tail_mask(V - v);
    acc = _mm512_add_ps(acc, kvpage::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, o + v), m), k));
  }
  return _mm512_reduce_add_ps(acc);
#else
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < V; ++v) sum += kvpage::exp_neg(o[v] - mx);
  return sum;
#endif
}

// The logits pass, one vocabulary slice (`part`, [B, w], columns start..start+w) at a time, so that the lm
// head's product can run slice by slice with one slice's output alive at once; logits_finish ends it.
//   with `out` ([B, V] float32): the part is widened into its columns of out, row_max updated;
//   without (greedy steps that want only the argmax): nothing is written. For bf16 parts with the weight,
//   the entries within bf16 rounding distance of the running maximum are recomputed exactly (h . W[v] from
//   the float32 final hidden state) and the best kept: every entry below max - tol is below the exact value
//   of the entry that rounded to the max, and the running max never exceeds the final one, so the true
//   argmax is among the recomputed entries. float32 parts: their maximum, first index on ties.
struct LogitsPass {
  const float* hidden;
  const at::BFloat16* weight;  // nullptr for float32 logits (nothing to recompute)
  int64_t Hd, V;
  // h . W[v] in float32, summed in index order
  float exact(int64_t b, int64_t v) const {
    const float* h = hidden + b * Hd;
    const at::BFloat16* w = weight + v * Hd;
    float s = 0.f;
    for (int64_t i = 0; i < Hd; ++i) s += h[i] * f32(w[i]);
    return s;
  }
  static float tolerance(float mx) { return std::fabs(mx) / 32.f + 1e-3f; }  // two bf16 ulps either side
};

template <typename L>
void scan_rows(const LogitsPass& ps, const L* part, int64_t B, int64_t width, int64_t start, float* row_max,
               float* best_value, int64_t* best_index, float* out) {
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const L* x = part + b * width;
      if (out != nullptr) {
        row_max[b] = std::max(row_max[b], widen_max(x, out + b * ps.V + start, width));
        continue;
      }
      const float mx = std::max(row_max[b], max_of(x, width));
      row_max[b] = mx;
      if (ps.weight == nullptr) {  // float32 logits: exact already
        for_each_at_least(x, width, mx, [&](int64_t v) {
          if (best_index[b] < 0 || f32(x[v]) > best_value[b]) best_value[b] = f32(x[v]), best_index[b] = start + v;
        });
        continue;
      }
      for_each_at_least(x, width, mx - LogitsPass::tolerance(mx), [&](int64_t v) {
        const float s = ps.exact(b, start + v);
        // ascending columns: the first index wins ties, as torch.argmax
        if (best_index[b] < 0 || s > best_value[b]) best_value[b] = s, best_index[b] = start + v;
      });
    }
  });
}

LogitsPass logits_pass(torch::Tensor& hidden, torch::Tensor& weight, at::ScalarType dt, int64_t V) {
  if (dt != at::kBFloat16) {
    TORCH_CHECK(dt == at::kFloat, "logits must be float32 or bfloat16");
    return {nullptr, nullptr, 0, V};
  }
  hidden = hidden.to(at::kFloat).contiguous();
  weight = weight.contiguous();
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.size(0) >= V && weight.size(1) == hidden.size(1),
              "weight must be the bf16 [vocab, hidden] output matrix");
  return {hidden.data_ptr<float>(), weight.data_ptr<at::BFloat16>(), hidden.size(1), V};
}

void logits_scan(torch::Tensor part, int64_t start, int64_t vocab, torch::Tensor hidden, torch::Tensor weight,
                 torch::Tensor row_max, torch::Tensor best_value, torch::Tensor best_index,
                 c10::optional<torch::Tensor> out) {
  part = part.contiguous();
  const int64_t B = part.size(0), W = part.size(1);
  TORCH_CHECK(part.dim() == 2 && start >= 0 && start + W <= vocab, "part must be [rows, width] inside the vocabulary");
  TORCH_CHECK(row_max.scalar_type() == at::kFloat && best_value.scalar_type() == at::kFloat &&
                  best_index.scalar_type() == at::kLong && row_max.numel() == B && best_value.numel() == B &&
                  best_index.numel() == B && row_max.is_contiguous() && best_value.is_contiguous() &&
                  best_index.is_contiguous(),
              "row_max, best_value (float32) and best_index (int64) must hold one entry per row");
  float* op = nullptr;
  if (out.has_value() && out->defined()) {
    TORCH_CHECK(out->scalar_type() == at::kFloat && out->is_contiguous() && out->dim() == 2 && out->size(0) == B &&
                    out->size(1) == vocab,
                "out must be float32 [rows, vocab], contiguous");
    op = out->data_ptr<float>();
  }
  const LogitsPass ps = logits_pass(hidden, weight, part.scalar_type(), vocab);
  if (part.scalar_type() == at::kBFloat16)
    scan_rows(ps, part.data_ptr<at::BFloat16>(), B, W, start, row_max.data_ptr<float>(), best_value.data_ptr<float>(),
              best_index.data_ptr<int64_t>(), op);
  else
    scan_rows(ps, part.data_ptr<float>(), B, W, start, row_max.data_ptr<float>(), best_value.data_ptr<float>(),
              best_index.data_ptr<int64_t>(), op);
}

// One row of float32 logits `o` whose maximum is mx: the entries near it recomputed exactly (bf16 logits), then
// its argmax (first index, as torch.argmax) and, where lse is given, its log-sum-exp.
void finish_row(const LogitsPass& ps, float* o, int64_t b, int64_t V, float mx, int64_t* argmax, float* lse) {
  if (ps.weight != nullptr) {
    for_each_at_least(o, V, mx - LogitsPass::tolerance(mx), [&](int64_t v) { o[v] = ps.exact(b, v); });
    mx = max_of(o, V);
  }
  int64_t best = 0;
  while (best + 1 < V && !(o[best] == mx)) ++best;
  *argmax = best;
  if (lse != nullptr) *lse = mx + std::log(exp_sum(o, V, mx));
}

// Row b of every part (the head's vocabulary slices, in order) widened into o; returns the row's maximum.
template <typename L>
float widen_row(const std::vector<torch::Tensor>& parts, int64_t b, float* o) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t start = 0;
  for (const auto& t : parts) {
    const int64_t w = t.size(1);
    mx = std::max(mx, widen_max(t.data_ptr<L>() + b * w, o + start, w));
    start += w;
  }
  return mx;
}

// The whole pass row by row when every part is at hand: each row's parts widened into its row of `out` and the
// row finished while it is still in cache (part by part, then row by row, read all of `out` back from memory:
// 25 MB a step at 128 rows of SmolLM2's vocabulary). The same bits as logits_scan then logits_finish.
template <typename L>
void widen_finish_rows(const LogitsPass& ps, const std::vector<torch::Tensor>& parts, float* out, int64_t B,
                       int64_t V, int64_t* argmax, float* lse) {
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* o = out + b * V;
      finish_row(ps, o, b, V, widen_row<L>(parts, b, o), argmax + b, lse + b);
    }
  });
}

// A step's head output as column parts (its vocabulary slices, in order), checked: one dtype, the same rows;
// contiguous copies where a part is not.
struct LogitParts {
  std::vector<torch::Tensor> parts;
  at::ScalarType dt;
  int64_t rows = 0, vocab = 0;
};
LogitParts logit_parts(const std::vector<torch::Tensor>& parts, const char* op) {
  TORCH_CHECK(!parts.empty(), op, " needs at least one part");
  LogitParts lp{{}, parts[0].scalar_type(), parts[0].size(0), 0};
  for (const auto& t : parts) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == lp.rows && t.scalar_type() == lp.dt,
                "logit parts must be [rows, width] of one dtype");
    lp.vocab += t.size(1);
    lp.parts.push_back(t.contiguous());
  }
  return lp;
}

// The logits pass with each row's draw made while the row is in cache: the row is widened into a thread's
// scratch row (never a [rows, vocab] buffer), finished as logits_postprocess finishes it, and then drawn from as
// sample_rows draws (temperature > 0) or given its argmax (temperature 0). The same float32 row, so the same
// tokens as logits_postprocess followed by sample_rows; at 128 rows of SmolLM2's vocabulary that pair wrote the
// 25 MB of logits out and read them back.
template <typename L>
void widen_draw_rows(const LogitsPass& ps, const std::vector<torch::Tensor>& parts, int64_t B, int64_t V,
                     const float* temp, const int64_t* top_k, const float* top_p, const float* min_p,
                     const double* u, int64_t W, int64_t* tokens, int64_t* argmax, const int64_t* mask_of,
                     const int32_t* masks, int64_t words) {
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> row;
    thread_local kvpage::sampling::Scratch scratch;
    row.resize(static_cast<size_t>(V));
    scratch.reserve(V);
    float* o = row.data();
    for (int64_t b = b0; b < b1; ++b) {
      // no log-sum-exp: no logprobs are asked for
      finish_row(ps, o, b, V, widen_row<L>(parts, b, o), argmax + b, nullptr);
      if (mask_of != nullptr && mask_of[b] >= 0) {
        // only the allowed tokens stay; none allowed: the model's argmax (as the sampler does with logits)
        const int64_t best = kvpage::sampling::mask_row(o, V, masks + mask_of[b] * words, words);
        if (best < 0 || !(temp[b] > 0.f)) {
          std::fill(tokens + b * W, tokens + (b + 1) * W, best < 0 ? argmax[b] : best);
          continue;
        }
      }
      if (temp[b] > 0.f)
        kvpage::sampling::sample_row(o, V, temp[b], top_k[b], top_p[b], min_p[b], u + b * W, W, tokens + b * W,
                                     scratch);
      else
        std::fill(tokens + b * W, tokens + (b + 1) * W, argmax[b]);
    }
  });
}

std::vector<torch::Tensor> logits_draw(std::vector<torch::Tensor> parts, torch::Tensor hidden, torch::Tensor weight,
                                       torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                                       torch::Tensor min_p, torch::Tensor uniforms,
                                       c10::optional<torch::Tensor> mask_of, c10::optional<torch::Tensor> masks) {
  const LogitParts lp = logit_parts(parts, "logits_draw");
  const at::ScalarType dt = lp.dt;
  const int64_t B = lp.rows, V = lp.vocab;
  const std::vector<torch::Tensor>& cparts = lp.parts;
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  min_p.scalar_type() == at::kFloat && top_k.scalar_type() == at::kLong,
              "temperature, top_p and min_p must be float32, top_k int64");
  TORCH_CHECK(temperature.numel() == B && top_k.numel() == B && top_p.numel() == B && min_p.numel() == B,
              "one temperature, top_k, top_p and min_p per row");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.dim() == 2 && uniforms.size(0) == B,
              "uniforms must be a [rows, draws] float64 tensor");
  const auto tc = temperature.contiguous(), kc = top_k.contiguous(), pc = top_p.contiguous(), mc = min_p.contiguous(),
             uc = uniforms.contiguous();
  const int64_t W = uc.size(1);
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(tc.data_ptr<float>()[b] >= 0.f, "temperature must be >= 0");
  const bool masked = mask_of.has_value() && mask_of->defined();
  TORCH_CHECK(masked == (masks.has_value() && masks->defined()), "mask_of and masks come together");
  torch::Tensor mo, mk;
  if (masked) {
    mo = mask_of->contiguous();
    mk = masks->contiguous();
    TORCH_CHECK(mo.scalar_type() == at::kLong && mo.numel() == B, "mask_of must be int64, one entry per row");
    TORCH_CHECK(mk.scalar_type() == at::kInt && mk.dim() == 2, "masks must be [masks, words] int32");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(mo.data_ptr<int64_t>()[b] < mk.size(0), "mask_of names a mask that is not there");
  }
  const int64_t* mop = masked ? mo.data_ptr<int64_t>() : nullptr;
  const int32_t* mkp = masked ? mk.data_ptr<int32_t>() : nullptr;
  const int64_t words = masked ? mk.size(1) : 0;
  auto opts = parts[0].options();
  auto tokens = at::empty({B, W}, opts.dtype(at::kLong));
  auto amax = at::empty({B}, opts.dtype(at::kLong));
  const LogitsPass ps = logits_pass(hidden, weight, dt, V);
  if (dt == at::kBFloat16)
    widen_draw_rows<at::BFloat16>(ps, cparts, B, V, tc.data_ptr<float>(), kc.data_ptr<int64_t>(), pc.data_ptr<float>(),
                                  mc.data_ptr<float>(), uc.data_ptr<double>(), W, tokens.data_ptr<int64_t>(),
                                  amax.data_ptr<int64_t>(), mop, mkp, words);
  else
    widen_draw_rows<float>(ps, cparts, B, V, tc.data_ptr<float>(), kc.data_ptr<int64_t>(), pc.data_ptr<float>(),
                           mc.data_ptr<float>(), uc.data_ptr<double>(), W, tokens.data_ptr<int64_t>(),
                           amax.data_ptr<int64_t>(), mop, mkp, words);
  return {tokens, amax};
}

// After every part went into `out`: the entries near each row's maximum recomputed exactly (bf16 logits),
// then the argmax (first index) and the log-sum-exp. Returns (argmax, lse).
std::vector<torch::Tensor> logits_finish(torch::Tensor out, torch::Tensor hidden, torch::Tensor weight,
                                         torch::Tensor row_max, bool bf16_logits) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2, "out must be float32 [rows, vocab]");
  const int64_t B = out.size(0), V = out.size(1);
  const LogitsPass ps = logits_pass(hidden, weight, bf16_logits ? at::kBFloat16 : at::kFloat, V);
  auto amax = at::empty({B}, out.options().dtype(at::kLong));
  auto lse = at::empty({B}, out.options());
  float* o_all = out.data_ptr<float>();
  const float* rm = row_max.contiguous().data_ptr<float>();
  int64_t* ap = amax.data_ptr<int64_t>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) finish_row(ps, o_all + b * V, b, V, rm[b], ap + b, lp + b);
  });
  return {amax, lse};
}

// Returns (float32 logits, argmax, log-sum-exp) from the logits given as column parts (scan and finish in one
// call); with with_logits=false only the argmax is computed and the other two are empty. `out`, if defined, is
// a float32 buffer with room for [rows, vocab] that the logits are written to (a view of it is returned).
std::vector<torch::Tensor> logits_postprocess(std::vector<torch::Tensor> parts, torch::Tensor hidden,
                                              torch::Tensor weight, bool with_logits, c10::optional<torch::Tensor> out_buf) {
  const LogitParts lp = logit_parts(parts, "logits_postprocess");
  const at::ScalarType dt = lp.dt;
  const int64_t B = lp.rows, V = lp.vocab;
  auto opts = parts[0].options().dtype(at::kFloat);
  torch::Tensor out;
  if (!with_logits) {
    out = at::empty({0, V}, opts);
  } else if (out_buf.has_value() && out_buf->defined()) {
    TORCH_CHECK(out_buf->scalar_type() == at::kFloat && out_buf->is_contiguous() && out_buf->numel() >= B * V,
                "out must be a contiguous float32 buffer of at least rows x vocab");
    out = out_buf->flatten().narrow(0, 0, B * V).view({B, V});
  } else {
    out = at::empty({B, V}, opts);
  }
  if (with_logits) {
    const std::vector<torch::Tensor>& cparts = lp.parts;
    const LogitsPass ps = logits_pass(hidden, weight, dt, V);
    auto amax = at::empty({B}, opts.dtype(at::kLong));
    auto lse = at::empty({B}, opts);
    if (dt == at::kBFloat16)
      widen_finish_rows<at::BFloat16>(ps, cparts, out.data_ptr<float>(), B, V, amax.data_ptr<int64_t>(),
                                      lse.data_ptr<float>());
    else
      widen_finish_rows<float>(ps, cparts, out.data_ptr<float>(), B, V, amax.data_ptr<int64_t>(),
                               lse.data_ptr<float>());
    return {out, amax, lse};
  }
  auto row_max = at::full({B}, -std::numeric_limits<float>::infinity(), opts);
  auto best_value = at::full({B}, -std::numeric_limits<float>::infinity(), opts);
  auto best_index = at::full({B}, -1, opts.dtype(at::kLong));
  int64_t start = 0;
  for (const auto& t : parts) {
    logits_scan(t, start, V, hidden, weight, row_max, best_value, best_index, c10::nullopt);
    start += t.size(1);
  }
  return {out, best_index.clamp_min(0), at::empty({0}, opts)};
}

// act(gate) * up for gu = [gate | up] rows (the gate_up projection's output), one pass, no temporaries; act is
// SiLU (Llama-family MLPs) or GELU with the tanh approximation (Gemma's).
template <typename T, bool GELU>
void act_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter, int64_t stride) {
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gu + r * stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#if KVPAGE_ISA_AVX512
      for (; i < inter; i += 16) {
        const __mmask16 k = tail_mask(inter - i);
        const __m512 gv = load16(g + i, k), uv = load16(u + i, k);
        store16(o + i, GELU ? kvpage::gelu_mul16(gv, uv, k) : kvpage::silu_mul16(gv, uv, k), k);
      }
#else
#if KVPAGE_ISA_AVX2_ONLY
      if constexpr (std::is_same_v<T, float>)
        for (; i + 8 <= inter; i += 8) {
          const __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
          _mm256_storeu_ps(o + i, GELU ? kvpage::gelu_mul8(gv, uv) : kvpage::silu_mul8(gv, uv));
        }
#endif
      for (; i < inter; ++i) {
        const float x = f32(g[i]);
        const float z = GELU ? 2.f * kvpage::kGeluC0 * (x + kvpage::kGeluC1 * x * x * x) : x;
        o[i] = static_cast<T>(x / (1.f + std::exp(-z)) * f32(u[i]));
      }
#endif
    }
  });
}

template <bool GELU>
torch::Tensor act_mul(const torch::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && gu.stride(1) == 1, "gu must be [tokens, 2 * inter], rows dense");
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  auto out = at::empty({rows, inter}, gu.options());
  if (gu.scalar_type() == at::kBFloat16)
    act_mul_rows<at::BFloat16, GELU>(gu.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, inter,
                                     gu.stride(0));
  else {
    TORCH_CHECK(gu.scalar_type() == at::kFloat, "gu must be float32 or bfloat16");
    act_mul_rows<float, GELU>(gu.data_ptr<float>(), out.data_ptr<float>(), rows, inter, gu.stride(0));
  }
  return out;
}

torch::Tensor silu_mul(torch::Tensor gu) { return act_mul<false>(gu); }

torch::Tensor gelu_mul(torch::Tensor gu) { return act_mul<true>(gu); }
