// Quantized KV rows (int8, fp8 e4m3, fp8 e5m2): each (token, KV head) row of the cache is D one-byte codes
// followed by its bfloat16 scale (2 bytes), value = code x scale (attention/kv_quant.py is the torch oracle).
// Here: the codes' decoding (scalar and 8 lanes at a time on AVX2), the quantizing write, and the attention
// main loop that dequantizes in registers as it reads each row.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "attention/loop.h"
#include "attention/quant_codes.h"

namespace kvpage::attn {

// x <- x Hb in place, Hb the orthonormal Walsh-Hadamard matrix on blocks of b dims (b = the largest power of two
// dividing D): key rows are stored rotated (one scale then fits a row whose few large channels are spread over
// all), and queries are rotated alike, so scores are unchanged. The butterflies add in the same order as
// attention/kv_quant.py's hadamard, so both round alike.
inline void fwht(float* x, int64_t D) {
  const int64_t b = D & -D;
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(b)));
  for (int64_t base = 0; base < D; base += b) {
    float* y = x + base;
    for (int64_t h = 1; h < b; h *= 2)
      for (int64_t g = 0; g < b; g += 2 * h)
        for (int64_t j = g; j < g + h; ++j) {
          const float lo = y[j], hi = y[j + h];
          y[j] = lo + hi;
          y[j + h] = lo - hi;
        }
    for (int64_t j = 0; j < b; ++j) y[j] *= norm;
  }
}

// fwht on one row, in registers where D is a power of two the row lanes take (the same bits: fwht_lanes adds
// as the scalar loop does). Why: the quantized loops rotate every query row of every task; done scalar, that
// was ~12% of a decode call's time at Gemma 3's 256-wide heads (perf, Zen 4).
inline void fwht_row(float* x, int64_t D) {
#if KVPAGE_ISA_AVX2
  if (D >= RowLanes::kW && D <= 256 && (D & (D - 1)) == 0) {
    RowLanes::F r[256 / RowLanes::kW];
    const int64_t n = D / RowLanes::kW;
    for (int64_t i = 0; i < n; ++i) r[i] = RowLanes::load(x + RowLanes::kW * i);
    fwht_lanes<RowLanes>(r, n);
    for (int64_t i = 0; i < n; ++i) RowLanes::store(x + RowLanes::kW * i, r[i]);
    return;
  }
#endif
  fwht(x, D);
}

inline float row_scale(const uint8_t* row, int64_t D) {
  uint16_t bits;
  std::memcpy(&bits, row + D, sizeof(bits));
  const uint32_t f = static_cast<uint32_t>(bits) << 16;
  float s;
  std::memcpy(&s, &f, sizeof(s));
  return s;
}

// One row of D values -> D codes and the bfloat16 scale: absmax / code max rounded up, so no value passes the
// code max (and any magnitude is representable). `buf` holds D floats; `rotate`: a key row (fwht first).
template <KVCode C, typename IN>
inline void quantize_row(const IN* src, uint8_t* row, int64_t D, float* buf, bool rotate) {
#if KVPAGE_ISA_AVX2
  if (D >= RowLanes::kW && D <= 256 && (D & (D - 1)) == 0) {
    quantize_row_lanes<RowLanes, C>(src, row, D, rotate);
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) buf[d] = to_float(src[d]);
  if (rotate) fwht(buf, D);
  const float* x = buf;
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const uint16_t bits = scale_bits<C>(amax);
  const float s = scale_value(bits);
  for (int64_t d = 0; d < D; ++d) row[d] = s > 0.f ? encode1<C>(x[d] / s) : encode1<C>(0.f);
  std::memcpy(row + D, &bits, sizeof(bits));
}

#if KVPAGE_ISA_AVX2
// Eight codes as float32 (unscaled). e4m3: sign, exponent and mantissa moved into a float32's fields give
// 2^-120 times the value, subnormals included; e5m2 is the high byte of a float16.
template <KVCode C>
inline __m256 decode8(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (C == KVCode::kInt8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else if constexpr (C == KVCode::kE4M3) {
    const __m256i w = _mm256_cvtepu8_epi32(b);
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7F)), 20);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24);
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(mag, sign)), _mm256_set1_ps(0x1p120f));
  } else {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
  }
}
#endif

#if KVPAGE_ISA_AVX2
// Eight dot products q . k_i over D floats (k_i = k + i * D) as one vector, lane i = key i.
template <int64_t D>
inline __m256 dot8_f32(const float* q, const float* k) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(k + i * D + c), qv, a[i]);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// Rows [0, n) of one KV head in a block -> float32 rows of D values, each times its row's scale. Every row below
// n holds a written token (the task's keys start at or after its window's edge and end at its last query).
template <KVCode C, int64_t D>
inline void dequantize_block(const uint8_t* base, int64_t row_stride, int64_t n, int64_t dim, float* out) {
  const int64_t Dd = D > 0 ? D : dim;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = base + i * row_stride;
    const float s = row_scale(row, Dd);
    float* o = out + i * Dd;
#if KVPAGE_ISA_AVX2
    if constexpr (D > 0) {
      const __m256 vs = _mm256_set1_ps(s);
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(decode8<C>(row + d), vs));
      continue;
    }
#endif
    for (int64_t d = 0; d < Dd; ++d) o[d] = decode1<C>(row[d]) * s;
  }
}

