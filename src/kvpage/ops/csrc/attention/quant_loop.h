// The main loop for quantized rows of one-byte codes (int8, fp8 e4m3, fp8 e5m2): 16 codes at a time on AVX2
// builds, 32 on AVX-512 ones (Lanes256 / Lanes512), widened to 16-bit lanes and multiplied pairwise into
// 32-bit accumulator lanes, never dequantized to a float32 row first:
//   int8     int16 x int16 -> int32 (VNNI's fused multiply-add where the CPU has it), exact: the query row is
//            quantized once per task to int16 (scale = absmax / 32767, 2^-16 of its range: far below the keys'
//            own int8 step), and each block's weights times the value rows' scales to int16 against their
//            largest;
//   fp8      bf16 x bf16 -> float32 (dpbf16 on AVX512_BF16, two FMAs on the halves elsewhere): a code's sign,
//            exponent and mantissa bits moved into a bf16's fields are the code's value times 2^-120 (e4m3) or
//            2^-112 (e5m2), one shift and one mask per 16 codes; the query and the weights are rounded to bf16
//            and lifted by 2^64 so that no product falls below float32's normal range (dpbf16 flushes those;
//            what it still flushes are codes below e4m3's normal range: |x| < 2^-6, 1/28672 of the row's
//            absmax, far under the code's own rounding).
//   scores   q . k_i = (q' . codes_i) x q_factor x k_scale_i;
//   P.V      sum_i w_i v_i = sum_i (w_i x v_scale_i)' codes_i: two tokens' codes interleaved feed one
//            multiply-add per 8 dims, and each block's sum is scaled back and added to the float32 output row.
// The float32 softmax (running max, exp, denominator) is the other paths' own. The next blocks are fetched in
// small steps all through a block's work (LineStream). On a Zen 3 (AVX2, 64 sequences x 8K keys) this reads an
// int8 cache in ~0.8x the bf16 cache's time, where dequantizing each block to float32 first took ~1.05x.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "attention/loop.h"
#include "attention/quant_rows.h"

namespace kvpage::attn {

#if KVPAGE_ISA_AVX2
constexpr float kI16Max = 32767.f;

// Two int16 weights (tokens i, i + 1) as one 32-bit word, which the lanes' pair() puts in every 32-bit lane,
// as madd pairs them with interleaved codes.
inline int32_t pair_bits(const int16_t* w) {
  int32_t x;
  std::memcpy(&x, w, sizeof(x));
  return x;
}

// x (n floats) -> int16 codes with x ~= code x scale; returns the scale (0 for a zero row).
inline float quantize_i16(const float* x, int16_t* out, int64_t n) {
  float amax = 0.f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float inv = amax > 0.f ? kI16Max / amax : 0.f;
  for (int64_t d = 0; d < n; ++d)
    out[d] = static_cast<int16_t>(std::nearbyint(std::min(kI16Max, std::max(-kI16Max, x[d] * inv))));
  return amax / kI16Max;
}

// x[0, n) -> int16 at out: round(x x inv), x >= 0 (weights times scales, so at most 32767 after scaling).
inline void to_i16(const float* x, int64_t n, float inv, int16_t* out) {
  const __m256 vi = _mm256_set1_ps(inv);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256i c32 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                     _mm_packs_epi32(_mm256_castsi256_si128(c32), _mm256_extracti128_si256(c32, 1)));
  }
  for (; k < n; ++k) out[k] = static_cast<int16_t>(std::nearbyint(std::min(kI16Max, x[k] * inv)));
}

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// The four totals of a0..a3 (eight lanes each), lane k = a_k's.
inline __m128i hsum4_epi32(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}
inline __m128 hsum4_ps(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// x (n floats, n a multiple of 8) times `lift` -> bf16 bits at out, rounded to nearest even.
inline void to_bf16_lifted(const float* x, int64_t n, float lift, int16_t* out) {
  const __m256 vl = _mm256_set1_ps(lift);
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256i b = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x + k), vl));
    const __m256i r = _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(b, 16), one));
    const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(b, r), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                     _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
  }
}

