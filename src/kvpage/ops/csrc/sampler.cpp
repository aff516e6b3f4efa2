// Token draws for a step's sampled rows: temperature, top-k, top-p and min-p as one threshold on each row's
// softmax weights, found without sorting the vocabulary, then an inverse-CDF draw per uniform.
//
// Per row (one OpenMP task each), with top-k: counting passes find a band below the maximum logit that holds
// at least k logits; only its entries are sorted and weighed, and top-p, min-p and the draws work on them.
// Without top-k: the weights e_i = exp((x_i - max) / T) with their sums per block of 256; for top-p, a
// histogram (1024 bins of log-weight) over the weights that can hold the boundary (above a floor that provably
// lies below it) locates the one bin where the mass boundary falls, and only that bin is sorted. min-p is the
// threshold e_i >= min_p (the maximum's weight is 1). The kept weights are those at or above the largest
// threshold (ties at the boundary stay), so the most likely token always stays. A draw walks the block sums,
// then one block.
#include "tensor.h"

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "common.h"
#include "sampler.h"

namespace {

constexpr int64_t kBins = 1024;
constexpr int64_t kBlock = 256;

using kvpage::sampling::Scratch;

// The row's maximum (NaN ignored). Vector paths per instruction set: the compiler's own vectorization of
// these loops ran 10x slower than the intrinsics here.
float row_max(const float* x, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if KVPAGE_ISA_AVX512
  __m512 acc = _mm512_set1_ps(m);
  for (; i + 16 <= V; i += 16) acc = _mm512_max_ps(_mm512_loadu_ps(x + i), acc);  // NaN lane: keeps acc
  m = _mm512_reduce_max_ps(acc);
#elif KVPAGE_ISA_AVX2
  __m256 acc = _mm256_set1_ps(m);
  for (; i + 8 <= V; i += 8) acc = _mm256_max_ps(_mm256_loadu_ps(x + i), acc);
  m = kvpage::hmax8(acc);
#endif
  for (; i < V; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// e[i] = exp((x[i] - m) * inv) for i in [begin, end), 0 where that is below e^-87 or NaN; returns their sum.
float weights(const float* x, float* e, int64_t begin, int64_t end, float m, float inv) {
  int64_t i = begin;
  float sum = 0.f;
#if KVPAGE_ISA_AVX512
  const __m512 vm = _mm512_set1_ps(m), vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-87.f);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= end; i += 16) {
    const __m512 z = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm), vinv);
    const __m512 w = kvpage::exp16(z, _mm512_cmp_ps_mask(z, lo, _CMP_GT_OQ));
    _mm512_storeu_ps(e + i, w);
    acc = _mm512_add_ps(acc, w);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif KVPAGE_ISA_AVX2
  const __m256 vm = _mm256_set1_ps(m), vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-87.f);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= end; i += 8) {
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), vinv);
    const __m256 w = _mm256_and_ps(kvpage::exp8(z), _mm256_cmp_ps(z, lo, _CMP_GT_OQ));
    _mm256_storeu_ps(e + i, w);
    acc = _mm256_add_ps(acc, w);
  }
  sum = kvpage::hsum8(acc);
#endif
  for (; i < end; ++i) {
    const float z = (x[i] - m) * inv;
    e[i] = z > -87.f ? kvpage::exp_neg(z) : 0.f;
    sum += e[i];
  }
  return sum;
}

// Sum of the weights in [begin, end) that are >= thr.
float kept_sum(const float* e, int64_t begin, int64_t end, float thr) {
  int64_t i = begin;
  float sum = 0.f;
#if KVPAGE_ISA_AVX512
  const __m512 t = _mm512_set1_ps(thr);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= end; i += 16) {
    const __m512 w = _mm512_loadu_ps(e + i);
    acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(w, t, _CMP_GE_OQ), acc, w);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif KVPAGE_ISA_AVX2
  const __m256 t = _mm256_set1_ps(thr);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= end; i += 8) {
    const __m256 w = _mm256_loadu_ps(e + i);
    acc = _mm256_add_ps(acc, _mm256_and_ps(w, _mm256_cmp_ps(w, t, _CMP_GE_OQ)));
  }
  sum = kvpage::hsum8(acc);
#endif
  for (; i < end; ++i) sum += e[i] >= thr ? e[i] : 0.f;
  return sum;
}

// How many of x[0, V) are >= t (NaN never is).
int64_t count_at_least(const float* x, int64_t V, float t) {
  int64_t n = 0, i = 0;
#if KVPAGE_ISA_AVX512
  const __m512 vt = _mm512_set1_ps(t);
  for (; i + 16 <= V; i += 16) n += _mm_popcnt_u32(_mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vt, _CMP_GE_OQ));
