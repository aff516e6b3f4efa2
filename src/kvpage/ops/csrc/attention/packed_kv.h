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
// The tensor keeps the row layout's shape [2, num_blocks, block_size, kv_heads, D] (and its strides, contiguous
// or block-major: common.h kv_geometry) and its block size, so
// block copies, swapping and prefix sharing are unchanged; only token-level access differs (writes through
// write_cache_packed, reads through this kernel). Needs block_size % 16 == 0 and D % 32 == 0.
#pragma once

#include "isa.h"

#if KVPAGE_PACKED

#include <immintrin.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "attention/amx_rows.h"

namespace kvpage {

constexpr int64_t kPackedPrefetchAhead = 2;  // steps of kPackedStep keys
constexpr int64_t kPackedStep = 32;          // keys per online-softmax step: two 16-key groups

// Element offset, from the K (or V) base of the cache, of the 16-key group holding in-block position `off` of
// physical block `block`, KV head 0 (head h is h * 16 * D further): the layout's one formula. block_stride:
// elements from one block's K to the next block's K (kv_geometry).
inline int64_t packed_group_offset(int64_t block, int64_t off, int64_t block_stride, int64_t kv_heads, int64_t D) {
  return block * block_stride + (off / 16) * kv_heads * 16 * D;
}

// Requests `bytes` from p on (whole 64-byte lines) into the cache level Hint names.
template <int Hint>
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, static_cast<_mm_hint>(Hint));
}

// A (16-key group, KV head)'s V, [8 key pairs][D][2], copied with every key at or past n zeroed: never-written
// slots may hold NaN, and a product multiplies them by 0 (a zero weight, or another head's zero row), which
// NaN would poison. src null or n == 0: all zero.
template <int64_t D>
inline void stage_value_group(const at::BFloat16* src, int64_t n, at::BFloat16* dst) {
  const __m512i low_halves = _mm512_set1_epi32(0xFFFF);
  for (int64_t p = 0; p < 8; ++p)
    for (int64_t c = 0; c < D / 16; ++c) {
      __m512i v = _mm512_setzero_si512();
      if (src != nullptr && 2 * p < n) {
        v = _mm512_loadu_si512(reinterpret_cast<const void*>(src + p * 2 * D + 32 * c));
        if (2 * p + 1 >= n) v = _mm512_and_si512(v, low_halves);  // key 2p + 1 is past the end
      }
      _mm512_storeu_si512(reinterpret_cast<void*>(dst + p * 2 * D + 32 * c), v);
    }
}

// Where a sequence's 16-key groups lie in the packed cache, and the step-by-step walk the kernels make.
struct PackedGroups {
  const at::BFloat16* kcache;
  const at::BFloat16* vcache;
  const int64_t* table;  // the sequence's block table
  int64_t block_size, block_stride, kv_heads, group;  // group: elements of one (16-key group, KV head) = 16 * D
  // The keys the same thread attends to next (its next task), so that the prefetch runs on across the end of
  // this task: without it, a task's first kPackedPrefetchAhead steps would wait for memory.
  NextKeys next;

  // Element offset of the group holding key t (its KV head 0; head h is h * group further).
  int64_t at(int64_t t) const { return at(table, t); }
  int64_t at(const int64_t* tab, int64_t t) const {
    return packed_group_offset(tab[t / block_size], t % block_size, block_stride, kv_heads, group / 16);
  }

  // The two groups of the step starting at key t (n: their keys before k_end; base: their offsets).
  struct Step {
    int64_t n[2], base[2];
  };
  Step step(int64_t t, int64_t k_end) const {
    Step st{};
    for (int64_t u = 0; u < 2; ++u) {
      st.n[u] = std::clamp<int64_t>(k_end - (t + 16 * u), 0, 16);
      st.base[u] = st.n[u] > 0 ? at(t + 16 * u) : 0;
    }
    return st;
  }