// The 16-bit lane moves of the 256-bit loops (kW = 16 codes at a time).
struct Lanes256 {
  static __m256i load(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static __m256i pair(const int16_t* w) { return _mm256_set1_epi32(pair_bits(w)); }
  static __m256i zlanes() { return _mm256_setzero_si256(); }
  static __m256i unlo(__m256i a, __m256i b) { return _mm256_unpacklo_epi16(a, b); }
  static __m256i unhi(__m256i a, __m256i b) { return _mm256_unpackhi_epi16(a, b); }
  // a[0, 16) <- a x corr + wscale x the sums: lo holds dims 0-3 | 8-11, hi dims 4-7 | 12-15 (unlo / unhi)
  static void finish(__m256 lo, __m256 hi, float* a, float corr, float wscale) {
    const __m256 vc = _mm256_set1_ps(corr), vw = _mm256_set1_ps(wscale);
    const __m256 d0 = _mm256_permute2f128_ps(lo, hi, 0x20), d1 = _mm256_permute2f128_ps(lo, hi, 0x31);
    _mm256_storeu_ps(a, _mm256_fmadd_ps(d0, vw, _mm256_mul_ps(_mm256_loadu_ps(a), vc)));
    _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(d1, vw, _mm256_mul_ps(_mm256_loadu_ps(a + 8), vc)));
  }
};

// How int8 codes enter the multiply-adds (see the file's head): int16 lanes, int32 sums.
struct Int8Lanes : Lanes256 {
  using Acc = __m256i;
  using V = __m256i;                  // 16-bit lanes
  static constexpr int64_t kW = 16;   // codes per widen
  static Acc zero() { return _mm256_setzero_si256(); }
  static __m256i widen(const uint8_t* p) { return _mm256_cvtepi8_epi16(load16(p)); }
  static Acc madd(Acc acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
  }
  static __m128 hsum4(Acc a0, Acc a1, Acc a2, Acc a3) { return _mm_cvtepi32_ps(hsum4_epi32(a0, a1, a2, a3)); }
  static void finish(Acc lo, Acc hi, float* a, float corr, float wscale) {
    Lanes256::finish(_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi), a, corr, wscale);
  }
  // A query row -> its 16-bit lanes; returns what a dot product with codes is multiplied by (before k_scale).
  static float query(const float* x, int64_t n, int16_t* out) { return quantize_i16(x, out, n); }
  // A block's weights x value scales (>= 0, largest `top`) -> 16-bit lanes; returns their sum's factor.
  static float weights(const float* x, int64_t n, float top, int16_t* out) {
    to_i16(x, n, top > 0.f ? kI16Max / top : 0.f, out);
    return top / kI16Max;
  }
};

// How fp8 codes enter them (see the file's head): bf16 lanes, float32 sums.
template <KVCode C>
struct Fp8Lanes : Lanes256 {
  static_assert(C != KVCode::kInt8, "int8 codes take Int8Lanes");
  using Acc = __m256;
  using V = __m256i;
  static constexpr int64_t kW = 16;
  static constexpr int kShift = C == KVCode::kE4M3 ? 4 : 5;  // code bits 0-6 -> bf16 exponent and mantissa
  static constexpr int16_t kKeep = C == KVCode::kE4M3 ? static_cast<int16_t>(0x87F0) : static_cast<int16_t>(0x8FE0);
  static constexpr float kCode = C == KVCode::kE4M3 ? 0x1p120f : 0x1p112f;  // value = bf16 lane x kCode
  static constexpr float kLift = 0x1p64f;
  static Acc zero() { return _mm256_setzero_ps(); }
  // sign-extended, the sign lands in bit 15 and the magnitude's 7 bits under it; the mask drops the copies
  static __m256i widen(const uint8_t* p) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(load16(p)), kShift), _mm256_set1_epi16(kKeep));
  }
  static Acc madd(Acc acc, __m256i a, __m256i b) {
#if KVPAGE_ISA_AVX512BF16
    return _mm256_dpbf16_ps(acc, (__m256bh)a, (__m256bh)b);
#else
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                          _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, high)),
                           _mm256_castsi256_ps(_mm256_and_si256(b, high)), acc);
#endif
  }
  static __m128 hsum4(Acc a0, Acc a1, Acc a2, Acc a3) { return hsum4_ps(a0, a1, a2, a3); }

  static float query(const float* x, int64_t n, int16_t* out) {
    to_bf16_lifted(x, n, kLift, out);
    return kCode / kLift;
  }
  static float weights(const float* x, int64_t n, float top, int16_t* out) {
    (void)top;
    int64_t k = n & ~int64_t{7};
    to_bf16_lifted(x, k, kLift, out);
    for (; k < n; ++k) out[k] = static_cast<int16_t>(c10::BFloat16(x[k] * kLift).x);
    return kCode / kLift;
  }
};

