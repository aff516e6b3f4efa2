// Matrix-vector products straight from GGUF-style quantized weights, for steps with few tokens (one stream's
// decode, small batches), where the cost is reading the weights: 4.5 or 8.5 bits per weight instead of 16.
//
//   quant_linear(x [M, K], qs, d, m, float_out, int16, gated) -> [M, N] ([M, N / 2] gated)
//
// Weights are "repacked GGUF blocks" of 32 along K (see kvpage/model/quant.py):
//   Q4 (from Q4_0 / Q4_1): qs uint8 [N, K/2] (16 bytes per block: low nibbles = elements 0..15, high nibbles =
//                           16..31, as in GGUF), d and m float16 [N, K/32]; weight = d * q + m.
//   Q8 (from Q8_0):        qs int8 [N, K], d float16 [N, K/32]; weight = d * q.
// The arithmetic is float32 on the exact weights: sum_b d_b * (q_b . x_b) + m_b * sum(x_b), with x widened to
// float32 (int16, one token row, AVX2 builds: x_b as 16-bit codes of a per-block scale, integer products).
// Output is float32 or x's dtype (bf16 rounded to nearest even).

#include "tensor.h"
#include <ATen/Parallel.h>

#include "common.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQK = 32;    // weights per block
constexpr int64_t kMaxM = 8;   // tokens handled per pass over the weights
constexpr int64_t kAhead = 4;  // rows prefetched ahead

inline void store_out(float* o, float v) { *o = v; }
inline void store_out(at::BFloat16* o, float v) { *o = at::BFloat16(v); }

#if KVPAGE_ISA_AVX512
inline __m512 half16(const at::Half* src, int64_t left) {
  const __mmask16 k = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, reinterpret_cast<const void*>(src)));
}
inline void half_row(const at::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(dst + i, k, half16(src + i, n - i));
  }
}
#else
inline void half_row(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if KVPAGE_ISA_AVX2_ONLY && defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  // the tail too (K = 576 leaves 2 of 18 scales per row): at::Half's software conversion is ~10x the cost
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i].x);
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

#if KVPAGE_ISA_AVX512 || KVPAGE_ISA_AVX2
// Row n's codes and scales into L1 ahead of use: the hardware prefetcher alone leaves the weight stream
// latency-bound (measured: half the bandwidth). m may be null (Q8). Hint _MM_HINT_T1: the codes into L2 only, for
// streams whose arithmetic is too light to keep up with L1's few outstanding misses (one token row of Q8 on
// AVX-512: Gemma 3's 262k x 640 head took 8.6 ms instead of 10.4, ~21 against ~17 GB/s, AMX Xeon, 2026-12-02;
// four rows, or one row of Q4 blocks, were as fast or faster with L1 prefetches).
template <enum _mm_hint Hint = _MM_HINT_T0>
inline void prefetch_row(const void* qs, int64_t row_bytes, const at::Half* d, const at::Half* m, int64_t nb,
                         int64_t n) {
  const char* next = static_cast<const char*>(qs) + n * row_bytes;
  for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(next + off, Hint);
  _mm_prefetch(reinterpret_cast<const char*>(d + n * nb), _MM_HINT_T0);
  if (m != nullptr) _mm_prefetch(reinterpret_cast<const char*>(m + n * nb), _MM_HINT_T0);
}
#endif

