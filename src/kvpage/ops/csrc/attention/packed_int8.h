// The packed int8 KV layout and the AVX-512 VNNI attention kernel that reads it.
//
// Why: in the row layout (quant_loop.h) each token's codes are contiguous, so the scores need a horizontal sum
// per key and the codes must be widened to int16 before every multiply-add; on one thread that arithmetic,
// not memory, set the int8 loop's time (13.8 ms in cache against 15.6 ms from memory at 32 seqs x 8K on the
// Xeon without AMX). Here the page holds each 16-key group in vpdpbusd's operand order, arranged when a token
// is written, and the products take bytes as they lie (64 of them per instruction):
//   a block is cut into groups of 16 keys; group q of KV head h occupies 16 * (D + 2) bytes at
//   (q * kv_heads + h) * 16 * (D + 2) inside the block (the row layout's bytes, rearranged within the group):
//   K: [D/4 dim quads][16 keys][4] codes + 128 (unsigned: vpdpbusd's first operand), then 16 bf16 scales
//       -> one 512-bit load = 4 dims of all 16 keys: 16 scores per instruction, no horizontal sums;
//   V: [4 key quads][D][4] codes (signed), then 16 bf16 scales
//       -> one 512-bit load = 16 dims of 4 keys, multiplied by the 4 keys' weights as unsigned bytes.
// Precision is the row loop's: queries enter as two int8 codes per value (hi, and lo for what hi leaves,
// 1/256 of its step: ~16 bits), each block's softmax weights times the value scales as two unsigned bytes
// (16 bits against the block's largest); int32 sums, scaled back into float32 once per group.
// The tensor keeps the row layout's shape [2, num_blocks, block_size, kv_heads, D + 2] int8 and strides, so
// block copies, swapping and prefix sharing are unchanged (ops/kv_layout.py converts in torch for tests).
// Needs block_size % 16 == 0. A sliding window masks the keys before each query's edge within a group and
// never reads a group wholly before it (the plan starts each task at its first query's edge).
#pragma once

#include "isa.h"

#if KVPAGE_PACKED_INT8

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "attention/packed_kv.h"
#include "attention/quant_rows.h"

namespace kvpage::attn {

constexpr int64_t kInt8PrefetchAhead = 4;  // 16-key groups

// Byte offset, from the K (or V) base, of the group holding in-block position `off` of block `block`, head 0
// (head h is h * 16 * (D + 2) further).
inline int64_t int8_group_offset(int64_t block, int64_t off, int64_t block_stride, int64_t kv_heads, int64_t D) {
  return kvpage::packed_group_offset(block, off, block_stride, kv_heads, D + kScaleBytes);
}

// One token's quantized rows (D codes + bf16 scale each, as quantize_row writes them) into its group: the key's
// codes offset by 128 in dim-quad order, the value's in key-quad order, scales after the codes.
inline void put_packed_int8(const uint8_t* krow, const uint8_t* vrow, uint8_t* kgroup, uint8_t* vgroup,
                            int64_t key, int64_t D) {
  for (int64_t d = 0; d < D; ++d) {
    kgroup[(d / 4) * 64 + key * 4 + d % 4] = static_cast<uint8_t>(krow[d] ^ 0x80u);
    vgroup[(key / 4) * 4 * D + d * 4 + key % 4] = vrow[d];
  }
  std::memcpy(kgroup + 16 * D + 2 * key, krow + D, kScaleBytes);
  std::memcpy(vgroup + 16 * D + 2 * key, vrow + D, kScaleBytes);
}

// 16 bf16 scales as float32 lanes.
inline __m512 load_scales16(const uint8_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// A query row (D floats, D a multiple of 16) as hi and lo int8 codes (q ~= (256 hi + lo) x scale); returns
// scale, and in bias the sum of 128 x code over each part, which the unsigned key codes (code + 128) add to the
// products. 16 lanes at a time: every task quantizes its query rows, and scalar that was ~10% of a decode call
// at Gemma 3's 256-wide heads (perf, Zen 4).
inline float quantize_query_i8(const float* x, int8_t* hi, int8_t* lo, int64_t D, int32_t bias[2]) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
  const float amax = _mm512_reduce_max_ps(top);
  const float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const float inv_lo = amax > 0.f ? 256.f * inv : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv), vinv_lo = _mm512_set1_ps(inv_lo), vstep = _mm512_set1_ps(step);
  const __m512 cmin = _mm512_set1_ps(-127.f), cmax = _mm512_set1_ps(127.f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v = _mm512_loadu_ps(x + d);
    const __m512 h = _mm512_roundscale_ps(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v, vinv), cmin), cmax), kNearest);
    const __m512 r = _mm512_roundscale_ps(
        _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_fnmadd_ps(h, vstep, v), vinv_lo), cmin), cmax), kNearest);
    const __m512i hi32 = _mm512_cvtps_epi32(h), lo32 = _mm512_cvtps_epi32(r);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + d), _mm512_cvtepi32_epi8(hi32));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + d), _mm512_cvtepi32_epi8(lo32));
    sh = _mm512_add_epi32(sh, hi32);
    sl = _mm512_add_epi32(sl, lo32);
  }
  bias[0] = 128 * _mm512_reduce_add_epi32(sh);
  bias[1] = 128 * _mm512_reduce_add_epi32(sl);
  return step / 256.f;
}

