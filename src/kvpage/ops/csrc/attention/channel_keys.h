// int8 pages whose keys are rounded per channel over a complete block (attention/kv_channel.py is the torch
// oracle, and says why): one block of one layer is, for every KV head in turn, n x D key codes (token-major),
// D zero codes (int8), D step codes (uint8) and two bfloat16 units, then the block's values as int8 rows
// [n, heads, D + 2] (quant_rows.h). A block of the residual-key group (kv/residual.py) holds instead its
// sequence's unrounded keys, bfloat16 [n, heads, D], at the start of the same bytes.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa.h"

namespace kvpage::attn {

// One head's keys of one block: codes, zero codes, step codes, units.
inline int64_t channel_block_bytes(int64_t n, int64_t D) { return n * D + 2 * D + 4; }
// One block of one layer: every head's keys, then the value rows.
inline int64_t channel_page_bytes(int64_t n, int64_t heads, int64_t D) {
  return heads * (channel_block_bytes(n, D) + n * (D + 2));
}

inline uint16_t bf16_bits(float x) { return c10::BFloat16(x).x; }  // rounded to nearest even, as torch rounds
inline float bf16_float(uint16_t bits) {
  const uint32_t f = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &f, sizeof(x));
  return x;
}

constexpr float kChannelWiden = 1.f + 0x1p-7f;  // past bf16's rounding of a unit (kv_channel._WIDEN)
constexpr float kChannelTiny = 1e-30f;

// The zero point and step of every channel of a head's block, from its stored bytes (kv_channel._params): what
// the writer rounds with and every reader dequantizes with (eight channels at a time on AVX2 builds, the same
// float32 operations: dividing by 256 and multiplying by 1/256 round alike).
inline void channel_params(const uint8_t* head_block, int64_t n, int64_t D, float* zero, float* step) {
  const uint8_t* zc = head_block + n * D;
  const uint8_t* sc = zc + D;
  uint16_t units[2];
  std::memcpy(units, sc + D, sizeof(units));
  const float unit = std::max(bf16_float(units[0]), kChannelTiny) / 127.f;
  const float largest = std::max(bf16_float(units[1]), kChannelTiny) * kChannelWiden;
  int64_t d = 0;
#if KVPAGE_ISA_AVX2
  const __m256 vu = _mm256_set1_ps(unit), vl = _mm256_set1_ps(largest);
  const __m256 one = _mm256_set1_ps(1.f), inv256 = _mm256_set1_ps(1.f / 256.f);
  for (; d + 8 <= D; d += 8) {
    const __m128i z8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zc + d));
    const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + d));
    _mm256_storeu_ps(zero + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(z8)), vu));
    const __m256 c = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s8)), one);
    _mm256_storeu_ps(step + d, _mm256_mul_ps(_mm256_mul_ps(vl, c), inv256));
  }
#endif
  for (; d < D; ++d) {
    zero[d] = static_cast<float>(static_cast<int8_t>(zc[d])) * unit;
    step[d] = largest * (static_cast<float>(sc[d]) + 1.f) / 256.f;
  }
}

// n keys of one head (rows of D floats, `stride` apart) -> the head's block bytes, byte for byte what
// kv_channel.to_bytes(quantize_block_keys(...)) gives: the same float32 operations in the same order (no fused
// multiply-add may merge two of them, hence fp-contract off). `lo`, `hi`: scratch of D floats each.
__attribute__((optimize("fp-contract=off"))) inline void round_channel_block(const float* x, int64_t stride,
                                                                             int64_t n, int64_t D, uint8_t* out,
                                                                             float* lo, float* hi) {
  for (int64_t d = 0; d < D; ++d) {
    lo[d] = std::numeric_limits<float>::infinity();
    hi[d] = -std::numeric_limits<float>::infinity();
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) {
      lo[d] = std::min(lo[d], x[i * stride + d]);
      hi[d] = std::max(hi[d], x[i * stride + d]);
    }
  float low = 0.f;
  for (int64_t d = 0; d < D; ++d) low = std::max(low, std::fabs(lo[d]));
  const uint16_t zero_unit = bf16_bits(low * kChannelWiden);
  const float unit = std::max(bf16_float(zero_unit), kChannelTiny) / 127.f;
  uint8_t* zc = out + n * D;
  uint8_t* sc = zc + D;
  float widest = -std::numeric_limits<float>::infinity();
  for (int64_t d = 0; d < D; ++d) {
    const float z = std::min(127.f, std::max(-127.f, std::floor(lo[d] / unit)));
    zc[d] = static_cast<uint8_t>(static_cast<int8_t>(z));
    hi[d] = hi[d] - z * unit;  // the channel's span above its zero point
    widest = std::max(widest, hi[d]);
  }
  const uint16_t step_unit = bf16_bits(widest / 255.f);
  const float largest = std::max(bf16_float(step_unit), kChannelTiny) * kChannelWiden;
  for (int64_t d = 0; d < D; ++d) {
    const float m = std::min(256.f, std::max(1.f, std::ceil(hi[d] / 255.f / largest * 256.f)));
    sc[d] = static_cast<uint8_t>(static_cast<int>(m) - 1);
  }
  const uint16_t units[2] = {zero_unit, step_unit};
  std::memcpy(sc + D, units, sizeof(units));
  channel_params(out, n, D, lo, hi);  // lo, hi <- each channel's zero point and step, as readers see them
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) {
      const float c = std::nearbyint((x[i * stride + d] - lo[d]) / hi[d]);
      out[i * D + d] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, c)));
    }
}

}  // namespace kvpage::attn
