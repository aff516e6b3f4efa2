// Paged decode attention with AMX tile products (bf16 KV, bf16 queries, one query token per task).
//
// Why: on this class of CPU the 16-keys-at-a-time AVX-512 kernel spends most of its time forming q.k scores
// (32 dot products and a transposing reduction per query head per 16 keys) and in the per-chunk online
// softmax. Here a task works in three phases over each span of its partition:
//   1. scores: for each 16-key slice of a block and each KV head, one AMX product K[16 x D] . Q^T[D x G]
//      straight from the cache rows (tile stride = the cache's row stride), so K is read once for its whole
//      query group; scores land row-major in a scratch array [R][span];
//   2. softmax per query row over a span of up to kAmxSpan keys in one vector pass (rescaling earlier spans
//      only when the running max rises), weights rounded to bf16 pairs (as the AVX-512 kernel does);
//   3. values: each 16-key slice's V rows are interleaved in pairs once per KV head and accumulated into
//      the G rows' float32 outputs with dpbf16, the group's accumulators held in registers.
// Phase 1 prefetches K and V kAmxPrefetchSlices slices ahead, so phase 3 finds the span's V in L2.
// Needs block_size % 16 == 0, partition starts at multiples of 16 and G <= 8; the caller checks and falls back
// to the AVX-512 kernel otherwise. Twice as fast as that kernel with the KV in cache, but slower when many
// sequences stream their KV from memory (11 vs 14 GB/s at 256 x 1024; cause not found: a longer prefetch
// distance or prefetching V during phase 1 did not change it), so the caller uses it only for small batches.
#pragma once

#include "isa.h"

#if KVPAGE_ISA_AMX

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