// Where a sequence's 16-key groups lie, and the groups to prefetch, running on into the thread's next task.
struct Int8Groups {
  const uint8_t* kcache;
  const uint8_t* vcache;
  const int64_t* table;
  int64_t block_size, block_stride, kv_heads, D, group;  // group: bytes of one (16-key group, KV head)
  NextKeys next;

  int64_t at(const int64_t* tab, int64_t t) const {
    return int8_group_offset(tab[t / block_size], t % block_size, block_stride, kv_heads, D);
  }
  // Offset of the group kInt8PrefetchAhead groups after the one at key t of [k_begin, k_end); -1: none.
  int64_t ahead(int64_t t, int64_t k_end) const {
    const int64_t key = t + 16 * kInt8PrefetchAhead;
    if (key < k_end) return at(table, key);
    if (next.table == nullptr) return -1;
    const int64_t k2 = next.begin + (key - ((k_end + 15) / 16) * 16);
    return k2 < next.end ? at(next.table, k2) : -1;
  }
  void prefetch(int64_t off, int64_t h) const {
    if (off < 0) return;
    prefetch_lines<_MM_HINT_T1>(kcache + off + h * group, group);
    prefetch_lines<_MM_HINT_T1>(vcache + off + h * group, group);
  }
};

// Scores of up to 4 query rows (SB) against one 16-key group: lane i = row . key i in float32 (masked lanes
// -inf). q8: the rows' hi codes then lo codes (2 x D bytes a row); qs: their scales; bias: their [hi, lo] biases.
template <int SB, int64_t D>
inline void int8_scores(const int8_t* const* q8, const float* qs, const int32_t* const* bias, const uint8_t* kp,
                        __m512 kscale, __mmask16 keep, __m512* out) {
  __m512i ah[SB], al[SB];
  for (int i = 0; i < SB; ++i) {
    ah[i] = _mm512_set1_epi32(-bias[i][0]);
    al[i] = _mm512_set1_epi32(-bias[i][1]);
  }
  for (int64_t c = 0; c < D / 4; ++c) {
    const __m512i kv = _mm512_loadu_si512(reinterpret_cast<const void*>(kp + 64 * c));
    for (int i = 0; i < SB; ++i) {
      int32_t h4, l4;
      std::memcpy(&h4, q8[i] + 4 * c, 4);
      std::memcpy(&l4, q8[i] + D + 4 * c, 4);
      ah[i] = _mm512_dpbusd_epi32(ah[i], kv, _mm512_set1_epi32(h4));
      al[i] = _mm512_dpbusd_epi32(al[i], kv, _mm512_set1_epi32(l4));
    }
  }
  const __m512 vneg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i = 0; i < SB; ++i) {
    const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(ah[i], 8), al[i]);
    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(kscale, _mm512_set1_ps(qs[i])));
    out[i] = _mm512_mask_blend_ps(keep, vneg_inf, f);
  }
}

// Online-softmax update of one row (running maximum m, denominator l) with a group's scores: sets corr and
// returns the group's weights times the value scales (masked lanes 0), as the packed loops' P.V takes them.
inline __m512 group_weights(__m512 s, __mmask16 keep, __m512 vscale, float& m, float& l, float& corr) {
  // Past the first groups a group seldom raises the running maximum; a compare tells, without the horizontal
  // maximum and the scalar exp on the step's critical path. Bit for bit the full update: exp_neg(0) is 1.
  __m512 vm = _mm512_set1_ps(m);
  corr = 1.f;
  if (_mm512_mask_cmp_ps_mask(keep, s, vm, _CMP_GT_OQ) != 0) {
    const float new_m = _mm512_mask_reduce_max_ps(keep, s);
    corr = exp_neg(m - new_m);
    m = new_m;
    vm = _mm512_set1_ps(new_m);
  }
  const __m512 e = exp16(_mm512_sub_ps(s, vm), keep);
  l = l * corr + _mm512_reduce_add_ps(e);
  return _mm512_maskz_mul_ps(keep, e, vscale);  // unwritten lanes' scales may be NaN: never used
}

