// The main loop for quantized rows of one-byte codes (int8, fp8 e4m3, fp8 e5m2): 16 codes at a time on AVX2
// builds, 32 on AVX-512 ones (Lanes256 / Lanes512), widened to 16-bit lanes and multiplied pairwise into
// 32-bit accumulator lanes, never dequantized to a float32 row first:
//   int8     int16 x int16 -> int32 (VNNI's fused multiply-add where the CPU has it), exact: the query row is
//            quantized once per task to int16 (scale = absmax / 32767, 2^-16 of its range: far below the keys'
//            own int8 step), and each unit's weights times the value rows' scales to 16-bit lanes against
//            their largest (AVX2 builds: 0..65535 less 32768, all 16 bits; AVX-512 builds: 15 bits against a
//            bound of it, see block_weights16);
//   fp8      bf16 x bf16 -> float32 (dpbf16 on AVX512_BF16, two FMAs on the halves elsewhere): a code's sign,
//            exponent and mantissa bits moved into a bf16's fields are the code's value times 2^-120 (e4m3) or
//            2^-112 (e5m2), one shift and one mask per 16 codes; the query and the weights are rounded to bf16
//            and lifted by 2^64 so that no product falls below float32's normal range (dpbf16 flushes those;
//            what it still flushes are codes below e4m3's normal range: |x| < 2^-6, 1/28672 of the row's
//            absmax, far under the code's own rounding).
//   scores   q . k_i = (q' . codes_i) x q_factor x k_scale_i;
//   P.V      sum_i w_i v_i = sum_i (w_i x v_scale_i)' codes_i: two tokens' codes interleaved feed one
//            multiply-add per 8 dims, and each unit's sum is scaled back and added to the float32 output row.
// Keys go in units of consecutive blocks (up to the lanes' kUnitKeys: 64 on AVX2 builds, 16 on AVX-512 ones),
// one softmax step and one integer P.V sum per unit. The float32 softmax (running max, exp, denominator) is the
// other paths' own. The next blocks are fetched in small steps all through a unit's work (LineStream). On a
// Zen 3 (AVX2, 64 sequences x 8K keys) this read an int8 cache in ~0.8x the bf16 cache's time one block at a
// time, where dequantizing each block to float32 first took ~1.05x. On
// AVX-512 builds the softmax step takes 16 lanes and all of a KV head's rows at once (block_weights16), four
// keys' sums are folded by one unpack tree, and the rows' scales come by gathers: on a Zen 5 (64 x 8K keys) the
// int8 loop went from 8.1 to 6.65 ms, 0.72x to 0.58x the bf16 cache's time (fp8 0.71x to 0.54x).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "attention/code_lanes.h"
#include "attention/loop.h"
#include "attention/quant_rows.h"

