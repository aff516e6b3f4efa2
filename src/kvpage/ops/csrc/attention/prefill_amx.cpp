// Causal attention of prompts with AMX tile products (attention/prefill_tiles.h), head sizes 64, 128 and 256,
// optionally over a sliding window.
//
// Why: torch's SDPA ran these at 0.1-0.35 TFLOP/s for the 60-1000-token prompts of a serving workload (one
// call per prompt per layer, ~0.4 ms for 220 tokens), ~6% of a ShareGPT-like run. Here one call covers every
// prompt of a step: each prompt's K and V (per KV head) are copied once into the products' operand order, then
// tasks of (prompt, query head, 16 query rows) run scores, softmax and P.V on tiles.
// prefill_attention takes whole fresh prompts from the step's K/V tensors; prefill_attention_paged takes prompt
// chunks that may follow cached keys (a prefix-cache hit, or the second and later chunks of a chunked prefill),
// which the paged decode kernel served at ~0.1 TFLOP/s: every key (cached and new: the step's K/V are written
// before attention) is copied from the packed cache, whose 16-key groups already hold K in the scratch's order,
// and a chunk of n queries after c cached keys sees keys 0 .. c + r for its query r (with a window W, keys
// c + r - W + 1 .. c + r, and only the cache's blocks from the first query's window edge on are read).
#include "tensor.h"

#include "ops.h"
#include <ATen/Parallel.h>

#include "common.h"  // kv_geometry
#include "attention/prefill_tiles.h"

#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

namespace kvpage::prefill {

bool prefill_amx_available() {
#if KVPAGE_ISA_AMX
  return kvpage::amx_permitted();
#else
  return false;
#endif
}

void check_query_out(const torch::Tensor& query, const torch::Tensor& out, double scale) {
  TORCH_CHECK(prefill_amx_available(), "AMX tile products are not available on this CPU/OS");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention takes bfloat16 tensors");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out [T, H, D]");
  const int64_t D = query.size(2);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "head size must be 64, 128 or 256, got ", D);
  for (const torch::Tensor* t : {&query, static_cast<const torch::Tensor*>(&out)})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D, "rows of heads must be dense");
  TORCH_CHECK(scale > 0, "scale must be positive");
}

#if KVPAGE_ISA_AMX
// Whole fresh prompts from the step's K/V tensors (kbase 0, nothing cached).
template <int64_t D>
void fresh_prompts(std::vector<Prompt>& prompts, const torch::Tensor& query, const torch::Tensor& key,
                   const torch::Tensor& value, torch::Tensor& out, double scale, int64_t window) {
  const int64_t H = query.size(1), KVH = key.size(1);
  int64_t k_total, v_total;
  place_scratch<D>(prompts, KVH, &k_total, &v_total);
  std::vector<at::BFloat16> kpack(k_total), vpack(v_total);  // zeroed: pack_head writes only the n keys
  const auto* kp = key.data_ptr<at::BFloat16>();
  const auto* vp = value.data_ptr<at::BFloat16>();
  const int64_t sk = key.stride(0), sv = value.stride(0);
  const int64_t P = static_cast<int64_t>(prompts.size());
  at::parallel_for(0, P * KVH, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Prompt& p = prompts[i / KVH];
      const int64_t h = i % KVH;
      pack_head<D>(kp, sk, vp, sv, h, p, kpack.data() + p.k_off + h * k_slots(p.held()) * D,
                   vpack.data() + p.v_off + h * v_slots(p.held()) * D);
    }
  });
  attend_prompts<D>(prompts, kpack.data(), vpack.data(), query.data_ptr<at::BFloat16>(), query.stride(0),
                    out.data_ptr<at::BFloat16>(), out.stride(0), H, H / KVH, scale, window);
}

