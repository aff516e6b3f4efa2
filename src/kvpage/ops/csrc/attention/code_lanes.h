// How one-byte KV codes (int8, fp8 e4m3, fp8 e5m2) enter the quantized row loop's multiply-adds (quant_loop.h):
// the 16-bit lanes they widen to, the products they feed, and how the query rows and a block's weights are
// brought to the same lanes. 256-bit lanes on AVX2 builds (Int8Lanes, Fp8Lanes), 512-bit ones on AVX-512 builds
// (Int8Lanes512, Fp8Lanes512); CodeLanes<C> is the build's choice. quant_loop.h's head says what each code's
// arithmetic is and why it is exact enough.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "attention/quant_rows.h"

namespace kvpage::attn {

#if KVPAGE_ISA_AVX2
constexpr float kI16Max = 32767.f;
constexpr float kU16Max = 65535.f;

// Two int16 weights (tokens i, i + 1) as one 32-bit word, which the lanes' pair() puts in every 32-bit lane,
// as madd pairs them with interleaved codes.
inline int32_t pair_bits(const int16_t* w) {
  int32_t x;
  std::memcpy(&x, w, sizeof(x));
  return x;
}

// x (n floats) -> int16 codes with x ~= code x scale; returns the scale (0 for a zero row). Eight lanes at a time
// (a scalar tail), as every task quantizes its query rows with it.
inline float quantize_i16(const float* x, int16_t* out, int64_t n) {
  const int64_t n8 = n - n % 8;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps();
  for (int64_t d = 0; d < n8; d += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(x + d), abs_mask));
  float amax = kvpage::hmax8(top);
  for (int64_t d = n8; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float inv = amax > 0.f ? kI16Max / amax : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(kI16Max), lo = _mm256_set1_ps(-kI16Max);
  for (int64_t d = 0; d < n8; d += 8) {
    const __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(x + d), vinv)));
    const __m256i c = _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d),
                     _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
  }
  for (int64_t d = n8; d < n; ++d)
    out[d] = static_cast<int16_t>(std::nearbyint(std::min(kI16Max, std::max(-kI16Max, x[d] * inv))));
  return amax / kI16Max;
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

// Eight floats -> their bf16 bits, rounded to nearest even.
inline __m128i bf16_bits8(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i r = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)));
  const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(b, r), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// x (n floats, n a multiple of 8) times `lift` -> bf16 bits at out, rounded to nearest even.
inline void to_bf16_lifted(const float* x, int64_t n, float lift, int16_t* out) {
  const __m256 vl = _mm256_set1_ps(lift);
  for (int64_t k = 0; k < n; k += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), bf16_bits8(_mm256_mul_ps(_mm256_loadu_ps(x + k), vl)));
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
  // Weights x value scales (>= 0, at most `top`) -> 16-bit lanes, 8 at a time or one: u x inv rounded, with
  // inv = weight_inv(top), less 32768 (kWeightOffset): a weight uses all 16 bits of its lane, not the 15 of
  // the non-negative half, and P.V adds 32768 x the codes' sum back (pv_rows); the lanes' sums times
  // weight_factor(top) are the products' sums. Half the rounding of 15-bit weights: what lets a softmax step
  // span 64 keys (quant_loop.h, kUnitKeys) at the precision 15-bit weights had over 16.
  static constexpr int32_t kWeightOffset = 32768;
  static constexpr int64_t kUnitKeys = 64;  // keys per softmax step (quant_loop.h)
  static __m256i add16(__m256i a, __m256i b) { return _mm256_add_epi16(a, b); }
  static Acc add32(Acc a, Acc b) { return _mm256_add_epi32(a, b); }
  // 16-bit lanes of codes' sums, in (token 2p, 2p + 1) pairs as pv_rows' x / y -> kWeightOffset x each pair's
  // total, in the layout of its int32 sums
  static Acc offset_sums(__m256i s) {
    static_assert(kWeightOffset == 1 << 15, "the offset is applied as a shift");
    return _mm256_slli_epi32(_mm256_madd_epi16(s, _mm256_set1_epi16(1)), 15);
  }
  static __m128i weights8(__m256 u, __m256 inv) {
    const __m256i c32 = _mm256_sub_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(u, inv)), _mm256_set1_epi32(kWeightOffset));
    return _mm_packs_epi32(_mm256_castsi256_si128(c32), _mm256_extracti128_si256(c32, 1));
  }
  static int16_t weight1(float u, float inv) {
    return static_cast<int16_t>(static_cast<int32_t>(std::nearbyint(std::min(kU16Max, u * inv))) - kWeightOffset);
  }
  static float weight_inv(float top) { return top > 0.f ? kU16Max / top : 0.f; }
  static float weight_factor(float top) { return top / kU16Max; }
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
  // As Int8Lanes': bf16 lanes of the lifted products, whatever their bound.
  static __m128i weights8(__m256 u, __m256 lift) { return bf16_bits8(_mm256_mul_ps(u, lift)); }
  static int16_t weight1(float u, float lift) { return static_cast<int16_t>(c10::BFloat16(u * lift).x); }
  static float weight_inv(float) { return kLift; }
  static float weight_factor(float) { return kCode / kLift; }
  static constexpr int32_t kWeightOffset = 0;
  static constexpr int64_t kUnitKeys = 64;  // bf16 weights keep their relative precision however small
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
  // The four totals of a0..a3 (sixteen lanes each), lane k = a_k's: neighbours' lanes interleaved and added
  // twice, then the four 128-bit chunks folded (11 instructions, where halving to 256 bits and hadd took ~19).
  static __m128i hsum4_epi32(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    const __m256i y = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
  }
  static __m128 hsum4_ps(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512d t0d = _mm512_castps_pd(t0), t1d = _mm512_castps_pd(t1);
    const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(t0d, t1d)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(t0d, t1d)));
    const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(u),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
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
  static __m128 hsum4(Acc a0, Acc a1, Acc a2, Acc a3) { return _mm_cvtepi32_ps(hsum4_epi32(a0, a1, a2, a3)); }
  static void finish(Acc lo, Acc hi, float* a, float corr, float wscale) {
    Lanes512::finish(_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi), a, corr, wscale);
  }
  static float query(const float* x, int64_t n, int16_t* out) { return Int8Lanes::query(x, n, out); }
  // Sixteen weights x value scales (u x inv <= 32767) -> their 16-bit lanes; inv and the sum's factor are the
  // block's: weight_inv / weight_factor of the largest value scale it has (a weight is at most 1). 15 bits, no
  // offset: these loops take 16 keys per softmax step.
  static constexpr int32_t kWeightOffset = 0;
  static constexpr int64_t kUnitKeys = 16;
  static __m256i weights16(__m512 u, __m512 inv) { return _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(u, inv))); }
  static float weight_inv(float top) { return top > 0.f ? kI16Max / top : 0.f; }
  static float weight_factor(float top) { return top / kI16Max; }
};