#if KVPAGE_ISA_AVX512BF16
#define KVPAGE_Q4_DPBF16 1
// Q4 rows for bf16 activations with AVX512_BF16: the nibbles of two blocks become 32 exact bf16 integers by a
// table lookup (vpermw reads the low 5 index bits, so the table maps i -> bf16(i & 15)), and vdpbf16ps sums
// their products with x exactly in float32. ``xp`` holds x reordered per block pair as [lo(b), lo(b+1),
// hi(b), hi(b+1)] (lo = elements 0..15 of a block, hi = 16..31), zero-padded to an even block count.
template <int M, typename OUT>
void q4_rows_bf16(const at::BFloat16* xp, const float* xsum, const uint8_t* qs, const at::Half* d,
                  const at::Half* m, int64_t K, int64_t N, int64_t n0, int64_t n1, OUT* out) {
  const int64_t nb = K / kQK, npair = (nb + 1) / 2, row_bytes = K / 2;
  std::vector<float> dbuf(2 * npair, 0.f);
  alignas(64) uint16_t table_v[32];
  for (int i = 0; i < 32; ++i) table_v[i] = at::BFloat16(static_cast<float>(i & 15)).x;
  const __m512i table = _mm512_load_si512(table_v);
  for (int64_t n = n0; n < n1; ++n) {
    if (n + kAhead < n1) prefetch_row(qs, row_bytes, d, m, nb, n + kAhead);
    half_row(d + n * nb, dbuf.data(), nb);
    __m512 acc[M];
    for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) {  // min terms: m_b * sum(x_b), 16 blocks per vector
      const __m512 mv = half16(m + n * nb + b, nb - b);
      const __mmask16 k = nb - b >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (nb - b)) - 1u);
      for (int t = 0; t < M; ++t) acc[t] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, xsum + t * nb + b), acc[t]);
    }
    const uint8_t* q = qs + n * row_bytes;
    for (int64_t p = 0; p < npair; ++p) {
      const int64_t b = 2 * p;
      __m256i raw;
      if (b + 1 < nb) raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 16));
      else raw = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
      const __m512i v = _mm512_cvtepu8_epi16(raw);
      const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(v, table);
      const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
      const __m512 dv = _mm512_insertf32x8(_mm512_set1_ps(dbuf[b]), _mm256_set1_ps(dbuf[b + 1]), 1);
      for (int t = 0; t < M; ++t) {
        const at::BFloat16* xb = xp + t * npair * 64 + p * 64;
        __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(xb));
        s = _mm512_dpbf16_ps(s, hi, (__m512bh)_mm512_loadu_si512(xb + 32));
        acc[t] = _mm512_fmadd_ps(s, dv, acc[t]);
      }
    }
    for (int t = 0; t < M; ++t) store_out(out + t * N + n, _mm512_reduce_add_ps(acc[t]));
  }
}
#else
#define KVPAGE_Q4_DPBF16 0
#endif

#if KVPAGE_ISA_AVX512
// acc[t] += d * (w . x_t) for one block of 32 weights (lo = elements 0..15, hi = 16..31) and M token rows.
template <int M>
inline void add_block(__m512 lo, __m512 hi, float d, const float* xb, int64_t K, __m512* acc) {
  const __m512 dv = _mm512_set1_ps(d);
  for (int t = 0; t < M; ++t) {
    __m512 s = _mm512_mul_ps(lo, _mm512_loadu_ps(xb + t * K));
    s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + t * K + 16), s);
    acc[t] = _mm512_fmadd_ps(s, dv, acc[t]);
  }
}
#endif

#if KVPAGE_ISA_AVX2_ONLY
// acc[t] += d * (w . x_t) for one block of 32 weights as four 8-lane vectors and M token rows.
template <int M>
inline void add_block8(const __m256 (&w)[4], float d, const float* xb, int64_t K, __m256* acc) {
  const __m256 dv = _mm256_set1_ps(d);
  for (int t = 0; t < M; ++t) {
    const float* xt = xb + t * K;
    __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xt));
    s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xt + 8), s);
    s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xt + 16), s);
    s = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xt + 24), s);
    acc[t] = _mm256_fmadd_ps(s, dv, acc[t]);
  }
}

// block(b, chain) for b = 0 .. nb-1, even blocks into c0 and odd ones into c1, written out (an accumulator
// array indexed by b & 1 would live in memory).
template <typename F>
inline void two_chains(int64_t nb, F&& block, __m256* c0, __m256* c1) {
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    block(b, c0);
    block(b + 1, c1);
  }
  if (b < nb) block(b, c0);
}
#endif

