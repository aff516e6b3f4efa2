// Decode attention over packed int8 pages with AMX byte products.
//
// Why: the packed int8 loop (packed_int8.h) spends a vpdpbusd per 4 dims x 16 keys x one code half of one query
// row: for SmolLM2 (3 rows per KV head, D = 64) 96 instructions for a 16-key group's scores and as many for its
// P.V, so on the Xeon with AMX it read int8 pages in 0.8-0.88x the bf16 pages' time, which decode on AMX tiles
// near memory speed. The packed int8 groups are already AMX's byte operand order (a tile row = 4 bytes for each
// of 16 columns), so tile products replace those runs, for a head's G query rows:
//   scores  [hi codes of the G rows; lo codes] (2G x 64 bytes, signed) times a group's K (16 dim quads x 16
//           keys x 4 bytes, codes + 128: unsigned) -> tdpbsud, 2G x 16 int32 per 64 dims;
//   P.V     [high bytes of the rows' weights; middle bytes; low bytes] (3G x 64 keys, unsigned) times 16 dims of
//           64 keys' V (16 key quads x 16 dims x 4 bytes, signed) -> tdpbusd, 3G x 16 int32. A group's V is
//           4 key quads 4D bytes apart and the next group lies elsewhere, so each span's V is first copied into
//           one run of quads (one vector load and store per 64 bytes).
// The query codes and their biases are packed_int8.h's; what differs is the unit of the softmax step: a span
// of 128 keys (eight groups) instead of one group. Between the products everything crosses through memory
// (tile stores, vector loads and back), and each crossing waits for the store before it, so the fewer steps
// the better: at 64 sequences x 8K keys, one group per step took 1.07x the bf16 time, 64-key spans 0.62x,
// 128-key spans 0.59-0.66x (the spread is mostly the bf16 pages' own, 16.4-18.7 ms). Weights scaled to a
// whole span's largest need more than the loop's 16 bits: with 16 the median error over 4K keys with an
// attention sink was 3.7e-5 against the loop's 2.7e-5, with 24 bits (three bytes) 2.4e-5 (the int8 pages'
// time stayed 10.7-11.5 ms in either form). Per span the int32 sums are folded into the float32 output rows
// (a span's weights carry their own scale). Needs 3G <= 16 and D % 64 == 0; tiles configured by
// amx_configure_int8(G).
// From DRAM this loop streams ~17-19 GB/s against the bf16 tile pairs' ~21-23: measured no faster (64 x 8K keys,
// pages evicted from L3): no software prefetch (1.15-1.20x the time), every other line (1.2x), only the first 2, 4
// or 8 of the ~17 lines of each (group, head)'s K and V, the rest left to the hardware (1.11-1.17x), into L1
// (1.01-1.05x), a span ahead (1.03x), a block's heads at once (1.18x), all heads group by group (1.28-1.52x), two
// (span, head) units in flight so that one's softmax overlaps the other's tile products (1.02-1.04x).
// What its time is made of (each part compiled out in turn, 2026-12-04): docs/kv.md.
#pragma once

#include "isa.h"

#if KVPAGE_AMX_INT8

#include "attention/amx_rows.h"
#include "attention/packed_int8.h"

namespace kvpage::attn {

constexpr int64_t kInt8Span = 128;  // keys per softmax step: eight 16-key groups, two byte products per 16 dims
constexpr float kWeightCodes = 16777215.f;  // 2^24 - 1: a weight's three bytes against the span's largest

// Tiles: 0 = query codes (2G rows x 64 bytes); 1 and 5 = a group's K in turn (16 dim quads x 64 bytes), then in
// P.V the V of the span's keys 64-127 (1) and 0-63 (5) (16 key quads x 64 bytes); 2 and 3 = a group's scores in
// turn (2G x 16 int32); 4 and 7 = the weights of keys 0-63 and 64-127 (3G x 64 bytes); 6 = P.V sums (3G x 16
// int32). (3G rows everywhere, the query's third G zero, with the sums in tiles 6 and 7 in turn: the same speed.)
inline void amx_configure_int8(int64_t G) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t == 1 || t == 5 ? 16 : t == 0 || t == 2 || t == 3 ? 2 * G : 3 * G);
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

