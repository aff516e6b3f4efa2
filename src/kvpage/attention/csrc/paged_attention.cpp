// Paged attention on CPU for kvpage.
//
// KV layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16.
// A flat batch holds, for sequence s, query rows query_start_loc[s] .. query_start_loc[s+1]-1; they are the
// last q_len tokens of a context of seq_lens[s] tokens, so query j sits at position seq_len - q_len + j and
// attends to keys 0..that position (causal, with any cached prefix in front).
//
// One task = (sequence, query token, KV head, context partition). A task reads each key/value row of its
// partition once and uses it for every query head of the KV head's group (GQA), keeping a block-wise online
// softmax in float32. Long contexts are split into partitions whose partial results are merged afterwards,
// so a single long sequence still keeps every core busy.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using kvpage::exp_neg;
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

constexpr int64_t kTile = 16;  // query tokens per task (prompt chunks); decode tasks hold one

struct Task {
  int64_t seq, row0, nq, kv_head, part;  // rows row0 .. row0+nq-1 of the flat batch
  int64_t pos0;                          // absolute position of the first query of the tile
};

// One task: nq query tokens x G heads (R = nq * G rows, ordered (query, head)) over keys [k_begin, k_end) of
// its sequence; row r only sees keys <= pos0 + r / G. Float32 accumulators, running max and sum per row.
template <typename KV>
void attend_tile(const float* q, int64_t R, int64_t G, const KV* kcache, const KV* vcache, const int64_t* table,
                 int64_t block_size, int64_t kv_heads, int64_t head, int64_t D, int64_t pos0, int64_t k_begin,
                 int64_t k_end, float* acc, float* m, float* l, std::vector<float>& scratch) {
  const int64_t row_stride = kv_heads * D;
  const int64_t block_stride = block_size * row_stride;
  scratch.resize(static_cast<size_t>(block_size * D + R * block_size));
  float* rows = scratch.data();                 // this block's keys (then values) as float, [i][d]
  float* sc = scratch.data() + block_size * D;  // scores, then weights, [r][i]
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < R; ++r) {
    m[r] = neg_inf;
    l[r] = 0.f;
  }
  std::fill(acc, acc + R * D, 0.f);
  int64_t t = k_begin;
  while (t < k_end) {
    const int64_t off = t % block_size;
    const int64_t n = std::min(block_size - off, k_end - t);
    const int64_t phys = table[t / block_size];
    const KV* kbase = kcache + phys * block_stride + off * row_stride + head * D;
    const KV* vbase = vcache + phys * block_stride + off * row_stride + head * D;
    for (int64_t i = 0; i < n; ++i) load_row(kbase + i * row_stride, rows + i * D, D);
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = q + r * D;
      float* s = sc + r * block_size;
      const int64_t visible = std::min(n, pos0 + r / G + 1 - t);  // keys after this row's position are masked
      if (visible <= 0) {
        for (int64_t i = 0; i < n; ++i) s[i] = 0.f;
        continue;
      }
      float bmax = neg_inf;
      for (int64_t i = 0; i < visible; ++i) {
        s[i] = dot(qr, rows + i * D, D);
        bmax = std::max(bmax, s[i]);
      }
      const float new_m = std::max(m[r], bmax);
      const float corr = exp_neg(m[r] - new_m);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < visible; ++i) {
        const float w = exp_neg(s[i] - new_m);
        s[i] = w;
        sum += w;
      }
      for (int64_t i = visible; i < n; ++i) s[i] = 0.f;
      l[r] = l[r] * corr + sum;
      m[r] = new_m;
      if (corr != 1.f) {
        float* a = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] *= corr;
      }
    }
    for (int64_t i = 0; i < n; ++i) load_row(vbase + i * row_stride, rows + i * D, D);
    for (int64_t r = 0; r < R; ++r) {
      float* a = acc + r * D;
      const float* w = sc + r * block_size;
      for (int64_t i = 0; i < n; ++i) {
        const float wi = w[i];
        if (wi == 0.f) continue;
        const float* v = rows + i * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += wi * v[d];
      }
    }
    t += n;
  }
}