// group_weights, left as 16-bit unsigned codes (hi bytes at w[0..15], lo bytes at w[16..31]); returns (corr,
// weight scale).
inline void int8_softmax(__m512 s, __mmask16 keep, __m512 vscale, float& m, float& l, uint8_t* w, float& corr,
                         float& wscale) {
  const __m512 u = group_weights(s, keep, vscale, m, l, corr);
  const float top = _mm512_reduce_max_ps(u);
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(u, _mm512_set1_ps(top > 0.f ? 65535.f / top : 0.f)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(w), _mm512_cvtepi32_epi8(_mm512_srli_epi32(q, 8)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(w + 16), _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(255))));
  wscale = top / 65535.f;
}

// acc_i <- acc_i x corr_i + wscale_i x sum_k w_i,k v_k for RB rows over a group's first `quads` key quads (NQ of
// them when NQ > 0: a whole group, the common case, with the quad loop unrolled at compile time).
template <int RB, int64_t D, int NQ = 0>
inline void int8_pv_n(const uint8_t* const* w, const float* corr, const float* wscale, const uint8_t* vp,
                      int64_t quads, float* const* acc) {
  if constexpr (NQ > 0) quads = NQ;
  constexpr int64_t CB = 2;  // 16-dim chunks per pass: 2 x RB x 2 accumulators
  for (int64_t c0 = 0; c0 < D / 16; c0 += CB) {
    __m512i vh[RB][CB], vl[RB][CB];
    for (int i = 0; i < RB; ++i)
      for (int64_t c = 0; c < CB; ++c) vh[i][c] = vl[i][c] = _mm512_setzero_si512();
    for (int64_t p = 0; p < quads; ++p) {
      __m512i vv[CB];
      for (int64_t c = 0; c < CB; ++c)
        vv[c] = _mm512_loadu_si512(reinterpret_cast<const void*>(vp + p * 4 * D + 64 * (c0 + c)));
      for (int i = 0; i < RB; ++i) {
        int32_t h4, l4;
        std::memcpy(&h4, w[i] + 4 * p, 4);
        std::memcpy(&l4, w[i] + 16 + 4 * p, 4);
        const __m512i bh = _mm512_set1_epi32(h4), bl = _mm512_set1_epi32(l4);
        for (int64_t c = 0; c < CB; ++c) {
          vh[i][c] = _mm512_dpbusd_epi32(vh[i][c], bh, vv[c]);
          vl[i][c] = _mm512_dpbusd_epi32(vl[i][c], bl, vv[c]);
        }
      }
    }
    for (int i = 0; i < RB; ++i) {
      const __m512 vc = _mm512_set1_ps(corr[i]), vw = _mm512_set1_ps(wscale[i]);
      for (int64_t c = 0; c < CB; ++c) {
        float* a = acc[i] + 16 * (c0 + c);
        const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(vh[i][c], 8), vl[i][c]);
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), vw, _mm512_mul_ps(_mm512_loadu_ps(a), vc)));
      }
    }
  }
}

template <int RB, int64_t D>
inline void int8_pv(const uint8_t* const* w, const float* corr, const float* wscale, const uint8_t* vp, int64_t quads,
                    float* const* acc) {
  if (quads == 4) int8_pv_n<RB, D, 4>(w, corr, wscale, vp, 4, acc);
  else int8_pv_n<RB, D>(w, corr, wscale, vp, quads, acc);
}

