// The packed bf16 KV layout and the AVX-512 attention kernel that reads it.
//
// Why: the row layout keeps each token's K and V row contiguous, so every read has to rearrange them for the
// dot-product instructions (a transposing add tree per query row for the scores, a pair interleave of the
// value rows for P.V), and that arithmetic, not memory, limited the kernel. Here the cache itself holds K
// and V in the operand order of vdpbf16ps, arranged once when a token is written:
//   a block is cut into groups of 16 keys; group q of KV head h occupies 16 * D elements at
//   (q * kv_heads + h) * 16 * D inside the block (so a group's heads are adjacent: one 16-key chunk of a
//   block is one contiguous stretch, as in the row layout), and within it
//   K: [D/2 dim pairs][16 keys][2]   -> one 512-bit load = one dim pair of all 16 keys: 16 scores per
//                                       instruction, no horizontal reduction;
//   V: [8 key pairs][D][2]            -> one 512-bit load = 16 dims of two keys, dpbf16's P.V operand as is.
// The tensor keeps the row layout's shape [2, num_blocks, block_size, kv_heads, D] and its block size, so
// block copies, swapping and prefix sharing are unchanged; only token-level access differs (writes through
// write_cache_packed, reads through this kernel). Needs block_size % 16 == 0 and D % 32 == 0.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KVPAGE_PACKED 1

#include <immintrin.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