#elif KVPAGE_ISA_AVX2
  const __m256 vt = _mm256_set1_ps(t);
  for (; i + 8 <= V; i += 8)
    n += _mm_popcnt_u32(static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vt, _CMP_GE_OQ))));
#endif
  for (; i < V; ++i) n += x[i] >= t;
  return n;
}

// top-k (with top-p and min-p inside it) without touching the rest of the vocabulary: a band below the
// maximum that holds at least k logits (widened or narrowed by counting passes), its entries sorted, their
// weights, then the draws among the kept ones.
void sample_top_k(const float* x, int64_t V, float m, float inv, int64_t k, float top_p, float min_p,
                  const double* u, int64_t W, int64_t* out, Scratch& s) {
  float lo = 0.f, hi = std::numeric_limits<float>::infinity(), delta = 8.f;
  for (int it = 0; it < 40; ++it) {  // find delta with k <= count(x >= m - delta) <= 64 k, if there is one
    const int64_t n = count_at_least(x, V, m - delta);
    if (n < k) {
      lo = delta;
      if (!std::isfinite(hi) && delta > 1e30f) break;
      delta = std::isfinite(hi) ? 0.5f * (lo + hi) : delta * 4.f;
    } else if (n > 64 * k && delta > 1e-30f) {
      hi = delta;
      delta = 0.5f * (lo + hi);
    } else {
      break;
    }
  }
  const float band = m - delta;
  s.cand.clear();
  kvpage::for_each_at_least(x, V, band, [&](int64_t i) { s.cand.emplace_back(x[i], static_cast<int32_t>(i)); });
  auto by_logit = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  int64_t keep = std::min<int64_t>(k, static_cast<int64_t>(s.cand.size()));
  std::partial_sort(s.cand.begin(), s.cand.begin() + keep, s.cand.end(), by_logit);
  while (keep < static_cast<int64_t>(s.cand.size()) && s.cand[keep].first == s.cand[keep - 1].first) {
    // ties with the k-th logit stay, as in the full-vocabulary path
    auto tie = std::find_if(s.cand.begin() + keep, s.cand.end(),
                            [&](const auto& c) { return c.first == s.cand[keep - 1].first; });
    if (tie == s.cand.end()) break;
    std::iter_swap(s.cand.begin() + keep, tie);
    ++keep;
  }
  s.pick.resize(keep);
  double total = 0.0;
  for (int64_t j = 0; j < keep; ++j) {
    const float z = (s.cand[j].first - m) * inv;
    s.pick[j] = z > -87.f ? kvpage::exp_neg(z) : 0.f;
    total += s.pick[j];
  }
  int64_t kept = keep;
  if (top_p < 1.f) {  // the smallest prefix (by weight) whose mass reaches top_p of the top k
    const double target = static_cast<double>(top_p) * total;
    double cum = 0.0;
    for (int64_t j = 0; j < keep; ++j) {
      cum += s.pick[j];
      if (cum >= target) { kept = j + 1; break; }
    }
    while (kept < keep && s.pick[kept] == s.pick[kept - 1]) ++kept;
  }
  double mass = 0.0;
  int64_t last = 0;
  for (int64_t j = 0; j < kept; ++j) {
    if (s.pick[j] < min_p) s.pick[j] = 0.f;  // p_i / p_max = e_i; the first entry has e = 1
    mass += s.pick[j];
    if (s.pick[j] > 0.f) last = j;
  }
  for (int64_t w = 0; w < W; ++w) {
    const double target = u[w] * mass;
    double cum = 0.0;
    int64_t pick = last;
    for (int64_t j = 0; j < kept; ++j) {
      cum += s.pick[j];
      if (cum > target && s.pick[j] > 0.f) { pick = j; break; }
    }
    out[w] = s.cand[pick].second;
  }
}

// Index of the first weight (>= thr) where the running sum passes `target`; the last kept index otherwise.
int64_t draw(const float* e, int64_t V, const std::vector<double>& block_sum, float thr, double target) {
  const int64_t nblk = static_cast<int64_t>(block_sum.size());
  double cum = 0.0;
  int64_t b = 0;
  for (; b < nblk - 1; ++b) {
    if (cum + block_sum[b] > target) break;
    cum += block_sum[b];
  }
  int64_t last = -1;
  for (; b < nblk; ++b) {
    const int64_t end = std::min(V, (b + 1) * kBlock);
    for (int64_t i = b * kBlock; i < end; ++i) {
      if (e[i] < thr || e[i] <= 0.f) continue;
      last = i;
      cum += e[i];
      if (cum > target) return i;
    }
  }
  return last;
}

}  // namespace

