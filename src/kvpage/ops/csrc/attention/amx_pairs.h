// Decode attention over the packed layout with every AMX product covering all of a task's query rows.
//
// Why: attend_decode_amx_packed multiplies one KV head at a time (G = 3 rows for SmolLM2) and keeps its output
// in memory, loading and storing an accumulator tile around every product. AMX tiles are not renamed, so
// those products run one after another, each waiting for the last; the kernel computed ~24 GB/s of KV per
// core with its data in cache, and from memory its arithmetic and its waiting for memory added up (removing
// either the score or the value arithmetic alone brought it to the bare read speed of the same addresses).
// Here the R = kv_heads * G rows of all heads share each product, with zeros where a row's head does not
// match (block-diagonal operands), so:
//   - the output stays in four accumulator tiles (64 dims) for the whole task: no load/store per product;
//   - one value tile covers two head-groups at once: a 16-key group of one head is 8 key pairs of 256 bytes
//     and the next head's group follows it, so 16 rows at that stride are two heads' values, and a step's
//     2 * kv_heads head-groups are kv_heads products per 16 dims instead of 2 * kv_heads;
//   - scores of all rows land in one tile per 16-key group and are stored once.
// The softmax rescales the output only when a row's maximum grows by more than kLazyRescale (weights up to
// e^8 against the row's reference maximum are exact in float32 and bf16 alike), because rescaling means
// storing and reloading the four accumulator tiles.
// Each tile load waits for the product before it to release the operand tile, so a load that misses L1 stalls
// the whole chain: while a step's scores are computed, that step's V is requested into L1, and while its
// values are accumulated, the next step's K (the next task's first keys at a task's end). These near requests
// (~12 KiB ahead, within L1) replace the L2 prefetch two steps ahead that the other packed kernels use: with
// them that one no longer helped, on consecutive or on scattered blocks (+14-19% over the engine's tables).
// Needs D == 64, R <= 16 (tile rows), block_size % 16 == 0; tiles configured by amx_configure_pairs(R).
#pragma once

#include "attention/packed_kv.h"

#if KVPAGE_ISA_AMX

namespace kvpage {

constexpr float kLazyRescale = 8.f;

// Tiles: 0-3 = output (R rows x 16 dims each), 4 = the left operand (Q or P, R rows x 32 bf16),
// 5 and 7 = the right operand (K or V, 16 pair rows x 16 columns), used in turn so that loading the next one
// need not wait for the product reading the last, 6 = one group's scores.
inline void amx_configure_pairs(int64_t R) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t == 5 || t == 7 ? 16 : R);
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// A head-group's 2 KiB (K or V of 16 keys, one KV head) requested into L1.
inline void prefetch_group_l1(const at::BFloat16* p) { prefetch_lines<_MM_HINT_T0>(p, 16 * 64 * 2); }