// Prompt chunks whose keys are in the packed cache, in groups whose copied keys fit max_scratch_bytes (many
// chunks after long cached prefixes in one step would otherwise copy the whole of their caches at once); a
// prompt larger than the bound is one group.
template <int64_t D>
void cached_prompts(const std::vector<Prompt>& prompts, const torch::Tensor& query, const torch::Tensor& kv_cache,
                    const kvpage::KVGeometry& geo, const int64_t* tables, int64_t max_blocks, torch::Tensor& out,
                    double scale, int64_t window, int64_t max_scratch_bytes) {
  const int64_t H = query.size(1), KVH = kv_cache.size(3), bs = kv_cache.size(2);
  const auto* kcache = kv_cache.data_ptr<at::BFloat16>();
  const auto* vcache = kcache + geo.v_offset;
  auto scratch_bytes = [&](const Prompt& p) { return KVH * (k_slots(p.held()) + v_slots(p.held())) * D * 2; };
  for (size_t first = 0; first < prompts.size();) {
    size_t last = first;
    int64_t bytes = 0;
    do {
      bytes += scratch_bytes(prompts[last++]);
    } while (last < prompts.size() && bytes + scratch_bytes(prompts[last]) <= max_scratch_bytes);
    std::vector<Prompt> group(prompts.begin() + first, prompts.begin() + last);
    first = last;
    int64_t k_total, v_total;
    place_scratch<D>(group, KVH, &k_total, &v_total);
    // not zeroed: pack_head_cached writes every K and V slot the products read
    std::unique_ptr<at::BFloat16[]> kpack(new at::BFloat16[k_total]), vpack(new at::BFloat16[v_total]);
    const int64_t P = static_cast<int64_t>(group.size());
    at::parallel_for(0, P * KVH, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const Prompt& p = group[i / KVH];
        const int64_t h = i % KVH;
        pack_head_cached<D>(kcache, vcache, tables + p.seq * max_blocks, bs, geo.block_stride, KVH, h, p,
                            kpack.get() + p.k_off + h * k_slots(p.held()) * D,
                            vpack.get() + p.v_off + h * v_slots(p.held()) * D);
      }
    });
    attend_prompts<D>(group, kpack.get(), vpack.get(), query.data_ptr<at::BFloat16>(), query.stride(0),
                      out.data_ptr<at::BFloat16>(), out.stride(0), H, H / KVH, scale, window);
  }
}
#endif

// out[start:start+n] = causal softmax(q k^T * scale) v for every prompt (starts[i], lengths[i]); query
// [T, H, D], key/value [T, KVH, D] bf16 with dense rows (row strides free), out [T, H, D] bf16; D 64, 128 or 256.
// window > 0: query r sees keys r - window + 1 .. r (a sliding-window layer's prompts over their own K/V, as
// quantized pages' layers take them).
void prefill_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                       torch::Tensor& out, const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths,
                       double scale, int64_t window) {
  check_query_out(query, out, scale);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(key.scalar_type() == at::kBFloat16 && value.scalar_type() == at::kBFloat16,
              "prefill_attention takes bfloat16 tensors");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key/value [T, KVH, D]");
  const int64_t T = query.size(0), H = query.size(1), KVH = key.size(1), D = query.size(2);
  TORCH_CHECK(key.size(2) == D && value.sizes() == key.sizes(), "key/value head size differs from the query's");
  TORCH_CHECK(key.size(0) == T && KVH > 0 && H % KVH == 0, "query heads must be a multiple of KV heads");
  for (const torch::Tensor* t : {&key, &value}) TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D, "rows of heads must be dense");
  TORCH_CHECK(starts.size() == lengths.size(), "starts and lengths differ in length");
#if KVPAGE_ISA_AMX
  std::vector<Prompt> prompts;
  for (size_t i = 0; i < starts.size(); ++i) {
    TORCH_CHECK(starts[i] >= 0 && lengths[i] >= 0 && starts[i] + lengths[i] <= T, "prompt ", i, " outside the batch");
    if (lengths[i] > 0) prompts.push_back({starts[i], lengths[i], 0, 0, 0, 0, 0});
  }
  if (prompts.empty()) return;
  if (D == 64) fresh_prompts<64>(prompts, query, key, value, out, scale, window);
  else if (D == 128) fresh_prompts<128>(prompts, query, key, value, out, scale, window);
  else fresh_prompts<256>(prompts, query, key, value, out, scale, window);
