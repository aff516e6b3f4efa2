// One-byte KV codes (int8, fp8 e4m3, fp8 e5m2): what a code is worth, and how a row of values becomes codes
// and its bfloat16 scale (value = code x scale; attention/kv_quant.py is the torch oracle). Scalar here, and a
// row 16 lanes at a time on AVX-512 builds or 8 on AVX2 ones for head sizes that are powers of two (the
// quantizing write, quant_rows.h quantize_row, picks them).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "isa.h"

namespace kvpage::attn {

enum class KVCode { kInt8, kE4M3, kE5M2 };

constexpr int64_t kScaleBytes = 2;

template <KVCode C>
constexpr float code_max() {
  return C == KVCode::kInt8 ? 127.f : C == KVCode::kE4M3 ? 448.f : 57344.f;
}

template <KVCode C>
inline float decode1(uint8_t x) {
  if constexpr (C == KVCode::kInt8) return static_cast<float>(static_cast<int8_t>(x));
  else if constexpr (C == KVCode::kE4M3) return static_cast<float>(c10::Float8_e4m3fn(x, c10::Float8_e4m3fn::from_bits()));
  else return static_cast<float>(c10::Float8_e5m2(x, c10::Float8_e5m2::from_bits()));
}

// Code of v (already divided by the row's scale), rounded to nearest even and clamped, as torch rounds it.
template <KVCode C>
inline uint8_t encode1(float v) {
  v = std::min(code_max<C>(), std::max(-code_max<C>(), v));
  if constexpr (C == KVCode::kInt8) return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(v)));
  else if constexpr (C == KVCode::kE4M3) return c10::Float8_e4m3fn(v).x;
  else return c10::Float8_e5m2(v).x;
}

// The bfloat16 scale of a row whose largest magnitude is amax: amax / code max rounded up (its bits).
template <KVCode C>
inline uint16_t scale_bits(float amax) {
  const float raw = amax / code_max<C>();
  uint32_t f;
  std::memcpy(&f, &raw, sizeof(f));
  return static_cast<uint16_t>((f + 0xFFFFu) >> 16);
}

// The float a scale's bfloat16 bits stand for.
inline float scale_value(uint16_t bits) {
  const uint32_t up = static_cast<uint32_t>(bits) << 16;
  float s;
  std::memcpy(&s, &up, sizeof(s));
  return s;
}

#if KVPAGE_ISA_AVX2
// quantize_row's arithmetic a vector of lanes at a time, the same operations on every value in the same order (so
// the same codes, byte for byte): the butterflies of fwht stage by stage, the division by the scale, and the
// codes as torch rounds them (int8: to nearest even; fp8: c10's fp8e4m3fn / fp8e5m2_from_fp32_value, their
// subnormal and normal branches blended). At 256 tokens x 3 KV heads x 64 dims the scalar write took 108 us
// (int8) and 166 us (fp8_e4m3) per layer on the AMX Xeon, ~3-5% of an offline decode step over 30 layers; 16
// lanes took 25 and 40 us. The lanes: RowLanes8 (AVX2), RowLanes16 (AVX-512).
struct RowLanes8 {
  using F = __m256;
  using I = __m256i;
  static constexpr int kW = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const at::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void store(at::BFloat16* p, F x) {  // rounded to nearest even, as torch rounds
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  static F set(float x) { return _mm256_set1_ps(x); }
  static I seti(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F abs(F x) { return _mm256_and_ps(x, _mm256_castsi256_ps(seti(0x7FFFFFFFu))); }
  static float hmax(F x) {
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  }
  static I bits(F x) { return _mm256_castps_si256(x); }
  static F floats(I x) { return _mm256_castsi256_ps(x); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I iand(I a, I b) { return _mm256_and_si256(a, b); }
  static I ior(I a, I b) { return _mm256_or_si256(a, b); }
  static I ixor(I a, I b) { return _mm256_xor_si256(a, b); }
  template <int K>
  static I srl(I a) { return _mm256_srli_epi32(a, K); }
  static I umin(I a, I b) { return _mm256_min_epu32(a, b); }
  static I round(F x) { return _mm256_cvtps_epi32(x); }  // MXCSR's default: to nearest even, as nearbyint
  static F tofloat(I x) { return _mm256_cvtepi32_ps(x); }
  // where a < b (both below 2^31: a signed compare orders them) y, else x
  static I select_below(I a, I b, I x, I y) { return _mm256_blendv_epi8(x, y, _mm256_cmpgt_epi32(b, a)); }
  // lanes H apart within blocks of 2H: lo + hi below, lo - hi above
  template <int H>
  static F butterfly(F x) {
    const __m256i partner = _mm256_xor_si256(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(H));
    const __m256 p = _mm256_permutevar8x32_ps(x, partner);
    return _mm256_blend_ps(add(x, p), sub(p, x), H == 1 ? 0xAA : H == 2 ? 0xCC : 0xF0);
  }
  // codes in the low byte of each lane (int8 within +-127, fp8 0..255: the packs never saturate) -> 8 bytes
  // table[code] for 8 one-byte codes
  static F gather(const float* table, const uint8_t* codes) {
    return _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))), 4);
  }
  static void store_codes(I c, bool is_signed, uint8_t* out) {
    const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
    const __m128i w = is_signed ? _mm_packs_epi32(lo, hi) : _mm_packus_epi32(lo, hi);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), is_signed ? _mm_packs_epi16(w, w) : _mm_packus_epi16(w, w));
  }
};

