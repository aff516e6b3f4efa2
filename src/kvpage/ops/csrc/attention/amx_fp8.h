// Decode attention over fp8 row pages (e4m3, e5m2) with AMX bf16 tile products.
//
// Why: on a CPU with AMX the bf16 cache decodes on tile pairs (amx_pairs.h), while fp8 rows took the dpbf16
// loop (quant_loop.h) and read their half-size pages in about the bf16 cache's time (1.0-1.07x at 64 x 8K
// keys on the AMX Xeon). A code's sign, exponent and mantissa bits moved into a bf16's fields (one widening,
// one shift and one mask per 32 codes, code_lanes.h) are its value times 2^-120 (e4m3) or 2^-112 (e5m2), an
// operand AMX multiplies as it is; so per span of keys and KV head:
//   scores  K (16 keys x 32 dims, the rows' codes staged as bf16) times Q^T (16 dim pairs x G rows, the query
//           rounded to bf16 and lifted by 2^64) -> 16 keys x G float32 per 16-key group, as amx_rows.h forms
//           a bf16 cache's scores; times each key row's scale;
//   P.V     the G rows' weights (x each value row's scale, lifted, bf16; 32 keys a tile row) times 16 dims of
//           32 keys' V (16 key pairs x 16 dims x 2: two rows' codes interleaved byte by byte, then widened)
//           -> G x 16 float32, folded into the float32 output rows once per span.
// The softmax step is a span of 64 keys. Codes below e4m3's normal range read as zero, as in the dpbf16 loop (tiles flush bf16
// subnormals), and lifting keeps every product that matters inside float32's normal range. Rows past a
// group's keys hold anything: their codes still widen to finite bf16 (the exponent field stays under 32),
// and their scores are blended to -inf and their weights to 0 before any product reads them.
// On the AMX Xeon, 64 sequences x 8K keys of SmolLM2's shape (D = 64, 3 KV heads of 3 rows): 13.5-13.8 ms against
// the loop's 18.1 (0.79-0.80x the bf16 cache's time on tile pairs, from 1.07x); no faster: 4, 12 or 16 groups ahead,
// 32-key softmax steps (0.85-0.88x bf16's time against 64-key steps' 0.84-0.88x, 2026-12-05), 128-key steps
// (1.13-1.21x the time from DRAM, 1.07-1.18x in cache), two K operand tiles in turn, the output held in four tiles
// all task long (block-diagonal weights of every head, lazy rescale), a span's K staged before any of its products
// (1.09x from DRAM), the next group's K staged (into a second buffer) while a group's products run, before its
// scores are stored (1.08-1.14x the time in cache, 1.01-1.02x from DRAM, 2026-12-05); the rows' scales read as the
// rows are staged instead of gathered: 0.96-0.99x the time from DRAM; D = 64 with one KV head of 4 rows 5.1 against
// 7.4 ms; D = 128 (2 heads of 4) 20.3 against 21.9. At D = 256 (Gemma 3's shape, 32-key spans so that the staged V
// fit L1) it took 24.2 ms against the loop's 21.6, so that head size keeps the loop. Needs block_size % 16 == 0 (a
// 16-key group lies in one block), D of 64 or 128 and G <= 16; tiles configured by amx_configure_fp8(G).
#pragma once

#include "isa.h"

#if KVPAGE_ISA_AMX

#include "attention/amx_rows.h"
#include "attention/code_lanes.h"
#include "attention/loop.h"
#include "attention/packed_kv.h"

namespace kvpage::attn {

// Tiles: 0 = K (16 keys x 32 dims), 1 = Q^T (16 dim pairs x G rows), 2 = a group's scores (16 keys x G),
// 3 and 4 = the weights of keys 32-63 and 0-31 (G rows x 32 keys), 5 and 7 = V (16 key pairs x 16 dims) in
// turn, 6 = P.V sums (G rows x 16 dims).
inline void amx_configure_fp8(int64_t G) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t == 3 || t == 4 || t == 6 ? G : 16);
    cfg.colsb[t] = static_cast<uint16_t>(t == 1 || t == 2 ? 4 * G : 64);
  }
  load_tile_config(cfg);
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }



