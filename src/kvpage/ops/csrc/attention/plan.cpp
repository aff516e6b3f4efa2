// plan_attention (attention/plan.h): a step's paged-attention tasks, once per step.

#include "attention/plan.h"

#include <ATen/Parallel.h>

#include <limits>

#include "attention/loop.h"
#include "common.h"

namespace kvpage::attn {

namespace {

// The batch description must fit the query and the cache: the kernels index with these numbers unchecked, so a
// bad offset or block id would read outside the tensors. O(sequences + blocks), once per step.
void check_batch(const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                 const torch::Tensor& seq_lens, int64_t num_blocks, int64_t block_size, int64_t window) {
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int64 [seqs] tensor");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) == S + 1,
              "query_start_loc must be a contiguous int64 tensor of seqs + 1 = ", S + 1, " offsets");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.size(0) >= S,
              "block_tables must be an int64 [seqs, max_blocks] tensor with a row per sequence");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(qsl[0] == 0, "query_start_loc must run from 0, got ", qsl[0], " .. ", qsl[S]);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(q_len >= 0, "query_start_loc decreases at sequence ", s);
    TORCH_CHECK(lens[s] >= q_len, "sequence ", s, " has fewer keys (", lens[s], ") than queries (", q_len, ")");
    // With a window only the blocks the window reaches are read (the others may be placeholders).
    const int64_t first = window > 0 ? std::max<int64_t>(0, lens[s] - q_len - window + 1) / block_size : 0;
    kvpage::check_table_row(tables + s * max_blocks, max_blocks, lens[s], block_size, num_blocks, "sequence", s,
                            first);
  }
}

}  // namespace

std::shared_ptr<AttentionPlan> plan_attention(torch::Tensor block_tables, torch::Tensor query_start_loc,
                                              torch::Tensor seq_lens, int64_t num_heads, int64_t num_blocks,
                                              int64_t block_size, int64_t partition_size, bool split_short,
                                              int64_t window, bool invariant) {
  TORCH_CHECK(partition_size > 0, "partition_size must be positive");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(num_heads > 0 && num_blocks > 0 && block_size > 0, "bad plan geometry");
  auto plan = std::make_shared<AttentionPlan>();
  plan->block_tables = block_tables.contiguous();
  plan->query_start_loc = query_start_loc;
  plan->seq_lens = seq_lens;
  check_batch(plan->block_tables, query_start_loc, seq_lens, num_blocks, block_size, window);
  plan->window = window;
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t S = seq_lens.size(0), H = num_heads;
  plan->num_heads = H;
  plan->num_rows = qsl[S];
  plan->num_blocks = num_blocks;
  plan->block_size = block_size;

  // Tasks: (sequence, tile of up to kTile query tokens, context partition), all heads. Contexts are split
  // into partitions only when there are too few tiles to keep every core busy.
  int64_t base_tasks = 0;
  for (int64_t s = 0; s < S; ++s) base_tasks += (qsl[s + 1] - qsl[s] + kTile - 1) / kTile;
  const int64_t threads = at::get_num_threads();
  plan->few_tasks = base_tasks < 4 * threads;
  plan->invariant = invariant;
  if (!plan->few_tasks && !invariant)
    partition_size = std::numeric_limits<int64_t>::max() / 4 / 16 * 16;  // no split
  if (split_short && !invariant && base_tasks > 0 && base_tasks < threads) {
    // Fewer tiles than threads (one stream's decode): contexts shorter than a partition would leave threads
    // idle, so cut them into one part per idle thread, in multiples of 16 keys and at least kMinPartition.
    int64_t longest = 0;
    for (int64_t s = 0; s < S; ++s) longest = std::max(longest, window > 0 ? std::min(lens[s], window) : lens[s]);
    const int64_t ways = (threads + base_tasks - 1) / base_tasks;
    const int64_t part = ((longest + ways - 1) / ways + 15) / 16 * 16;
    partition_size = std::min(partition_size, std::max(kMinPartition, part));
  }
  plan->partition_size = partition_size;
  std::vector<Task>& tasks = plan->tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    for (int64_t j0 = 0; j0 < q_len; j0 += kTile) {
      const int64_t nq = std::min(kTile, q_len - j0);
      const int64_t pos0 = lens[s] - q_len + j0;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
      const int64_t parts = (pos0 + nq + partition_size - 1) / partition_size;
      for (int64_t p = lo / partition_size; p < parts; ++p)
        tasks.push_back({s, qsl[s] + j0, nq, p, pos0, lo, p == lo / partition_size});
    }
  }
  const int64_t T = plan->num_tasks();
  plan->offset.assign(static_cast<size_t>(T + 1), 0);
  for (int64_t ti = 0; ti < T; ++ti) plan->offset[ti + 1] = plan->offset[ti] + tasks[ti].nq * H;

  // Runs of contiguous tasks (so the prefetch can run on into the next task) at equal estimated cost rather
  // than equal task counts: contexts vary several-fold within a batch, and a prompt tile (up to kTile queries)
  // costs several decode tasks per key. kRunsPerThread runs per thread, claimed in order as threads come free
  // (RunClaims): the estimate need not be exact, and a thread whose core is taken for a while by another
  // process does not stall the other at the end of the call.
  const int64_t nt = std::min<int64_t>(threads * kRunsPerThread, T);
  std::vector<double> cost(static_cast<size_t>(T + 1), 0.0);  // running sum
  for (int64_t ti = 0; ti < T; ++ti) {
    const auto [kb, ke] = tasks[ti].keys(partition_size);
    cost[ti + 1] = cost[ti] + static_cast<double>(ke - kb + 32) * (1.0 + 0.6 * static_cast<double>(tasks[ti].nq - 1));
  }
  plan->cut.assign(static_cast<size_t>(std::max<int64_t>(nt, 0) + 1), T);
  plan->cut[0] = 0;
  for (int64_t c = 1; c < nt; ++c)
    plan->cut[c] = std::lower_bound(cost.begin(), cost.end(), cost[T] * c / nt) - cost.begin();
  for (int64_t ti = 0; ti < T; ++ti)
    if (tasks[ti].first) plan->starts.push_back(ti);
  return plan;
}

}  // namespace kvpage::attn