#if KVPAGE_ISA_AVX512BF16
template <KVCode C>
struct Fp8Lanes512 : Lanes512 {
  using F = Fp8Lanes<C>;
  using Acc = __m512;
  using V = __m512i;
  static constexpr int64_t kW = 32;
  static Acc zero() { return _mm512_setzero_ps(); }
  // 32 codes -> their bf16 lanes (the code's value x 2^-120 or 2^-112); the AMX fp8 kernel widens them too
  static V widen_codes(__m256i codes) {
    return _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(codes), F::kShift), _mm512_set1_epi16(F::kKeep));
  }
  static V widen(const uint8_t* p) { return widen_codes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Acc madd(Acc acc, V a, V b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  static __m128 hsum4(Acc a0, Acc a1, Acc a2, Acc a3) { return hsum4_ps(a0, a1, a2, a3); }
  static float query(const float* x, int64_t n, int16_t* out) { return F::query(x, n, out); }
  // As Int8Lanes512's: bf16 lanes (rounded to nearest even) of the lifted products, whatever the block's scales.
  static __m256i weights16(__m512 u, __m512 lift) { return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(u, lift)); }
  static float weight_inv(float top) { return F::weight_inv(top); }
  static float weight_factor(float top) { return F::weight_factor(top); }
  static constexpr int32_t kWeightOffset = 0;
  static constexpr int64_t kUnitKeys = 16;
};
#endif
#endif

// Keys per channel (channel_keys.h) enter the int8 lanes as their codes less 128 (the top bit flipped, then
// widened with its sign: -128..127), against the query times each channel's step in int16 lanes; the 128 steps
// go to the block's q . (zero point + 128 x step). Centred, a code's share of the query's int16 rounding is half
// what 0..255 would carry.
struct ChannelKeyLanes : Int8Lanes {
  static __m256i widen(const uint8_t* p) { return _mm256_cvtepi8_epi16(_mm_xor_si128(load16(p), _mm_set1_epi8(-128))); }
};
#if KVPAGE_ISA_AVX512
struct ChannelKeyLanes512 : Int8Lanes512 {
  static V widen(const uint8_t* p) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_cvtepi8_epi16(_mm256_xor_si256(c, _mm256_set1_epi8(-128)));
  }
};
using ChannelLanes = ChannelKeyLanes512;
#else
using ChannelLanes = ChannelKeyLanes;
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
#endif

}  // namespace kvpage::attn