// One decode query (rows r = h * G + g, pre-scaled float32 in the keys' rotated basis) over keys
// [k_begin, k_end) of fp8 row pages; k_begin may fall inside a 16-key group (a window's edge: the keys before it
// are masked). Writes unnormalized float32 sums acc[R][D], row maxima m[R] and weight sums l[R]; `next` (the
// thread's next task) is where the prefetch goes once this task's keys run out.
template <KVCode C, int64_t D>
void attend_decode_fp8_amx(const float* q, int64_t G, int64_t kv_heads, const uint8_t* kcache,
                           const uint8_t* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                           int64_t k_begin, int64_t k_end, float* acc, float* m, float* l, const NextKeys& next) {
  static_assert(D == 64 || D == 128, "head sizes the tiles beat the dpbf16 loop at");
  using F = Fp8Lanes<C>;
  using W = Fp8Lanes512<C>;  // how 32 codes widen to bf16 lanes
  constexpr int64_t NC = D / 32, NV = D / 16;
  constexpr int64_t NG = 4, kSpan = 16 * NG, NP = kSpan / 2;  // groups, keys, key pairs a span
  // groups ahead that the prefetch asks for (two spans at D <= 128; 4, 12 and 16 took the same time)
  constexpr int64_t kAhead = 8;
  const int64_t head_stride = D + kScaleBytes, row_stride = kv_heads * head_stride, R = kv_heads * G;
  const int64_t group_lines = (16 * row_stride + 63) / 64;
  // Per thread: query bf16 rows [R][D] | Q^T [kv_heads][NC][16][G] dword pairs | a group's K [16][D] bf16 |
  // the span's V [NV][NP][32] bf16 | weights [G][kSpan] bf16 | scores [NG][16][G] | P.V sums [NV][G][16]
  thread_local std::vector<int16_t> q16, kst, vst, pbuf;
  thread_local std::vector<int32_t> qt;
  thread_local std::vector<float> sbuf, pv;
  q16.resize(static_cast<size_t>(R * D));
  qt.resize(static_cast<size_t>(kv_heads * NC * 16 * G));
  kst.resize(static_cast<size_t>(16 * D));
  vst.resize(static_cast<size_t>(NV * NP * 32));  // zeros at first: a group past the keys' end is never staged
  pbuf.resize(static_cast<size_t>(G * kSpan));
  const int64_t SG = std::max<int64_t>(16 * G, 64);  // floats per group's scores (four vectors at least)
  sbuf.resize(static_cast<size_t>(NG * SG));
  pv.resize(static_cast<size_t>(NV * G * 16));
  // addresses taken once (a thread_local's address is a call in a shared object)
  int16_t *const qp = q16.data(), *const kp = kst.data(), *const vp = vst.data(), *const pp = pbuf.data();
  int32_t* const qtp = qt.data();
  float *const sp = sbuf.data(), *const pvp = pv.data();

  const float qfactor = F::query(q, R * D, qp);  // the same for every row
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t c = 0; c < NC; ++c)
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t g = 0; g < G; ++g) {
          int32_t pair;
          std::memcpy(&pair, qp + (h * G + g) * D + 32 * c + 2 * i, sizeof(pair));
          qtp[((h * NC + c) * 16 + i) * G + g] = pair;
        }
  reset_partials(acc, m, l, R, D);

  // byte offset of the group starting at key k (a multiple of 16) of this task, or of the thread's next task
  // once k passes this one's last group; -1: none
  const int64_t t0 = group_start(k_begin), t_last = group_start(k_end - 1);
  const auto group_at = [&](int64_t k) -> int64_t {
    if (k <= t_last) return table[k / block_size] * block_stride + (k % block_size) * row_stride;
    if (next.table == nullptr) return -1;
    const int64_t nk = group_start(next.begin) + (k - t_last - 16);
    if (nk >= next.end) return -1;
    return next.table[nk / block_size] * block_stride + (nk % block_size) * row_stride;
  };
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i score_idx = _mm512_mullo_epi32(iota, _mm512_set1_epi32(static_cast<int>(G)));
  const __m512 vneg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vlift = _mm512_set1_ps(F::kLift);
  const __m512 wfactor = _mm512_set1_ps(F::kCode / F::kLift);

  for (int64_t t = t0; t < k_end; t += kSpan) {
    int64_t at[NG], far[NG];
    __mmask16 keep[NG];
    const int64_t ng = span_groups<NG>(t, k_begin, k_end, keep, [&](int64_t u, int64_t tu) {
      at[u] = group_at(tu);
      far[u] = group_at(tu + 16 * kAhead);
    });
    // the K and V lines of the groups kAhead ahead, into L2 a few at a time all through the span's staging:
    // asked for at once they fill the core's miss queue and stall the loads behind them
    LineStream ls;
    for (int64_t u = 0; u < ng; ++u)
      if (far[u] >= 0) {
        BlockPrefetch<uint8_t> b;
        b.k = reinterpret_cast<const char*>(kcache + far[u]);
        b.v = reinterpret_cast<const char*>(vcache + far[u]);
        b.lines = group_lines;
        ls.add(b);
      }
    ls.pace(kv_heads * ng * 24);  // one step per staged K row and V pair (half as many steps: 1.2x the time)
    for (int64_t h = 0; h < kv_heads; ++h) {
      // scores of each group: its 16 key rows as bf16, then K . Q^T over NC chunks of 32 dims
      __m512 kscale[NG], vscale[NG];
      for (int64_t u = 0; u < NG; ++u) {
        if (u >= ng) {
          kscale[u] = vscale[u] = _mm512_setzero_ps();
          continue;
        }
        const uint8_t* kr = kcache + at[u] + h * head_stride;
        const uint8_t* vr = vcache + at[u] + h * head_stride;
        at::BFloat16 scales[2][16];  // the rows' bf16 scales, K then V, picked up as the rows go by
        for (int64_t j = 0; j < 16; ++j) {
          ls.step();
          for (int64_t c = 0; c < NC; ++c)
            _mm512_storeu_si512(kp + j * D + 32 * c, W::widen(kr + j * row_stride + 32 * c));
          std::memcpy(&scales[0][j], kr + j * row_stride + D, 2);
          std::memcpy(&scales[1][j], vr + j * row_stride + D, 2);
        }
        kscale[u] = kvpage::load16(scales[0], 0xFFFF);
        vscale[u] = kvpage::load16(scales[1], 0xFFFF);
        _tile_zero(2);
        for (int64_t c = 0; c < NC; ++c) {
          _tile_loadd(0, kp + 32 * c, 2 * D);
          _tile_loadd(1, qtp + (h * NC + c) * 16 * G, 4 * G);
          _tile_dpbf16ps(2, 0, 1);
        }
        _tile_stored(2, sp + u * SG, 4 * G);
      }
      // the span's V as key pairs: rows 2p and 2p + 1 interleaved byte by byte, then widened; chunk c of 16
      // dims, pair p at vp + (c * NP + p) * 32
      for (int64_t u = 0; u < ng; ++u) {
        const uint8_t* vr = vcache + at[u] + h * head_stride;
        for (int64_t p = 0; p < 8; ++p) {
          ls.step();
          for (int64_t s = 0; s < NC; ++s) {
            const __m256i a = load32(vr + 2 * p * row_stride + 32 * s), b = load32(vr + (2 * p + 1) * row_stride + 32 * s);
            const __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);  // dims 0-7 | 16-23, 8-15 | 24-31
            int16_t* dst = vp + ((2 * s) * NP + 8 * u + p) * 32;
            _mm512_storeu_si512(dst, W::widen_codes(_mm256_permute2x128_si256(lo, hi, 0x20)));
            _mm512_storeu_si512(dst + NP * 32, W::widen_codes(_mm256_permute2x128_si256(lo, hi, 0x31)));
          }
        }
      }
      // softmax of each row over the span; weights x value scales, lifted, as bf16
      float corr[16];
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = h * G + g;
        const __m512i idx = _mm512_add_epi32(score_idx, _mm512_set1_epi32(static_cast<int>(g)));
        __m512 s[NG];
        __m512 mx = vneg_inf;
        for (int64_t u = 0; u < NG; ++u) {
          s[u] = vneg_inf;
          if (u >= ng) continue;
          const float* su = sp + u * SG;
          __m512 raw;
          if (G <= 4) {  // key j's score of row g is float j * G + g of four vectors: two permutes and a blend
            const __m512 lo = _mm512_permutex2var_ps(_mm512_loadu_ps(su), idx, _mm512_loadu_ps(su + 16));
            const __m512 hi = _mm512_permutex2var_ps(_mm512_loadu_ps(su + 32), idx, _mm512_loadu_ps(su + 48));
            raw = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(32)), lo, hi);
          } else {
            raw = _mm512_i32gather_ps(idx, su, 4);
          }
          s[u] = _mm512_mask_blend_ps(keep[u], vneg_inf, _mm512_mul_ps(_mm512_mul_ps(raw, kscale[u]), _mm512_set1_ps(qfactor)));
          mx = _mm512_max_ps(mx, s[u]);
        }
        const float new_m = std::max(m[r], _mm512_reduce_max_ps(mx));
        corr[g] = new_m == m[r] ? 1.f : exp_neg(m[r] - new_m);  // both -inf while no key has counted yet
        m[r] = new_m;
        const __m512 vm = _mm512_set1_ps(new_m);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t u = 0; u < NG; ++u) {
          const __m512 e = exp16(_mm512_sub_ps(s[u], vm), keep[u]);
          sum = _mm512_add_ps(sum, e);
          // unwritten lanes' scales may be NaN: masked to 0, never multiplied
          const __m512 w = _mm512_maskz_mul_ps(keep[u], e, _mm512_mul_ps(vscale[u], vlift));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + g * kSpan + 16 * u), (__m256i)_mm512_cvtneps_pbh(w));
        }
        l[r] = l[r] * corr[g] + _mm512_reduce_add_ps(sum);
      }
      // P.V: keys 0-31 (and 32-63) of the span in one product each per 16 dims
      _tile_loadd(4, pp, 2 * kSpan);
      const bool two = ng > 2;
      if (two) _tile_loadd(3, pp + 32, 2 * kSpan);
      for (int64_t c = 0; c < NV; ++c) {
        _tile_zero(6);
        _tile_loadd(5, vp + c * NP * 32, 64);
        _tile_dpbf16ps(6, 4, 5);
        if (two) {
          _tile_loadd(7, vp + (c * NP + 16) * 32, 64);
          _tile_dpbf16ps(6, 3, 7);
        }
        _tile_stored(6, pvp + c * G * 16, 64);
      }
      for (int64_t g = 0; g < G; ++g) {
        const __m512 vc = _mm512_set1_ps(corr[g]);
        float* out = acc + (h * G + g) * D;
        for (int64_t c = 0; c < NV; ++c)
          _mm512_storeu_ps(out + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(pvp + (c * G + g) * 16), wfactor,
                                                         _mm512_mul_ps(_mm512_loadu_ps(out + 16 * c), vc)));
      }
    }
  }
}

}  // namespace kvpage::attn

#endif