// Rows [n0, n1) of out[M, N] = x[M, K] . W^T for Q4 (m != nullptr) or Q8 (m == nullptr) weights.
template <int M, bool Q4, typename OUT>
void quant_rows(const float* x, const float* xsum, const void* qs_v, const at::Half* d, const at::Half* m,
                int64_t K, int64_t N, int64_t n0, int64_t n1, OUT* out) {
  const int64_t nb = K / kQK;
  std::vector<float> dbuf(nb), mbuf(Q4 ? nb : 0);
  [[maybe_unused]] const int64_t row_bytes = Q4 ? K / 2 : K;
  for (int64_t n = n0; n < n1; ++n) {
#if KVPAGE_ISA_AVX512 || KVPAGE_ISA_AVX2
    constexpr auto hint = KVPAGE_ISA_AVX512 && !Q4 && M == 1 ? _MM_HINT_T1 : _MM_HINT_T0;
    if (n + kAhead < n1) prefetch_row<hint>(qs_v, row_bytes, d, m, nb, n + kAhead);
#endif
    half_row(d + n * nb, dbuf.data(), nb);
    float mterm[M];
    for (int t = 0; t < M; ++t) mterm[t] = 0.f;
    if constexpr (Q4) {
      half_row(m + n * nb, mbuf.data(), nb);
      for (int t = 0; t < M; ++t) {
        const float* xs = xsum + t * nb;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t b = 0; b < nb; ++b) s += mbuf[b] * xs[b];
        mterm[t] = s;
      }
    }
#if KVPAGE_ISA_AVX512
    __m512 acc[M];
    for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_ps();
    if constexpr (Q4) {
      const uint8_t* q = static_cast<const uint8_t*>(qs_v) + n * (K / 2);
      const __m512i low4 = _mm512_set1_epi32(0x0F);
      for (int64_t b = 0; b < nb; ++b) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low4));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        add_block<M>(lo, hi, dbuf[b], x + b * kQK, K, acc);
      }
    } else {
      const int8_t* q = static_cast<const int8_t*>(qs_v) + n * K;
      for (int64_t b = 0; b < nb; ++b) {
        const __m128i* p = reinterpret_cast<const __m128i*>(q + b * kQK);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
        add_block<M>(lo, hi, dbuf[b], x + b * kQK, K, acc);
      }
    }
    for (int t = 0; t < M; ++t) store_out(out + t * N + n, _mm512_reduce_add_ps(acc[t]) + mterm[t]);
#elif KVPAGE_ISA_AVX2
    // 8 lanes, two accumulator chains per token row (even and odd blocks). A Q4 block's 16 bytes are
    // broadcast to both 128-bit lanes and one byte shuffle spreads 8 of them over 8 dword lanes: their low
    // nibbles are elements 0-7 (or 8-15), their high nibbles 16-23 (or 24-31), in GGUF order.
    __m256 acc[2][M];
    for (int t = 0; t < M; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
    if constexpr (Q4) {
      const uint8_t* q = static_cast<const uint8_t*>(qs_v) + n * (K / 2);
      const __m256i low4 = _mm256_set1_epi32(0x0F);
      const __m256i first8 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                              4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
      // bytes 8-15: +8 on each dword's first byte only (the -1 bytes, which zero a lane's upper bytes, stay -1)
      const __m256i last8 = _mm256_add_epi8(first8, _mm256_set1_epi32(8));
      const auto block = [&](int64_t b, __m256* into) {
        const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
        const __m256i e0 = _mm256_shuffle_epi8(v, first8), e1 = _mm256_shuffle_epi8(v, last8);
        const __m256 w[4] = {_mm256_cvtepi32_ps(_mm256_and_si256(e0, low4)),
                             _mm256_cvtepi32_ps(_mm256_and_si256(e1, low4)),
                             _mm256_cvtepi32_ps(_mm256_srli_epi32(e0, 4)),
                             _mm256_cvtepi32_ps(_mm256_srli_epi32(e1, 4))};
        add_block8<M>(w, dbuf[b], x + b * kQK, K, into);
      };
      two_chains(nb, block, acc[0], acc[1]);
    } else {
      const int8_t* q = static_cast<const int8_t*>(qs_v) + n * K;
      const auto block = [&](int64_t b, __m256* into) {
        const int8_t* p = q + b * kQK;
        const __m256 w[4] = {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16)))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 24))))};
        add_block8<M>(w, dbuf[b], x + b * kQK, K, into);
      };
      two_chains(nb, block, acc[0], acc[1]);
    }
    for (int t = 0; t < M; ++t) store_out(out + t * N + n, kvpage::hsum8(_mm256_add_ps(acc[0][t], acc[1][t])) + mterm[t]);
#else
    float acc[M];
    for (int t = 0; t < M; ++t) acc[t] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      float wq[kQK];
      if constexpr (Q4) {
        const uint8_t* q = static_cast<const uint8_t*>(qs_v) + n * (K / 2) + b * 16;
        for (int j = 0; j < 16; ++j) {
          wq[j] = static_cast<float>(q[j] & 0x0F);
          wq[j + 16] = static_cast<float>(q[j] >> 4);
        }
      } else {
        const int8_t* q = static_cast<const int8_t*>(qs_v) + n * K + b * kQK;
        for (int j = 0; j < kQK; ++j) wq[j] = static_cast<float>(q[j]);
      }
      for (int t = 0; t < M; ++t) {
        const float* xb = x + t * K + b * kQK;
        float s = 0.f;
        for (int j = 0; j < kQK; ++j) s += wq[j] * xb[j];
        acc[t] += dbuf[b] * s;
      }
    }
    for (int t = 0; t < M; ++t) store_out(out + t * N + n, acc[t] + mterm[t]);