namespace kvpage::attn {

#if KVPAGE_ISA_AVX2
// Dot products of GT query rows (q16: their 16-bit lanes, D apart) with KT key rows (k, row_stride apart):
// out[g] lane kk = row g . key kk, before the factors. Each key chunk is widened once for all GT rows.
template <class L, int GT, int KT, int64_t D>
inline void dot_keys(const int16_t* q16, const uint8_t* k, int64_t row_stride, __m128* out) {
  using Acc = typename L::Acc;
  Acc acc[KT][GT];
  for (int kk = 0; kk < KT; ++kk)
    for (int g = 0; g < GT; ++g) acc[kk][g] = L::zero();
  for (int64_t c = 0; c < D; c += L::kW) {
    typename L::V kv[KT];
    for (int kk = 0; kk < KT; ++kk) kv[kk] = L::widen(k + kk * row_stride + c);
    for (int g = 0; g < GT; ++g) {
      const typename L::V qv = L::load(q16 + g * D + c);
      for (int kk = 0; kk < KT; ++kk) acc[kk][g] = L::madd(acc[kk][g], kv[kk], qv);
    }
  }
  const Acc z = L::zero();
  for (int g = 0; g < GT; ++g)
    out[g] = L::hsum4(acc[0][g], KT > 1 ? acc[KT > 1 ? 1 : 0][g] : z, KT > 2 ? acc[KT > 2 ? 2 : 0][g] : z,
                      KT > 3 ? acc[KT > 3 ? 3 : 0][g] : z);
}

// Scores of keys [first, visible) of a block for GT query rows: sc[g * ss + i] = q_g . k_i (float32, scaled).
template <class L, int GT, int64_t D>
inline void score_rows(const int16_t* q16, const float* qs, const uint8_t* kb, int64_t row_stride, int64_t first,
                       int64_t visible, const float* ks, float* sc, int64_t ss, LineStream& ls) {
  // keys per pass: KT x GT accumulators, KT widened keys and a query chunk stay in registers (16 of them on
  // 256-bit builds, 32 on 512-bit ones)
  constexpr int KT = L::kW == 32 ? 4 : GT <= 2 ? 4 : GT == 3 ? 3 : 2;
  __m128 out[GT];
  int64_t i = first;
  for (; i + KT <= visible; i += KT) {
    ls.step();
    dot_keys<L, GT, KT, D>(q16, kb + i * row_stride, row_stride, out);
    // four lanes stored whatever KT: lanes past KT land on scores the next pass (or the tail) writes, or past
    // `visible` (never read); ks has room to read four (the value scales follow it)
    for (int g = 0; g < GT; ++g) {
      const __m128 f = _mm_mul_ps(out[g], _mm_set1_ps(qs[g]));
      _mm_storeu_ps(sc + g * ss + i, _mm_mul_ps(f, _mm_loadu_ps(ks + i)));
    }
  }
  for (; i < visible; ++i) {
    dot_keys<L, GT, 1, D>(q16, kb + i * row_stride, row_stride, out);
    for (int g = 0; g < GT; ++g) sc[g * ss + i] = _mm_cvtss_f32(out[g]) * qs[g] * ks[i];
  }
}

// A run of value rows inside one block: where it starts and how many; a unit's runs take consecutive weights.
struct ValueRun {
  const uint8_t* v;
  int64_t n;
};

// acc_g <- acc_g x corr_g + wscale_g x sum_i w_g,i codes_i for GT output rows (D apart) over the value rows of
// `runs` (row_stride apart within a run); wq[g * ws + i] holds the 16-bit weight of token i, counted across the
// runs (and a 0 after the last of an odd count). A run of odd length pairs its last token with the next run's
// first weight against zero codes, so runs need not be even. The sums of all runs stay in int32 lanes (at most
// 32768 x 128 = 2^22 per product, 2^29 for 64 tokens with the offset's share) and are scaled into the float32
// rows once. Lanes whose weights carry an offset (kWeightOffset) get it back as offset x the codes' sums.
template <class L, int GT, int64_t D>
inline void pv_rows(const int16_t* wq, int64_t ws, const ValueRun* runs, int nruns, int64_t row_stride, float* acc,
                    const float* corr, const float* wscale, LineStream& ls) {
  using V = typename L::V;
  for (int64_t c = 0; c < D; c += L::kW) {
    ls.step();
    typename L::Acc lo[GT], hi[GT];
    for (int g = 0; g < GT; ++g) lo[g] = hi[g] = L::zero();
    V sx = L::zlanes(), sy = L::zlanes();  // offset weights: the codes' sums, 16-bit lanes (<= 40 x 128 each)
    const int16_t* w = wq;
    // one pair of tokens: x, y their interleaved codes, wp their two weights of row 0 (row g's are g x ws on)
    const auto take = [&](const V x, const V y, const int16_t* wp) {
      if constexpr (L::kWeightOffset != 0) {
        sx = L::add16(sx, x);
        sy = L::add16(sy, y);
      }
      for (int g = 0; g < GT; ++g) {
        const V pw = L::pair(wp + g * ws);
        lo[g] = L::madd(lo[g], x, pw);
        hi[g] = L::madd(hi[g], y, pw);
      }
    };
    for (int r = 0; r < nruns; ++r) {
      const int64_t full = runs[r].n / 2;
      const uint8_t* vr = runs[r].v + c;
      for (int64_t p = 0; p < full; ++p, vr += 2 * row_stride) {
        const V a = L::widen(vr), b = L::widen(vr + row_stride);
        // per 128-bit chunk k: x = dims 8k .. 8k + 3 and y = 8k + 4 .. 8k + 7, each as (token 2p, 2p + 1) pairs
        take(L::unlo(a, b), L::unhi(a, b), w + 2 * p);
      }
      if (runs[r].n & 1) {  // the last token against zero codes
        const V a = L::widen(vr), z = L::zlanes();
        take(L::unlo(a, z), L::unhi(a, z), w + 2 * full);
      }
      w += runs[r].n;
    }
    if constexpr (L::kWeightOffset != 0) {  // each weight was stored less the offset: add offset x sum of codes
      const typename L::Acc ox = L::offset_sums(sx), oy = L::offset_sums(sy);
      for (int g = 0; g < GT; ++g) {
        lo[g] = L::add32(lo[g], ox);
        hi[g] = L::add32(hi[g], oy);
      }
    }
    for (int g = 0; g < GT; ++g) L::finish(lo[g], hi[g], acc + g * D + c, corr[g], wscale[g]);
  }
}

// The softmax step of one block (or unit of blocks: sc, vs and the weights run on across them) for the G query
// rows of a KV head (rows r0 .. r0 + G - 1 of m, l; scores sc[g][i] for keys [first, visible)): running maxima
// and sums updated, corr[g] the old partials' factor, and each row's weights times the value rows' scales (vs) in 16-bit lanes at w16 + g * ws (a 0 after an odd count), whose
// sum is multiplied by wscale[g]. The weights are taken against the block's own maximum, exp(s - bmax) <= 1
// with 1 reached, and the block's factor exp(bmax - m) goes to the sums and the denominator: so the products
// can be scaled to the block's largest value scale (`inv`, `factor`: the lanes' weight_inv / weight_factor of
// it, once per block and KV head) without a division and a second pass per row, and without losing the
// lanes' range when a whole block weighs little against the running maximum. Against each row's own largest
// product int8's attention output is ~20% closer to the reference's (median 3.6e-5 against 4.3e-5 relative, 8 x
// 4K keys), both ~1% of the codes' own rounding; scaled to the running maximum instead it was 4x further, and
// SmolLM2's int8 top-1 fell from 99.37% to 98.75% (800 positions). 8 lanes at a time; both factors of up to
// 4 rows in one exp.
template <class L>
inline void block_weights(const float* sc, int64_t ss, int64_t first, int64_t visible, const float* vs, float inv,
                          float factor, int64_t G, float* m, float* l, float* corr, float* wscale, int16_t* w16,
                          int64_t ws, LineStream& ls) {
  const int64_t cnt = visible - first;
  float bmax[kMaxGroup], bscale[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    const float* s = sc + g * ss;
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t i = first;
    for (; i + 8 <= visible; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
    float mx = kvpage::hmax8(vmax);
    for (; i < visible; ++i) mx = std::max(mx, s[i]);
    bmax[g] = mx;
  }
  if (G <= 4) {  // lanes 0-3 the old partials' factors, 4-7 the blocks'; lanes past G are exp(0)
    const __m128 mo = _mm_setr_ps(m[0], G > 1 ? m[1] : 0.f, G > 2 ? m[2] : 0.f, G > 3 ? m[3] : 0.f);
    const __m128 bm = _mm_setr_ps(bmax[0], G > 1 ? bmax[1] : 0.f, G > 2 ? bmax[2] : 0.f, G > 3 ? bmax[3] : 0.f);
    const __m128 mn = _mm_max_ps(mo, bm);
    const __m256 e = kvpage::exp8(_mm256_set_m128(_mm_sub_ps(bm, mn), _mm_sub_ps(mo, mn)));
    float mnew[4];
    _mm_storeu_ps(corr, _mm256_castps256_ps128(e));  // corr has room for 16
    _mm_storeu_ps(bscale, _mm256_extractf128_ps(e, 1));
    _mm_storeu_ps(mnew, mn);
    for (int64_t g = 0; g < G; ++g) m[g] = mnew[g];
  } else {
    for (int64_t g = 0; g < G; ++g) {
      const float mn = std::max(m[g], bmax[g]);
      corr[g] = exp_neg(m[g] - mn);
      bscale[g] = exp_neg(bmax[g] - mn);
      m[g] = mn;
    }
  }
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t g = 0; g < G; ++g) {
    ls.step();
    const float* s = sc + g * ss;
    int16_t* wq = w16 + g * ws;
    const __m256 vm = _mm256_set1_ps(bmax[g]);
    __m256 vsum = _mm256_setzero_ps();
    int64_t i = first;
    for (; i + 8 <= visible; i += 8) {
      const __m256 w = kvpage::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
      vsum = _mm256_add_ps(vsum, w);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(wq + (i - first)), L::weights8(_mm256_mul_ps(w, _mm256_loadu_ps(vs + i)), vinv));
    }
    float sum = kvpage::hsum8(vsum);
    for (; i < visible; ++i) {
      const float w = exp_neg(s[i] - bmax[g]);
      sum += w;
      wq[i - first] = L::weight1(w * vs[i], inv);
    }
    l[g] = l[g] * corr[g] + bscale[g] * sum;
    wscale[g] = factor * bscale[g];
    if (cnt & 1) wq[cnt] = 0;
  }
}