namespace kvpage {

// The kernel lets a process use the AMX tile state only after asking (Linux >= 5.16). Asked once; a refusal
// (older kernel, a hypervisor that hides AMX) leaves the AVX-512 kernel in charge.
constexpr int64_t kAmxPrefetchSlices = 4;
// Keys per span: a span's V (512 x kv_heads x D bf16; 192 KiB for SmolLM2) waits in L2 between phases 1 and 3.
constexpr int64_t kAmxSpan = 512;

inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg with the whole 64-byte configuration as its operand. Why: GCC 12's _tile_loadconfig declares only a
// pointer's 8 bytes as read, so the compiler may sink or drop stores to the rest of the struct (the tiles' rows
// and widths) past the instruction; a configuration whose last fields were set under a condition loaded stale
// shapes that way, and the next tile product raised an illegal instruction.
inline void load_tile_config(const TileConfig& cfg) { asm volatile("ldtilecfg %0" : : "m"(cfg)); }

// Tiles: 0 = K slice (16 keys x 32 dims), 1 = Q^T pairs (16 dim pairs x G rows), 2 = scores (16 keys x G).
inline void amx_configure(int64_t G) {
  TileConfig cfg;
  cfg.rows[0] = 16;
  cfg.colsb[0] = 64;
  cfg.rows[1] = 16;
  cfg.colsb[1] = static_cast<uint16_t>(4 * G);
  cfg.rows[2] = 16;
  cfg.colsb[2] = static_cast<uint16_t>(4 * G);
  load_tile_config(cfg);
}

inline void amx_release() { _tile_release(); }

// Every tile 16 rows x 64 bytes (the GEMM and the prompt kernel, whose operands are all full tiles).
inline void amx_configure_full() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// One P.V product step over 64 dims: the P tile (bf16 weights of 32 keys per row, row stride p_stride bytes)
// times 32 keys of V in [16 key pairs][D dims][2] order from v (its first of the 64 dims), accumulated into
// tiles 0-3 (dims 0-15, ..., 48-63). P goes to tile 4; the V operands alternate between tiles 5 and 7, so that
// loading the next need not wait for the product reading the last (tiles are not renamed).
template <int64_t D>
inline void pv_product(const at::BFloat16* p, int64_t p_stride, const at::BFloat16* v) {
  _tile_loadd(4, p, p_stride);
  _tile_loadd(5, v, 4 * D);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(7, v + 32, 4 * D);
  _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(5, v + 64, 4 * D);
  _tile_dpbf16ps(2, 4, 5);
  _tile_loadd(7, v + 96, 4 * D);
  _tile_dpbf16ps(3, 4, 7);
}
inline void pv_product64(const at::BFloat16* p, int64_t p_stride, const at::BFloat16* v) {
  pv_product<64>(p, p_stride, v);
}

// Accumulator tiles 0-3 (16 dims each) to / from acc rows of row_floats floats (64: one head of 64 dims).
inline void store_acc64(float* acc, int64_t row_floats = 64) {
  _tile_stored(0, acc, row_floats * 4);
  _tile_stored(1, acc + 16, row_floats * 4);
  _tile_stored(2, acc + 32, row_floats * 4);
  _tile_stored(3, acc + 48, row_floats * 4);
}
inline void load_acc64(const float* acc) {
  _tile_loadd(0, acc, 256);
  _tile_loadd(1, acc + 16, 256);
  _tile_loadd(2, acc + 32, 256);
  _tile_loadd(3, acc + 48, 256);
}

// One decode task: R = kv_heads * G query rows (query row r = head r; KV head r / G) over keys
// [k_begin, k_end), every one visible. Writes the unnormalized float32 sums acc[R][D], the row maxima m[R]
// and the sums of weights l[R], like attend_tile_bf16. k_begin must be a multiple of 16.
template <int64_t D, int64_t G>
void attend_decode_amx(const at::BFloat16* q, int64_t kv_heads, const at::BFloat16* kcache,
                       const at::BFloat16* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                       int64_t k_begin,
                       int64_t k_end, float* acc, float* m, float* l, std::vector<float>& scratch, float scale) {
  static_assert(D % 32 == 0, "head size must be a multiple of 32");
  constexpr int64_t NC = D / 32;  // 32-dim slices of a bf16 row (AMX K steps; 512-bit chunks)
  constexpr int64_t NF = D / 16;  // 512-bit chunks of a float row
  const int64_t R = kv_heads * G;
  const int64_t span_pad = std::min<int64_t>(kAmxSpan, (k_end - k_begin + 15) / 16 * 16);
  const int64_t row_stride = kv_heads * D;
  // scratch: scores [R][span_pad] floats | weights [R][span_pad] bf16 | Q^T pairs [kv_heads][NC][16][G] int32 |
  // one score tile [16][16] floats | interleaved V slice [8 pairs][NC][64] bf16
  scratch.resize(static_cast<size_t>(R * span_pad * 3 / 2 + kv_heads * NC * 16 * G + 256 + 8 * D + 16));
  float* scores = scratch.data();
  auto* wts = reinterpret_cast<at::BFloat16*>(scores + R * span_pad);
  auto* qpack = reinterpret_cast<int32_t*>(scores + R * span_pad * 3 / 2);
  float* ctile = reinterpret_cast<float*>(qpack + kv_heads * NC * 16 * G);
  ctile = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(ctile) + 63) & ~uintptr_t(63));
  auto* vpairs = reinterpret_cast<at::BFloat16*>(ctile + 256);

  // Q^T in the tile's pair layout: row i of (head h, slice c) holds, for each group row g, dims 32c+2i, +1.
  const auto* q32 = reinterpret_cast<const int32_t*>(q);
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t c = 0; c < NC; ++c)
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t g = 0; g < G; ++g)
          qpack[((h * NC + c) * 16 + i) * G + g] = q32[(h * G + g) * (D / 2) + 16 * c + i];

  // Blocks are scattered, so the hardware prefetcher stops at each block's end: ask for the K and V of the
  // 16-key slice kAmxPrefetchSlices slices later (following the block table) while this one is scored, so
  // the span's V is in L2 for phase 3.
  auto prefetch_slice = [&](int64_t t) {
    const int64_t ahead = t + 16 * kAmxPrefetchSlices;
    if (ahead >= k_end) return;
    const int64_t at = table[ahead / block_size] * block_stride + (ahead % block_size) * row_stride;
    const char* pk = reinterpret_cast<const char*>(kcache + at);
    const char* pv = reinterpret_cast<const char*>(vcache + at);
    const int64_t lines = (std::min<int64_t>(16, k_end - ahead) * row_stride * 2 + 63) / 64;
    for (int64_t i = 0; i < lines; ++i) {
      _mm_prefetch(pk + 64 * i, _MM_HINT_T1);
      _mm_prefetch(pv + 64 * i, _MM_HINT_T1);
    }
  };

  const __m512i gather_idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(16));
  const __m512 vscale = _mm512_set1_ps(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  reset_partials(acc, m, l, R, D);  // kept in the interleaved element order of unpacklo/hi until the end
  for (int64_t s0 = k_begin; s0 < k_end; s0 += kAmxSpan) {
    const int64_t s1 = std::min(k_end, s0 + kAmxSpan);
    const int64_t n = s1 - s0;

    // Phase 1: scores of the span.
    for (int64_t t = s0; t < s1; t += 16) {
      prefetch_slice(t);
      const at::BFloat16* kslice = kcache + table[t / block_size] * block_stride + (t % block_size) * row_stride;
      for (int64_t h = 0; h < kv_heads; ++h) {
        _tile_zero(2);
        for (int64_t c = 0; c < NC; ++c) {
          _tile_loadd(0, kslice + h * D + 32 * c, row_stride * 2);
          _tile_loadd(1, qpack + (h * NC + c) * 16 * G, G * 4);
          _tile_dpbf16ps(2, 0, 1);
        }
        _tile_stored(2, ctile, 64);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 sc = _mm512_i32gather_ps(
              _mm512_add_epi32(gather_idx, _mm512_set1_epi32(static_cast<int>(g))), ctile, 4);
          _mm512_storeu_ps(scores + (h * G + g) * span_pad + (t - s0), _mm512_mul_ps(sc, vscale));
        }
      }
    }

    // Phase 2: softmax per row against the running max (earlier spans rescaled when it rises); keys past the
    // span's end (the rest of its last slice) get weight 0.
    for (int64_t r = 0; r < R; ++r) {
      const float* sr = scores + r * span_pad;
      __m512 vmax = _mm512_set1_ps(neg_inf);
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
        vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_loadu_ps(sr + i));
      }
      const float mx = std::max(m[r], _mm512_reduce_max_ps(vmax));
      if (m[r] != neg_inf && mx != m[r]) {
        const __m512 corr = _mm512_set1_ps(exp_neg(m[r] - mx));
        l[r] *= exp_neg(m[r] - mx);
        for (int64_t c = 0; c < NF; ++c)
          _mm512_storeu_ps(acc + r * D + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * c), corr));
      }
      m[r] = mx;
      const __m512 vmx = _mm512_set1_ps(mx);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
        const __m512 w = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sr + i), vmx), k);
        vsum = _mm512_add_ps(vsum, w);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wts + r * span_pad + i), (__m256i)_mm512_cvtneps_pbh(w));
      }
      l[r] += _mm512_reduce_add_ps(vsum);
    }

    // Phase 3: values of the span (already requested in phase 1).
    for (int64_t t = s0; t < s1; t += 16) {
      const int64_t nv = std::min<int64_t>(16, s1 - t);
      const at::BFloat16* vslice = vcache + table[t / block_size] * block_stride + (t % block_size) * row_stride;
      const int64_t pairs = (nv + 1) / 2;
      for (int64_t h = 0; h < kv_heads; ++h) {
        interleave_value_pairs<NC>(vslice + h * D, row_stride, nv, vpairs);  // rows past the span: zero
        __m512 av[G][NF];
        const int32_t* wrow[G];
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = h * G + g;
          wrow[g] = reinterpret_cast<const int32_t*>(wts + r * span_pad + (t - s0));
          for (int64_t c = 0; c < NF; ++c) av[g][c] = _mm512_loadu_ps(acc + r * D + 16 * c);
        }
        for (int64_t pr = 0; pr < pairs; ++pr) {
          __m512i vv[NF];
          for (int64_t c = 0; c < NF; ++c)
            vv[c] = _mm512_loadu_si512(reinterpret_cast<const void*>(vpairs + pr * NC * 64 + 32 * c));
          for (int64_t g = 0; g < G; ++g) {
            const __m512bh wb = (__m512bh)_mm512_set1_epi32(wrow[g][pr]);
            for (int64_t c = 0; c < NF; ++c) av[g][c] = _mm512_dpbf16_ps(av[g][c], (__m512bh)vv[c], wb);
          }
        }
        for (int64_t g = 0; g < G; ++g)
          for (int64_t c = 0; c < NF; ++c) _mm512_storeu_ps(acc + (h * G + g) * D + 16 * c, av[g][c]);
      }
    }
  }
  restore_pair_order<D>(acc, R);
}

}  // namespace kvpage
#endif