#endif
  }
}

#if KVPAGE_ISA_AVX2_ONLY
// Token rows as 16-bit integer blocks: per block of 32, scale = max|x| / 32767 and codes round(x / scale)
// (nearest even, the default rounding mode). The rounding error, at most 1.5e-5 of the block's largest
// value, is far below bf16's; llama.cpp's 8-bit codes were measured here at 93% top-1 agreement with the
// float32 path on the test prompts (their error is 256x this), too coarse for this model's outliers.
void quantize_rows_i16(const float* xf, int64_t blocks, int16_t* xq, float* xd) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < blocks; ++i) {
    const float* src = xf + i * kQK;
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(src + 8 * j);
    const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const float amax = kvpage::hmax8(mx);
    xd[i] = amax / 32767.f;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    for (int j = 0; j < 4; j += 2) {
      const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)),
                                                _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inv)));
      // packs interleaves 128-bit lanes: quadwords (0, 2, 1, 3) restore element order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kQK + 8 * j), _mm256_permute4x64_epi64(packed, 0xD8));
    }
  }
}

// Eight float16 scales from p (the first `count`, the rest 0).
inline __m256 half8(const at::Half* p, int64_t count) {
  if (count >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tmp, p, sizeof(uint16_t) * count);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
}

// Rows [n0, n1) of out[1, N] from one 16-bit token row (xq; xd and xsum zero-padded to a multiple of 8 blocks)
// with integer dot products per block: the weight codes widened to 16 bits, 16 products summed pairwise per
// instruction (vpmaddwd; at most 2 * 32767 * 128 per pair, no overflow), one float conversion and FMA per
// block instead of four of each. Scales are handled eight blocks at a time in registers (d * xd; Q4's m term
// m . xsum against the float32 block sums), so a row has no scalar pass over its scales.
template <bool Q4, typename OUT>
void quant_row_i16(const int16_t* xq, const float* xd, const float* xsum, const void* qs_v, const at::Half* d,
                   const at::Half* m, int64_t K, int64_t n0, int64_t n1, OUT* out) {
  const int64_t nb = K / kQK;
  const int64_t row_bytes = Q4 ? K / 2 : K;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  alignas(32) float sc[8];
  for (int64_t n = n0; n < n1; ++n) {
    if (n + kAhead < n1) prefetch_row(qs_v, row_bytes, d, m, nb, n + kAhead);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), mterm = _mm256_setzero_ps();
    const at::Half* dn = d + n * nb;
    const auto dot = [&](int64_t b, __m256i w0, __m256i w1, float scale, __m256& into) {
      const __m256i* xv = reinterpret_cast<const __m256i*>(xq + b * kQK);
      const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xv)),
                                         _mm256_madd_epi16(w1, _mm256_loadu_si256(xv + 1)));
      into = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale), into);
    };
    const auto block = [&](int64_t b, float scale, __m256& into) {
      if constexpr (Q4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(qs_v) +
                                                                             n * row_bytes + b * 16));
        // low nibbles = elements 0..15, high nibbles = 16..31 (GGUF order)
        dot(b, _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4)),
            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)), scale, into);
      } else {
        const __m128i* p = reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(qs_v) + n * row_bytes + b * kQK);
        dot(b, _mm256_cvtepi8_epi16(_mm_loadu_si128(p)), _mm256_cvtepi8_epi16(_mm_loadu_si128(p + 1)), scale, into);
      }
    };
    for (int64_t g = 0; g < nb; g += 8) {
      const int64_t count = std::min<int64_t>(8, nb - g);
      _mm256_store_ps(sc, _mm256_mul_ps(half8(dn + g, count), _mm256_loadu_ps(xd + g)));
      if constexpr (Q4) mterm = _mm256_fmadd_ps(half8(m + n * nb + g, count), _mm256_loadu_ps(xsum + g), mterm);
      int64_t j = 0;
      for (; j + 2 <= count; j += 2) {  // two accumulator chains
        block(g + j, sc[j], acc0);
        block(g + j + 1, sc[j + 1], acc1);
      }
      if (j < count) block(g + j, sc[j], acc0);
    }
    store_out(out + n, kvpage::hsum8(_mm256_add_ps(_mm256_add_ps(acc0, acc1), mterm)));
  }
}
#endif