#if KVPAGE_ISA_AVX512
// The 512-bit loops (kW = 32 codes at a time; head sizes that are multiples of 32): half the instructions of the
// 256-bit ones for the same codes, which the loop needs where it, not memory, sets the pace (Zen 5, 64 x 8K
// keys: the 256-bit int8 loop took 8.8 ms with every block in cache and 9.8 ms from memory).
struct Lanes512 {
  static __m512i load(const int16_t* p) { return _mm512_loadu_si512(reinterpret_cast<const void*>(p)); }
  static __m512i pair(const int16_t* w) { return _mm512_set1_epi32(pair_bits(w)); }
  static __m512i zlanes() { return _mm512_setzero_si512(); }
  static __m512i unlo(__m512i a, __m512i b) { return _mm512_unpacklo_epi16(a, b); }
  static __m512i unhi(__m512i a, __m512i b) { return _mm512_unpackhi_epi16(a, b); }
  static __m512i widen_raw(const uint8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // a[0, 32) <- a x corr + wscale x the sums: 128-bit chunk k of lo holds dims 8k .. 8k + 3, of hi 8k + 4 .. 8k + 7
  static void finish(__m512 lo, __m512 hi, float* a, float corr, float wscale) {
    const __m512 vc = _mm512_set1_ps(corr), vw = _mm512_set1_ps(wscale);
    const __m512 t0 = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));  // lo0 lo1 hi0 hi1
    const __m512 t1 = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));  // lo2 lo3 hi2 hi3
    const __m512 d0 = _mm512_shuffle_f32x4(t0, t0, _MM_SHUFFLE(3, 1, 2, 0));  // dims 0-15
    const __m512 d1 = _mm512_shuffle_f32x4(t1, t1, _MM_SHUFFLE(3, 1, 2, 0));  // dims 16-31
    _mm512_storeu_ps(a, _mm512_fmadd_ps(d0, vw, _mm512_mul_ps(_mm512_loadu_ps(a), vc)));
    _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(d1, vw, _mm512_mul_ps(_mm512_loadu_ps(a + 16), vc)));
  }
};

struct Int8Lanes512 : Lanes512 {
  using Acc = __m512i;
  using V = __m512i;
  static constexpr int64_t kW = 32;
  static Acc zero() { return _mm512_setzero_si512(); }
  static V widen(const uint8_t* p) { return widen_raw(p); }
  static Acc madd(Acc acc, V a, V b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
  }
  static __m256i half_sum(Acc a) {
    return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
  }
  static __m128 hsum4(Acc a0, Acc a1, Acc a2, Acc a3) {
    return _mm_cvtepi32_ps(hsum4_epi32(half_sum(a0), half_sum(a1), half_sum(a2), half_sum(a3)));
  }
  static void finish(Acc lo, Acc hi, float* a, float corr, float wscale) {
    Lanes512::finish(_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi), a, corr, wscale);
  }
  static float query(const float* x, int64_t n, int16_t* out) { return Int8Lanes::query(x, n, out); }
  static float weights(const float* x, int64_t n, float top, int16_t* out) {
    return Int8Lanes::weights(x, n, top, out);
  }
};

