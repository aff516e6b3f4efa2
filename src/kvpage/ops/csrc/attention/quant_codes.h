// One-byte KV codes (int8, fp8 e4m3, fp8 e5m2): what a code is worth, and how a row of values becomes codes
// and its bfloat16 scale (value = code x scale; attention/kv_quant.py is the torch oracle). Scalar here, and a
// row 16 lanes at a time on AVX-512 builds or 8 on AVX2 ones for head sizes that are powers of two (the
// quantizing write, quant_rows.h quantize_row, picks them).
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

#if KVPAGE_ISA_AVX512
// quantize_row's arithmetic 16 lanes at a time, the same operations on every value in the same order (so the
// same codes, byte for byte): the butterflies of fwht stage by stage, the division by the scale, and the
// codes as torch rounds them (int8: to nearest even; fp8: c10's fp8e4m3fn / fp8e5m2_from_fp32_value, their
// subnormal and normal branches blended). At 256 tokens x 3 KV heads x 64 dims the scalar write took 108 us
// (int8) and 166 us (fp8_e4m3) per layer, ~3-5% of an offline decode step over 30 layers.
template <int H>
inline __m512 butterfly_lanes(__m512 x) {  // lanes H apart within blocks of 2H: lo + hi below, lo - hi above
  const __m512i partner =
      _mm512_xor_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(H));
  constexpr __mmask16 upper = H == 1 ? 0xAAAA : H == 2 ? 0xCCCC : H == 4 ? 0xF0F0 : 0xFF00;
  const __m512 p = _mm512_permutexvar_ps(partner, x);
  return _mm512_mask_sub_ps(_mm512_add_ps(x, p), upper, p, x);
}

template <KVCode C>
inline __m128i encode16(__m512 v) {
  v = _mm512_min_ps(_mm512_set1_ps(code_max<C>()), _mm512_max_ps(_mm512_set1_ps(-code_max<C>()), v));
  if constexpr (C == KVCode::kInt8) {
    return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));  // MXCSR's default: to nearest even, as nearbyint
  } else {
    constexpr bool e4 = C == KVCode::kE4M3;
    constexpr uint32_t kSmall = (e4 ? 121u : 113u) << 23, kDenorm = (e4 ? 141u : 134u) << 23;
    constexpr int kShift = e4 ? 20 : 21;
    constexpr uint32_t kBias = (static_cast<uint32_t>(e4 ? 7 - 127 : 15 - 127) << 23) + (e4 ? 0x7FFFFu : 0xFFFFFu);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    const __m512i a = _mm512_xor_si512(bits, sign);
    const __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(_mm512_set1_epi32(kDenorm)))),
        _mm512_set1_epi32(kDenorm));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, kShift), _mm512_set1_epi32(1));
    __m512i norm = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int>(kBias))), odd), kShift);
    norm = _mm512_and_si512(norm, _mm512_set1_epi32(0xFF));
    if constexpr (e4) norm = _mm512_min_epu32(norm, _mm512_set1_epi32(0x7E));  // a carry into NaN saturates
    const __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(kSmall)));
    const __m512i code = _mm512_mask_blend_epi32(small, norm, _mm512_and_si512(sub, _mm512_set1_epi32(0xFF)));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(code, _mm512_srli_epi32(sign, 24)));
  }
}

// quantize_row for D a power of two from 16 to 256 (fwht's block is the whole row).
template <KVCode C, typename IN>
inline void quantize_row16(const IN* src, uint8_t* row, int64_t D, bool rotate) {
  __m512 x[16];
  const int64_t n = D / 16;
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<IN, float>) {
      x[i] = _mm512_loadu_ps(src + 16 * i);
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * i));
      x[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
  if (rotate) {
    for (int64_t i = 0; i < n; ++i) x[i] = butterfly_lanes<8>(butterfly_lanes<4>(butterfly_lanes<2>(butterfly_lanes<1>(x[i]))));
    for (int64_t h = 1; h < n; h *= 2)
      for (int64_t g = 0; g < n; g += 2 * h)
        for (int64_t j = g; j < g + h; ++j) {
          const __m512 lo = x[j], hi = x[j + h];
          x[j] = _mm512_add_ps(lo, hi);
          x[j + h] = _mm512_sub_ps(lo, hi);
        }
    const __m512 norm = _mm512_set1_ps(static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))));
    for (int64_t i = 0; i < n; ++i) x[i] = _mm512_mul_ps(x[i], norm);
  }
  __m512 top = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) top = _mm512_max_ps(top, _mm512_abs_ps(x[i]));
  const uint16_t bits = scale_bits<C>(_mm512_reduce_max_ps(top));
  const uint32_t up = static_cast<uint32_t>(bits) << 16;
  float s;
  std::memcpy(&s, &up, sizeof(s));
  const __m512 vs = _mm512_set1_ps(s);
  for (int64_t i = 0; i < n; ++i) {
    const __m512 v = s > 0.f ? _mm512_div_ps(x[i], vs) : _mm512_setzero_ps();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 16 * i), encode16<C>(v));
  }
  std::memcpy(row + D, &bits, sizeof(bits));
}
#endif

