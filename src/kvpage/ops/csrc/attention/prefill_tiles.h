// The tile products of prefill_amx.cpp: prompts' K/V copied into the products' operand order, then causal
// (optionally sliding-window) attention of 16-row query blocks over them with AMX tiles. Head sizes 64, 128, 256.
//
// Scratch layout per (prompt, KV head), keys counted from the prompt's kbase: K as [16-key block][D / 32 dim
// chunks][16 dim pairs][16 keys][2] (a B tile is 1 KiB contiguous; the packed cache's 16-key groups already hold
// it so), V as [32-key block][16 key pairs][D dims][2] (a 32-key block is two of the cache's V groups).
// A task = (prompt, query head, 16 query rows): scores against every key block from the one holding its first
// row's window edge up to its diagonal, softmax per row in float32 over its visible keys (weights rounded to bf16
// for the product), then P.V 64 dims at a time into four accumulator tiles, divided by the row sums at the end.
#pragma once

#include "tensor.h"

#include <ATen/Parallel.h>

#include "attention/amx_rows.h"  // amx_configure_full, pv_product, store_acc64, exp16, KVPAGE_ISA_AMX
#include "attention/packed_kv.h"  // packed_group_offset, stage_value_group

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace kvpage::prefill {

#if KVPAGE_ISA_AMX
// Tiles (all full): 0-3 = scores of four 16-key blocks (16 x 16 float32), then the output accumulators (16 rows
// x 16 dims); 4/5 = Q (16 rows x 32 dims) during scores; 6/7 = K operands; during P.V 4 = P, 5/7 = V.

// Keys a prompt holds per KV head in the packed K (16-key blocks) and V (32-key blocks).
inline int64_t k_slots(int64_t n) { return (n + 15) / 16 * 16; }
inline int64_t v_slots(int64_t n) { return (n + 31) / 32 * 32; }

struct Prompt {
  int64_t start, n;      // its query rows in query / out
  int64_t cached;        // keys before its first query (0 for a fresh prompt); it sees cached + n keys
  int64_t kbase;         // its first key in the scratch: 0, or with a window the 16-key group of its first
                         // query's window edge (the cache's blocks before it may be freed)
  int64_t k_off, v_off;  // element offsets of this prompt's packed K / V (KV head 0) in the scratch buffers
  int64_t seq;           // its row of the block tables (cache-read prompts)
  int64_t keys() const { return cached + n; }
  int64_t held() const { return keys() - kbase; }  // keys in the scratch
};

// The first key query position `pos` sees (window: itself and window - 1 keys back; 0: every key before it).
inline int64_t window_edge(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Lanes of keys j .. j + 15 inside [from, to).
inline __mmask16 range_mask(int64_t j, int64_t from, int64_t to) {
  const int64_t lo = std::clamp<int64_t>(from - j, 0, 16), hi = std::clamp<int64_t>(to - j, 0, 16);
  if (hi <= lo) return 0;
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// Packs one fresh prompt's KV head h (kbase 0): K into kp, V into vp. Both arrive zeroed, so the keys past n stay
// zero.
template <int64_t D>
void pack_head(const at::BFloat16* key, int64_t sk, const at::BFloat16* value, int64_t sv, int64_t h,
               const Prompt& p, at::BFloat16* kp, at::BFloat16* vp) {
  auto* k32 = reinterpret_cast<uint32_t*>(kp);
  for (int64_t j = 0; j < p.n; ++j) {
    const auto* krow = reinterpret_cast<const uint32_t*>(key + (p.start + j) * sk + h * D);
    const at::BFloat16* vrow = value + (p.start + j) * sv + h * D;
    uint32_t* kb = k32 + (j / 16) * 16 * (D / 2);  // this key's 16-key block, in 32-bit words
    for (int64_t pair = 0; pair < D / 2; ++pair) kb[pair * 16 + j % 16] = krow[pair];  // [chunk][16 pairs] = pair
    at::BFloat16* vb = vp + (j / 32) * 32 * D + ((j % 32) / 2) * 2 * D + (j % 2);
    for (int64_t d = 0; d < D; ++d) vb[2 * d] = vrow[d];
  }
}

// Packs KV head h of a prompt's keys kbase .. keys() - 1 from the packed cache (packed_kv.h): a K group is the
// scratch's 16-key block as it is; a V group is half of a 32-key block. Every V slot past the last key is zeroed
// (a never-written cache slot, or the uninitialized scratch, may hold NaN, which a zero weight would not cancel);
// K there is never used (its scores are masked out of the softmax).
template <int64_t D>
void pack_head_cached(const at::BFloat16* kcache, const at::BFloat16* vcache, const int64_t* table,
                      int64_t block_size, int64_t block_stride, int64_t kv_heads, int64_t h, const Prompt& p,
                      at::BFloat16* kp, at::BFloat16* vp) {
  const int64_t L = p.keys(), group = 16 * D, groups = (p.held() + 15) / 16;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t pos = p.kbase + g * 16;
    const int64_t base =
        kvpage::packed_group_offset(table[pos / block_size], pos % block_size, block_stride, kv_heads, D) + h * group;
    std::memcpy(kp + g * group, kcache + base, group * sizeof(at::BFloat16));
    at::BFloat16* vdst = vp + (g / 2) * 32 * D + (g % 2) * 8 * 2 * D;
    if (L - pos >= 16)
      std::memcpy(vdst, vcache + base, group * sizeof(at::BFloat16));
    else
      kvpage::stage_value_group<D>(vcache + base, L - pos, vdst);
  }
  if (groups % 2 == 1)  // the last 32-key V block's second half holds no key (the scratch is not zeroed)
    std::memset(vp + groups * group, 0, group * sizeof(at::BFloat16));
}

// One 32-dim chunk of the scores of NB consecutive 16-key blocks: K operands from kptr (blocks 16 * D apart)
// times the Q tile QT, into tiles 0..NB-1; K loads alternate between tiles 6 and 7 so that each waits only for
// the product two places earlier (tiles are not renamed). A macro: tile numbers are spelled into the instruction.
#define KVPAGE_SCORE_CHUNK(QT, kptr)     \
  do {                                   \
    const at::BFloat16* k_ = (kptr);     \
    _tile_loadd(6, k_, 64);              \
    _tile_dpbf16ps(0, QT, 6);            \
    if constexpr (NB > 1) {              \
      _tile_loadd(7, k_ + 16 * D, 64);   \
      _tile_dpbf16ps(1, QT, 7);          \
    }                                    \
    if constexpr (NB > 2) {              \
      _tile_loadd(6, k_ + 32 * D, 64);   \
      _tile_dpbf16ps(2, QT, 6);          \
    }                                    \
    if constexpr (NB > 3) {              \
      _tile_loadd(7, k_ + 48 * D, 64);   \
      _tile_dpbf16ps(3, QT, 7);          \
    }                                    \
  } while (0)

// Scores of NB consecutive 16-key blocks (K operands from k0 on) against 16 query rows q (row pitch qstride
// bytes), into tiles 0..NB-1, stored at dst (row stride span floats). Several blocks at once: a single score
// tile would serialize zero -> product -> product -> store for every block. Head size 64 keeps its two Q tiles
// (4/5) loaded by the caller; larger heads load them chunk by chunk, alternating.
template <int64_t D, int NB>
inline void score_blocks(const at::BFloat16* q, int64_t qstride, const at::BFloat16* k0, float* dst, int64_t span) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t c = 0; c < D / 32; c += 2) {
    if constexpr (D != 64) _tile_loadd(4, q + c * 32, qstride);
    KVPAGE_SCORE_CHUNK(4, k0 + c * 512);
    if constexpr (D != 64) _tile_loadd(5, q + (c + 1) * 32, qstride);
    KVPAGE_SCORE_CHUNK(5, k0 + (c + 1) * 512);
  }
  _tile_stored(0, dst, span * 4);
  if constexpr (NB > 1) _tile_stored(1, dst + 16, span * 4);
  if constexpr (NB > 2) _tile_stored(2, dst + 32, span * 4);
  if constexpr (NB > 3) _tile_stored(3, dst + 48, span * 4);
}
#undef KVPAGE_SCORE_CHUNK