#if KVPAGE_ISA_AVX512BF16
template <KVCode C>
struct Fp8Lanes512 : Lanes512 {
  using F = Fp8Lanes<C>;
  using Acc = __m512;
  using V = __m512i;
  static constexpr int64_t kW = 32;
  static Acc zero() { return _mm512_setzero_ps(); }
  static V widen(const uint8_t* p) {
    return _mm512_and_si512(_mm512_slli_epi16(widen_raw(p), F::kShift), _mm512_set1_epi16(F::kKeep));
  }
  static Acc madd(Acc acc, V a, V b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  static __m256 half_sum(Acc a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
  static __m128 hsum4(Acc a0, Acc a1, Acc a2, Acc a3) {
    return hsum4_ps(half_sum(a0), half_sum(a1), half_sum(a2), half_sum(a3));
  }
  static float query(const float* x, int64_t n, int16_t* out) { return F::query(x, n, out); }
  static float weights(const float* x, int64_t n, float top, int16_t* out) { return F::weights(x, n, top, out); }
};
#endif
#endif

// The lanes a build reads codes C with: 512-bit where it has AVX-512 (and, for fp8, AVX512_BF16), else 256-bit.
template <KVCode C>
struct CodeLanesOf {
#if KVPAGE_ISA_AVX512BF16
  using type = Fp8Lanes512<C>;
#else
  using type = Fp8Lanes<C>;
#endif
};
template <>
struct CodeLanesOf<KVCode::kInt8> {
#if KVPAGE_ISA_AVX512
  using type = Int8Lanes512;
#else
  using type = Int8Lanes;
#endif
};
template <KVCode C>
using CodeLanes = typename CodeLanesOf<C>::type;

// The block kPrefetchAhead blocks ahead, fetched into L2 a few lines of K and V at a time by step(), called
// all through a block's work (scores, softmax, P.V): int8 work per byte is small, and a block's lines fetched
// at once fill the core's miss queue (on a Zen 3 at 64 x 8K keys: 1.35-1.45x bf16's time, against ~0.8x).
struct LineStream {
  BlockPrefetch<uint8_t> block;  // the block ahead: where its K and V rows lie, how many lines
  int64_t next = 0, per_step = 1;

  LineStream(const uint8_t* kcache, const uint8_t* vcache, const int64_t* table, int64_t block_size,
             int64_t block_stride, int64_t row_stride, int64_t t, int64_t k_begin, int64_t k_end, int64_t steps)
      : block(kcache, vcache, table, block_size, block_stride, row_stride, t, k_begin, k_end),
        per_step(std::max<int64_t>(1, (block.lines + steps - 1) / steps)) {}
  void step(int64_t count = 0) {
    const int64_t end = std::min(block.lines, next + (count > 0 ? count : per_step));
    for (; next < end; ++next) {
      _mm_prefetch(block.k + 64 * next, _MM_HINT_T1);
      _mm_prefetch(block.v + 64 * next, _MM_HINT_T1);
    }
  }
  void rest() { step(block.lines); }
};

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
  constexpr int KT = GT <= 2 ? 4 : GT == 3 ? 3 : 2;  // keys per pass: KT x GT accumulators stay in registers
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

// acc_g <- acc_g x corr_g + wscale_g x sum_i w_g,i codes_i for GT output rows (D apart) over n value rows from v;
// wq[g * ws + i] holds the 16-bit weight of token i (and a 0 after the last of an odd count).
template <class L, int GT, int64_t D>
inline void pv_rows(const int16_t* wq, int64_t ws, int64_t n, const uint8_t* v, int64_t row_stride, float* acc,
                    const float* corr, const float* wscale, LineStream& ls) {
  const int64_t full = n / 2;
  using V = typename L::V;
  for (int64_t c = 0; c < D; c += L::kW) {
    ls.step();
    typename L::Acc lo[GT], hi[GT];
    for (int g = 0; g < GT; ++g) lo[g] = hi[g] = L::zero();
    const uint8_t* vr = v + c;
    for (int64_t p = 0; p < full; ++p, vr += 2 * row_stride) {
      const V a = L::widen(vr), b = L::widen(vr + row_stride);
      // per 128-bit chunk k: x = dims 8k .. 8k + 3 and y = 8k + 4 .. 8k + 7, each as (token 2p, 2p + 1) pairs
      const V x = L::unlo(a, b), y = L::unhi(a, b);
      for (int g = 0; g < GT; ++g) {
        const V w = L::pair(wq + g * ws + 2 * p);
        lo[g] = L::madd(lo[g], x, w);
        hi[g] = L::madd(hi[g], y, w);
      }
    }
    if (n & 1) {
      const V a = L::widen(vr), z = L::zlanes();
      const V x = L::unlo(a, z), y = L::unhi(a, z);
      for (int g = 0; g < GT; ++g) {
        const V w = L::pair(wq + g * ws + 2 * full);
        lo[g] = L::madd(lo[g], x, w);
        hi[g] = L::madd(hi[g], y, w);
      }
    }
    for (int g = 0; g < GT; ++g) L::finish(lo[g], hi[g], acc + g * D + c, corr[g], wscale[g]);
  }
}

// attend_tile for quantized rows of codes C and head size D (a multiple of 16), the contract of attend_tile_quant:
// q pre-scaled float32 rows in the keys' rotated basis, rows r = j * H + head, row r sees keys <= pos0 + r / H
// and none before its window.
template <KVCode C, int64_t D>
void attend_tile_codes(const float* q, int64_t nq, int64_t H, int64_t G, const uint8_t* kcache,
                      const uint8_t* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                      int64_t kv_heads, int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m,
                      float* l, int64_t window) {
  using L = CodeLanes<C>;
  static_assert(D % L::kW == 0, "rows are read kW codes at a time");
  const int64_t head_stride = D + kScaleBytes, row_stride = kv_heads * head_stride;
  const int64_t R = nq * H, ws = block_size + 2;  // 16-bit weights per row: a block's tokens and a trailing 0
  thread_local std::vector<int16_t> q16, w16;
  thread_local std::vector<float> buf;
  q16.resize(static_cast<size_t>(R * D));
  w16.resize(static_cast<size_t>(G * ws));
  buf.resize(static_cast<size_t>(R + 2 * block_size + G * (block_size + 8) + 2 * G));
  float* qs = buf.data();          // the query rows' factors
  float* ks = qs + R;              // this block's key row scales (the current KV head)
  float* vs = ks + block_size;     // and its value row scales
  float* sc = vs + block_size;     // scores, then weights x value scales, of the head's G rows: [g][i]
  const int64_t ss = block_size + 8;
  float* corr = sc + G * ss;       // per row: the running max's correction
  float* wscale = corr + G;        // per row: the 16-bit weights' factor
  for (int64_t r = 0; r < R; ++r) qs[r] = L::query(q + r * D, D, q16.data() + r * D);
  reset_partials(acc, m, l, R, D);
  int64_t t = k_begin;
  while (t < k_end) {
    const int64_t off = t % block_size;
    const int64_t n = std::min(block_size - off, k_end - t);
    const int64_t phys = table[t / block_size];
    LineStream ls(kcache, vcache, table, block_size, block_stride, row_stride, t, k_begin, k_end,
                  kv_heads * (2 + G + n / 3 + D / L::kW));  // about the step() calls of this block
    for (int64_t h = 0; h < kv_heads; ++h) {
      ls.step();
      const uint8_t* kb = kcache + phys * block_stride + off * row_stride + h * head_stride;
      const uint8_t* vb = vcache + phys * block_stride + off * row_stride + h * head_stride;
      for (int64_t i = 0; i < n; ++i) {
        ks[i] = row_scale(kb + i * row_stride, D);
        vs[i] = row_scale(vb + i * row_stride, D);
      }
      ls.step();
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);  // keys after this query's position are masked
        const int64_t first = window_first(window, pos0 + j, t, n);  // and keys before its window
        if (visible <= first) continue;
        const int64_t r0 = j * H + h * G, cnt = visible - first;
#define KVPAGE_SCORE(gt) \
  score_rows<L, gt, D>(q16.data() + (r0 + g0) * D, qs + r0 + g0, kb, row_stride, first, visible, ks, sc + g0 * ss, ss, ls)
        KVPAGE_ROW_BATCHES(KVPAGE_SCORE)
#undef KVPAGE_SCORE
        for (int64_t g = 0; g < G; ++g) {
          ls.step();
          const int64_t r = r0 + g;
          float* s = sc + g * ss;
          __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
          int64_t i = first;
          for (; i + 8 <= visible; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
          float bmax = kvpage::hmax8(vmax);
          for (; i < visible; ++i) bmax = std::max(bmax, s[i]);
          const float new_m = std::max(m[r], bmax);
          corr[g] = exp_neg(m[r] - new_m);
          // weights exp(s - m), summed in float32; then times each value row's scale, kept in s
          const __m256 vm = _mm256_set1_ps(new_m);
          __m256 vsum = _mm256_setzero_ps(), umax = _mm256_setzero_ps();
          for (i = first; i + 8 <= visible; i += 8) {
            const __m256 w = kvpage::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
            vsum = _mm256_add_ps(vsum, w);
            const __m256 u = _mm256_mul_ps(w, _mm256_loadu_ps(vs + i));
            umax = _mm256_max_ps(umax, u);
            _mm256_storeu_ps(s + i, u);
          }
          float sum = kvpage::hsum8(vsum), top = kvpage::hmax8(umax);
          for (; i < visible; ++i) {
            const float w = exp_neg(s[i] - new_m);
            sum += w;
            s[i] = w * vs[i];
            top = std::max(top, s[i]);
          }
          l[r] = l[r] * corr[g] + sum;
          m[r] = new_m;
          int16_t* wq = w16.data() + g * ws;
          wscale[g] = L::weights(s + first, cnt, top, wq);
          if (cnt & 1) wq[cnt] = 0;
        }
#define KVPAGE_PV(gt) \
  pv_rows<L, gt, D>(w16.data() + g0 * ws, ws, cnt, vb + first * row_stride, row_stride, acc + (r0 + g0) * D, corr + g0, wscale + g0, ls)
        KVPAGE_ROW_BATCHES(KVPAGE_PV)
#undef KVPAGE_PV
      }
    }
    ls.rest();
    t += n;
  }
}
#endif

}  // namespace kvpage::attn