#if KVPAGE_ISA_AVX512
// The same step (block_weights) 16 lanes at a time, masked at the ends, the 16-bit weights written as they are
// computed; both factors of up to 8 rows in one exp, the rows' block maxima gathered in a register (read back
// from memory, they stalled on the stores).
template <class L>
inline void block_weights16(const float* sc, int64_t ss, int64_t first, int64_t visible, const float* vs, float inv,
                            float factor, int64_t G, float* m, float* l, float* corr, float* wscale, int16_t* w16,
                            int64_t ws, LineStream& ls) {
  const int64_t cnt = visible - first;
  const __m512 vinv = _mm512_set1_ps(inv), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const int64_t rows = std::min<int64_t>(16, G - g0);
    const __mmask16 k = kvpage::tail_mask(rows);
    __m512 bm = ninf;  // the rows' block maxima, lane g
    for (int64_t g = 0; g < rows; ++g) {
      const float* s = sc + (g0 + g) * ss;
      __m512 vmax = ninf;
      for (int64_t i = first; i < visible; i += 16)
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(ninf, kvpage::tail_mask(visible - i), s + i));
      bm = _mm512_mask_mov_ps(bm, static_cast<__mmask16>(1u << g), _mm512_set1_ps(_mm512_reduce_max_ps(vmax)));
    }
    const __m512 mo = _mm512_maskz_loadu_ps(k, m + g0), mn = _mm512_max_ps(mo, bm);
    const __m512 dc = _mm512_sub_ps(mo, mn), db = _mm512_sub_ps(bm, mn);
    __m512 vc, vb;  // the old partials' and the blocks' factors
    if (rows <= 8) {  // both in one exp: lanes 0-7 the old partials', 8-15 the block's
      const __m512 e = exp16(_mm512_shuffle_f32x4(dc, db, _MM_SHUFFLE(1, 0, 1, 0)), static_cast<__mmask16>(k | (k << 8)));
      vc = e;
      vb = _mm512_shuffle_f32x4(e, e, _MM_SHUFFLE(3, 2, 3, 2));
    } else {
      vc = exp16(dc, k);
      vb = exp16(db, k);
    }
    _mm512_mask_storeu_ps(m + g0, k, mn);
    __m512 sums = _mm512_setzero_ps();
    for (int64_t g = 0; g < rows; ++g) {
      ls.step();
      const float* s = sc + (g0 + g) * ss;
      const __m512 vm = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(g)), bm);
      __m512 vsum = _mm512_setzero_ps();
      int16_t* wq = w16 + (g0 + g) * ws;
      for (int64_t i = first; i < visible; i += 16) {
        const __mmask16 kk = kvpage::tail_mask(visible - i);
        const __m512 w = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(kk, s + i), vm), kk);
        vsum = _mm512_add_ps(vsum, w);
        _mm256_mask_storeu_epi16(wq + (i - first), kk, L::weights16(_mm512_mul_ps(w, _mm512_maskz_loadu_ps(kk, vs + i)), vinv));
      }
      sums = _mm512_mask_mov_ps(sums, static_cast<__mmask16>(1u << g), _mm512_set1_ps(_mm512_reduce_add_ps(vsum)));
      if (cnt & 1) wq[cnt] = 0;
    }
    _mm512_mask_storeu_ps(l + g0, k, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, l + g0), vc, _mm512_mul_ps(vb, sums)));
    // P.V reads these one at a time: whole stores (each buffer is a multiple of 16 floats) forward to such
    // loads where masked ones may not
    _mm512_storeu_ps(corr + g0, vc);
    _mm512_storeu_ps(wscale + g0, _mm512_mul_ps(vb, _mm512_set1_ps(factor)));
  }
}
#endif

