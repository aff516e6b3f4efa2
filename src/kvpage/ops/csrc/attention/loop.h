// The pieces every paged-attention main loop shares (attention/paged_attention.cpp picks the loop): the
// task geometry constants, row loads, float32 dot products, the exponent-and-sum of a score block, and
// the prefetch of blocks ahead that the row-layout loops issue.
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

namespace kvpage::attn {

// Runs CALL(n) over the G query rows of a KV head in batches of at most four (g0: the batch's first row), n a
// compile-time constant: the register budget of one pass of the int8 loops (quant_loop.h, packed_int8.h).
#define KVPAGE_ROW_BATCHES(CALL)            \
  for (int64_t g0 = 0; g0 < G; g0 += 4) {   \
    switch (std::min<int64_t>(4, G - g0)) { \
      case 1: CALL(1); break;               \
      case 2: CALL(2); break;               \
      case 3: CALL(3); break;               \
      default: CALL(4); break;              \
    }                                       \
  }

using kvpage::exp_neg;
using kvpage::reset_partials;
#if KVPAGE_ISA_AVX512
using kvpage::exp16;
#endif
#if KVPAGE_ISA_AVX2
using kvpage::exp8;
#endif
using kvpage::to_float;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

constexpr int64_t kMaxGroup = 64;

// The first key of a block run [t, t + n) that a query at position `pos` sees under a sliding window of
// `window` positions (itself and window - 1 before it; window 0: no window), clamped to [0, n].
inline int64_t window_first(int64_t window, int64_t pos, int64_t t, int64_t n) {
  if (window <= 0) return 0;
  return std::min(n, std::max<int64_t>(0, pos - window + 1 - t));
}

constexpr int64_t kTile = 16;  // query tokens per task (prompt chunks); decode tasks hold one
constexpr int64_t kRunsPerThread = 8;  // runs of tasks per thread in a plan, claimed as threads come free
constexpr int64_t kMinPartition = 64;  // keys: below this, merging partitions costs more than a second thread saves

#if KVPAGE_ISA_AVX512BF16
// q . k for bf16 vectors of length D (a multiple of 32): products are exact in float32, summed in float32.
inline float dot_bf16(const at::BFloat16* q, const at::BFloat16* k, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512i qv = _mm512_loadu_si512(reinterpret_cast<const void*>(q + d));
    const __m512i kv = _mm512_loadu_si512(reinterpret_cast<const void*>(k + d));
    acc = _mm512_dpbf16_ps(acc, (__m512bh)qv, (__m512bh)kv);
  }
  return _mm512_reduce_add_ps(acc);
}
#endif

// w[i] = exp(s[i] - mx) for i < n (every s[i] <= mx); returns the sum of the w[i].
inline float exp_shift_sum(float* s, int64_t n, float mx) {
#if KVPAGE_ISA_AVX512
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 w = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vmx), k);
    _mm512_mask_storeu_ps(s + i, k, w);
    vsum = _mm512_add_ps(vsum, w);
  }
  return _mm512_reduce_add_ps(vsum);
#else
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = exp_neg(s[i] - mx);
    sum += s[i];
  }
  return sum;
#endif
}

constexpr int64_t kPrefetchAhead = 2;  // blocks (the row-layout kernels' prefetch distance)

#if KVPAGE_ISA_AVX512 || KVPAGE_ISA_AVX2
// Blocks are scattered, so the hardware prefetcher cannot run ahead across a block boundary. Made where a row
// kernel starts a block (key t), this picks the block kPrefetchAhead blocks later and fetches its K and V rows
// into L2 in parts, so the requests do not queue up behind each other: part(i, parts) fetches the i-th of
// `parts` equal shares (the AVX-512 kernel takes one share per KV head; the loops that take units of blocks
// hand each block to a LineStream, which spreads its lines over the unit's work). Past the task's last block
// it runs on into the thread's next task (`next`), so a short context (decode at a few hundred keys: ~20
// blocks) does not start every sequence on cold misses.
template <typename KV>
struct BlockPrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t lines = 0;

  BlockPrefetch() = default;  // nothing to fetch
  // `ahead`: the distance in blocks (loops that take several blocks at once fetch past the ones they hold)
  BlockPrefetch(const KV* kcache, const KV* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                int64_t row_stride, int64_t t, int64_t k_begin, int64_t k_end, const NextKeys& next = {},
                int64_t ahead = kPrefetchAhead) {
    if (t % block_size != 0 && t != k_begin) return;  // not the start of a block
    const int64_t target = t / block_size + ahead;  // an index into the sequence's block table
    const int64_t last = (k_end - 1) / block_size;
    int64_t nb, rows;
    if (target <= last) {
      nb = table[target];
      rows = std::min<int64_t>(block_size, k_end - target * block_size);
    } else {
      if (next.table == nullptr) return;
      const int64_t key = (next.begin / block_size + target - last - 1) * block_size;
      if (key >= next.end) return;
      nb = next.table[key / block_size];
      rows = std::min<int64_t>(block_size, next.end - key);
    }
    k = reinterpret_cast<const char*>(kcache + nb * block_stride);
    v = reinterpret_cast<const char*>(vcache + nb * block_stride);
    lines = (rows * row_stride * static_cast<int64_t>(sizeof(KV)) + 63) / 64;
  }

  void part(int64_t idx, int64_t parts) const {
    for (int64_t i = idx * lines / parts; i < (idx + 1) * lines / parts; ++i) {
      _mm_prefetch(k + 64 * i, _MM_HINT_T1);
      _mm_prefetch(v + 64 * i, _MM_HINT_T1);
    }
  }
};
#endif