#else
  (void)key, (void)value, (void)starts, (void)lengths, (void)T, (void)H, (void)KVH, (void)D, (void)window;
#endif
}

// The same for prompts (or prompt chunks) whose keys are in the packed bf16 cache [2, blocks, block_size, KVH,
// D]: prompt i has query rows starts[i] .. starts[i] + lengths[i] - 1, block table row seqs[i], and
// seq_lens[i] keys in the cache, of which the last lengths[i] are its own (causal among them); the
// seq_lens[i] - lengths[i] before them are visible to all its rows (window > 0: only the last `window` keys up to
// each row's own, as in the paged kernel's plan).
void prefill_attention_paged(const torch::Tensor& query, const torch::Tensor& kv_cache,
                             const torch::Tensor& block_tables, torch::Tensor& out, const std::vector<int64_t>& starts,
                             const std::vector<int64_t>& lengths, const std::vector<int64_t>& seq_lens,
                             const std::vector<int64_t>& seqs, double scale, int64_t max_scratch_bytes,
                             int64_t window) {
  check_query_out(query, out, scale);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.scalar_type() == at::kBFloat16,
              "kv_cache must be a bfloat16 [2, blocks, block_size, kv_heads, D] tensor");
  const kvpage::KVGeometry geo = kvpage::kv_geometry(kv_cache);  // checks shape and strides
  const int64_t T = query.size(0), H = query.size(1), KVH = kv_cache.size(3), bs = kv_cache.size(2);
  const int64_t num_blocks = kv_cache.size(1), D = query.size(2);
  TORCH_CHECK(kv_cache.size(4) == D, "the cache's head size (", kv_cache.size(4), ") differs from the query's (", D,
              ")");
  TORCH_CHECK(bs % 16 == 0, "the packed layout needs a block size that is a multiple of 16, got ", bs);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(max_scratch_bytes > 0, "max_scratch_bytes must be positive");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "block_tables must be a contiguous int64 [seqs, max_blocks] tensor");
  TORCH_CHECK(starts.size() == lengths.size() && seq_lens.size() == lengths.size() && seqs.size() == lengths.size(),
              "starts, lengths, seq_lens and seqs differ in length");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
#if KVPAGE_ISA_AMX
  std::vector<Prompt> prompts;
  for (size_t i = 0; i < starts.size(); ++i) {
    TORCH_CHECK(starts[i] >= 0 && lengths[i] >= 0 && starts[i] + lengths[i] <= T, "prompt ", i, " outside the batch");
    TORCH_CHECK(seq_lens[i] >= lengths[i], "prompt ", i, " has fewer keys (", seq_lens[i], ") than queries (",
                lengths[i], ")");
    TORCH_CHECK(seqs[i] >= 0 && seqs[i] < block_tables.size(0), "prompt ", i, ": no block table row ", seqs[i]);
    const int64_t cached = seq_lens[i] - lengths[i];
    const int64_t kbase = window_edge(cached, window) / 16 * 16;  // blocks before it may be freed
    kvpage::check_table_row(tables + seqs[i] * max_blocks, max_blocks, seq_lens[i], bs, num_blocks, "prompt",
                            static_cast<int64_t>(i), kbase / bs);  // only the blocks from kbase on are read
    if (lengths[i] > 0) prompts.push_back({starts[i], lengths[i], cached, kbase, 0, 0, seqs[i]});
  }
  if (prompts.empty()) return;
  const auto run = [&](auto d) {
    cached_prompts<decltype(d)::value>(prompts, query, kv_cache, geo, tables, max_blocks, out, scale, window,
                                       max_scratch_bytes);
  };
  if (D == 64) run(std::integral_constant<int64_t, 64>{});
  else if (D == 128) run(std::integral_constant<int64_t, 128>{});
  else run(std::integral_constant<int64_t, 256>{});
#else
  (void)geo, (void)tables, (void)max_blocks, (void)num_blocks, (void)T, (void)H, (void)starts, (void)lengths,
      (void)seq_lens, (void)seqs;
#endif
}

}  // namespace kvpage::prefill