#if KVPAGE_ISA_AVX512
// The bf16 scales of n key and value rows (row_stride apart, each after its D codes) as float32 at ks, vs, 16
// rows per gather; returns the largest value scale. Each lane reads the row's last two codes and its scale
// (bytes D - 2 .. D + 1, inside the row), so the scale's bits are the word's high half: a float32 once the
// codes are masked off.
inline float gather_scales(const uint8_t* kb, const uint8_t* vb, int64_t row_stride, int64_t D, int64_t n, float* ks,
                           float* vs) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int>(row_stride)));
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 top = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = kvpage::tail_mask(n - i);
    const int64_t off = i * row_stride + D - 2;
    const __m512i kw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, idx, kb + off, 1);
    const __m512i vw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, idx, vb + off, 1);
    const __m512 v = _mm512_castsi512_ps(_mm512_and_si512(vw, high));
    _mm512_mask_storeu_ps(ks + i, k, _mm512_castsi512_ps(_mm512_and_si512(kw, high)));
    _mm512_mask_storeu_ps(vs + i, k, v);
    top = _mm512_max_ps(top, v);
  }
  return _mm512_reduce_max_ps(top);
}
#endif

// A task's buffers for the steps after a unit's scores: scores at sc (row g at sc + g * ss), value scales at vs,
// the rows' factors (corr, wscale) and 16-bit weights (row g at w16 + g * ws).
struct UnitBuffers {
  float* sc;
  int64_t ss;
  const float* vs;
  float* corr;
  float* wscale;
  int16_t* w16;
  int64_t ws;
};