// One block run [t, t + n) of KV head h, its keys and values already float32 rows in L1 (kf, vf: [n][D]), for
// the task's query rows of that head: scores, the running softmax and P.V into acc / m / l. sc: room for
// nq * H * block_size scores. The float main loop every dequantizing path shares (rows of codes here, keys per
// channel in paged_attention_channel.cpp).
template <int64_t D>
void attend_block_rows(const float* q, int64_t nq, int64_t H, int64_t G, int64_t h, const float* kf,
                       const float* vf, int64_t t, int64_t n, int64_t pos0, int64_t window, int64_t block_size,
                       int64_t dim, float* sc, float* acc, float* m, float* l) {
  const int64_t Dd = D > 0 ? D : dim;
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t visible = std::min(n, pos0 + j + 1 - t);  // keys after this query's position are masked
    const int64_t first = window_first(window, pos0 + j, t, n);  // and keys before its window
    if (visible <= first) continue;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = j * H + h * G + g;
      float* s = sc + r * block_size;
      const float* qr = q + r * Dd;
      float bmax = -std::numeric_limits<float>::infinity();
      int64_t i = first;
#if KVPAGE_ISA_AVX2
      if constexpr (D > 0) {
        __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        for (; i + 8 <= visible; i += 8) {
          const __m256 d8 = dot8_f32<D>(qr, kf + i * D);
          _mm256_storeu_ps(s + i, d8);
          vmax = _mm256_max_ps(vmax, d8);
        }
        bmax = kvpage::hmax8(vmax);
      }
#endif
      for (; i < visible; ++i) {
        float dot = 0.f;
        for (int64_t d = 0; d < Dd; ++d) dot += qr[d] * kf[i * Dd + d];
        s[i] = dot;
        bmax = std::max(bmax, dot);
      }
      const float new_m = std::max(m[r], bmax);
      const float corr = exp_neg(m[r] - new_m);
      float sum = 0.f;
      i = first;
#if KVPAGE_ISA_AVX2
      {
        const __m256 vm = _mm256_set1_ps(new_m);
        __m256 vsum = _mm256_setzero_ps();
        for (; i + 8 <= visible; i += 8) {
          const __m256 w = kvpage::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
          _mm256_storeu_ps(s + i, w);
          vsum = _mm256_add_ps(vsum, w);
        }
        sum = kvpage::hsum8(vsum);
      }
#endif
      for (; i < visible; ++i) {
        s[i] = exp_neg(s[i] - new_m);
        sum += s[i];
      }
      l[r] = l[r] * corr + sum;
      m[r] = new_m;
      float* a = acc + r * Dd;
#if KVPAGE_ISA_AVX2
      if constexpr (D > 0) {
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
          const __m256 vc = _mm256_set1_ps(corr);
          __m256 o[8];
          for (int c = 0; c < 8; ++c) o[c] = _mm256_mul_ps(_mm256_loadu_ps(a + d0 + 8 * c), vc);
          for (int64_t k = first; k < visible; ++k) {
            const __m256 wv = _mm256_set1_ps(s[k]);
            const float* v = vf + k * D + d0;
            for (int c = 0; c < 8; ++c) o[c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + 8 * c), o[c]);
          }
          for (int c = 0; c < 8; ++c) _mm256_storeu_ps(a + d0 + 8 * c, o[c]);
        }
        continue;
      }
#endif
      for (int64_t d = 0; d < Dd; ++d) a[d] *= corr;
      for (int64_t k = first; k < visible; ++k)
        for (int64_t d = 0; d < Dd; ++d) a[d] += s[k] * vf[k * Dd + d];
    }
  }
}

// attend_tile for quantized rows and head size D (0: any, scalar), same contract as the other main loops: q
// pre-scaled float32 (and rotated like the keys), rows r = j * H + head, row r sees keys <= pos0 + r / H (and
// none before its window). Each block's K and V rows of a KV head are dequantized once into L1-resident float32
// rows that every query row of the group then reads: the codes cross the memory bus once, at half bf16's bytes.
template <KVCode C, int64_t D>
void attend_tile_quant(const float* q, int64_t nq, int64_t H, int64_t G, const uint8_t* kcache,
                       const uint8_t* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                       int64_t kv_heads, int64_t dim, int64_t pos0, int64_t k_begin, int64_t k_end, float* acc,
                       float* m, float* l, std::vector<float>& scratch, int64_t window) {
  const int64_t Dd = D > 0 ? D : dim;
  const int64_t head_stride = Dd + kScaleBytes, row_stride = kv_heads * head_stride;
  const int64_t R = nq * H;
  scratch.resize(static_cast<size_t>(R * block_size + 2 * block_size * Dd + 8));
  float* sc = scratch.data();  // this block's weights, [r][i]
  float* kf = sc + R * block_size;  // the block's keys of the current KV head, dequantized, [i][d]
  float* vf = kf + block_size * Dd;  // and its values
  reset_partials(acc, m, l, R, Dd);
  int64_t t = k_begin;
  while (t < k_end) {
    const int64_t off = t % block_size;
    const int64_t n = std::min(block_size - off, k_end - t);
    const int64_t phys = table[t / block_size];
#if KVPAGE_ISA_AVX2
    const BlockPrefetch<uint8_t> prefetch(kcache, vcache, table, block_size, block_stride, row_stride, t, k_begin,
                                          k_end);
#endif
    for (int64_t h = 0; h < kv_heads; ++h) {
#if KVPAGE_ISA_AVX2
      prefetch.part(h, kv_heads);
#endif
      dequantize_block<C, D>(kcache + phys * block_stride + off * row_stride + h * head_stride, row_stride, n, Dd, kf);
      dequantize_block<C, D>(vcache + phys * block_stride + off * row_stride + h * head_stride, row_stride, n, Dd, vf);
      attend_block_rows<D>(q, nq, H, G, h, kf, vf, t, n, pos0, window, block_size, Dd, sc, acc, m, l);
    }
    t += n;
  }
}

}  // namespace kvpage::attn
