// The AVX2 + FMA main loop: 8-lane float32 arithmetic over float32, float16 and bf16 caches in the row layout.
// AVX-512 builds run it too, for row-layout tasks that would otherwise take the generic loop and for bf16
// decode on AMD CPUs, where its prefetch spread over the block's work streams the cache faster than the
// AVX-512 row loop (attention/paged_attention.cpp says where).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"
#include "attention/loop.h"

namespace kvpage::attn {

#if KVPAGE_ISA_AVX2
// Eight KV elements as float32: float32 rows load as they are; float16 widens exactly in one F16C conversion
// (every AVX2 CPU has F16C; the scalar path otherwise). bf16 rows go through load16 below.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}

// Sixteen KV elements as two float32 vectors. float32 and float16 rows keep their order (lo = elements 0-7, hi
// = 8-15). A bf16 value is the high half of its float32, so a bf16 row is read as eight 32-bit words of two
// values each: shifting a word left by 16 gives the even element as a float32, masking off its low half the odd
// one (both exact), so lo = elements 0, 2, .., 14 and hi = 1, 3, .., 15: one load and two cheap operations
// instead of two widening loads and two shifts.
// The query and output rows a bf16 cache meets are kept in that even/odd order (kPairOrder).
template <typename KV>
constexpr bool kPairOrder = std::is_same_v<KV, at::BFloat16>;

template <typename KV>
inline void load16(const KV* p, __m256& lo, __m256& hi) {
  if constexpr (kPairOrder<KV>) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    lo = load8(p);
    hi = load8(p + 8);
  }
}

// Rows of D values between natural order and the even/odd order of load16 for bf16, within each 16 values.
inline void to_pair_order(const float* src, float* dst, int64_t D) {
  for (int64_t c = 0; c < D; c += 16)
    for (int64_t j = 0; j < 8; ++j) {
      dst[c + j] = src[c + 2 * j];
      dst[c + 8 + j] = src[c + 2 * j + 1];
    }
}
inline void from_pair_order(float* row, int64_t D) {
  float tmp[16];
  for (int64_t c = 0; c < D; c += 16) {
    for (int64_t j = 0; j < 8; ++j) {
      tmp[2 * j] = row[c + j];
      tmp[2 * j + 1] = row[c + 8 + j];
    }
    std::memcpy(row + c, tmp, sizeof(tmp));
  }
}

// One dot product q . k over D values, q in load16's order for KV.
template <typename KV, int64_t D>
inline float dot1(const float* q, const KV* k) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    __m256 lo, hi;
    load16(k + c, lo, hi);
    a = _mm256_fmadd_ps(lo, _mm256_loadu_ps(q + c), a);
    a = _mm256_fmadd_ps(hi, _mm256_loadu_ps(q + c + 8), a);
  }
  return kvpage::hsum8(a);
}

// Eight dot products q . k_i (k_i = k + i * stride, D values each) as one vector, lane i = key i: eight
// accumulators over the dims, then a horizontal-add tree (no per-key horizontal reduction). q is in load16's
// order for KV.
template <typename KV, int64_t D>
inline __m256 dot8(const float* q, const KV* k, int64_t stride) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    const __m256 qlo = _mm256_loadu_ps(q + c), qhi = _mm256_loadu_ps(q + c + 8);
    for (int i = 0; i < 8; ++i) {
      __m256 lo, hi;
      load16(k + i * stride + c, lo, hi);
      a[i] = _mm256_fmadd_ps(lo, qlo, a[i]);
      a[i] = _mm256_fmadd_ps(hi, qhi, a[i]);
    }
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Keys per softmax step of attend_tile_avx2: consecutive blocks of a sequence (four 16-token blocks) go through
// one step, so a query row's serial work (its maxima, the correction's exp, the output row's rescaling) is paid
// once per 64 keys instead of once per block.
constexpr int64_t kFloatUnitKeys = 64;

