// One step's paged-attention work, planned once and run for every layer.
//
// The tasks of a step (sequence, tile of query rows, context partition), the rows their partial results
// occupy, the runs of tasks each thread takes and the tiles whose partitions are merged depend only on the
// batch (query_start_loc, seq_lens), the head count and the thread count, never on a layer. So the attention
// metadata builder asks for the plan once per step (plan_attention) and every layer's call
// (paged_attention_planned) reuses it, as do the layers of a compiled decode step. The batch description is
// checked against the cache's geometry once, here.
#pragma once

#include "tensor.h"

#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

namespace kvpage::attn {

struct Task {
  int64_t seq, row0, nq, part;  // query rows row0 .. row0+nq-1 of the flat batch, every head
  int64_t pos0;                 // absolute position of the first query of the tile
  int64_t lo = 0;               // the tile's first visible key (its first query's window edge; 0 without one)
  bool first = true;            // the tile's first partition (its partial results are merged from here)

  // The keys [begin, end) this task attends to: its partition, from the window's edge up to its last query's
  // position. Partitions wholly before the edge are never made.
  std::pair<int64_t, int64_t> keys(int64_t partition_size) const {
    const int64_t begin = part * partition_size;
    return {std::max(begin, lo), std::min(pos0 + nq, begin + partition_size)};
  }
};

struct AttentionPlan {
  // The batch, as checked (contiguous int64): sequence s owns query rows query_start_loc[s] .. [s+1]-1, the
  // last of its seq_lens[s] positions, and its keys through block_tables[s].
  torch::Tensor block_tables, query_start_loc, seq_lens;
  int64_t num_heads = 0, num_rows = 0;  // of the query it runs on
  int64_t num_blocks = 0, block_size = 0;  // of the caches it was checked against
  int64_t partition_size = 0;  // keys per task, at most (a multiple of 16, or "no split")
  int64_t window = 0;          // sliding window in positions (a query sees itself and window - 1 keys back); 0: none
  bool few_tasks = false;  // contexts split into partitions because tiles alone would leave threads idle
  bool invariant = false;  // the tasks and their arithmetic depend on each sequence alone, not on the batch
  std::vector<Task> tasks;
  std::vector<int64_t> offset;  // first partial row of each task (num_tasks + 1)
  std::vector<int64_t> cut;     // run c: tasks cut[c] .. cut[c+1]-1 (equal estimated cost, several per thread)
  std::vector<int64_t> starts;  // the first task (partition 0) of each tile, for the merge

  int64_t num_tasks() const { return static_cast<int64_t>(tasks.size()); }
};

// Hands out a plan's runs of tasks in order, one at a time, to whichever thread asks first. A plan has several
// runs per thread, so a thread that falls behind (more work than the cost estimate said, colder data, its core
// taken for a while by another process) does not hold the other threads at the end of the call; a run is
// contiguous, so the loops' prefetch still runs on into the next task within it.
class RunClaims {
 public:
  explicit RunClaims(const AttentionPlan& plan)
      : cut_(plan.cut), runs_(static_cast<int64_t>(plan.cut.size()) - 1, 1) {}
  int64_t chunks() const { return runs_.chunks(); }
  bool next(int64_t& begin, int64_t& end) {
    int64_t run = 0, after = 0;
    if (!runs_.next(run, after)) return false;
    begin = cut_[run];
    end = cut_[run + 1];
    return true;
  }

 private:
  const std::vector<int64_t>& cut_;
  kvpage::ChunkClaims runs_;  // the runs' indices, one at a time
};

// The keys of the task after task ti within its run (which ends at `end`), for the loops' prefetch to run on
// into; none past the run's end (the thread's next run is not known yet). tables: [S, max_blocks].
inline kvpage::NextKeys next_keys(const AttentionPlan& plan, const int64_t* tables, int64_t max_blocks, int64_t ti,
                                  int64_t end) {
  kvpage::NextKeys next;
  if (ti + 1 < end) {
    const Task& nt = plan.tasks[ti + 1];
    next.table = tables + nt.seq * max_blocks;
    std::tie(next.begin, next.end) = nt.keys(plan.partition_size);
  }
  return next;
}

// work(claims) on every thread the plan's runs can keep busy.
template <typename F>
void run_claimed(const AttentionPlan& plan, F&& work) {
  RunClaims claims(plan);
  kvpage::on_claiming_threads(claims, work);
}

// The plan of a batch over caches of num_blocks blocks of block_size tokens, for queries of num_heads heads.
// partition_size: keys per task when contexts are split; split_short: one stream's short contexts are cut over
// the threads (kvpage.envs KVPAGE_SPLIT_SHORT).
// window > 0: a sliding-window layer's plan (keys before a tile's window are neither read nor scored).
// invariant (kvpage.envs KVPAGE_BATCH_INVARIANT): every context is cut at every partition_size keys whatever the
// batch, short contexts are not cut over idle threads, and no loop is chosen by the batch's size, so a query
// row's output is the same bits alone, in a busy step or in any chunk of its prompt.
std::shared_ptr<AttentionPlan> plan_attention(torch::Tensor block_tables, torch::Tensor query_start_loc,
                                              torch::Tensor seq_lens, int64_t num_heads, int64_t num_blocks,
                                              int64_t block_size, int64_t partition_size, bool split_short,
                                              int64_t window = 0, bool invariant = false);

}  // namespace kvpage::attn