// One decode query (rows r = query heads, KV head r / G) over keys [k_begin, k_end), k_begin a multiple of
// 16 unless it is a window's edge (keys before it in its group are masked). Same results contract as attend_decode_amx_packed: unnormalized float32 acc[R][64], the maxima the
// weights are relative to in m[R] and the weight sums in l[R].
inline void attend_decode_amx_pairs(const at::BFloat16* q, int64_t G, int64_t kv_heads, const at::BFloat16* kcache,
                                    const at::BFloat16* vcache, const int64_t* table, int64_t block_size,
                                    int64_t block_stride,
                                    int64_t k_begin, int64_t k_end, float* acc, float* m, float* l,
                                    std::vector<float>& scratch, float scale, NextKeys next = {}) {
  constexpr int64_t D = 64, NC = D / 32;
  const int64_t R = kv_heads * G;
  const int64_t group = 16 * D;
  const PackedGroups groups{kcache, vcache, table, block_size, block_stride, kv_heads, group, next};
  // scratch (bf16 unless noted): Q operands [kv_heads][NC][R][32] | P operands [kv_heads][R][32] |
  // scores [R][32] f32 | staged values [2][group] | rescale factors [16] f32
  const int64_t q_elems = kv_heads * NC * R * 32, p_elems = kv_heads * R * 32;
  scratch.resize(static_cast<size_t>((q_elems + p_elems) / 2 + 32 * R + group + 16));
  auto* qtiles = reinterpret_cast<at::BFloat16*>(scratch.data());
  auto* ptiles = qtiles + q_elems;
  float* sbuf = reinterpret_cast<float*>(ptiles + p_elems);
  auto* vstage = reinterpret_cast<at::BFloat16*>(sbuf + 32 * R);
  float* corr = reinterpret_cast<float*>(vstage + 2 * group);

  // Q of head h's rows, dims [32c, 32c + 32), zero in every other row; P operands start all zero and each
  // step fills the same places (row r's weights for group u go to head-group f = u * kv_heads + r / G,
  // which is half f % 2 of operand f / 2).
  std::fill(qtiles, qtiles + q_elems + p_elems, at::BFloat16(0.f));
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t c = 0; c < NC; ++c)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = h * G + g;
        std::copy(q + r * D + 32 * c, q + r * D + 32 * c + 32, qtiles + ((h * NC + c) * R + r) * 32);
      }
  // Per task, not per step (runtime divisors): row r's P slot for each group, and each pair's (group, head).
  at::BFloat16* pslot[16][2];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t u = 0; u < 2; ++u) {
      const int64_t f = u * kv_heads + r / G;
      pslot[r][u] = ptiles + ((f / 2) * R + r) * 32 + 16 * (f % 2);
    }
  int64_t pair_u[16][2], pair_h[16][2];
  for (int64_t f = 0; f < 2 * kv_heads; ++f) {
    pair_u[f / 2][f % 2] = f / kv_heads;
    pair_h[f / 2][f % 2] = f % kv_heads;
  }

  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vneg_inf = _mm512_set1_ps(neg_inf), vscale = _mm512_set1_ps(scale);
  std::fill(m, m + R, neg_inf);
  std::fill(l, l + R, 0.f);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t t0 = group_start(k_begin);
  for (int64_t t = t0; t < k_end; t += kPackedStep) {
    const PackedGroups::Step st = groups.step(t, k_end);
    const int64_t* n = st.n;
    const int64_t* base = st.base;
    // K of the next step's two groups (this task's, or the next task's first ones), -1 where there is none
    const int64_t next_k[2] = {groups.ahead(t, t0, k_end, 1, 0), groups.ahead(t, t0, k_end, 1, 1)};

    // Scores of every row for each group, in address order (a group's heads are adjacent). The K operand
    // alternates between tiles 5 (dims 0-31) and 7 (dims 32-63).
    for (int64_t u = 0; u < 2; ++u) {
      _tile_zero(6);
      if (n[u] > 0)
        for (int64_t h = 0; h < kv_heads; ++h) {
          prefetch_group_l1(vcache + base[u] + h * group);
          const at::BFloat16* kp = kcache + base[u] + h * group;
          _tile_loadd(4, qtiles + (h * NC) * R * 32, 64);
          _tile_loadd(5, kp, 64);
          _tile_dpbf16ps(6, 4, 5);
          _tile_loadd(4, qtiles + (h * NC + 1) * R * 32, 64);
          _tile_loadd(7, kp + 512, 64);
          _tile_dpbf16ps(6, 4, 7);
        }
      _tile_stored(6, sbuf + 16 * u, 128);
    }

    // Softmax against each row's reference maximum, which moves (rescaling the output) only when a score
    // passes it by more than kLazyRescale. Lanes past the keys' end are -inf (their K may be anything).
    const __mmask16 keep0 = packed_keep(t, k_begin, n[0]), keep1 = packed_keep(t + 16, k_begin, n[1]);
    bool rescale = false;
    for (int64_t r = 0; r < R; ++r) {
      const __m512 s0 = _mm512_mask_blend_ps(keep0, vneg_inf, _mm512_mul_ps(_mm512_loadu_ps(sbuf + 32 * r), vscale));
      const __m512 s1 = _mm512_mask_blend_ps(keep1, vneg_inf, _mm512_mul_ps(_mm512_loadu_ps(sbuf + 32 * r + 16), vscale));
      corr[r] = 1.f;
      const float mx = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      if (mx > m[r] + kLazyRescale) {
        if (m[r] != neg_inf) {
          corr[r] = exp_neg(m[r] - mx);
          l[r] *= corr[r];
          rescale = true;
        }
        m[r] = mx;
      }
      const __m512 vm = _mm512_set1_ps(m[r]);
      const __m512 e0 = exp16(_mm512_sub_ps(s0, vm), keep0), e1 = exp16(_mm512_sub_ps(s1, vm), keep1);
      l[r] += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pslot[r][0]), (__m256i)_mm512_cvtneps_pbh(e0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pslot[r][1]), (__m256i)_mm512_cvtneps_pbh(e1));
    }
    if (rescale) {
      store_acc64(acc);
      for (int64_t r = 0; r < R; ++r)
        if (corr[r] != 1.f) {
          const __m512 vc = _mm512_set1_ps(corr[r]);
          for (int64_t c = 0; c < 4; ++c)
            _mm512_storeu_ps(acc + r * D + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * c), vc));
        }
      load_acc64(acc);
    }

    // P.V, two head-groups per product: head-groups f = 2j and 2j + 1 of the step (f = u * kv_heads + h). When
    // the second lies right after the first in memory and both are full, one strided tile reads both;
    // otherwise (a group's end, the step's groups in blocks apart) the pair is staged with its tail zeroed.
    for (int64_t j = 0; j < kv_heads; ++j) {
      const int64_t u0 = pair_u[j][0], h0 = pair_h[j][0], u1 = pair_u[j][1], h1 = pair_h[j][1];
      if (next_k[u0] >= 0) prefetch_group_l1(kcache + next_k[u0] + h0 * group);
      if (next_k[u1] >= 0) prefetch_group_l1(kcache + next_k[u1] + h1 * group);
      const at::BFloat16* a0 = n[u0] > 0 ? vcache + base[u0] + h0 * group : nullptr;
      const at::BFloat16* a1 = n[u1] > 0 ? vcache + base[u1] + h1 * group : nullptr;
      const at::BFloat16* vp = a0;
      if (n[u0] < 16 || n[u1] < 16 || a1 != a0 + group) {
        stage_value_group<D>(a0, n[u0], vstage);
        stage_value_group<D>(a1, n[u1], vstage + group);
        vp = vstage;
      }
      pv_product64(ptiles + j * R * 32, 64, vp);
    }
  }
  store_acc64(acc);
}

}  // namespace kvpage
#endif