// The walk of the packed quantized loops (this file's and packed_fp8.h's): each 16-key group of [k_begin, k_end)
// (prefetching kInt8PrefetchAhead groups ahead), each KV head, each query token that sees some of the group's
// keys (later keys masked, and those before its window or before k_begin, which may fall inside a group):
// on_rows(kp, vp, kscale, vscale, keep, visible, r0) for the G query rows from r0 = j * H + head * G.
template <class OnRows>
inline void walk_packed_groups(const Int8Groups& groups, int64_t nq, int64_t H, int64_t G,
                               int64_t pos0, int64_t k_begin, int64_t k_end, int64_t window, OnRows&& on_rows) {
  for (int64_t t = group_start(k_begin); t < k_end; t += 16) {
    const int64_t n = std::min<int64_t>(16, k_end - t);
    const int64_t lane0 = std::max<int64_t>(0, k_begin - t);  // keys before the task's range
    const int64_t base = groups.at(groups.table, t), far = groups.ahead(t, k_end);
    for (int64_t h = 0; h < groups.kv_heads; ++h) {
      groups.prefetch(far, h);
      const uint8_t* kp = groups.kcache + base + h * groups.group;
      const uint8_t* vp = groups.vcache + base + h * groups.group;
      const __m512 kscale = load_scales16(kp + 16 * groups.D), vscale = load_scales16(vp + 16 * groups.D);
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::clamp<int64_t>(pos0 + j + 1 - t, 0, n);  // later keys are masked
        const int64_t first = std::max(lane0, window_first(window, pos0 + j, t, n));  // and those before its window
        if (visible <= first) continue;
        on_rows(kp, vp, kscale, vscale, lane_range(first, visible), visible, j * H + h * G);
      }
    }
  }
}

// attend_tile for packed int8 pages and head size D (a multiple of 32), the contract of attend_tile_int8: q
// pre-scaled float32 rows in the keys' rotated basis, rows r = j * H + head, row r sees keys <= pos0 + r / H and
// none before its window (or before k_begin, which may fall inside a group).
template <int64_t D>
void attend_tile_int8_packed(const float* q, int64_t nq, int64_t H, int64_t G, const uint8_t* kcache,
                             const uint8_t* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                             int64_t kv_heads, int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m,
                             float* l, int64_t window, NextKeys next) {
  static_assert(D % 32 == 0, "packed int8 groups take head sizes that are multiples of 32");
  const int64_t R = nq * H;
  const Int8Groups groups{kcache, vcache, table, block_size, block_stride, kv_heads, D, 16 * (D + kScaleBytes), next};
  thread_local std::vector<int8_t> q8;
  thread_local std::vector<int32_t> qbias;
  thread_local std::vector<float> qscale;
  thread_local std::vector<uint8_t> wbuf;
  q8.resize(static_cast<size_t>(R * 2 * D));
  qbias.resize(static_cast<size_t>(2 * R));
  qscale.resize(static_cast<size_t>(R));
  wbuf.resize(static_cast<size_t>(G * 32));
  for (int64_t r = 0; r < R; ++r)
    qscale[r] = quantize_query_i8(q + r * D, q8.data() + r * 2 * D, q8.data() + r * 2 * D + D, D, qbias.data() + 2 * r);
  reset_partials(acc, m, l, R, D);
  float corr[4], wscale[4];
  walk_packed_groups(groups, nq, H, G, pos0, k_begin, k_end, window,
                     [&](const uint8_t* kp, const uint8_t* vp, __m512 kscale, __m512 vscale, __mmask16 keep,
                         int64_t visible, int64_t r0) {
#define KVPAGE_INT8_BATCH(sb)                                                                             \
  {                                                                                                        \
    const int8_t* qp[sb];                                                                                  \
    const int32_t* bp[sb];                                                                                 \
    const uint8_t* wp[sb];                                                                                 \
    float* ap[sb];                                                                                         \
    __m512 s[sb];                                                                                          \
    for (int i = 0; i < sb; ++i) {                                                                         \
      qp[i] = q8.data() + (r0 + g0 + i) * 2 * D;                                                           \
      bp[i] = qbias.data() + 2 * (r0 + g0 + i);                                                            \
      wp[i] = wbuf.data() + (g0 + i) * 32;                                                                 \
      ap[i] = acc + (r0 + g0 + i) * D;                                                                     \
    }                                                                                                      \
    int8_scores<sb, D>(qp, qscale.data() + r0 + g0, bp, kp, kscale, keep, s);                              \
    for (int i = 0; i < sb; ++i)                                                                           \
      int8_softmax(s[i], keep, vscale, m[r0 + g0 + i], l[r0 + g0 + i], wbuf.data() + (g0 + i) * 32, corr[i], \
                   wscale[i]);                                                                             \
    int8_pv<sb, D>(wp, corr, wscale, vp, (visible + 3) / 4, ap);                                           \
  }
    KVPAGE_ROW_BATCHES(KVPAGE_INT8_BATCH)
#undef KVPAGE_INT8_BATCH
  });
}

}  // namespace kvpage::attn

#endif