// The attention of every prompt (its packed K/V in kpack / vpack, KV head h at k_off + h * k_slots(held)) into
// out: tasks of (prompt, query head, 16 query rows), taken costliest first from a shared counter.
template <int64_t D>
void attend_prompts(const std::vector<Prompt>& prompts, const at::BFloat16* kpack, const at::BFloat16* vpack,
                    const at::BFloat16* qp, int64_t sq, at::BFloat16* op, int64_t so, int64_t H, int64_t G,
                    double scale, int64_t window) {
  struct Task {
    int32_t prompt, head;
    int64_t row0;
    int64_t cost;  // keys the task's rows span
  };
  std::vector<Task> tasks;
  int64_t max_held = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Prompt& p = prompts[i];
    max_held = std::max(max_held, p.held());
    for (int64_t r0 = 0; r0 < p.n; r0 += 16) {
      const int64_t last = std::min(p.n, r0 + 16) - 1;
      const int64_t cost = p.cached + last + 1 - window_edge(p.cached + r0, window);
      for (int64_t hq = 0; hq < H; ++hq) tasks.push_back({static_cast<int32_t>(i), static_cast<int32_t>(hq), r0, cost});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });

  const int64_t max32 = (max_held + 31) / 32 * 32 + 32;
  const float fscale = static_cast<float>(scale);
  // Threads take tasks from a shared counter, costliest first, so that the last tasks are the short ones.
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    kvpage::amx_configure_full();
    std::vector<float> scores(16 * max32);
    std::vector<at::BFloat16> probs(16 * max32);
    std::vector<at::BFloat16> qstage(16 * D);
    std::vector<float> obuf(16 * D);
    float rsum[16];
    for (int64_t ti = next++; ti < num_tasks; ti = next++) {
      const Task& task = tasks[ti];
      const Prompt& p = prompts[task.prompt];
      const int64_t h = task.head / G, r0 = task.row0, c = p.cached;
      const int64_t rows = std::min<int64_t>(16, p.n - r0);
      const at::BFloat16* kh = kpack + p.k_off + h * k_slots(p.held()) * D;
      const at::BFloat16* vh = vpack + p.v_off + h * v_slots(p.held()) * D;
      // Q rows r0..r0+15 of this head (a partial last block is staged with zero rows)
      const at::BFloat16* q = qp + (p.start + r0) * sq + task.head * D;
      int64_t qstride = sq * 2;
      if (rows < 16) {
        std::fill(qstage.begin(), qstage.end(), at::BFloat16(0.0f));
        for (int64_t r = 0; r < rows; ++r) std::memcpy(qstage.data() + r * D, q + r * sq, D * sizeof(at::BFloat16));
        q = qstage.data();
        qstride = D * 2;
      }
      // Keys in the scratch's count (from kbase): the task reads from s0, the 32-key block holding its first row's
      // window edge, up to the 16-key block holding its last row's diagonal.
      const int64_t s0 = (window_edge(c + r0, window) - p.kbase) / 32 * 32;
      const int64_t nk16 = (c + r0 + rows - 1 - p.kbase) / 16 + 1 - s0 / 16, nk32 = (nk16 + 1) / 2, span = nk32 * 32;
      // 1. scores
      if constexpr (D == 64) {
        _tile_loadd(4, q, qstride);
        _tile_loadd(5, q + 32, qstride);
      }
      for (int64_t kb = 0; kb < nk16; kb += 4) {
        float* dst = scores.data() + kb * 16;
        const at::BFloat16* k0 = kh + (s0 / 16 + kb) * 16 * D;
        switch (std::min<int64_t>(4, nk16 - kb)) {
          case 4: score_blocks<D, 4>(q, qstride, k0, dst, span); break;
          case 3: score_blocks<D, 3>(q, qstride, k0, dst, span); break;
          case 2: score_blocks<D, 2>(q, qstride, k0, dst, span); break;
          default: score_blocks<D, 1>(q, qstride, k0, dst, span); break;
        }
      }
      // 2. softmax per row over its keys [window edge, diagonal]; weights as bf16, zeros elsewhere in the span.
      // 16-key chunks: [jin, jend) wholly visible, a masked chunk at either edge (j0 before, jend after) when from
      // or to falls inside one, zero weights elsewhere in the span: the mask is worked out at the two edges only
      // and no exponential is taken past the diagonal. Every row's maximum is found before any row's weights, so
      // that the rows' reductions (a chain of dependent shuffles each) overlap instead of running in turn.
      struct Edges {
        int64_t j0, jin, jend;
        __mmask16 lead, trail;  // the edge chunks' visible lanes (0: no such chunk)
      };
      auto edges = [&](int64_t r) {
        const int64_t from = window_edge(c + r0 + r, window) - p.kbase - s0, to = c + r0 + r + 1 - p.kbase - s0;
        Edges e;
        e.j0 = from / 16 * 16;
        e.jin = std::min((from + 15) / 16 * 16, to / 16 * 16);
        e.jend = std::max(e.jin, to / 16 * 16);
        e.lead = e.j0 < e.jin ? range_mask(e.j0, from, to) : 0;
        e.trail = e.jend < to ? range_mask(e.jend, from, to) : 0;
        return e;
      };
      Edges edge[16];
      float rmax[16];
      const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t r = 0; r < rows; ++r) {
        const float* s = scores.data() + r * span;
        const Edges& e = edge[r] = edges(r);
        __m512 vmax = _mm512_mask_max_ps(ninf, e.lead, ninf, _mm512_maskz_loadu_ps(e.lead, s + e.j0));
        for (int64_t j = e.jin; j < e.jend; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
        vmax = _mm512_mask_max_ps(vmax, e.trail, vmax, _mm512_maskz_loadu_ps(e.trail, s + e.jend));
        rmax[r] = _mm512_reduce_max_ps(vmax);
      }
      const __m512 sc = _mm512_set1_ps(fscale);
      const __m256i zero = _mm256_setzero_si256();
      for (int64_t r = 0; r < 16; ++r) {
        const float* s = scores.data() + r * span;
        at::BFloat16* pr = probs.data() + r * span;
        if (r >= rows) {
          std::memset(pr, 0, span * sizeof(at::BFloat16));
          rsum[r] = 1.f;
          continue;
        }
        const Edges& e = edge[r];
        const __m512 m = _mm512_set1_ps(rmax[r] * fscale);
        __m512 vsum = _mm512_setzero_ps();
        auto weigh = [&](int64_t j, __mmask16 k) {
          const __m512 w = kvpage::exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j), sc, m), k);
          vsum = _mm512_add_ps(vsum, w);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(w));
        };
        for (int64_t j = 0; j < e.j0; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), zero);
        if (e.lead != 0) weigh(e.j0, e.lead);
        for (int64_t j = e.jin; j < e.jend; j += 16) weigh(j, 0xFFFF);
        if (e.trail != 0) weigh(e.jend, e.trail);
        for (int64_t j = e.trail != 0 ? e.jend + 16 : e.jend; j < span; j += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), zero);
        rsum[r] = _mm512_reduce_add_ps(vsum);
      }
      // 3. P.V over the 32-key blocks, 64 dims at a time into four 16-dim accumulators
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < nk32; ++kb)
          kvpage::pv_product<D>(probs.data() + kb * 32, span * 2, vh + (s0 / 32 + kb) * 32 * D + 2 * d0);
        kvpage::store_acc64(obuf.data() + d0, D);
      }
      for (int64_t r = 0; r < rows; ++r) {
        at::BFloat16* o = op + (p.start + r0 + r) * so + task.head * D;
        const __m512 inv = _mm512_set1_ps(1.f / rsum[r]);
        const float* orow = obuf.data() + r * D;
        for (int64_t d = 0; d < D; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(orow + d), inv)));
      }
    }
    _tile_release();
  });
}

// Scratch offsets for every prompt (all KV heads).
template <int64_t D>
void place_scratch(std::vector<Prompt>& prompts, int64_t kv_heads, int64_t* k_total, int64_t* v_total) {
  *k_total = *v_total = 0;
  for (Prompt& p : prompts) {
    p.k_off = *k_total;
    p.v_off = *v_total;
    *k_total += kv_heads * k_slots(p.held()) * D;
    *v_total += kv_heads * v_slots(p.held()) * D;
  }
}
#endif

}  // namespace kvpage::prefill