// One unit's softmax step and P.V for the G query rows of a KV head (m, l and acc at the head's first row) over
// keys [first, visible) of the unit, the value rows in vrun: what both quantized loops share after their scores
// (attend_tile_codes, attend_tile_channel_codes).
template <class L, int64_t D>
inline void unit_softmax_pv(const UnitBuffers& u, int64_t first, int64_t visible, float winv, float wfactor, int64_t G,
                            float* m, float* l, float* acc, const ValueRun* vrun, int nv, int64_t row_stride,
                            LineStream& ls) {
#if KVPAGE_ISA_AVX512
  if constexpr (L::kW == 32)
    block_weights16<L>(u.sc, u.ss, first, visible, u.vs, winv, wfactor, G, m, l, u.corr, u.wscale, u.w16, u.ws, ls);
  else
#endif
    block_weights<L>(u.sc, u.ss, first, visible, u.vs, winv, wfactor, G, m, l, u.corr, u.wscale, u.w16, u.ws, ls);
#define KVPAGE_PV(gt) \
  pv_rows<L, gt, D>(u.w16 + g0 * u.ws, u.ws, vrun, nv, row_stride, acc + g0 * D, u.corr + g0, u.wscale + g0, ls)
  KVPAGE_ROW_BATCHES(KVPAGE_PV)
#undef KVPAGE_PV
}