  // Offset of group u of the step `steps` steps after the one at key t of [k_begin, k_end), running on into
  // the next task's keys past this task's end; -1 where there is none.
  int64_t ahead(int64_t t, int64_t k_begin, int64_t k_end, int64_t steps, int64_t u) const {
    const int64_t total = (k_end - k_begin + kPackedStep - 1) / kPackedStep;
    const int64_t s = (t - k_begin) / kPackedStep + steps;
    if (s < total) {
      const int64_t key = k_begin + s * kPackedStep + 16 * u;
      return key < k_end ? at(key) : -1;
    }
    if (next.table == nullptr) return -1;
    const int64_t key = next.begin + (s - total) * kPackedStep + 16 * u;
    return key < next.end ? at(next.table, key) : -1;
  }

  // The K/V of the groups kPackedPrefetchAhead steps after the one at key t, to request while it runs.
  struct Far {
    const char* pf[4];  // K, V of group 0, then of group 1; null where there is none
  };
  Far far(int64_t t, int64_t k_begin, int64_t k_end) const {
    Far f{};
    for (int64_t u = 0; u < 2; ++u) {
      const int64_t off = ahead(t, k_begin, k_end, kPackedPrefetchAhead, u);
      f.pf[2 * u] = off >= 0 ? reinterpret_cast<const char*>(kcache + off) : nullptr;
      f.pf[2 * u + 1] = off >= 0 ? reinterpret_cast<const char*>(vcache + off) : nullptr;
    }
    return f;
  }

  // KV head h's slice of the step's prefetch, into L2 (a sequence's blocks may lie anywhere, and the hardware
  // prefetcher alone leaves the core waiting; a slice per head keeps the requests from queueing up in one burst).
  void prefetch(const Far& far, int64_t h) const {
    for (const char* p : far.pf) prefetch_group(p, h);
  }
  // KV head h's part of one prefetched group (p: far.pf[i], may be null).
  void prefetch_group(const char* p, int64_t h) const {
    if (p != nullptr) prefetch_lines<_MM_HINT_T1>(p + h * group * 2, group * 2);
  }
};

// One online-softmax update of a row with a step's two score vectors (masked lanes already -inf): new running
// max, earlier sums rescaled when it rises, the step's weights e0/e1 (0 outside keep0/keep1).
template <int64_t NF>
inline void online_softmax_step(__m512 s0, __m512 s1, __mmask16 keep0, __mmask16 keep1, float& m, float& l,
                                float* acc_row, __m512& e0, __m512& e1) {
  const float new_m = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
  const float corr = exp_neg(m - new_m);
  const __m512 vm = _mm512_set1_ps(new_m);
  e0 = exp16(_mm512_sub_ps(s0, vm), keep0);
  e1 = exp16(_mm512_sub_ps(s1, vm), keep1);
  l = l * corr + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
  m = new_m;
  if (corr != 1.f) {
    const __m512 vc = _mm512_set1_ps(corr);
    for (int64_t c = 0; c < NF; ++c) _mm512_storeu_ps(acc_row + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc_row + 16 * c), vc));
  }
}

// The first key of the 16-key group holding key k: where a walk over keys from k starts (k may be a sliding
// window's edge; the keys before it in the group are masked).
inline int64_t group_start(int64_t k) { return k - k % 16; }