#if KVPAGE_ISA_AVX512
struct RowLanes16 {
  using F = __m512;
  using I = __m512i;
  static constexpr int kW = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const at::BFloat16* p) { return kvpage::load16(p, 0xFFFF); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void store(at::BFloat16* p, F x) { kvpage::store16(p, x, 0xFFFF); }
  static F set(float x) { return _mm512_set1_ps(x); }
  static I seti(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F abs(F x) { return _mm512_abs_ps(x); }
  static float hmax(F x) { return _mm512_reduce_max_ps(x); }
  static I bits(F x) { return _mm512_castps_si512(x); }
  static F floats(I x) { return _mm512_castsi512_ps(x); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I iand(I a, I b) { return _mm512_and_si512(a, b); }
  static I ior(I a, I b) { return _mm512_or_si512(a, b); }
  static I ixor(I a, I b) { return _mm512_xor_si512(a, b); }
  template <int K>
  static I srl(I a) { return _mm512_srli_epi32(a, K); }
  static I umin(I a, I b) { return _mm512_min_epu32(a, b); }
  static I round(F x) { return _mm512_cvtps_epi32(x); }
  static F tofloat(I x) { return _mm512_cvtepi32_ps(x); }
  static I select_below(I a, I b, I x, I y) { return _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, b), x, y); }
  template <int H>
  static F butterfly(F x) {
    const __m512i partner = _mm512_xor_si512(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(H));
    constexpr __mmask16 upper = H == 1 ? 0xAAAA : H == 2 ? 0xCCCC : H == 4 ? 0xF0F0 : 0xFF00;
    const __m512 p = _mm512_permutexvar_ps(partner, x);
    return _mm512_mask_sub_ps(add(x, p), upper, p, x);
  }
  static F gather(const float* table, const uint8_t* codes) {
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))), table, 4);
  }
  static void store_codes(I c, bool, uint8_t* out) {  // the low byte of each lane, whatever its sign
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(c));
  }
};
#endif

// kW codes of values v (already divided by the row's scale) into out.
template <class V, KVCode C>
inline void encode_lanes(typename V::F v, uint8_t* out) {
  v = V::min(V::set(code_max<C>()), V::max(V::set(-code_max<C>()), v));
  if constexpr (C == KVCode::kInt8) {
    V::store_codes(V::round(v), true, out);
  } else {
    constexpr bool e4 = C == KVCode::kE4M3;
    constexpr uint32_t kSmall = (e4 ? 121u : 113u) << 23, kDenorm = (e4 ? 141u : 134u) << 23;
    constexpr int kShift = e4 ? 20 : 21;
    constexpr uint32_t kBias = (static_cast<uint32_t>(e4 ? 7 - 127 : 15 - 127) << 23) + (e4 ? 0x7FFFFu : 0xFFFFFu);
    const typename V::I sign = V::iand(V::bits(v), V::seti(0x80000000u));
    const typename V::I a = V::ixor(V::bits(v), sign);
    // below the normal range: the magnitude plus 2^(kDenorm) as a float, less its bits
    const typename V::I sub = V::isub(V::bits(V::add(V::floats(a), V::floats(V::seti(kDenorm)))), V::seti(kDenorm));
    // normal: the exponent rebiased and the mantissa rounded to nearest even
    const typename V::I odd = V::iand(V::template srl<kShift>(a), V::seti(1));
    typename V::I norm = V::iand(V::template srl<kShift>(V::iadd(V::iadd(a, V::seti(kBias)), odd)), V::seti(0xFF));
    if constexpr (e4) norm = V::umin(norm, V::seti(0x7E));  // a carry into NaN's pattern saturates
    const typename V::I code = V::select_below(a, V::seti(kSmall), norm, V::iand(sub, V::seti(0xFF)));
    V::store_codes(V::ior(code, V::template srl<24>(sign)), false, out);
  }
}

// fwht (quant_rows.h) on a row of D = n * kW values held in n vectors, D a power of two: the butterflies stage by
// stage (within each vector, then across vectors), then the orthonormal factor, as the scalar loop adds them.
template <class V>
inline void fwht_lanes(typename V::F* x, int64_t n) {
  using F = typename V::F;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = V::template butterfly<4>(V::template butterfly<2>(V::template butterfly<1>(x[i])));
    if constexpr (V::kW == 16) x[i] = V::template butterfly<8>(x[i]);
  }
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t g = 0; g < n; g += 2 * h)
      for (int64_t j = g; j < g + h; ++j) {
        const F lo = x[j], hi = x[j + h];
        x[j] = V::add(lo, hi);
        x[j + h] = V::sub(lo, hi);
      }
  const F norm = V::set(static_cast<float>(1.0 / std::sqrt(static_cast<double>(n * V::kW))));
  for (int64_t i = 0; i < n; ++i) x[i] = V::mul(x[i], norm);
}

// quantize_row for D a power of two from kW to 256 (fwht's block is the whole row).
template <class V, KVCode C, typename IN>
inline void quantize_row_lanes(const IN* src, uint8_t* row, int64_t D, bool rotate) {
  using F = typename V::F;
  F x[256 / V::kW];
  const int64_t n = D / V::kW;
  for (int64_t i = 0; i < n; ++i) x[i] = V::load(src + V::kW * i);
  if (rotate) fwht_lanes<V>(x, n);
  F top = V::set(0.f);
  for (int64_t i = 0; i < n; ++i) top = V::max(top, V::abs(x[i]));
  const uint16_t bits = scale_bits<C>(V::hmax(top));
  const float s = scale_value(bits);
  const F vs = V::set(s);
  for (int64_t i = 0; i < n; ++i) encode_lanes<V, C>(s > 0.f ? V::div(x[i], vs) : V::set(0.f), row + V::kW * i);
  std::memcpy(row + D, &bits, sizeof(bits));
}

// The lanes the row write takes on this build.
#if KVPAGE_ISA_AVX512
using RowLanes = RowLanes16;
#else
using RowLanes = RowLanes8;
#endif
#endif

}  // namespace kvpage::attn