namespace kvpage {

// Element offsets of key / value element d of the token at offset `off` of its block, KV head h.
inline int64_t packed_k_offset(int64_t off, int64_t h, int64_t d, int64_t kv_heads, int64_t D) {
  return ((off / 16) * kv_heads + h) * 16 * D + (d / 2) * 32 + (off % 16) * 2 + (d % 2);
}
inline int64_t packed_v_offset(int64_t off, int64_t h, int64_t d, int64_t kv_heads, int64_t D) {
  return ((off / 16) * kv_heads + h) * 16 * D + ((off % 16) / 2) * 2 * D + d * 2 + (off % 2);
}

constexpr int64_t kPackedPrefetchAhead = 2;  // 16-key chunks

// Attention of nq query tokens x H heads (rows r = j * H + head, like attend_tile_bf16) over keys
// [k_begin, k_end) of one sequence in the packed layout; row r sees keys <= pos0 + r / H. k_begin must be a
// multiple of 16. Writes unnormalized float32 sums acc[R][D], row maxima m[R] and weight sums l[R].
// Per 16-key chunk and KV head: scores of up to 4 rows at once, each summed in 4 independent partial
// accumulators (a single chain of D/2 dependent dpbf16 per row would leave the unit waiting on latency),
// an online softmax step per row, then P.V with each value load serving a batch of rows.
template <int64_t D>
void attend_tile_packed(const at::BFloat16* const* qb, int64_t nq, int64_t H, int64_t G, const at::BFloat16* kcache,
                        const at::BFloat16* vcache, const int64_t* table, int64_t block_size, int64_t kv_heads,
                        int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m, float* l,
                        std::vector<float>& scratch, float scale) {
  static_assert(D % 32 == 0, "head size must be a multiple of 32");
  constexpr int64_t NF = D / 16;           // 512-bit chunks of a float row
  constexpr int64_t RB = D == 64 ? 6 : 3;  // rows per register batch in P.V (RB * NF accumulators)
  constexpr int64_t SB = 4, NP = 4;        // rows per score batch, partial sums per row
  const int64_t R = nq * H;
  const int64_t group = 16 * D;            // elements of one (16-key group, head)
  const int64_t block_stride = block_size * kv_heads * D;
  scratch.resize(static_cast<size_t>(R * 16));
  float* wts = scratch.data();  // this chunk's softmax weights, [r][16]
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vneg_inf = _mm512_set1_ps(neg_inf), vscale = _mm512_set1_ps(scale);
  const __m512i low_halves = _mm512_set1_epi32(0xFFFF);
  for (int64_t r = 0; r < R; ++r) {
    m[r] = neg_inf;
    l[r] = 0.f;
  }
  std::fill(acc, acc + R * D, 0.f);
  for (int64_t t = k_begin; t < k_end; t += 16) {
    const int64_t n = std::min<int64_t>(16, k_end - t);
    const int64_t chunk = table[t / block_size] * block_stride + ((t % block_size) / 16) * kv_heads * group;
    // The chunk kPackedPrefetchAhead chunks later (its block is elsewhere: the hardware prefetcher cannot
    // know) into L2, a slice per KV head so the requests do not queue up in one burst.
    const int64_t ahead = t + 16 * kPackedPrefetchAhead;
    const char* pf_k = nullptr;
    const char* pf_v = nullptr;
    if (ahead < k_end) {
      const int64_t at = table[ahead / block_size] * block_stride + ((ahead % block_size) / 16) * kv_heads * group;
      pf_k = reinterpret_cast<const char*>(kcache + at);
      pf_v = reinterpret_cast<const char*>(vcache + at);
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      if (pf_k != nullptr) {
        for (int64_t i = 0; i < group * 2 / 64; ++i) {
          _mm_prefetch(pf_k + h * group * 2 + 64 * i, _MM_HINT_T1);
          _mm_prefetch(pf_v + h * group * 2 + 64 * i, _MM_HINT_T1);
        }
      }
      const at::BFloat16* kp = kcache + chunk + h * group;
      const at::BFloat16* vp = vcache + chunk + h * group;
      int64_t vis_max = 0;
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);  // keys after this query's position are masked
        vis_max = std::max(vis_max, visible);
        if (visible <= 0) {
          for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(wts + (j * H + h * G + g) * 16, _mm512_setzero_ps());
          continue;
        }
        const __mmask16 keep = static_cast<__mmask16>((1u << visible) - 1u);
        for (int64_t g0 = 0; g0 < G; g0 += SB) {
          const int64_t gn = std::min<int64_t>(SB, G - g0);
          __m512 sv[SB][NP];
          const int32_t* q32[SB];
          for (int64_t i = 0; i < SB; ++i) {
            for (int64_t u = 0; u < NP; ++u) sv[i][u] = _mm512_setzero_ps();
            q32[i] = reinterpret_cast<const int32_t*>(qb[j * H + h * G + g0 + std::min(i, gn - 1)]);
          }
          for (int64_t p = 0; p < D / 2; p += NP) {
            for (int64_t u = 0; u < NP; ++u) {
              const __m512bh kv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(kp + (p + u) * 32));
              for (int64_t i = 0; i < SB; ++i)
                if (i < gn) sv[i][u] = _mm512_dpbf16_ps(sv[i][u], kv, (__m512bh)_mm512_set1_epi32(q32[i][p + u]));
            }
          }
          for (int64_t i = 0; i < gn; ++i) {
            const int64_t r = j * H + h * G + g0 + i;
            const __m512 s = _mm512_add_ps(_mm512_add_ps(sv[i][0], sv[i][1]), _mm512_add_ps(sv[i][2], sv[i][3]));
            // lanes past the visible keys may hold anything (never-written slots, NaN included): blend them out
            const __m512 sc = _mm512_mask_blend_ps(keep, vneg_inf, _mm512_mul_ps(s, vscale));
            const float new_m = std::max(m[r], _mm512_reduce_max_ps(sc));
            const float corr = exp_neg(m[r] - new_m);
            const __m512 e = exp16(_mm512_sub_ps(sc, _mm512_set1_ps(new_m)), keep);
            _mm512_storeu_ps(wts + r * 16, e);
            l[r] = l[r] * corr + _mm512_reduce_add_ps(e);
            m[r] = new_m;
            if (corr != 1.f) {
              float* a = acc + r * D;
              const __m512 vc = _mm512_set1_ps(corr);
              for (int64_t c = 0; c < NF; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), vc));
            }
          }
        }
      }
      if (vis_max <= 0) continue;
      // P.V: the weights as bf16 pairs; each value load serves a batch of rows. In the chunk's last pair a
      // key at or past n (never written: may be NaN) is zeroed, since 0 * NaN would poison the sum.
      const int64_t pairs = (vis_max + 1) / 2;
      const bool odd_tail = (n % 2 == 1) && pairs * 2 > n;
      for (int64_t j = 0; j < nq; ++j) {
        if (pos0 + j + 1 - t <= 0) continue;
        for (int64_t g0 = 0; g0 < G; g0 += RB) {
          const int64_t gn = std::min<int64_t>(RB, G - g0);
          __m512 av[RB][NF];
          int32_t wp[RB][8];
          for (int64_t i = 0; i < gn; ++i) {
            const int64_t r = j * H + h * G + g0 + i;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(wp[i]),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(wts + r * 16)));
            for (int64_t c = 0; c < NF; ++c) av[i][c] = _mm512_loadu_ps(acc + r * D + 16 * c);
          }
          for (int64_t pr = 0; pr < pairs; ++pr) {
            const bool mask_hi = odd_tail && pr == pairs - 1;
            for (int64_t c = 0; c < NF; ++c) {
              __m512i vv = _mm512_loadu_si512(reinterpret_cast<const void*>(vp + pr * 2 * D + 32 * c));
              if (mask_hi) vv = _mm512_and_si512(vv, low_halves);
              for (int64_t i = 0; i < gn; ++i)
                av[i][c] = _mm512_dpbf16_ps(av[i][c], (__m512bh)vv, (__m512bh)_mm512_set1_epi32(wp[i][pr]));
            }
          }
          for (int64_t i = 0; i < gn; ++i) {
            const int64_t r = j * H + h * G + g0 + i;
            for (int64_t c = 0; c < NF; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, av[i][c]);
          }
        }
      }
    }
  }
}

}  // namespace kvpage
#endif