namespace kvpage::sampling {

void sample_row(const float* x, int64_t V, float T, int64_t k, float top_p, float min_p, const double* u,
                int64_t W, int64_t* out, Scratch& s) {
  const float m = row_max(x, V);
  auto argmax = [&] {
    for (int64_t i = 0; i < V; ++i)
      if (x[i] == m) return i;
    return int64_t{0};
  };
  if (!(m > -std::numeric_limits<float>::infinity()) || !std::isfinite(m)) {
    std::fill(out, out + W, argmax());  // nothing drawable (the caller cleans rows first): the argmax
    return;
  }
  const float inv = 1.f / T;
  if (k > 0 && k < V) {
    sample_top_k(x, V, m, inv, k, top_p, min_p, u, W, out, s);
    return;
  }
  float* e = s.e.data();
  const int64_t nblk = (V + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < nblk; ++b) {
    s.block_sum[b] = weights(x, e, b * kBlock, std::min(V, (b + 1) * kBlock), m, inv);
    total += s.block_sum[b];
  }
  float thr = 0.f;
  if (top_p < 1.f) {
    // Only weights at or above a floor can hold the top-p boundary: the weights below c sum to less than
    // V c = (1 - p) Z / 2, so the kept mass p Z is reached above c.
    const float floor = std::max(static_cast<float>(0.5 * (1.0 - top_p) * total / static_cast<double>(V)),
                                 std::numeric_limits<float>::min());
    s.idx.resize(V);
    int64_t n = 0;
    for (int64_t i = 0; i < V; ++i) {  // branch-free: most entries fail
      s.idx[n] = static_cast<int32_t>(i);
      n += e[i] >= floor;
    }
    s.idx.resize(n);
    // Bins of log-weight over [log(lowest survivor), 0]; bin 0 holds the largest weights.
    float z_lo = 0.f;
    for (int32_t i : s.idx) z_lo = std::min(z_lo, (x[i] - m) * inv);
    const float scale = z_lo < 0.f ? static_cast<float>(kBins) / -z_lo : 0.f;
    s.bin.resize(s.idx.size());
    std::fill(s.mass.begin(), s.mass.end(), 0.0);
    for (size_t j = 0; j < s.idx.size(); ++j) {
      const int32_t i = s.idx[j];
      const float f = -((x[i] - m) * inv) * scale;  // clamped before the cast: it may be huge
      const int32_t b = f < 1.f ? 0 : (f < static_cast<float>(kBins - 1) ? static_cast<int32_t>(f) : kBins - 1);
      s.bin[j] = b;
      s.mass[b] += e[i];
    }
    const double target = static_cast<double>(top_p) * total;
    double cum = 0.0;
    int32_t b = 0;
    for (; b < kBins && cum + s.mass[b] < target; ++b) cum += s.mass[b];
    if (b < kBins) {  // else rounding left the mass short of the target: keep everything
      s.pick.clear();
      for (size_t j = 0; j < s.idx.size(); ++j)
        if (s.bin[j] == b) s.pick.push_back(e[s.idx[j]]);
      std::sort(s.pick.begin(), s.pick.end(), std::greater<float>());
      thr = s.pick.empty() ? 0.f : s.pick.back();
      for (float w : s.pick) {  // the token that brings the mass to top_p is the last one kept
        cum += w;
        if (cum >= target) { thr = w; break; }
      }
    }
  }
  thr = std::max(thr, min_p);  // p_i / p_max = e_i
  if (thr > 0.f)
    for (int64_t b = 0; b < nblk; ++b) s.block_sum[b] = kept_sum(e, b * kBlock, std::min(V, (b + 1) * kBlock), thr);
  double kept = 0.0;
  for (int64_t b = 0; b < nblk; ++b) kept += s.block_sum[b];
  for (int64_t j = 0; j < W; ++j) {
    const int64_t t = draw(e, V, s.block_sum, thr, u[j] * kept);
    out[j] = t >= 0 ? t : argmax();
  }
}

void Scratch::reserve(int64_t V) {
  e.resize(V);
  block_sum.resize((V + kBlock - 1) / kBlock);
  mass.resize(kBins);
}

}  // namespace kvpage::sampling

using kvpage::sampling::sample_row;