// Calls fn(std::integral_constant<int, R>) for R = rows (1..kMaxM): the token count is a compile-time constant
// inside the kernels, so their accumulators stay in registers.
template <typename F>
void with_rows(int64_t rows, F&& fn) {
  switch (rows) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    default: TORCH_CHECK(false, "internal: bad token group ", rows);
  }
}

// Runs rows(n0, n1, dst) over W's rows in parallel chunks; rows writes out[t, n] of its chunk at dst[t * N + n]
// (dst is out itself, or float32 scratch). With `gated` (W = [gate; up], out [M, N / 2]) a chunk computes its
// gate rows and the matching up rows into the scratch and writes silu(gate) * up: the MLP's activation costs
// neither a second pass over memory nor a second parallel region.
template <typename OUT, typename F>
void over_rows(int64_t M, int64_t N, int64_t grain, bool gated, OUT* out, F&& rows) {
  if (!gated) {
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { rows(n0, n1, out); });
    return;
  }
  const int64_t inter = N / 2;
  std::vector<float> both(M * N);
  at::parallel_for(0, inter, std::max<int64_t>(8, grain / 2), [&](int64_t n0, int64_t n1) {
    rows(n0, n1, both.data());
    rows(n0 + inter, n1 + inter, both.data());
    for (int64_t t = 0; t < M; ++t) {
      const float* g = both.data() + t * N;
      const float* u = g + inter;
      OUT* o = out + t * inter;
      int64_t i = n0;
#if KVPAGE_ISA_AVX512
      for (; i + 16 <= n1; i += 16) {  // the formula silu_mul uses (same bits for float32 output)
        alignas(64) float r[16];
        _mm512_store_ps(r, kvpage::silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i), 0xFFFF));
        for (int j = 0; j < 16; ++j) store_out(o + i + j, r[j]);
      }
#elif KVPAGE_ISA_AVX2
      for (; i + 8 <= n1; i += 8) {
        alignas(32) float r[8];
        _mm256_store_ps(r, kvpage::silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
        for (int j = 0; j < 8; ++j) store_out(o + i + j, r[j]);
      }
#endif
      for (; i < n1; ++i) store_out(o + i, g[i] / (1.f + std::exp(-g[i])) * u[i]);
    }
  });
}

template <typename IN, typename OUT>
void run_quant(const IN* x, int64_t M, int64_t K, int64_t N, bool q4, const void* qs, const at::Half* d,
               const at::Half* m, bool int16, bool gated, OUT* out) {
  const int64_t nb = K / kQK;
  // Rows of W in chunks: both cores stream disjoint parts of the weights.
  const int64_t grain = std::max<int64_t>(8, N / (4 * at::get_num_threads()));
  // Block sums of x (Q4's m term), zero-padded by 8: the one-row int16 kernel reads them eight blocks at a time.
  const int64_t nsum = q4 ? M * nb : 0;
  std::vector<float> xf(M * K), xsum(nsum + 8, 0.f);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = kvpage::to_float(x[i]);
  for (int64_t i = 0; i < nsum; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < kQK; ++j) s += xf[i * kQK + j];
    xsum[i] = s;
  }
#if KVPAGE_ISA_AVX2_ONLY
  // One token row only: from two rows up the float path's shared weight conversion pays for itself (measured
  // at par or faster at 2-4 rows), so those steps keep it.
  if (int16 && M == 1) {
    std::vector<int16_t> xq(K);
    std::vector<float> xd(nb + 8, 0.f);  // padded like xsum
    quantize_rows_i16(xf.data(), nb, xq.data(), xd.data());
    over_rows(M, N, grain, gated, out, [&](int64_t n0, int64_t n1, auto* dst) {
      using D = std::remove_pointer_t<decltype(dst)>;
      if (q4) quant_row_i16<true, D>(xq.data(), xd.data(), xsum.data(), qs, d, m, K, n0, n1, dst);
      else quant_row_i16<false, D>(xq.data(), xd.data(), nullptr, qs, d, m, K, n0, n1, dst);
    });
    return;
  }
