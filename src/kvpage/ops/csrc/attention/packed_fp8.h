// The packed fp8 KV layout (e4m3, e5m2) and the AVX-512 BF16 attention kernel that reads it.
//
// Why: the fp8 row loop (quant_loop.h) widens 32 codes at a time to bf16 lanes and folds four keys' sums
// horizontally per query row; on the Zen 4 EPYC, whose 512-bit instructions run on 256-bit units, that work,
// not memory, set its pace (0.70-0.79x the bf16 cache's time at 64 sequences x 8K keys, where packed int8
// pages took 0.45-0.50x). Here the codes lie in the 16-key groups of the packed int8 layout (packed_int8.h:
// same offsets, same 16 bf16 scales after each group's codes), so one 512-bit load holds 4 dims of 16 keys
// (K) or 16 dims of 4 keys (V), and two bf16 dot products take them with no horizontal sums:
//   within each 32-bit lane the four codes lie as [x0, x2, x1, x3], so the lane's low bytes are the pair
//   (x0, x1) and its high bytes (x2, x3): a shift moves each byte to the top of its 16-bit half, an arithmetic
//   shift and a mask make it the bf16 of the code's value x 2^-120 (e4m3) or 2^-112 (e5m2), code_lanes.h's
//   Fp8Lanes arithmetic (5 instructions per 64 codes), and the query's (or the weights') bf16 pairs are
//   consecutive as they stand:
//   K: [D/4 dim quads][16 keys][4] codes, then 16 bf16 scales;
//   V: [4 key quads][D][4] codes, then 16 bf16 scales.
// Precision is the row loop's: queries rounded to bf16 (lifted by 2^64 so that no product leaves float32's
// normal range), each group's softmax weights times the value scales rounded to bf16, float32 sums.
// Built where the packed int8 layout is (KVPAGE_PACKED_INT8: AVX-512 BF16 and VNNI; every CPU with the one has
// the other), whose group geometry and prefetch it shares; block_size % 16 == 0.
#pragma once

#include "isa.h"

#if KVPAGE_PACKED_INT8

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "attention/code_lanes.h"
#include "attention/packed_int8.h"

namespace kvpage::attn {

// Where element j of a quad (dims of a key, or keys of a dim) lies in its 32-bit lane.
constexpr int kFp8QuadSlot[4] = {0, 2, 1, 3};

// One token's fp8 rows (D codes + bf16 scale each, as quantize_row writes them) into its 16-key group.
inline void put_packed_fp8(const uint8_t* krow, const uint8_t* vrow, uint8_t* kgroup, uint8_t* vgroup, int64_t key,
                           int64_t D) {
  for (int64_t d = 0; d < D; ++d) {
    kgroup[(d / 4) * 64 + key * 4 + kFp8QuadSlot[d % 4]] = krow[d];
    vgroup[(key / 4) * 4 * D + d * 4 + kFp8QuadSlot[key % 4]] = vrow[d];
  }
  std::memcpy(kgroup + 16 * D + 2 * key, krow + D, kScaleBytes);
  std::memcpy(vgroup + 16 * D + 2 * key, vrow + D, kScaleBytes);
}

// 64 codes -> the bf16 lanes of their lanes' low bytes (lo) and high bytes (hi).
template <KVCode C>
inline void fp8_split(__m512i x, __m512i& lo, __m512i& hi) {
  constexpr int kDown = 8 - Fp8Lanes<C>::kShift;
  const __m512i keep = _mm512_set1_epi16(Fp8Lanes<C>::kKeep);
  lo = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(x, 8), kDown), keep);
  hi = _mm512_and_si512(_mm512_srai_epi16(x, kDown), keep);
}

inline __m512i bcast_pair(const int16_t* p) {
  int32_t x;
  std::memcpy(&x, p, sizeof(x));
  return _mm512_set1_epi32(x);
}

// Scores of up to 4 query rows (SB) against one 16-key group: lane i = row . key i in float32 (masked lanes
// -inf). q16: the rows' lifted bf16 lanes; factor: Fp8Lanes' kCode / kLift.
template <KVCode C, int SB, int64_t D>
inline void fp8_scores(const int16_t* const* q16, float factor, const uint8_t* kp, __m512 kscale, __mmask16 keep,
                       __m512* out) {
  __m512 a[SB], b[SB];
  for (int i = 0; i < SB; ++i) a[i] = b[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D / 4; ++c) {
    __m512i lo, hi;
    fp8_split<C>(_mm512_loadu_si512(reinterpret_cast<const void*>(kp + 64 * c)), lo, hi);
    for (int i = 0; i < SB; ++i) {
      a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)lo, (__m512bh)bcast_pair(q16[i] + 4 * c));
      b[i] = _mm512_dpbf16_ps(b[i], (__m512bh)hi, (__m512bh)bcast_pair(q16[i] + 4 * c + 2));
    }
  }
  const __m512 vneg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 f = _mm512_mul_ps(kscale, _mm512_set1_ps(factor));
  for (int i = 0; i < SB; ++i)
    out[i] = _mm512_mask_blend_ps(keep, vneg_inf, _mm512_mul_ps(_mm512_add_ps(a[i], b[i]), f));
}

// group_weights (packed_int8.h), left lifted as 16 bf16 lanes at w; sets corr.
template <KVCode C>
inline void fp8_softmax(__m512 s, __mmask16 keep, __m512 vscale, float& m, float& l, int16_t* w, float& corr) {
  const __m512 u = group_weights(s, keep, vscale, m, l, corr);
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(u, _mm512_set1_ps(Fp8Lanes<C>::kLift)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), b);
}

