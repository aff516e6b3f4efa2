// The portable main loop (any instruction set, any head size): each block's rows loaded as float32,
// scores and values by simd loops. The fallback of every other loop.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"
#include "attention/loop.h"

namespace kvpage::attn {

// One task: nq query tokens x all H query heads (R = nq * H rows, ordered (query, head) like the query
// tensor) over keys [k_begin, k_end) of its sequence; row r only sees keys <= pos0 + r / H, and with a window
// (> 0) only keys > pos0 + r / H - window. Within each block
// every KV head is processed while the block's cache lines are hot (a token's heads are adjacent in the
// layout), and each K/V row serves the G query heads of its group. Float32 accumulators, running max and sum.
template <typename KV, int64_t DC>
void attend_tile(const float* q, int64_t nq, int64_t H, int64_t G, const KV* kcache, const KV* vcache,
                 const int64_t* table, int64_t block_size, int64_t block_stride, int64_t kv_heads, int64_t D_rt,
                 int64_t pos0,
                 int64_t k_begin, int64_t k_end, float* acc, float* m, float* l, std::vector<float>& scratch,
                 const at::BFloat16* const* qb, float scale, int64_t window = 0) {
  // DC > 0: the head size is a compile-time constant, so the per-element loops unroll fully.
  const int64_t D = DC > 0 ? DC : D_rt;
  // qb (optional): each row's unscaled bf16 query, for exact bf16 dot products straight from the cache
  const int64_t R = nq * H;
  const int64_t row_stride = kv_heads * D;
  scratch.resize(static_cast<size_t>(block_size * D + R * block_size));
  float* rows = scratch.data();                 // one head's keys (then values) of this block as float, [i][d]
  float* sc = scratch.data() + block_size * D;  // scores, then weights, [r][i]
  const float neg_inf = -std::numeric_limits<float>::infinity();
  reset_partials(acc, m, l, R, D);
  const bool direct = qb != nullptr;
  int64_t t = k_begin;
  while (t < k_end) {
    const int64_t off = t % block_size;
    const int64_t n = std::min(block_size - off, k_end - t);
    const int64_t phys = table[t / block_size];
    for (int64_t h = 0; h < kv_heads; ++h) {
      const KV* kbase = kcache + phys * block_stride + off * row_stride + h * D;
      const KV* vbase = vcache + phys * block_stride + off * row_stride + h * D;
      if (!direct)
        for (int64_t i = 0; i < n; ++i) load_row(kbase + i * row_stride, rows + i * D, D);
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);  // keys after this query's position are masked
        const int64_t first = window_first(window, pos0 + j, t, n);  // and keys before its window
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = j * H + h * G + g;
          float* s = sc + r * block_size;
          for (int64_t i = 0; i < std::min(first, n); ++i) s[i] = 0.f;
          if (visible <= first) {
            for (int64_t i = 0; i < n; ++i) s[i] = 0.f;
            continue;
          }
          float bmax = neg_inf;
#if KVPAGE_ISA_AVX512BF16
          if (direct) {
            if constexpr (std::is_same_v<KV, at::BFloat16>) {
              for (int64_t i = first; i < visible; ++i) {
                s[i] = dot_bf16(qb[r], kbase + i * row_stride, D) * scale;
                bmax = std::max(bmax, s[i]);
              }
            }
          } else
#endif
          {
            const float* qr = q + r * D;
            for (int64_t i = first; i < visible; ++i) {
              s[i] = dot(qr, rows + i * D, D);
              bmax = std::max(bmax, s[i]);
            }
          }
          const float new_m = std::max(m[r], bmax);
          const float corr = exp_neg(m[r] - new_m);
          const float sum = exp_shift_sum(s + first, visible - first, new_m);
          for (int64_t i = visible; i < n; ++i) s[i] = 0.f;
          l[r] = l[r] * corr + sum;
          m[r] = new_m;
          if (corr != 1.f) {
            float* a = acc + r * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= corr;
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) load_row(vbase + i * row_stride, rows + i * D, D);
      for (int64_t j = 0; j < nq; ++j) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = j * H + h * G + g;
          float* a = acc + r * D;
          const float* w = sc + r * block_size;
          float local[DC > 0 ? DC : 1];
          if constexpr (DC > 0) {
            for (int64_t d = 0; d < DC; ++d) local[d] = a[d];
            for (int64_t i = 0; i < n; ++i) {
              const float wi = w[i];
              const float* v = rows + i * DC;
#pragma omp simd
              for (int64_t d = 0; d < DC; ++d) local[d] += wi * v[d];
            }
            for (int64_t d = 0; d < DC; ++d) a[d] = local[d];
          } else {
            for (int64_t i = 0; i < n; ++i) {
              const float wi = w[i];
              const float* v = rows + i * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += wi * v[d];
            }
          }
        }
      }
    }
    t += n;
  }
}

}  // namespace kvpage::attn