template <typename KV, typename Q>
void run_attention(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens, double scale,
                   int64_t partition_size, torch::Tensor& out) {
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const int64_t G = H / kv_heads;
  const int64_t S = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const Q* qptr = query.data_ptr<Q>();
  Q* optr = out.data_ptr<Q>();
  const KV* kcache = kv_cache.data_ptr<KV>();
  const KV* vcache = kcache + num_blocks * block_size * kv_heads * D;

  // Tasks: (sequence, tile of up to kTile query tokens, KV head, context partition). A tile's partitions
  // cover keys up to its last query's position; rows that end earlier mask the rest.
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    for (int64_t j0 = 0; j0 < q_len; j0 += kTile) {
      const int64_t nq = std::min(kTile, q_len - j0);
      const int64_t pos0 = lens[s] - q_len + j0;
      const int64_t parts = (pos0 + nq + partition_size - 1) / partition_size;
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t p = 0; p < parts; ++p) tasks.push_back({s, qsl[s] + j0, nq, h, p, pos0});
    }
  }
  const int64_t T = static_cast<int64_t>(tasks.size());
  std::vector<int64_t> offset(static_cast<size_t>(T + 1), 0);  // first partial row of each task
  for (int64_t ti = 0; ti < T; ++ti) offset[ti + 1] = offset[ti] + tasks[ti].nq * G;
  std::vector<float> part_acc(static_cast<size_t>(offset[T] * D));
  std::vector<float> part_m(static_cast<size_t>(offset[T])), part_l(static_cast<size_t>(offset[T]));

  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf(static_cast<size_t>(kTile * G * D));
    std::vector<float> scratch;
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& tk = tasks[ti];
      for (int64_t j = 0; j < tk.nq; ++j) {
        const Q* qrow = qptr + ((tk.row0 + j) * H + tk.kv_head * G) * D;
        float* dst = qbuf.data() + j * G * D;
        for (int64_t i = 0; i < G * D; ++i) dst[i] = to_float(qrow[i]) * static_cast<float>(scale);
      }
      const int64_t k_begin = tk.part * partition_size;
      const int64_t k_end = std::min(tk.pos0 + tk.nq, k_begin + partition_size);
      attend_tile<KV>(qbuf.data(), tk.nq * G, G, kcache, vcache, tables + tk.seq * max_blocks, block_size,
                      kv_heads, tk.kv_head, D, tk.pos0, k_begin, k_end, part_acc.data() + offset[ti] * D,
                      part_m.data() + offset[ti], part_l.data() + offset[ti], scratch);
    }
  });

  // Merge each tile's partitions and write normalized outputs.
  std::vector<int64_t> starts;
  for (int64_t ti = 0; ti < T; ++ti)
    if (tasks[ti].part == 0) starts.push_back(ti);
  const int64_t NS = static_cast<int64_t>(starts.size());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, NS, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(D));
    for (int64_t si = begin; si < end; ++si) {
      const int64_t t0 = starts[si];
      int64_t t1 = t0 + 1;
      while (t1 < T && tasks[t1].part != 0) ++t1;
      const Task& tk = tasks[t0];
      for (int64_t r = 0; r < tk.nq * G; ++r) {
        float M = neg_inf;
        for (int64_t ti = t0; ti < t1; ++ti) M = std::max(M, part_m[offset[ti] + r]);
        float L = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t ti = t0; ti < t1; ++ti) {
          const float pm = part_m[offset[ti] + r];
          if (pm == neg_inf) continue;  // this partition lies entirely after the row's position
          const float c = exp_neg(pm - M);
          L += c * part_l[offset[ti] + r];
          const float* a = part_acc.data() + (offset[ti] + r) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += c * a[d];
        }
        const float inv = 1.f / L;
        const int64_t j = r / G, g = r % G;
        Q* o = optr + ((tk.row0 + j) * H + tk.kv_head * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<Q>(acc[d] * inv);
      }
    }
  });
}

template <typename KV, typename IN>
void write_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
                 const torch::Tensor& slot_mapping) {
  const int64_t N = key.size(0), row = key.size(1) * key.size(2);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  KV* kdst = kv_cache.data_ptr<KV>();
  KV* vdst = kdst + num_slots * row;
  const IN* ksrc = key.data_ptr<IN>();
  const IN* vsrc = value.data_ptr<IN>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " outside the KV cache (", num_slots, " slots)");
      for (int64_t e = 0; e < row; ++e) {
        kdst[slot * row + e] = static_cast<KV>(ksrc[i * row + e]);
        vdst[slot * row + e] = static_cast<KV>(vsrc[i * row + e]);
      }
    }
  });
}

void check_common(const torch::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, block_size, heads, dim]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "kv_cache must be float32 or bfloat16");
}

}  // namespace

void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping) {
  check_common(kv_cache);
  TORCH_CHECK(key.sizes() == value.sizes() && key.dim() == 3, "key/value must be [tokens, kv_heads, dim]");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4), "key shape does not match the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == key.size(0), "bad slot_mapping");
  key = key.contiguous();
  value = value.contiguous();
  TORCH_CHECK(key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16, "key must be float32/bfloat16");
  if (kv_cache.scalar_type() == at::kFloat) {
    if (key.scalar_type() == at::kFloat) write_cache<float, float>(key, value, kv_cache, slot_mapping);
    else write_cache<float, at::BFloat16>(key, value, kv_cache, slot_mapping);
  } else {
    if (key.scalar_type() == at::kFloat) write_cache<at::BFloat16, float>(key, value, kv_cache, slot_mapping);
    else write_cache<at::BFloat16, at::BFloat16>(key, value, kv_cache, slot_mapping);
  }
}

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                              int64_t partition_size) {
  check_common(kv_cache);
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, dim]");
  TORCH_CHECK(query.size(2) == kv_cache.size(4), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(1) / kv_cache.size(3) <= kMaxGroup, "query group too large");
  TORCH_CHECK(partition_size > 0, "partition_size must be positive");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  auto out = torch::empty_like(query);
  const bool kv_bf16 = kv_cache.scalar_type() == at::kBFloat16;
  if (query.scalar_type() == at::kFloat) {
    if (kv_bf16) run_attention<at::BFloat16, float>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                                    partition_size, out);
    else run_attention<float, float>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                     partition_size, out);
  } else {
    TORCH_CHECK(query.scalar_type() == at::kBFloat16, "query must be float32 or bfloat16");
    if (kv_bf16) run_attention<at::BFloat16, at::BFloat16>(query, kv_cache, block_tables, query_start_loc, seq_lens,
                                                           scale, partition_size, out);
    else run_attention<float, at::BFloat16>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                            partition_size, out);
  }
  return out;
}

void register_fused_ops(pybind11::module& m);  // fused_ops.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_fused_ops(m);
  m.def("reshape_and_cache", &reshape_and_cache, "scatter new K/V rows to their slots");
  m.def("paged_attention", &paged_attention, "varlen causal attention over a paged KV cache");
}