#if KVPAGE_ISA_AVX2_ONLY
// The same 8 lanes at a time on AVX2 builds (the same operations, so the same bytes).
template <int H>
inline __m256 butterfly_lanes8(__m256 x) {
  const __m256i partner = _mm256_xor_si256(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(H));
  const __m256 p = _mm256_permutevar8x32_ps(x, partner);
  return _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), H == 1 ? 0xAA : H == 2 ? 0xCC : 0xF0);
}

template <KVCode C>
inline int64_t encode8(__m256 v) {  // eight codes, byte k = lane k
  v = _mm256_min_ps(_mm256_set1_ps(code_max<C>()), _mm256_max_ps(_mm256_set1_ps(-code_max<C>()), v));
  __m128i b;
  if constexpr (C == KVCode::kInt8) {
    const __m256i i = _mm256_cvtps_epi32(v);  // to nearest even; within +-127, so the packs never saturate
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    b = _mm_packs_epi16(w, w);
  } else {
    constexpr bool e4 = C == KVCode::kE4M3;
    constexpr uint32_t kSmall = (e4 ? 121u : 113u) << 23, kDenorm = (e4 ? 141u : 134u) << 23;
    constexpr int kShift = e4 ? 20 : 21;
    constexpr uint32_t kBias = (static_cast<uint32_t>(e4 ? 7 - 127 : 15 - 127) << 23) + (e4 ? 0x7FFFFu : 0xFFFFFu);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    const __m256i a = _mm256_xor_si256(bits, sign);  // below 2^31: signed compares order it
    const __m256i sub = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(_mm256_set1_epi32(kDenorm)))),
        _mm256_set1_epi32(kDenorm));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, kShift), _mm256_set1_epi32(1));
    __m256i norm = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(static_cast<int>(kBias))), odd), kShift);
    norm = _mm256_and_si256(norm, _mm256_set1_epi32(0xFF));
    if constexpr (e4) norm = _mm256_min_epu32(norm, _mm256_set1_epi32(0x7E));
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(kSmall)), a);
    const __m256i code = _mm256_or_si256(
        _mm256_blendv_epi8(norm, _mm256_and_si256(sub, _mm256_set1_epi32(0xFF)), small), _mm256_srli_epi32(sign, 24));
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    b = _mm_packus_epi16(w, w);
  }
  return _mm_cvtsi128_si64(b);
}

// quantize_row for D a power of two from 8 to 256.
template <KVCode C, typename IN>
inline void quantize_row8(const IN* src, uint8_t* row, int64_t D, bool rotate) {
  __m256 x[32];
  const int64_t n = D / 8;
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<IN, float>) {
      x[i] = _mm256_loadu_ps(src + 8 * i);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8 * i));
      x[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
  if (rotate) {
    for (int64_t i = 0; i < n; ++i) x[i] = butterfly_lanes8<4>(butterfly_lanes8<2>(butterfly_lanes8<1>(x[i])));
    for (int64_t h = 1; h < n; h *= 2)
      for (int64_t g = 0; g < n; g += 2 * h)
        for (int64_t j = g; j < g + h; ++j) {
          const __m256 lo = x[j], hi = x[j + h];
          x[j] = _mm256_add_ps(lo, hi);
          x[j + h] = _mm256_sub_ps(lo, hi);
        }
    const __m256 norm = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))));
    for (int64_t i = 0; i < n; ++i) x[i] = _mm256_mul_ps(x[i], norm);
  }
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) top = _mm256_max_ps(top, _mm256_and_ps(x[i], magnitude));
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  t = _mm_max_ss(t, _mm_movehdup_ps(t));
  const uint16_t bits = scale_bits<C>(_mm_cvtss_f32(t));
  const uint32_t up = static_cast<uint32_t>(bits) << 16;
  float s;
  std::memcpy(&s, &up, sizeof(s));
  const __m256 vs = _mm256_set1_ps(s);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t codes = encode8<C>(s > 0.f ? _mm256_div_ps(x[i], vs) : _mm256_setzero_ps());
    std::memcpy(row + 8 * i, &codes, sizeof(codes));
  }
  std::memcpy(row + D, &bits, sizeof(bits));
}
#endif

}  // namespace kvpage::attn