// attend_tile for quantized rows of codes C and head size D (a multiple of 16), the contract of attend_tile_quant:
// q pre-scaled float32 rows in the keys' rotated basis, rows r = j * H + head, row r sees keys <= pos0 + r / H
// and none before its window. Keys go in units of up to kUnitKeys (consecutive blocks of the sequence, one run
// of rows each): scores block by block, one softmax step and one integer P.V sum per unit.
template <KVCode C, int64_t D>
void attend_tile_codes(const float* q, int64_t nq, int64_t H, int64_t G, const uint8_t* kcache,
                      const uint8_t* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                      int64_t kv_heads, int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m,
                      float* l, int64_t window, const NextKeys& next = {}) {
  using L = CodeLanes<C>;
  static_assert(D % L::kW == 0, "rows are read kW codes at a time");
  const int64_t head_stride = D + kScaleBytes, row_stride = kv_heads * head_stride;
  const int64_t blocks = std::clamp<int64_t>(L::kUnitKeys / block_size, 1, kUnitBlocks);  // per unit
  const int64_t U = blocks * block_size;  // keys per unit at most
  const int64_t R = nq * H, ws = U + 2;  // 16-bit weights per row: a unit's tokens and a trailing 0
  thread_local std::vector<int16_t> q16, w16;
  thread_local std::vector<float> buf;
  q16.resize(static_cast<size_t>(R * D));
  w16.resize(static_cast<size_t>(G * ws));
  const int64_t G16 = (G + 15) / 16 * 16;  // corr and wscale: whole 16-lane stores (block_weights16)
  buf.resize(static_cast<size_t>(R + 2 * U + G * (U + 8) + 2 * G16));
  float* qs = buf.data();          // the query rows' factors
  float* ks = qs + R;              // this unit's key row scales (the current KV head)
  float* vs = ks + U;              // and its value row scales
  float* sc = vs + U;              // scores, then weights x value scales, of the head's G rows: [g][i]
  const int64_t ss = U + 8;
  float* corr = sc + G * ss;       // per row: the running max's correction
  float* wscale = corr + G16;      // per row: the 16-bit weights' factor
  // the buffers' addresses taken once: a thread_local's address is a call (__tls_get_addr) in a shared object
  int16_t* const q16p = q16.data();
  int16_t* const w16p = w16.data();
  const UnitBuffers buffers{sc, ss, vs, corr, wscale, w16p, ws};
  for (int64_t r = 0; r < R; ++r) qs[r] = L::query(q + r * D, D, q16p + r * D);
  reset_partials(acc, m, l, R, D);
  int64_t t = k_begin;
  while (t < k_end) {
    LineStream ls;
    const UnitRuns unit(table, block_size, t, k_end, blocks, -1, [&](int64_t u) {
      ls.add(BlockPrefetch<uint8_t>(kcache, vcache, table, block_size, block_stride, row_stride, u, k_begin, k_end,
                                    next, std::max<int64_t>(kPrefetchAhead, blocks)));
    });
    const int runs = unit.count;
    const int64_t n = unit.n;
    int64_t at[kUnitBlocks];  // each run's byte offset in the caches
    for (int b = 0; b < runs; ++b) at[b] = unit.block[b] * block_stride + unit.off[b] * row_stride;
    ls.pace(kv_heads * (2 + G + n / 3 + D / L::kW));  // about the step() calls of this unit
    for (int64_t h = 0; h < kv_heads; ++h) {
      ls.step();
      float vtop = 0.f;
      for (int b = 0; b < runs; ++b) {
        const uint8_t* kb = kcache + at[b] + h * head_stride;
        const uint8_t* vb = vcache + at[b] + h * head_stride;
#if KVPAGE_ISA_AVX512
        if constexpr (L::kW == 32) {
          const int64_t s0 = unit.start[b];
          vtop = std::max(vtop, gather_scales(kb, vb, row_stride, D, unit.len[b], ks + s0, vs + s0));
          continue;
        }
#endif
        for (int64_t i = 0; i < unit.len[b]; ++i) {
          ks[unit.start[b] + i] = row_scale(kb + i * row_stride, D);
          vs[unit.start[b] + i] = row_scale(vb + i * row_stride, D);
          vtop = std::max(vtop, vs[unit.start[b] + i]);
        }
      }
      const float winv = L::weight_inv(vtop), wfactor = L::weight_factor(vtop);
      ls.step();
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);  // keys after this query's position are masked
        const int64_t first = window_first(window, pos0 + j, t, n);  // and keys before its window
        if (visible <= first) continue;
        const int64_t r0 = j * H + h * G;
        // each run's part of [first, visible): its scores, and its value rows for P.V
        int64_t lo[kUnitBlocks], hi[kUnitBlocks];
        ValueRun vrun[kUnitBlocks];
        int nv = 0;
        for (int b = 0; b < runs; ++b) {
          unit.part(b, first, visible, lo[b], hi[b]);
          if (lo[b] < hi[b]) vrun[nv++] = {vcache + at[b] + h * head_stride + lo[b] * row_stride, hi[b] - lo[b]};
        }
        // score_rows stores four lanes past a run's last key: they land on the next run's, written after it
#define KVPAGE_SCORE(gt)                                                                                        \
  for (int b = 0; b < runs; ++b)                                                                                \
    if (lo[b] < hi[b])                                                                                          \
      score_rows<L, gt, D>(q16p + (r0 + g0) * D, qs + r0 + g0, kcache + at[b] + h * head_stride, row_stride,   \
                           lo[b], hi[b], ks + unit.start[b], sc + g0 * ss + unit.start[b], ss, ls)
        KVPAGE_ROW_BATCHES(KVPAGE_SCORE)
#undef KVPAGE_SCORE
        unit_softmax_pv<L, D>(buffers, first, visible, winv, wfactor, G, m + r0, l + r0, acc + r0 * D, vrun, nv,
                              row_stride, ls);
      }
    }
    ls.rest();
    t += n;
  }
}
#endif

}  // namespace kvpage::attn