// Lanes [lo, hi) of a 16-key group (0 <= lo <= hi <= 16).
inline __mmask16 lane_range(int64_t lo, int64_t hi) {
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// The lanes of a decode query's 16-key group starting at key g that it weighs: the group's n keys (never-written
// slots past them may hold anything, NaN included: blended out, never multiplied) from k_begin on (keys
// before it, e.g. before a sliding window's edge, lie in the same group when k_begin is not a multiple of 16).
inline __mmask16 packed_keep(int64_t g, int64_t k_begin, int64_t n) {
  return lane_range(std::clamp<int64_t>(k_begin - g, 0, n), n);
}

// The NG 16-key groups of a decode span from key t (a multiple of 16): keep[u], the lanes group u weighs (none
// past k_end); on_group(u, first key) for each group that holds keys; returns how many do (they come first).
template <int64_t NG, class OnGroup>
inline int64_t span_groups(int64_t t, int64_t k_begin, int64_t k_end, __mmask16* keep, OnGroup&& on_group) {
  int64_t ng = 0;
  for (int64_t u = 0; u < NG; ++u) {
    const int64_t tu = t + 16 * u;
    keep[u] = tu < k_end ? packed_keep(tu, k_begin, std::min<int64_t>(16, k_end - tu)) : 0;
    if (tu < k_end) {
      ng = u + 1;
      on_group(u, tu);
    }
  }
  return ng;
}

// Attention of nq query tokens x H heads (rows r = j * H + head, like attend_tile_bf16) over keys
// [k_begin, k_end) of one sequence in the packed layout; row r sees keys <= pos0 + r / H, and under a sliding
// window (window > 0) none before pos0 + r / H - window + 1. k_begin may fall inside a 16-key group (a window's
// edge): the walk starts at the group and masks the keys before it. Writes unnormalized float32 sums
// acc[R][D], row maxima m[R] and weight sums l[R].
// Per step of 32 keys (two 16-key groups, which may sit in different blocks) and KV head: the scores of up to
// 4 rows at once, each summed in 4 independent partial accumulators (one chain of D/2 dependent dpbf16 per
// row would leave the unit waiting on latency); one online-softmax update per row for both groups; then P.V
// with each value load serving a batch of rows.
template <int64_t D>
void attend_tile_packed(const at::BFloat16* const* qb, int64_t nq, int64_t H, int64_t G, const at::BFloat16* kcache,
                        const at::BFloat16* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                        int64_t kv_heads,
                        int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m, float* l,
                        std::vector<float>& scratch, float scale, int64_t window = 0, NextKeys next = {}) {
  static_assert(D % 32 == 0, "head size must be a multiple of 32");
  constexpr int64_t NF = D / 16;           // 512-bit chunks of a float row
  constexpr int64_t RB = D == 64 ? 6 : 3;  // rows per register batch in P.V (RB * NF accumulators)
  constexpr int64_t SB = 4, NP = 4;        // rows per score batch, partial sums per row
  const int64_t R = nq * H;
  const int64_t group = 16 * D;            // elements of one (16-key group, head)
  const PackedGroups groups{kcache, vcache, table, block_size, block_stride, kv_heads, group, next};
  scratch.resize(static_cast<size_t>(R * kPackedStep));
  float* wts = scratch.data();  // this step's softmax weights, [r][32]
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vneg_inf = _mm512_set1_ps(neg_inf), vscale = _mm512_set1_ps(scale);
  const __m512i low_halves = _mm512_set1_epi32(0xFFFF);
  reset_partials(acc, m, l, R, D);
  // Query j's first visible key; and whether it sees any key of the step at t (the others' weights are 0).
  const auto first_key = [&](int64_t j) { return window > 0 ? std::max(k_begin, pos0 + j - window + 1) : k_begin; };
  const auto sees = [&](int64_t j, int64_t t) {
    return std::max(t, first_key(j)) < std::min({pos0 + j + 1, k_end, t + kPackedStep});
  };
  const int64_t t0 = group_start(k_begin);
  for (int64_t t = t0; t < k_end; t += kPackedStep) {
    const PackedGroups::Step st = groups.step(t, k_end);
    const PackedGroups::Far far = groups.far(t, t0, k_end);
    const int64_t* n = st.n;
    const int64_t* base = st.base;
    for (int64_t h = 0; h < kv_heads; ++h) {
      groups.prefetch(far, h);
      int64_t vis_max[2] = {0, 0};
      bool any = false;
      for (int64_t j = 0; j < nq; ++j) {
        int64_t visible[2];
        __mmask16 keep[2];
        for (int64_t u = 0; u < 2; ++u) {
          // keys after this query's position are masked, and so are lanes past k_end (never-written slots
          // may hold anything, NaN included: blended out, never multiplied) and keys before its first
          visible[u] = std::clamp<int64_t>(pos0 + j + 1 - (t + 16 * u), 0, n[u]);
          vis_max[u] = std::max(vis_max[u], visible[u]);
          keep[u] = lane_range(std::clamp<int64_t>(first_key(j) - (t + 16 * u), 0, visible[u]), visible[u]);
        }
        if (!sees(j, t)) {
          for (int64_t g = 0; g < G; ++g) {
            _mm512_storeu_ps(wts + (j * H + h * G + g) * kPackedStep, _mm512_setzero_ps());
            _mm512_storeu_ps(wts + (j * H + h * G + g) * kPackedStep + 16, _mm512_setzero_ps());
          }
          continue;
        }
        any = true;
        for (int64_t g0 = 0; g0 < G; g0 += SB) {
          const int64_t gn = std::min<int64_t>(SB, G - g0);
          const int32_t* q32[SB];
          for (int64_t i = 0; i < SB; ++i)
            q32[i] = reinterpret_cast<const int32_t*>(qb[j * H + h * G + g0 + std::min(i, gn - 1)]);
          __m512 sc[2][SB];
          for (int64_t u = 0; u < 2; ++u) {
            if (keep[u] == 0) {
              for (int64_t i = 0; i < SB; ++i) sc[u][i] = vneg_inf;
              continue;
            }
            const at::BFloat16* kp = kcache + base[u] + h * group;
            __m512 sv[SB][NP];
            for (int64_t i = 0; i < SB; ++i)
              for (int64_t w = 0; w < NP; ++w) sv[i][w] = _mm512_setzero_ps();
            for (int64_t p = 0; p < D / 2; p += NP) {
              for (int64_t w = 0; w < NP; ++w) {
                const __m512bh kv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(kp + (p + w) * 32));
                for (int64_t i = 0; i < SB; ++i)
                  if (i < gn) sv[i][w] = _mm512_dpbf16_ps(sv[i][w], kv, (__m512bh)_mm512_set1_epi32(q32[i][p + w]));
              }
            }
            for (int64_t i = 0; i < gn; ++i) {
              const __m512 sum = _mm512_add_ps(_mm512_add_ps(sv[i][0], sv[i][1]), _mm512_add_ps(sv[i][2], sv[i][3]));
              sc[u][i] = _mm512_mask_blend_ps(keep[u], vneg_inf, _mm512_mul_ps(sum, vscale));
            }
          }
          for (int64_t i = 0; i < gn; ++i) {
            const int64_t r = j * H + h * G + g0 + i;
            __m512 e0, e1;
            online_softmax_step<NF>(sc[0][i], sc[1][i], keep[0], keep[1], m[r], l[r], acc + r * D, e0, e1);
            _mm512_storeu_ps(wts + r * kPackedStep, e0);
            _mm512_storeu_ps(wts + r * kPackedStep + 16, e1);
          }
        }
      }
      if (!any) continue;
      // P.V: the weights as bf16 pairs; each value load serves a batch of rows. In a group's last pair a key
      // at or past n (never written: may be NaN) is zeroed, since 0 * NaN would poison the sum. Keys before a
      // window's edge inside the step have weight 0 and finite values (their block is held for the others).
      for (int64_t j = 0; j < nq; ++j) {
        if (!sees(j, t)) continue;
        for (int64_t g0 = 0; g0 < G; g0 += RB) {
          const int64_t gn = std::min<int64_t>(RB, G - g0);
          __m512 av[RB][NF];
          int32_t wp[RB][16];
          for (int64_t i = 0; i < gn; ++i) {
            const int64_t r = j * H + h * G + g0 + i;
            _mm512_storeu_si512(reinterpret_cast<void*>(wp[i]),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(wts + r * kPackedStep + 16),
                                                             _mm512_loadu_ps(wts + r * kPackedStep)));
            for (int64_t c = 0; c < NF; ++c) av[i][c] = _mm512_loadu_ps(acc + r * D + 16 * c);
          }
          for (int64_t u = 0; u < 2; ++u) {
            if (vis_max[u] <= 0) continue;
            const at::BFloat16* vp = vcache + base[u] + h * group;
            const int64_t pairs = (vis_max[u] + 1) / 2;
            const bool odd_tail = (n[u] % 2 == 1) && pairs * 2 > n[u];
            for (int64_t pr = 0; pr < pairs; ++pr) {
              const bool mask_hi = odd_tail && pr == pairs - 1;
              for (int64_t c = 0; c < NF; ++c) {
                __m512i vv = _mm512_loadu_si512(reinterpret_cast<const void*>(vp + pr * 2 * D + 32 * c));
                if (mask_hi) vv = _mm512_and_si512(vv, low_halves);
                for (int64_t i = 0; i < gn; ++i)
                  av[i][c] = _mm512_dpbf16_ps(av[i][c], (__m512bh)vv, (__m512bh)_mm512_set1_epi32(wp[i][8 * u + pr]));
              }
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
