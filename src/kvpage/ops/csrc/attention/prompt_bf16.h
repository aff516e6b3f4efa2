// Prompt tiles (several query tokens) over a bf16 cache in the row layout, on AVX-512 BF16.
//
// Why a loop of its own: attend_tile_bf16 (avx512_bf16.h) scores one query row at a time against 16 keys, each
// key row loaded and reduced across lanes (a 45-operation transposing sum per row and chunk), and reloads its
// value accumulators every 16 keys. A prompt tile has many rows per KV head (16 tokens x G heads), so here the
// keys are transposed once per chunk into dword pairs, [D/2][16 keys] (each 512-bit vector: one pair of dims of
// 16 keys), and a block of RB rows is scored against them together: per pair one load, RB dpbf16 with the
// row's broadcast query pair, and the 16 scores land in the lanes without a reduction. The rows' value
// accumulators stay in registers across a span of up to kSpanChunks chunks staged in scratch.
//
// Same arithmetic as attend_tile_bf16 up to float32 summation order: exact bf16 products of q and k, float32
// sums, softmax weights rounded to bf16 pairs for P @ V (FlashAttention's bf16 P), float32 accumulators.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "attention/loop.h"

namespace kvpage::attn {

#if KVPAGE_ISA_AVX512BF16
constexpr int kSpanChunks = 16;  // chunks of up to 16 keys staged at once (256 keys in 16-token blocks)

// r[i] holds dwords 0..15 of key i; afterwards r[j] holds dword j of keys 0..15 (lane i: key i).
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  // u[4k + e], 128-bit lane L: dword 4L + e of rows 4k .. 4k + 3
  for (int k = 0; k < 4; ++k) {
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// n (<= 16) key rows of D bf16 from kbase (rows row_stride apart) -> dst[D/2][16] dwords; keys n.. are zero.
template <int64_t D>
inline void stage_key_pairs(const at::BFloat16* kbase, int64_t row_stride, int64_t n, __m512i* dst) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {  // 16 dword pairs of every key at a time
    __m512i r[16];
    for (int64_t i = 0; i < 16; ++i)
      r[i] = i < n ? _mm512_loadu_si512(reinterpret_cast<const void*>(kbase + i * row_stride + d0))
                   : _mm512_setzero_si512();
    transpose16x16_epi32(r);
    for (int64_t j = 0; j < 16; ++j) _mm512_store_si512(dst + d0 / 2 + j, r[j]);
  }
}

struct KeyChunk {
  int64_t t, n;  // first key, keys (<= 16)
};

// Rows per block for a head size: RB x D/16 value accumulators held in registers.
template <int64_t D>
constexpr int kRowBlock = D <= 64 ? 4 : D <= 128 ? 2 : 1;

// RB rows of one KV head over the staged chunks: acc/m/l carried in and out (acc in the interleaved order
// of interleave_value_pairs), q the rows' bf16 queries, pos their positions.
template <int64_t D, int RB>
inline void prompt_rows(const at::BFloat16* const* q, float* const* acc, float* m, float* l, const int64_t* pos,
                        const __m512i* kp, const at::BFloat16* vp, const KeyChunk* chunks, int nch, float scale,
                        int64_t window) {
  constexpr int64_t NP = D / 2, NF = D / 16, NC = D / 32;
  // independent dpbf16 chains per row while scoring: fixed by the head size, not by the rows in this block,
  // so that a row's scores are summed in the same order whichever block (and prompt chunk) it comes in
  constexpr int CH = 8 / kRowBlock<D>;
  const __m512 vneg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), vscale = _mm512_set1_ps(scale);
  __m512 av[RB][NF];
  const uint32_t* q32[RB];
  int64_t pmax = 0;
  for (int r = 0; r < RB; ++r) {
    for (int64_t c = 0; c < NF; ++c) av[r][c] = _mm512_loadu_ps(acc[r] + 16 * c);
    q32[r] = reinterpret_cast<const uint32_t*>(q[r]);
    pmax = std::max(pmax, pos[r]);
  }
  for (int u = 0; u < nch; ++u) {
    const int64_t t = chunks[u].t, n = chunks[u].n;
    if (t > pmax) break;  // later chunks hold later keys: masked for every row here
    const __m512i* kc = kp + u * NP;
    __m512 s[RB][CH];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < CH; ++c) s[r][c] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < NP; p0 += CH) {
#pragma GCC unroll 8
      for (int c = 0; c < CH; ++c) {
        const __m512bh kv = (__m512bh)_mm512_load_si512(kc + p0 + c);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r)
          s[r][c] = _mm512_dpbf16_ps(s[r][c], (__m512bh)_mm512_set1_epi32(static_cast<int>(q32[r][p0 + c])), kv);
      }
    }
    alignas(64) int32_t wp[RB][8];
    int64_t pairs = 0;
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {  // unrolled, so that av stays in registers
      const int64_t visible = std::min(n, pos[r] + 1 - t), first = window_first(window, pos[r], t, n);
      __m512 e = _mm512_setzero_ps();
      if (visible > first) {
        __m512 sum = s[r][0];
        for (int c = 1; c < CH; ++c) sum = _mm512_add_ps(sum, s[r][c]);
        const __mmask16 keep = static_cast<__mmask16>(((1u << visible) - 1u) & ~((1u << first) - 1u));
        const __m512 sc = _mm512_mask_blend_ps(keep, vneg_inf, _mm512_mul_ps(sum, vscale));
        const float mx = _mm512_reduce_max_ps(sc);
        if (mx > m[r]) {  // a new maximum: rescale what was summed so far
          const float corr = exp_neg(m[r] - mx);
          l[r] *= corr;
          m[r] = mx;
          const __m512 vc = _mm512_set1_ps(corr);
          for (int64_t c = 0; c < NF; ++c) av[r][c] = _mm512_mul_ps(av[r][c], vc);
        }
        e = exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m[r])), keep);
        l[r] += _mm512_reduce_add_ps(e);
        pairs = std::max(pairs, (visible + 1) / 2);
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(wp[r]), (__m256i)_mm512_cvtneps_pbh(e));
    }
    const at::BFloat16* vc = vp + u * 8 * NC * 64;
    for (int64_t pr = 0; pr < pairs; ++pr) {
      __m512bh wb[RB];
      for (int r = 0; r < RB; ++r) wb[r] = (__m512bh)_mm512_set1_epi32(wp[r][pr]);
      for (int64_t c = 0; c < NF; ++c) {
        const __m512bh vv = (__m512bh)_mm512_load_si512(reinterpret_cast<const void*>(vc + (pr * NC) * 64 + 32 * c));
        for (int r = 0; r < RB; ++r) av[r][c] = _mm512_dpbf16_ps(av[r][c], vv, wb[r]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int64_t c = 0; c < NF; ++c) _mm512_storeu_ps(acc[r] + 16 * c, av[r][c]);
}

// The prompt-tile case of attend_tile_bf16 (same arguments; nq query tokens from pos0, rows r = j * H + head).
template <int64_t D>
void attend_prompt_bf16(const at::BFloat16* const* qb, int64_t nq, int64_t H, int64_t G, const at::BFloat16* kcache,
                        const at::BFloat16* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                        int64_t kv_heads, int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m,
                        float* l, std::vector<float>& scratch, float scale, int64_t window = 0,
                        const NextKeys& next = {}) {
  static_assert(D % 32 == 0, "head size must be a multiple of 32");
  constexpr int64_t NC = D / 32;
  constexpr int RB = kRowBlock<D>;
  const int64_t R = nq * H, row_stride = kv_heads * D;
  // staged keys [chunk][D/2][16 dwords] and values [chunk][8 pairs][NC][64 bf16]: D floats per key slot, plus
  // 16 floats of room to align the start to 64 bytes
  scratch.resize(static_cast<size_t>(kSpanChunks * 16 * D + 16));
  float* base = scratch.data() + (16 - (reinterpret_cast<uintptr_t>(scratch.data()) / sizeof(float)) % 16) % 16;
  auto* kp = reinterpret_cast<__m512i*>(base);
  auto* vp = reinterpret_cast<at::BFloat16*>(base + kSpanChunks * 16 * D / 2);
  reset_partials(acc, m, l, R, D);
  KeyChunk chunks[kSpanChunks];
  int64_t t0 = k_begin;
  while (t0 < k_end) {
    int nch = 0;
    int64_t t = t0;
    for (; t < k_end && nch < kSpanChunks; ++nch) {
      const int64_t off = t % block_size;
      const int64_t n = std::min<int64_t>({block_size - off, k_end - t, 16});
      chunks[nch] = {t, n};
      const BlockPrefetch<at::BFloat16> prefetch(kcache, vcache, table, block_size, block_stride, row_stride, t,
                                                 k_begin, k_end, next);
      prefetch.part(0, 1);
      t += n;
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int u = 0; u < nch; ++u) {
        const int64_t phys = table[chunks[u].t / block_size], off = chunks[u].t % block_size;
        const at::BFloat16* kbase = kcache + phys * block_stride + off * row_stride + h * D;
        const at::BFloat16* vbase = vcache + phys * block_stride + off * row_stride + h * D;
        stage_key_pairs<D>(kbase, row_stride, chunks[u].n, kp + u * (D / 2));
        kvpage::interleave_value_pairs<NC>(vbase, row_stride, chunks[u].n, vp + u * 8 * NC * 64);
      }
      const int64_t rows = nq * G;  // row i: token i / G, head h * G + i % G
      for (int64_t i0 = 0; i0 < rows; i0 += RB) {
        const at::BFloat16* q[RB];
        float* a[RB];
        float mm[RB], ll[RB];
        int64_t pos[RB];
        const int rb = static_cast<int>(std::min<int64_t>(RB, rows - i0));
        for (int k = 0; k < rb; ++k) {
          const int64_t i = i0 + k, r = (i / G) * H + h * G + i % G;
          q[k] = qb[r];
          a[k] = acc + r * D;
          mm[k] = m[r];
          ll[k] = l[r];
          pos[k] = pos0 + i / G;
        }
#define KVPAGE_PROMPT_ROWS(n) prompt_rows<D, n>(q, a, mm, ll, pos, kp, vp, chunks, nch, scale, window)
        if constexpr (RB == 4) {
          switch (rb) {
            case 1: KVPAGE_PROMPT_ROWS(1); break;
            case 2: KVPAGE_PROMPT_ROWS(2); break;
            case 3: KVPAGE_PROMPT_ROWS(3); break;
            default: KVPAGE_PROMPT_ROWS(4); break;
          }
        } else if constexpr (RB == 2) {
          if (rb == 1) KVPAGE_PROMPT_ROWS(1); else KVPAGE_PROMPT_ROWS(2);
        } else {
          KVPAGE_PROMPT_ROWS(1);
        }
#undef KVPAGE_PROMPT_ROWS
        for (int k = 0; k < rb; ++k) {
          const int64_t i = i0 + k, r = (i / G) * H + h * G + i % G;
          m[r] = mm[k];
          l[r] = ll[k];
        }
      }
    }
    t0 = t;
  }
  kvpage::restore_pair_order<D>(acc, R);
}
#endif

}  // namespace kvpage::attn