constexpr __mmask64 kUpper32 = 0xFFFFFFFF00000000ull;

// Byte permute indices that take byte 0 of each 32-bit lane of two vectors (32 keys) into bytes 0-31, and
// again into bytes 32-63 (for the second pair of vectors, blended in above kUpper32); + b picks byte b.
struct alignas(64) BytePick {
  uint8_t idx[64];
};
constexpr BytePick kLowBytes = [] {
  BytePick p{};
  for (int k = 0; k < 64; ++k) p.idx[k] = static_cast<uint8_t>(4 * (k % 32));  // 4 x 16..31: second vector
  return p;
}();
inline __m512i weight_byte_index(int b) {
  return _mm512_add_epi8(_mm512_load_si512(kLowBytes.idx), _mm512_set1_epi8(static_cast<char>(b)));
}

// One decode query (rows r = h * G + g, pre-scaled float32 in the keys' rotated basis) over keys
// [k_begin, k_end) of packed int8 pages; k_begin may fall inside a group (a window's edge: the keys before it
// are masked). Same results contract as attend_tile_int8_packed for one query token.
template <int64_t D>
void attend_decode_int8_amx(const float* q, int64_t G, int64_t kv_heads, const uint8_t* kcache,
                            const uint8_t* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                            int64_t k_begin, int64_t k_end, float* acc, float* m, float* l, NextKeys next) {
  static_assert(D % 64 == 0, "AMX byte tiles take 64 dims of a query row at a time");
  constexpr int64_t NQ = D / 64, NV = D / 16, NG = kInt8Span / 16;
  const int64_t R = kv_heads * G, QR = 2 * G, TR = 3 * G;  // tile rows: query codes and scores; weights and sums
  const Int8Groups groups{kcache, vcache, table, block_size, block_stride, kv_heads, D, 16 * (D + kScaleBytes), next};
  // Per thread: query operands [kv_heads][NQ][2G][64] | one row's codes [2][D] | scores [NG][2G][16] int32 |
  // weights [3G][128] | staged V [NV][32 key quads][64] | P.V sums [NV][3G][16] int32
  thread_local std::vector<int8_t> qtiles, row, vstage;
  thread_local std::vector<int32_t> sbuf, pv, bias;
  thread_local std::vector<uint8_t> wbuf;
  thread_local std::vector<float> qscale;
  qtiles.resize(static_cast<size_t>(kv_heads * NQ * QR * 64));
  row.resize(static_cast<size_t>(2 * D));
  sbuf.resize(static_cast<size_t>(NG * QR * 16));
  wbuf.resize(static_cast<size_t>(TR * kInt8Span));
  vstage.resize(static_cast<size_t>(NV * (kInt8Span / 4) * 64));
  pv.resize(static_cast<size_t>(NV * TR * 16));
  bias.resize(static_cast<size_t>(2 * R));
  qscale.resize(static_cast<size_t>(R));
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = h * G + g;
      qscale[r] = quantize_query_i8(q + r * D, row.data(), row.data() + D, D, bias.data() + 2 * r);
      for (int64_t c = 0; c < NQ; ++c) {
        int8_t* a = qtiles.data() + (h * NQ + c) * QR * 64;
        std::memcpy(a + g * 64, row.data() + 64 * c, 64);
        std::memcpy(a + (G + g) * 64, row.data() + D + 64 * c, 64);
      }
    }
  reset_partials(acc, m, l, R, D);
  const __m512 vneg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i byte_pick[3] = {weight_byte_index(0), weight_byte_index(1), weight_byte_index(2)};
  const int64_t t0 = group_start(k_begin);
  for (int64_t t = t0; t < k_end; t += kInt8Span) {
    int64_t base[NG], far[NG];
    __mmask16 keep[NG];
    const int64_t ng = span_groups<NG>(t, k_begin, k_end, keep, [&](int64_t u, int64_t tu) {
      base[u] = groups.at(table, tu);
      far[u] = groups.ahead(tu, k_end);  // kInt8PrefetchAhead (4) groups: 2, 3 and 6 the same, 8-24 slower (64 x 8K)
    });
    for (int64_t h = 0; h < kv_heads; ++h) {
      // scores of each group: 2G rows (hi codes' sums, then lo codes') x 16 keys, in tiles 2 and 3 in turn with
      // K in tiles 1 and 5 in turn, and each group's sums stored after the next group's products are issued (a
      // store right after its own products waited for them: the loop's largest stall with the pages in cache);
      // at D = 64 the query tile is loaded once per head
      auto scores = [&](int64_t u) { return sbuf.data() + u * QR * 16; };
      const int8_t* qh = qtiles.data() + h * NQ * QR * 64;
      if (NQ == 1) _tile_loadd(0, qh, 64);
      for (int64_t u = 0; u < ng; ++u) {
        groups.prefetch(far[u], h);
        const uint8_t* kp = kcache + base[u] + h * groups.group;
#define KVPAGE_INT8_SCORES(tile, ktile, prev)           \
  {                                                     \
    _tile_zero(tile);                                   \
    for (int64_t c = 0; c < NQ; ++c) {                  \
      if (NQ > 1) _tile_loadd(0, qh + c * QR * 64, 64); \
      _tile_loadd(ktile, kp + 1024 * c, 64);            \
      _tile_dpbsud(tile, 0, ktile);                     \
    }                                                   \
    if (u > 0) _tile_stored(prev, scores(u - 1), 64);   \
  }
        if (u % 2 == 0) KVPAGE_INT8_SCORES(2, 1, 3) else KVPAGE_INT8_SCORES(3, 5, 2)
#undef KVPAGE_INT8_SCORES
      }
      if ((ng - 1) % 2 == 0)
        _tile_stored(2, scores(ng - 1), 64);
      else
        _tile_stored(3, scores(ng - 1), 64);
      // the span's V staged as 32 key quads per 16 dims (groups past the keys' end keep stale codes: their
      // weights are 0)
      for (int64_t u = 0; u < ng; ++u) {
        const uint8_t* vp = vcache + base[u] + h * groups.group;
        for (int64_t p = 0; p < 4; ++p)
          for (int64_t c = 0; c < NV; ++c)
            _mm512_storeu_si512(vstage.data() + (c * (kInt8Span / 4) + 4 * u + p) * 64,
                                _mm512_loadu_si512(vp + p * 4 * D + 64 * c));
      }
      // softmax of each row over the span; weights x value scales as 24-bit codes against the span's largest
      float corr[8], wscale[8];
      __m512 kscale[NG], vscale[NG];  // groups past the keys' end: 0 (their lanes are masked anyway)
      for (int64_t u = 0; u < NG; ++u) {
        kscale[u] = u < ng ? load_scales16(kcache + base[u] + h * groups.group + 16 * D) : _mm512_setzero_ps();
        vscale[u] = u < ng ? load_scales16(vcache + base[u] + h * groups.group + 16 * D) : _mm512_setzero_ps();
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = h * G + g;
        const __m512i bias_hi = _mm512_set1_epi32(bias[2 * r]), bias_lo = _mm512_set1_epi32(bias[2 * r + 1]);
        __m512 s[NG], vs[NG];
        __m512 mx = vneg_inf;
        for (int64_t u = 0; u < NG; ++u) {
          if (u >= ng) {
            s[u] = vneg_inf;
            continue;
          }
          const int32_t* su = scores(u);
          const __m512i hi = _mm512_sub_epi32(_mm512_loadu_si512(su + 16 * g), bias_hi);
          const __m512i lo = _mm512_sub_epi32(_mm512_loadu_si512(su + 16 * (G + g)), bias_lo);
          const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo)),
                                         _mm512_mul_ps(kscale[u], _mm512_set1_ps(qscale[r])));
          s[u] = _mm512_mask_blend_ps(keep[u], vneg_inf, f);
          mx = _mm512_max_ps(mx, s[u]);
        }
        const float new_m = std::max(m[r], _mm512_reduce_max_ps(mx));
        corr[g] = new_m == m[r] ? 1.f : exp_neg(m[r] - new_m);  // both -inf while no key has counted yet
        m[r] = new_m;
        const __m512 vm = _mm512_set1_ps(new_m);
        __m512 sum = _mm512_setzero_ps(), top = _mm512_setzero_ps();
        for (int64_t u = 0; u < NG; ++u) {
          const __m512 e = exp16(_mm512_sub_ps(s[u], vm), keep[u]);
          sum = _mm512_add_ps(sum, e);
          vs[u] = _mm512_maskz_mul_ps(keep[u], e, vscale[u]);  // unwritten lanes' scales may be NaN: never used
          top = _mm512_max_ps(top, vs[u]);
        }
        l[r] = l[r] * corr[g] + _mm512_reduce_add_ps(sum);
        const float tmax = _mm512_reduce_max_ps(top);
        const __m512 inv = _mm512_set1_ps(tmax > 0.f ? kWeightCodes / tmax : 0.f);
        wscale[g] = tmax / kWeightCodes;
        const __m512i top_code = _mm512_set1_epi32(16777215);
        __m512i w[NG];
        for (int64_t u = 0; u < NG; ++u)  // the largest may round to 2^24, whose top byte would wrap to 0
          w[u] = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(vs[u], inv)), top_code);
        // each 64 keys' high, middle and low bytes gathered from four groups' 32-bit weights: two byte
        // permutes and a blend per 64 bytes (VBMI), where a vpmovdb per 16 bytes and the shifts before it
        // took 8-10% more time with the pages in cache, 2-3% more from DRAM
        uint8_t* wp = wbuf.data() + g * kInt8Span;
        for (int64_t j = 0; j < NG / 4; ++j)
          for (int b = 0; b < 3; ++b) {
            const __m512i lo = _mm512_permutex2var_epi8(w[4 * j], byte_pick[b], w[4 * j + 1]);
            const __m512i hi = _mm512_permutex2var_epi8(w[4 * j + 2], byte_pick[b], w[4 * j + 3]);
            _mm512_storeu_si512(wp + (2 - b) * G * kInt8Span + 64 * j, _mm512_mask_blend_epi8(kUpper32, lo, hi));
          }
      }
      // P.V: the span's keys 0-63 and 64-127 in one product each per 16 dims
      _tile_loadd(4, wbuf.data(), kInt8Span);
      const bool two = ng > 4;
      if (two) _tile_loadd(7, wbuf.data() + 64, kInt8Span);
      for (int64_t c = 0; c < NV; ++c) {
        const int8_t* vc = vstage.data() + c * (kInt8Span / 4) * 64;
        _tile_zero(6);
        _tile_loadd(5, vc, 64);
        _tile_dpbusd(6, 4, 5);
        if (two) {
          _tile_loadd(1, vc + 16 * 64, 64);
          _tile_dpbusd(6, 7, 1);
        }
        _tile_stored(6, pv.data() + c * TR * 16, 64);
      }
      for (int64_t g = 0; g < G; ++g) {
        const __m512 vc = _mm512_set1_ps(corr[g]), vw = _mm512_set1_ps(wscale[g]);
        float* out = acc + (h * G + g) * D;
        for (int64_t c = 0; c < NV; ++c) {
          const int32_t* sums = pv.data() + c * TR * 16;
          // hi x 2^16 + (mid x 2^8 + lo): the high bytes' sums (up to 128 x 255 x 127) would overflow int32
          // shifted by 16, so they join in float32
          const __m512i low = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(sums + 16 * (G + g)), 8),
                                               _mm512_loadu_si512(sums + 16 * (2 * G + g)));
          const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(sums + 16 * g)),
                                             _mm512_set1_ps(65536.f), _mm512_cvtepi32_ps(low));
          _mm512_storeu_ps(out + 16 * c,
                           _mm512_fmadd_ps(sum, vw, _mm512_mul_ps(_mm512_loadu_ps(out + 16 * c), vc)));
        }
      }
    }
  }
}

}  // namespace kvpage::attn

#endif