#else
  (void)int16;
#endif
#if KVPAGE_Q4_DPBF16
  if (q4 && std::is_same<IN, at::BFloat16>::value) {
    const int64_t npair = (nb + 1) / 2;
    std::vector<at::BFloat16> xp(M * npair * 64, at::BFloat16(0.f));
    for (int64_t t = 0; t < M; ++t)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t j = 0; j < kQK; ++j)  // [lo(b), lo(b+1), hi(b), hi(b+1)] per pair
          xp[t * npair * 64 + (b / 2) * 64 + (j / 16) * 32 + (b % 2) * 16 + j % 16] =
              at::BFloat16(xf[t * K + b * kQK + j]);
    over_rows(M, N, grain, gated, out, [&](int64_t n0, int64_t n1, auto* dst) {
      using D = std::remove_pointer_t<decltype(dst)>;
      for (int64_t t0 = 0; t0 < M; t0 += kMaxM)
        with_rows(std::min(kMaxM, M - t0), [&](auto R) {
          q4_rows_bf16<R(), D>(xp.data() + t0 * npair * 64, xsum.data() + t0 * nb, static_cast<const uint8_t*>(qs),
                               d, m, K, N, n0, n1, dst + t0 * N);
        });
    });
    return;
  }
#endif
  over_rows(M, N, grain, gated, out, [&](int64_t n0, int64_t n1, auto* dst) {
    using D = std::remove_pointer_t<decltype(dst)>;
    for (int64_t t0 = 0; t0 < M; t0 += kMaxM)
      with_rows(std::min(kMaxM, M - t0), [&](auto R) {
        const float* xr = xf.data() + t0 * K;
        if (q4) quant_rows<R(), true, D>(xr, xsum.data() + t0 * nb, qs, d, m, K, N, n0, n1, dst + t0 * N);
        else quant_rows<R(), false, D>(xr, nullptr, qs, d, m, K, N, n0, n1, dst + t0 * N);
      });
  });
}

}  // namespace

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m,
                           bool float_out, bool int16, bool gated) {
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  if (qs.dim() == 3) {  // panels (QuantWeight.as_panels): float32 in and out, the panel GEMM's sums
    TORCH_CHECK(x.scalar_type() == at::kFloat, "quant panels take float32 activations");
    return quant_panel_linear(x, qs, d, m, c10::nullopt, gated);
  }
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous(), "qs must be a dense [out_features, bytes] matrix");
  const bool q4 = qs.scalar_type() == at::kByte;
  TORCH_CHECK(q4 || qs.scalar_type() == at::kChar, "qs must be uint8 (Q4) or int8 (Q8)");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / kQK;
  TORCH_CHECK(K % kQK == 0, "in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(qs.size(1) == (q4 ? K / 2 : K), "qs has ", qs.size(1), " bytes per row for in_features ", K);
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 2 && d.size(0) == N && d.size(1) == nb,
              "d must be float16 [out_features, in_features / 32]");
  const at::Half* mp = nullptr;
  if (q4) {
    TORCH_CHECK(m.has_value() && m->scalar_type() == at::kHalf && m->is_contiguous() && m->dim() == 2 &&
                    m->size(0) == N && m->size(1) == nb,
                "Q4 weights need m: float16 [out_features, in_features / 32]");
    mp = m->data_ptr<at::Half>();
  }
  TORCH_CHECK(!gated || N % 2 == 0, "gated needs W = [gate; up]: an even number of rows, got ", N);
  const bool bf16_in = x.scalar_type() == at::kBFloat16, bf16_out = bf16_in && !float_out;
  auto out = at::empty({M, gated ? N / 2 : N}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (M == 0) return out;
  const void* qp = qs.data_ptr();
  const at::Half* dp = d.data_ptr<at::Half>();
  if (bf16_in) {
    if (bf16_out) run_quant(x.data_ptr<at::BFloat16>(), M, K, N, q4, qp, dp, mp, int16, gated, out.data_ptr<at::BFloat16>());
    else run_quant(x.data_ptr<at::BFloat16>(), M, K, N, q4, qp, dp, mp, int16, gated, out.data_ptr<float>());
  } else {
    run_quant(x.data_ptr<float>(), M, K, N, q4, qp, dp, mp, int16, gated, out.data_ptr<float>());
  }
  return out;
}

bool quant_int16_available() { return KVPAGE_ISA_AVX2_ONLY == 1; }