#if KVPAGE_ISA_AVX2
// Keys a pass of the loop takes at once (the lanes' kUnitKeys, 64 on AVX2 builds): with 16-token blocks, four
// blocks' scores go through one softmax step and their values into the same integer sums (attend_tile_codes),
// so the per-block work (the softmax's maxima and factors, the scaling of the sums into the float32 output) is
// paid once per 64 keys: on the family-23 EPYC (64 x 8K keys) int8 went from 0.87x to 0.74-0.81x the bf16
// cache's time, fp8 from 1.16x to 0.96-1.05x (32 keys: int8 0.81x; 128: 0.74x).
constexpr int kUnitBlocks = 8;  // blocks of a unit at most (8-token blocks)

// The blocks ahead of a unit (of one block or several), fetched into L2 a few lines of K and V at a time by
// step(), called all through the unit's work (scores, softmax, P.V): int8 work per byte is small, and a block's
// lines fetched at once fill the core's miss queue (on a Zen 3 at 64 x 8K keys: 1.35-1.45x bf16's time, against
// ~0.8x).
struct LineStream {
  BlockPrefetch<uint8_t> blocks[kUnitBlocks];  // where their K and V rows lie, how many lines
  int count = 0, cur = 0;
  int64_t lines = 0, next = 0, per_step = 1;   // next: the line of blocks[cur] to fetch next

  template <typename KV>
  void add(const BlockPrefetch<KV>& b) {  // a block of any cache dtype: its lines are bytes alike
    if (b.lines > 0 && count < kUnitBlocks) {
      BlockPrefetch<uint8_t>& c = blocks[count++];
      c.k = b.k;
      c.v = b.v;
      c.lines = b.lines;
      lines += b.lines;
    }
  }
  // spread the lines over about `steps` calls of step()
  void pace(int64_t steps) { per_step = std::max<int64_t>(1, (lines + steps - 1) / steps); }
  void step(int64_t n = 0) {
    for (int64_t todo = n > 0 ? n : per_step; todo > 0 && cur < count;) {
      const BlockPrefetch<uint8_t>& b = blocks[cur];
      const int64_t end = std::min(b.lines, next + todo);
      for (int64_t i = next; i < end; ++i) {
        _mm_prefetch(b.k + 64 * i, _MM_HINT_T1);
        _mm_prefetch(b.v + 64 * i, _MM_HINT_T1);
      }
      todo -= end - next;
      next = end;
      if (next == b.lines) {
        ++cur;
        next = 0;
      }
    }
  }
  void rest() { step(lines); }
};

// The runs of one unit: keys [t, t + n) of a sequence, cut at block edges into at most `max_runs` runs that each
// lie in one block (run b: keys [start[b], start[b] + len[b]) of the unit, from in-block offset off[b] of block
// id block[b]). The unit stops before k_end and before block index `stop` (-1: none), and `on_run(u)` is called
// with each run's first key (the caller's prefetch of what lies ahead).
struct UnitRuns {
  int64_t start[kUnitBlocks], len[kUnitBlocks], off[kUnitBlocks], block[kUnitBlocks];
  int count = 0;
  int64_t n = 0;

  template <class OnRun>
  UnitRuns(const int64_t* table, int64_t block_size, int64_t t, int64_t k_end, int64_t max_runs, int64_t stop,
           OnRun&& on_run) {
    while (count < max_runs && t + n < k_end && (t + n) / block_size != stop) {
      const int64_t u = t + n;
      off[count] = u % block_size;
      start[count] = n;
      len[count] = std::min(block_size - off[count], k_end - u);
      block[count] = table[u / block_size];
      on_run(u);
      n += len[count++];
    }
  }
  // run b's share of the unit's keys [first, visible), as offsets [lo, hi) into the run (empty: lo >= hi)
  void part(int b, int64_t first, int64_t visible, int64_t& lo, int64_t& hi) const {
    lo = std::max(first, start[b]) - start[b];
    hi = std::min(visible, start[b] + len[b]) - start[b];
  }
};
#endif

}  // namespace kvpage::attn