// logits [N, V] float32; rows [R] int64 (which logits row each draw uses); temperature, top_p, min_p [R]
// float32 (temperature > 0); top_k [R] int64 (0: off); uniforms [R, W] float64 in [0, 1). Returns [R, W]
// token ids.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor rows, torch::Tensor temperature, torch::Tensor top_k,
                          torch::Tensor top_p, torch::Tensor min_p, torch::Tensor uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous [rows, vocab] float32 tensor");
  const int64_t R = rows.size(0), V = logits.size(1), W = uniforms.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kLong && top_k.scalar_type() == at::kLong, "rows and top_k must be int64");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  min_p.scalar_type() == at::kFloat, "temperature, top_p and min_p must be float32");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.size(0) == R,
              "uniforms must be a contiguous [rows, draws] float64 tensor");
  TORCH_CHECK(temperature.size(0) == R && top_k.size(0) == R && top_p.size(0) == R && min_p.size(0) == R,
              "one temperature, top_k, top_p and min_p per row");
  auto out = at::empty({R, W}, at::kLong);
  const float* x = logits.data_ptr<float>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const float* tp = temperature.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const float* pp = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const double* up = uniforms.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(row[r] >= 0 && row[r] < logits.size(0) && tp[r] > 0.f, "row index or temperature out of range");
#pragma omp parallel if (R > 1)
  {
    Scratch s;
    s.reserve(V);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < R; ++r)
      sample_row(x + row[r] * V, V, tp[r], kp[r], pp[r], mp[r], up + r * W, W, op + r * W, s);
  }
  return out;
}

// In place on logits rows: the repetition penalty on every token seen in the prompt or the output (once per
// distinct token), then presence and frequency penalties from the output's counts. Ids are flat with
// offsets [R + 1] per row; ids outside [0, vocab) are ignored. O(ids) per row, no pass over the vocabulary.
void apply_penalties_(torch::Tensor logits, torch::Tensor rows, torch::Tensor prompt_ids, torch::Tensor prompt_offsets,
                      torch::Tensor output_ids, torch::Tensor output_offsets, torch::Tensor repetition,
                      torch::Tensor presence, torch::Tensor frequency) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous [rows, vocab] float32 tensor");
  const int64_t R = rows.size(0), V = logits.size(1);
  for (const auto& t : {rows, prompt_ids, prompt_offsets, output_ids, output_offsets})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), "ids, offsets and rows must be contiguous int64");
  for (const auto& t : {repetition, presence, frequency})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.size(0) == R, "one float32 penalty per row");
  TORCH_CHECK(prompt_offsets.size(0) == R + 1 && output_offsets.size(0) == R + 1, "offsets need rows + 1 entries");
  float* x = logits.data_ptr<float>();
  const int64_t *row = rows.data_ptr<int64_t>(), *pi = prompt_ids.data_ptr<int64_t>(),
                *po = prompt_offsets.data_ptr<int64_t>(), *oi = output_ids.data_ptr<int64_t>(),
                *oo = output_offsets.data_ptr<int64_t>();
  const float *rep = repetition.data_ptr<float>(), *pres = presence.data_ptr<float>(),
              *freq = frequency.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(row[r] >= 0 && row[r] < logits.size(0), "row index out of range");
#pragma omp parallel if (R > 1)
  {
    std::vector<uint32_t> stamp(V, 0);  // stamp[t] == tag: t seen in this row (no clearing between rows)
    std::vector<int32_t> count(V, 0);
    uint32_t tag = 0;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < R; ++r) {
      float* xr = x + row[r] * V;
      ++tag;
      if (rep[r] != 1.f) {
        auto penalize = [&](const int64_t* ids, int64_t a, int64_t b) {
          for (int64_t j = a; j < b; ++j) {
            const int64_t t = ids[j];
            if (t < 0 || t >= V || stamp[t] == tag) continue;
            stamp[t] = tag;
            xr[t] = xr[t] > 0.f ? xr[t] / rep[r] : xr[t] * rep[r];
          }
        };
        penalize(pi, po[r], po[r + 1]);
        penalize(oi, oo[r], oo[r + 1]);
        ++tag;
      }
      if (pres[r] != 0.f || freq[r] != 0.f) {
        for (int64_t j = oo[r]; j < oo[r + 1]; ++j) {
          const int64_t t = oi[j];
          if (t < 0 || t >= V) continue;
          if (stamp[t] != tag) { stamp[t] = tag; count[t] = 0; }
          ++count[t];
        }
        for (int64_t j = oo[r]; j < oo[r + 1]; ++j) {
          const int64_t t = oi[j];
          if (t < 0 || t >= V || count[t] == 0) continue;
          xr[t] -= freq[r] * static_cast<float>(count[t]) + pres[r];
          count[t] = 0;  // once per distinct token
        }
      }
    }
  }
}