// attend_tile for float32, bf16 or float16 KV and head size D on AVX2 + FMA (same contract: q pre-scaled, rows
// r = j * H + head, row r sees keys <= pos0 + r / H). K and V rows are read where they lie in the cache (no
// copy; 16-bit values widened to float32 in registers, so every cache computes the same float32 arithmetic
// on its stored values). Keys go in units of up to kFloatUnitKeys (runs of whole blocks, UnitRuns), in three
// passes: the scores of every row, block by block (all of a block's heads while its K rows are in L1), eight
// keys at a time (dot8); one softmax step per row over the unit (exp8); P.V block by block, each row's output
// in registers 64 dims at a time while the block's values stream past. The blocks after the unit are fetched
// in small steps all through the first query's work (LineStream).
template <typename KV, int64_t D>
void attend_tile_avx2(const float* q, int64_t nq, int64_t H, int64_t G, const KV* kcache, const KV* vcache,
                      const int64_t* table, int64_t block_size, int64_t block_stride, int64_t kv_heads, int64_t pos0,
                      int64_t k_begin, int64_t k_end, float* acc, float* m, float* l, std::vector<float>& scratch,
                      int64_t window = 0, const NextKeys& next = {}) {
  static_assert(D % 64 == 0, "head size must be a multiple of 64");
  const int64_t R = nq * H;
  const int64_t row_stride = kv_heads * D;
  const int64_t blocks = std::clamp<int64_t>(kFloatUnitKeys / block_size, 1, kUnitBlocks);  // per unit
  const int64_t ss = blocks * block_size + 8;  // a row's scores, then weights, over the unit
  scratch.resize(static_cast<size_t>(R * ss + 8 + (kPairOrder<KV> ? R * D : 0)));
  float* sc = scratch.data();
  if constexpr (kPairOrder<KV>) {  // queries in load16's order; the outputs accumulate in it too
    float* qp = scratch.data() + R * ss + 8;
    for (int64_t r = 0; r < R; ++r) to_pair_order(q + r * D, qp + r * D, D);
    q = qp;
  }
  reset_partials(acc, m, l, R, D);
  int64_t t = k_begin;
  while (t < k_end) {
    LineStream ls;
    const UnitRuns unit(table, block_size, t, k_end, blocks, -1, [&](int64_t u) {
      ls.add(BlockPrefetch<KV>(kcache, vcache, table, block_size, block_stride, row_stride, u, k_begin, k_end, next,
                               std::max<int64_t>(kPrefetchAhead, blocks)));
    });
    const int runs = unit.count;
    const int64_t n = unit.n;
    ls.pace(2 * kv_heads * G * ((n + 7) / 8));  // one step per eight keys of the first query's scores and P.V
    // the scores, block by block
    for (int b = 0; b < runs; ++b) {
      const int64_t at = unit.block[b] * block_stride + unit.off[b] * row_stride;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const KV* kb = kcache + at + h * D;
        for (int64_t j = 0; j < nq; ++j) {
          int64_t lo, hi;  // keys after this query's position are masked, and keys before its window
          unit.part(b, window_first(window, pos0 + j, t, n), std::min(n, pos0 + j + 1 - t), lo, hi);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = j * H + h * G + g;
            float* s = sc + r * ss + unit.start[b];  // indexed by the key's place in the unit
            const float* qr = q + r * D;
            int64_t i = lo;
            for (; i + 8 <= hi; i += 8) {
              if (j == 0) ls.step();
              _mm256_storeu_ps(s + i, dot8<KV, D>(qr, kb + i * row_stride, row_stride));
            }
            for (; i < hi; ++i) s[i] = dot1<KV, D>(qr, kb + i * row_stride);  // a run's last < 8 keys
          }
        }
      }
    }
    // one softmax step per row over the unit; the row's output rescaled to the new maximum
    for (int64_t j = 0; j < nq; ++j) {
      const int64_t visible = std::min(n, pos0 + j + 1 - t);
      const int64_t first = window_first(window, pos0 + j, t, n);
      if (visible <= first) continue;
      for (int64_t hg = 0; hg < H; ++hg) {
        const int64_t r = j * H + hg;
        float* s = sc + r * ss;
        __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        int64_t i = first;
        for (; i + 8 <= visible; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
        float bmax = kvpage::hmax8(vmax);
        for (; i < visible; ++i) bmax = std::max(bmax, s[i]);
        const float new_m = std::max(m[r], bmax);
        const float corr = exp_neg(m[r] - new_m);
        const __m256 vm = _mm256_set1_ps(new_m);
        __m256 vsum = _mm256_setzero_ps();
        for (i = first; i + 8 <= visible; i += 8) {
          const __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
          _mm256_storeu_ps(s + i, w);
          vsum = _mm256_add_ps(vsum, w);
        }
        float sum = kvpage::hsum8(vsum);
        for (; i < visible; ++i) {
          s[i] = exp_neg(s[i] - new_m);
          sum += s[i];
        }
        l[r] = l[r] * corr + sum;
        m[r] = new_m;
        if (corr != 1.f) {
          const __m256 vc = _mm256_set1_ps(corr);
          float* a = acc + r * D;
          for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(a + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), vc));
        }
      }
    }
    // P.V, block by block
    for (int b = 0; b < runs; ++b) {
      const int64_t at = unit.block[b] * block_stride + unit.off[b] * row_stride;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const KV* vb = vcache + at + h * D;
        for (int64_t j = 0; j < nq; ++j) {
          int64_t lo, hi;
          unit.part(b, window_first(window, pos0 + j, t, n), std::min(n, pos0 + j + 1 - t), lo, hi);
          if (lo >= hi) continue;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = j * H + h * G + g;
            const float* w = sc + r * ss + unit.start[b];
            if (j == 0)
              for (int64_t k = lo; k < hi; k += 8) ls.step();
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
              float* a = acc + r * D + d0;
              __m256 o[8];
              for (int c = 0; c < 8; ++c) o[c] = _mm256_loadu_ps(a + 8 * c);
              for (int64_t k = lo; k < hi; ++k) {
                const __m256 wv = _mm256_set1_ps(w[k]);
                const KV* v = vb + k * row_stride + d0;
                for (int c = 0; c < 4; ++c) {
                  __m256 vlo, vhi;
                  load16(v + 16 * c, vlo, vhi);
                  o[2 * c] = _mm256_fmadd_ps(wv, vlo, o[2 * c]);
                  o[2 * c + 1] = _mm256_fmadd_ps(wv, vhi, o[2 * c + 1]);
                }
              }
              for (int c = 0; c < 8; ++c) _mm256_storeu_ps(a + 8 * c, o[c]);
            }
          }
        }
      }
    }
    ls.rest();
    t += n;
  }
  if constexpr (kPairOrder<KV>)
    for (int64_t r = 0; r < R; ++r) from_pair_order(acc + r * D, D);
}
#endif

}  // namespace kvpage::attn