// acc_i <- acc_i x corr_i + factor x sum_k w_i,k v_k for RB rows over a group's first `quads` key quads (NQ when
// NQ > 0: a whole group, the quad loop unrolled at compile time, as int8_pv_n).
template <KVCode C, int RB, int64_t D, int NQ = 0>
inline void fp8_pv_n(const int16_t* const* w, const float* corr, float factor, const uint8_t* vp, int64_t quads,
                     float* const* acc) {
  if constexpr (NQ > 0) quads = NQ;
  constexpr int64_t CB = D / 16 < 4 ? D / 16 : 4;  // 16-dim chunks per pass: RB x CB accumulators
  const __m512 vf = _mm512_set1_ps(factor);
  for (int64_t c0 = 0; c0 < D / 16; c0 += CB) {
    __m512 s[RB][CB];
    for (int i = 0; i < RB; ++i)
      for (int64_t c = 0; c < CB; ++c) s[i][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < quads; ++p) {
      __m512i lo[CB], hi[CB];
      for (int64_t c = 0; c < CB; ++c)
        fp8_split<C>(_mm512_loadu_si512(reinterpret_cast<const void*>(vp + p * 4 * D + 64 * (c0 + c))), lo[c], hi[c]);
      for (int i = 0; i < RB; ++i) {
        const __m512i bl = bcast_pair(w[i] + 4 * p), bh = bcast_pair(w[i] + 4 * p + 2);
        for (int64_t c = 0; c < CB; ++c) {
          s[i][c] = _mm512_dpbf16_ps(s[i][c], (__m512bh)lo[c], (__m512bh)bl);
          s[i][c] = _mm512_dpbf16_ps(s[i][c], (__m512bh)hi[c], (__m512bh)bh);
        }
      }
    }
    for (int i = 0; i < RB; ++i) {
      const __m512 vc = _mm512_set1_ps(corr[i]);
      for (int64_t c = 0; c < CB; ++c) {
        float* a = acc[i] + 16 * (c0 + c);
        _mm512_storeu_ps(a, _mm512_fmadd_ps(s[i][c], vf, _mm512_mul_ps(_mm512_loadu_ps(a), vc)));
      }
    }
  }
}

template <KVCode C, int RB, int64_t D>
inline void fp8_pv(const int16_t* const* w, const float* corr, float factor, const uint8_t* vp, int64_t quads,
                   float* const* acc) {
  if (quads == 4) fp8_pv_n<C, RB, D, 4>(w, corr, factor, vp, 4, acc);
  else fp8_pv_n<C, RB, D>(w, corr, factor, vp, quads, acc);
}

// attend_tile for packed fp8 pages and head size D (a multiple of 32): attend_tile_int8_packed's contract.
template <KVCode C, int64_t D>
void attend_tile_fp8_packed(const float* q, int64_t nq, int64_t H, int64_t G, const uint8_t* kcache,
                            const uint8_t* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                            int64_t kv_heads, int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m,
                            float* l, int64_t window, NextKeys next) {
  static_assert(D % 32 == 0, "packed fp8 groups take head sizes that are multiples of 32");
  using F = Fp8Lanes<C>;
  constexpr float kFactor = F::kCode / F::kLift;
  const int64_t R = nq * H;
  const Int8Groups groups{kcache, vcache, table, block_size, block_stride, kv_heads, D, 16 * (D + kScaleBytes), next};
  thread_local std::vector<int16_t> q16;
  thread_local std::vector<int16_t> wbuf;
  q16.resize(static_cast<size_t>(R * D));
  wbuf.resize(static_cast<size_t>(G * 16));
  for (int64_t r = 0; r < R; ++r) to_bf16_lifted(q + r * D, D, F::kLift, q16.data() + r * D);
  reset_partials(acc, m, l, R, D);
  float corr[4];
  walk_packed_groups(groups, nq, H, G, pos0, k_begin, k_end, window,
                     [&](const uint8_t* kp, const uint8_t* vp, __m512 kscale, __m512 vscale, __mmask16 keep,
                         int64_t visible, int64_t r0) {
#define KVPAGE_FP8_BATCH(sb)                                                                              \
  {                                                                                                        \
    const int16_t* qp[sb];                                                                                 \
    const int16_t* wp[sb];                                                                                 \
    float* ap[sb];                                                                                         \
    __m512 s[sb];                                                                                          \
    for (int i = 0; i < sb; ++i) {                                                                         \
      qp[i] = q16.data() + (r0 + g0 + i) * D;                                                              \
      wp[i] = wbuf.data() + (g0 + i) * 16;                                                                 \
      ap[i] = acc + (r0 + g0 + i) * D;                                                                     \
    }                                                                                                      \
    fp8_scores<C, sb, D>(qp, kFactor, kp, kscale, keep, s);                                                \
    for (int i = 0; i < sb; ++i)                                                                           \
      fp8_softmax<C>(s[i], keep, vscale, m[r0 + g0 + i], l[r0 + g0 + i], wbuf.data() + (g0 + i) * 16, corr[i]); \
    fp8_pv<C, sb, D>(wp, corr, kFactor, vp, (visible + 3) / 4, ap);                                        \
  }
    KVPAGE_ROW_BATCHES(KVPAGE_FP8_BATCH)
#undef KVPAGE_FP8_BATCH
  });
}

}  // namespace kvpage::attn

#endif
