// A row of logits limited to the tokens its mask allows (structured outputs, allowed ids, blocked ids): the
// logits pass (fused_ops.cpp logits_draw) applies it to a finished row before the row's draw. Header-only so that
// the AVX2-only harness (tests/helpers/csrc/avx2_write.cpp) builds the 8-lane path on AVX-512 machines too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "isa.h"

namespace kvpage::sampling {

// Entries of x[V] whose bit in `allowed` is clear set to -inf (bit j of word i: token 32 i + j may come next;
// tokens at or past 32 * words are never allowed). Returns the first index of the largest allowed entry (NaN
// never counts), -1 when nothing is allowed. Each lane keeps its own running maximum and the index where it
// first reached it; the lanes are folded once at the end (the smallest index among equal maxima).
inline int64_t mask_row(float* x, int64_t V, const int32_t* allowed, int64_t words) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t covered = std::min(V, words * 32);
  float best = kNegInf;
  int64_t at = -1;
  int64_t v = 0;
  auto fold = [&](const float* mv, const int32_t* iv, int lanes) {
    for (int l = 0; l < lanes; ++l)
      if (iv[l] >= 0 && (mv[l] > best || (mv[l] == best && iv[l] < at))) best = mv[l], at = iv[l];
  };
#if KVPAGE_ISA_AVX512
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 mx = ninf;
  __m512i ix = _mm512_set1_epi32(-1);
  for (; v + 16 <= covered; v += 16) {
    const auto keep = static_cast<__mmask16>(static_cast<uint32_t>(allowed[v >> 5]) >> (v & 31));
    const __m512 m = _mm512_mask_mov_ps(ninf, keep, _mm512_loadu_ps(x + v));
    _mm512_storeu_ps(x + v, m);
    const __mmask16 up = _mm512_cmp_ps_mask(m, mx, _CMP_GT_OQ);
    mx = _mm512_mask_mov_ps(mx, up, m);
    ix = _mm512_mask_mov_epi32(ix, up, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(v))));
  }
  alignas(64) float mv[16];
  alignas(64) int32_t iv[16];
  _mm512_store_ps(mv, mx);
  _mm512_store_si512(iv, ix);
  fold(mv, iv, 16);
#elif KVPAGE_ISA_AVX2
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 mx = ninf;
  __m256i ix = _mm256_set1_epi32(-1);
  for (; v + 8 <= covered; v += 8) {
    const auto byte = static_cast<int32_t>((static_cast<uint32_t>(allowed[v >> 5]) >> (v & 31)) & 0xFFu);
    const __m256i keep = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(byte), bit), bit);
    const __m256 m = _mm256_blendv_ps(ninf, _mm256_loadu_ps(x + v), _mm256_castsi256_ps(keep));
    _mm256_storeu_ps(x + v, m);
    const __m256 up = _mm256_cmp_ps(m, mx, _CMP_GT_OQ);
    mx = _mm256_blendv_ps(mx, m, up);
    const __m256i here = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(v)));
    ix = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(ix), _mm256_castsi256_ps(here), up));
  }
  alignas(32) float mv[8];
  alignas(32) int32_t iv[8];
  _mm256_store_ps(mv, mx);
  _mm256_store_si256(reinterpret_cast<__m256i*>(iv), ix);
  fold(mv, iv, 8);
#endif
  for (; v < covered; ++v) {  // the rest (all of it without vectors), after every vector index
    if (!((static_cast<uint32_t>(allowed[v >> 5]) >> (v & 31)) & 1u)) x[v] = kNegInf;
    else if (x[v] > best) best = x[v], at = v;
  }
  for (; v < V; ++v) x[v] = kNegInf;
  return best == kNegInf ? -1 : at;
}

}  // namespace kvpage::sampling
