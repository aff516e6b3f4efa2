// The AVX-512 main loop for bf16 caches in the row layout: 16 keys at a time, q.k by dpbf16 straight from
// the cache, values accumulated in float32 registers.
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

#if KVPAGE_ISA_AVX512BF16
// Key m of a 16-key chunk goes into slot kSlotKey[m] so that reduce16 leaves key i's sum in lane i.
constexpr int kSlotKey[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// Horizontal sums of 16 vectors at once (a transposing add tree: 45 shuffles/adds instead of 16 separate
// reductions). Lane 4i + p of the result holds the sum of v[4p + i].
inline __m512 reduce16(const __m512* v) {
  __m512 r[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)
    r[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k) {
    const __m512d a = _mm512_castps_pd(u[2 * k]), b = _mm512_castps_pd(u[2 * k + 1]);
    w[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512 bf16x16_to_ps(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The bf16-cache, bf16-query case of attend_tile, vectorized across keys: keys are taken 16 at a time, each
// query row gets its 16 scores from exact bf16 dot products (dpbf16) and one transposing reduction, and the
// softmax runs on the 16 lanes in registers. Values are widened to float once per chunk and shared by every
// row of the KV head's group. Float32 accumulators, running max and sum, as in attend_tile.
template <int64_t D>
void attend_tile_bf16(const at::BFloat16* const* qb, int64_t nq, int64_t H, int64_t G, const at::BFloat16* kcache,
                      const at::BFloat16* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                      int64_t kv_heads,
                      int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m, float* l,
                      std::vector<float>& scratch, float scale, int64_t window = 0,
                      const NextKeys& next = {}) {
  static_assert(D % 32 == 0, "head size must be a multiple of 32");
  constexpr int64_t NC = D / 32;  // 512-bit chunks of a bf16 row
  constexpr int64_t NF = D / 16;  // 512-bit chunks of a float row
  const int64_t R = nq * H;
  const int64_t row_stride = kv_heads * D;
  scratch.resize(static_cast<size_t>(8 * D + R * 16));
  // the chunk's values as interleaved bf16 pairs: [pair][512-bit chunk c][lo, hi halves] = 8 x D floats' room
  auto* vpairs = reinterpret_cast<at::BFloat16*>(scratch.data());
  float* wts = scratch.data() + 8 * D;      // softmax weights, [r][i]
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vneg_inf = _mm512_set1_ps(neg_inf), vscale = _mm512_set1_ps(scale);
  reset_partials(acc, m, l, R, D);
  int64_t t = k_begin;
  while (t < k_end) {
    const int64_t off = t % block_size;
    const int64_t n = std::min<int64_t>({block_size - off, k_end - t, 16});
    const int64_t phys = table[t / block_size];
    const BlockPrefetch<at::BFloat16> prefetch(kcache, vcache, table, block_size, block_stride, row_stride, t,
                                               k_begin, k_end, next);
    for (int64_t h = 0; h < kv_heads; ++h) {
      prefetch.part(h, kv_heads);
      const at::BFloat16* kbase = kcache + phys * block_stride + off * row_stride + h * D;
      const at::BFloat16* vbase = vcache + phys * block_stride + off * row_stride + h * D;
      int64_t vis_max = 0;
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);  // keys after this query's position are masked
        const int64_t first = window_first(window, pos0 + j, t, n);  // and keys before its window
        if (visible > first) vis_max = std::max(vis_max, visible);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = j * H + h * G + g;
          float* w = wts + r * 16;
          if (visible <= first) {
            _mm512_storeu_ps(w, _mm512_setzero_ps());
            continue;
          }
          __m512i qv[NC];
          for (int64_t c = 0; c < NC; ++c) qv[c] = _mm512_loadu_si512(reinterpret_cast<const void*>(qb[r] + 32 * c));
          __m512 dots[16];
          for (int slot = 0; slot < 16; ++slot) {
            const int key = kSlotKey[slot];
            __m512 a = _mm512_setzero_ps();
            if (key < visible && key >= first) {
              const at::BFloat16* k = kbase + key * row_stride;
              for (int64_t c = 0; c < NC; ++c)
                a = _mm512_dpbf16_ps(a, (__m512bh)qv[c],
                                     (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(k + 32 * c)));
            }
            dots[slot] = a;
          }
          const __mmask16 keep = static_cast<__mmask16>(((1u << visible) - 1u) & ~((1u << first) - 1u));
          const __m512 s = _mm512_mask_blend_ps(keep, vneg_inf, _mm512_mul_ps(reduce16(dots), vscale));
          const float new_m = std::max(m[r], _mm512_reduce_max_ps(s));
          const float corr = exp_neg(m[r] - new_m);
          const __m512 e = exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_m)), keep);
          _mm512_storeu_ps(w, e);
          l[r] = l[r] * corr + _mm512_reduce_add_ps(e);
          m[r] = new_m;
          if (corr != 1.f) {
            float* a = acc + r * D;
            const __m512 vc = _mm512_set1_ps(corr);
            for (int64_t c = 0; c < NF; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), vc));
          }
        }
      }
      if (vis_max <= 0) continue;
      kvpage::interleave_value_pairs<NC>(vbase, row_stride, vis_max, vpairs);
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);
        if (visible <= window_first(window, pos0 + j, t, n)) continue;
        const int64_t row_pairs = (visible + 1) / 2;  // weights before the window are 0
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = j * H + h * G + g;
          float* a = acc + r * D;  // kept in the interleaved element order until the end of the task
          // The weights as bf16 pairs (w[2p] low, w[2p+1] high), like FlashAttention's bf16 P @ V.
          int32_t wp[8];
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(wp), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(wts + r * 16)));
          __m512 av[NF];
          for (int64_t c = 0; c < NF; ++c) av[c] = _mm512_loadu_ps(a + 16 * c);
          for (int64_t pr = 0; pr < row_pairs; ++pr) {
            const __m512bh wb = (__m512bh)_mm512_set1_epi32(wp[pr]);
            for (int64_t c = 0; c < NF; ++c)
              av[c] = _mm512_dpbf16_ps(av[c], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(vpairs + (pr * NC) * 64 + 32 * c)), wb);
          }
          for (int64_t c = 0; c < NF; ++c) _mm512_storeu_ps(a + 16 * c, av[c]);
        }
      }
    }
    t += n;
  }
  kvpage::restore_pair_order<D>(acc, R);
}
#endif

}  // namespace kvpage::attn
