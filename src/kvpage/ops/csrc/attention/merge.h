// The last phase of every paged-attention call: each tile's partitions (a long context split over threads)
// merged by their row maxima and weight sums, and the normalized outputs written in the query's dtype; and
// the task loop the quantized pages' kernels share (run_tasks) that ends in it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "attention/loop.h"
#include "attention/plan.h"

namespace kvpage::attn {

// Row r of a task is query r / H, head r % H; part_* hold every task's unnormalized partial results.
template <typename Q>
void merge_partitions(const AttentionPlan& plan, int64_t H, int64_t D, const std::vector<float>& part_acc,
                      const std::vector<float>& part_m, const std::vector<float>& part_l, Q* optr) {
  const std::vector<Task>& tasks = plan.tasks;
  const std::vector<int64_t>& offset = plan.offset;
  const std::vector<int64_t>& starts = plan.starts;
  const int64_t T = plan.num_tasks();
  const int64_t NS = static_cast<int64_t>(starts.size());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, NS, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(D));
    for (int64_t si = begin; si < end; ++si) {
      const int64_t t0 = starts[si];
      int64_t t1 = t0 + 1;
      while (t1 < T && !tasks[t1].first) ++t1;
      const Task& tk = tasks[t0];
      for (int64_t r = 0; r < tk.nq * H; ++r) {
        Q* o = optr + (tk.row0 * H + r) * D;
        if (t1 == t0 + 1) {  // one partition: normalize directly
          const float inv = 1.f / part_l[offset[t0] + r];
          const float* a = part_acc.data() + (offset[t0] + r) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<Q>(a[d] * inv);
          continue;
        }
        float M = neg_inf;
        for (int64_t ti = t0; ti < t1; ++ti) M = std::max(M, part_m[offset[ti] + r]);
        float L = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t ti = t0; ti < t1; ++ti) {
          const float pm = part_m[offset[ti] + r];
          if (pm == neg_inf) continue;  // this partition lies entirely after the row's position
          const float c = kvpage::exp_neg(pm - M);
          L += c * part_l[offset[ti] + r];
          const float* a = part_acc.data() + (offset[ti] + r) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += c * a[d];
        }
        const float inv = 1.f / L;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<Q>(acc[d] * inv);
      }
    }
  });
}

// Every task of the plan through tile(task, q, acc, m, l, next, scratch): q the task's query rows in float32
// times `scale` (rows r = j * H + head), acc / m / l its partial results, next the keys the thread runs on to
// (for prefetching), scratch a per-thread buffer; then the partitions merged into out. enter() and leave() run on
// each working thread before its first task and after its last (e.g. to configure AMX tiles and release them).
struct NoHook {
  void operator()() const {}
};
template <typename Q, typename Tile, typename Enter = NoHook, typename Leave = NoHook>
void run_tasks(const AttentionPlan& plan, const Q* qptr, int64_t H, int64_t D, double scale, Q* out, Tile&& tile,
               Enter enter = {}, Leave leave = {}) {
  const int64_t T = plan.num_tasks(), max_blocks = plan.block_tables.size(1);
  const int64_t* tables = plan.block_tables.data_ptr<int64_t>();
  std::vector<float> part_acc(static_cast<size_t>(plan.offset[T] * D));
  std::vector<float> part_m(static_cast<size_t>(plan.offset[T])), part_l(static_cast<size_t>(plan.offset[T]));
  run_claimed(plan, [&](RunClaims& claims) {
    enter();
    std::vector<float> qbuf(static_cast<size_t>(kTile * H * D)), scratch;
    for (int64_t begin = 0, end = 0; claims.next(begin, end);)
      for (int64_t ti = begin; ti < end; ++ti) {
        const Task& tk = plan.tasks[ti];
        const Q* qrows = qptr + tk.row0 * H * D;
        for (int64_t i = 0; i < tk.nq * H * D; ++i) qbuf[i] = kvpage::to_float(qrows[i]) * static_cast<float>(scale);
        const int64_t at = plan.offset[ti];
        tile(tk, qbuf.data(), part_acc.data() + at * D, part_m.data() + at, part_l.data() + at,
             next_keys(plan, tables, max_blocks, ti, end), scratch);
      }
    leave();
  });
  merge_partitions(plan, H, D, part_acc, part_m, part_l, out);
}

}  // namespace kvpage::attn
