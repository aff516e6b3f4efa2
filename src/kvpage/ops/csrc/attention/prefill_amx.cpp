// Causal attention of whole fresh prompts (nothing cached before them) with AMX tile products, head size 64.
//
// Why: torch's SDPA ran these at 0.1-0.35 TFLOP/s for the 60-1000-token prompts of a serving workload (one
// call per prompt per layer, ~0.4 ms for 220 tokens), ~6% of a ShareGPT-like run. Here one call covers every
// fresh prompt of a step:
//   1. each prompt's K and V (per KV head) are copied once into the products' operand order, keys past the
//      end zeroed: K as [16-key block][2 dim halves][16 dim pairs][16 keys][2] (a B tile is 1 KiB contiguous),
//      V as [32-key block][16 key pairs][64 dims][2];
//   2. a task = (prompt, query head, 16 query rows): scores against every key block up to the diagonal with
//      the two Q tiles held for the whole row block, softmax per row in float32 over its visible keys (weights
//      rounded to bf16 for the product), then P.V into four accumulator tiles, divided by the row sums at the
//      end. Query heads of one KV head read the same packed K/V.
// prefill_attention_paged runs the same products for prompt chunks that follow cached keys (a prefix-cache hit,
// or the second and later chunks of a chunked prefill), which the paged decode kernel served at ~0.1 TFLOP/s:
// every key (cached and new: the step's K/V are written before attention) is copied from the packed cache,
// whose 16-key groups already hold K in the scratch's order, and a chunk of n queries after c cached keys
// sees keys 0 .. c + r for its query r.
#include "tensor.h"

#include "ops.h"
#include <ATen/Parallel.h>

#include "common.h"  // kv_geometry
#include "attention/amx_rows.h"  // TileConfig, amx_permitted, exp16, KVPAGE_ISA_AMX
#include "attention/packed_kv.h"  // packed_group_offset, stage_value_group

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace kvpage::prefill {

#if KVPAGE_ISA_AMX
constexpr int64_t kD = 64;

// Tiles (all full, amx_configure_full): 0-3 = scores of four 16-key blocks (16 x 16 float32), then the output
// accumulators (16 rows x 16 dims); 4/5 = Q (16 rows x 32 dims) during scores; 6/7 = K operands; during P.V
// 4 = P, 5/7 = V (pv_product64).

// Keys a prompt of n tokens occupies per KV head in the packed K (16-key blocks) and V (32-key blocks).
inline int64_t k_slots(int64_t n) { return (n + 15) / 16 * 16; }
inline int64_t v_slots(int64_t n) { return (n + 31) / 32 * 32; }

struct Prompt {
  int64_t start, n;      // its query rows in query / out
  int64_t cached;        // keys before its first query (0 for a fresh prompt); it sees cached + n keys
  int64_t k_off, v_off;  // element offsets of this prompt's packed K / V (KV head 0) in the scratch buffers
  int64_t seq;           // its row of the block tables (cache-read prompts)
  int64_t keys() const { return cached + n; }
};

// Packs one prompt's KV head h: K into kp ([n16][2][16 pairs][16 keys][2]), V into vp ([n32][16 pairs][64][2]).
// Both arrive zeroed (value-initialized scratch), so the keys past n stay zero.
void pack_head(const at::BFloat16* key, int64_t sk, const at::BFloat16* value, int64_t sv, int64_t h,
               const Prompt& p, at::BFloat16* kp, at::BFloat16* vp) {
  auto* k32 = reinterpret_cast<uint32_t*>(kp);
  for (int64_t j = 0; j < p.n; ++j) {
    const auto* krow = reinterpret_cast<const uint32_t*>(key + (p.start + j) * sk + h * kD);
    const at::BFloat16* vrow = value + (p.start + j) * sv + h * kD;
    uint32_t* kb = k32 + (j / 16) * 16 * (kD / 2);  // this key's 16-key block, in 32-bit words
    for (int64_t pair = 0; pair < kD / 2; ++pair) kb[pair * 16 + j % 16] = krow[pair];  // [half][16 pairs] = pair
    at::BFloat16* vb = vp + (j / 32) * 32 * kD + ((j % 32) / 2) * 2 * kD + (j % 2);
    for (int64_t d = 0; d < kD; ++d) vb[2 * d] = vrow[d];
  }
}

// Packs KV head h of a prompt's keys 0 .. p.keys() - 1 from the packed cache (packed_kv.h) into the same
// scratch order as pack_head: a K group is the scratch's 16-key block as it is; a V group is half of a 32-key
// block. Every V slot past the last key is zeroed (a never-written cache slot, or the uninitialized scratch,
// may hold NaN, which a zero weight would not cancel); K there is never used (its scores are masked out of
// the softmax).
void pack_head_cached(const at::BFloat16* kcache, const at::BFloat16* vcache, const int64_t* table,
                      int64_t block_size, int64_t block_stride, int64_t kv_heads, int64_t h, const Prompt& p,
                      at::BFloat16* kp,
                      at::BFloat16* vp) {
  const int64_t L = p.keys(), group = 16 * kD, groups = (L + 15) / 16;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t pos = g * 16;
    const int64_t base =
        kvpage::packed_group_offset(table[pos / block_size], pos % block_size, block_stride, kv_heads, kD) + h * group;
    std::memcpy(kp + g * group, kcache + base, group * sizeof(at::BFloat16));
    at::BFloat16* vdst = vp + (g / 2) * 32 * kD + (g % 2) * 8 * 2 * kD;
    if (L - pos >= 16)
      std::memcpy(vdst, vcache + base, group * sizeof(at::BFloat16));
    else
      kvpage::stage_value_group<kD>(vcache + base, L - pos, vdst);
  }
  if (groups % 2 == 1)  // the last 32-key V block's second half holds no key (the scratch is not zeroed)
    std::memset(vp + groups * group, 0, group * sizeof(at::BFloat16));
}

// Scores of NB consecutive 16-key blocks (K operands from k0 on) against the Q tiles 4/5, into tiles 0..NB-1,
// stored at dst (row stride span floats). Several blocks at once: tiles are not renamed, so a single score
// tile would serialize zero -> product -> product -> store for every block.
template <int NB>
inline void score_blocks(const at::BFloat16* k0, float* dst, int64_t span) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  _tile_loadd(6, k0, 64);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (NB > 1) {
    _tile_loadd(7, k0 + 1024, 64);
    _tile_dpbf16ps(1, 4, 7);
  }
  if constexpr (NB > 2) {
    _tile_loadd(6, k0 + 2048, 64);
    _tile_dpbf16ps(2, 4, 6);
  }
  if constexpr (NB > 3) {
    _tile_loadd(7, k0 + 3072, 64);
    _tile_dpbf16ps(3, 4, 7);
  }
  _tile_loadd(6, k0 + 512, 64);
  _tile_dpbf16ps(0, 5, 6);
  if constexpr (NB > 1) {
    _tile_loadd(7, k0 + 1024 + 512, 64);
    _tile_dpbf16ps(1, 5, 7);
  }
  if constexpr (NB > 2) {
    _tile_loadd(6, k0 + 2048 + 512, 64);
    _tile_dpbf16ps(2, 5, 6);
  }
  if constexpr (NB > 3) {
    _tile_loadd(7, k0 + 3072 + 512, 64);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, dst, span * 4);
  if constexpr (NB > 1) _tile_stored(1, dst + 16, span * 4);
  if constexpr (NB > 2) _tile_stored(2, dst + 32, span * 4);
  if constexpr (NB > 3) _tile_stored(3, dst + 48, span * 4);
}
#endif

bool prefill_amx_available() {
#if KVPAGE_ISA_AMX
  return kvpage::amx_permitted();
#else
  return false;
#endif
}

#if KVPAGE_ISA_AMX
// The attention of every prompt (its packed K/V in kpack / vpack, KV head h at k_off + h * k_slots(keys)) into
// out: tasks of (prompt, query head, 16 query rows), taken costliest first from a shared counter.
void attend_prompts(const std::vector<Prompt>& prompts, const at::BFloat16* kpack, const at::BFloat16* vpack,
                    const at::BFloat16* qp, int64_t sq, at::BFloat16* op, int64_t so, int64_t H, int64_t G,
                    double scale) {
  struct Task {
    int32_t prompt, head;
    int64_t row0;
    int64_t cost;  // keys the task's last row sees
  };
  std::vector<Task> tasks;
  int64_t max_keys = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Prompt& p = prompts[i];
    max_keys = std::max(max_keys, p.keys());
    for (int64_t r0 = 0; r0 < p.n; r0 += 16)
      for (int64_t hq = 0; hq < H; ++hq)
        tasks.push_back({static_cast<int32_t>(i), static_cast<int32_t>(hq), r0, p.cached + r0});
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });

  const int64_t max32 = (max_keys + 31) / 32 * 32;
  const float fscale = static_cast<float>(scale);
  // Threads take tasks from a shared counter, costliest first, so that the last tasks are the short ones.
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    kvpage::amx_configure_full();
    std::vector<float> scores(16 * max32);
    std::vector<at::BFloat16> probs(16 * max32);
    alignas(64) at::BFloat16 qstage[16 * kD];
    alignas(64) float obuf[16 * kD];
    float rsum[16];
    for (int64_t ti = next++; ti < num_tasks; ti = next++) {
      const Task& task = tasks[ti];
      const Prompt& p = prompts[task.prompt];
      const int64_t h = task.head / G, r0 = task.row0, c = p.cached;
      const int64_t rows = std::min<int64_t>(16, p.n - r0);
      const at::BFloat16* kh = kpack + p.k_off + h * k_slots(p.keys()) * kD;
      const at::BFloat16* vh = vpack + p.v_off + h * v_slots(p.keys()) * kD;
      // Q rows r0..r0+15 of this head (a partial last block is staged with zero rows)
      const at::BFloat16* q = qp + (p.start + r0) * sq + task.head * kD;
      int64_t qstride = sq * 2;
      if (rows < 16) {
        std::memset(qstage, 0, sizeof(qstage));
        for (int64_t r = 0; r < rows; ++r) std::memcpy(qstage + r * kD, q + r * sq, kD * sizeof(at::BFloat16));
        q = qstage;
        qstride = kD * 2;
      }
      // 1. scores of the key blocks up to the one holding the last row's last visible key (c + r0 + rows - 1)
      const int64_t nk16 = (c + r0 + rows - 1) / 16 + 1, nk32 = (nk16 + 1) / 2, span = nk32 * 32;
      _tile_loadd(4, q, qstride);
      _tile_loadd(5, q + 32, qstride);
      for (int64_t kb = 0; kb < nk16; kb += 4) {
        float* dst = scores.data() + kb * 16;
        const at::BFloat16* k0 = kh + kb * 16 * kD;
        switch (std::min<int64_t>(4, nk16 - kb)) {
          case 4: score_blocks<4>(k0, dst, span); break;
          case 3: score_blocks<3>(k0, dst, span); break;
          case 2: score_blocks<2>(k0, dst, span); break;
          default: score_blocks<1>(k0, dst, span); break;
        }
      }
      // 2. softmax per row over keys 0..c+r0+r; weights as bf16 with zeros up to the span
      for (int64_t r = 0; r < 16; ++r) {
        float* s = scores.data() + r * span;
        at::BFloat16* pr = probs.data() + r * span;
        const int64_t visible = r < rows ? c + r0 + r + 1 : 0;
        if (visible == 0) {
          std::memset(pr, 0, span * sizeof(at::BFloat16));
          rsum[r] = 1.f;
          continue;
        }
        __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t j = 0; j < visible; j += 16) {
          const __mmask16 k = kvpage::tail_mask(visible - j);
          vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_maskz_loadu_ps(k, s + j));
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * fscale);
        const __m512 sc = _mm512_set1_ps(fscale);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t j = 0; j < span; j += 16) {
          const __mmask16 k = j < visible ? kvpage::tail_mask(visible - j) : 0;
          const __m512 w = kvpage::exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j), sc, m), k);
          vsum = _mm512_add_ps(vsum, w);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(w));
        }
        rsum[r] = _mm512_reduce_add_ps(vsum);
      }
      // 3. P.V over 32-key blocks into four 16-dim accumulators
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < nk32; ++kb) kvpage::pv_product64(probs.data() + kb * 32, span * 2, vh + kb * 32 * kD);
      kvpage::store_acc64(obuf);
      for (int64_t r = 0; r < rows; ++r) {
        at::BFloat16* o = op + (p.start + r0 + r) * so + task.head * kD;
        const __m512 inv = _mm512_set1_ps(1.f / rsum[r]);
        for (int64_t d = 0; d < kD; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(obuf + r * kD + d), inv)));
      }
    }
    _tile_release();
  });
}

// Scratch offsets for every prompt (all KV heads).
void place_scratch(std::vector<Prompt>& prompts, int64_t kv_heads, int64_t* k_total, int64_t* v_total) {
  *k_total = *v_total = 0;
  for (Prompt& p : prompts) {
    p.k_off = *k_total;
    p.v_off = *v_total;
    *k_total += kv_heads * k_slots(p.keys()) * kD;
    *v_total += kv_heads * v_slots(p.keys()) * kD;
  }
}
#endif

void check_query_out(const torch::Tensor& query, const torch::Tensor& out, double scale) {
  TORCH_CHECK(prefill_amx_available(), "AMX tile products are not available on this CPU/OS");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention takes bfloat16 tensors");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out [T, H, D]");
  TORCH_CHECK(query.size(2) == 64, "head size must be 64");
  for (const torch::Tensor* t : {&query, static_cast<const torch::Tensor*>(&out)})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == 64, "rows of heads must be dense");
  TORCH_CHECK(scale > 0, "scale must be positive");
}

// out[start:start+n] = causal softmax(q k^T * scale) v for every prompt (starts[i], lengths[i]); query
// [T, H, 64], key/value [T, KVH, 64] bf16 with dense rows (row strides free), out [T, H, 64] bf16.
void prefill_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                       torch::Tensor& out, const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths,
                       double scale) {
  check_query_out(query, out, scale);
  TORCH_CHECK(key.scalar_type() == at::kBFloat16 && value.scalar_type() == at::kBFloat16,
              "prefill_attention takes bfloat16 tensors");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key/value [T, KVH, D]");
  const int64_t T = query.size(0), H = query.size(1), KVH = key.size(1);
  TORCH_CHECK(key.size(2) == 64 && value.sizes() == key.sizes(), "head size must be 64");
  TORCH_CHECK(key.size(0) == T && KVH > 0 && H % KVH == 0, "query heads must be a multiple of KV heads");
  for (const torch::Tensor* t : {&key, &value}) TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == 64, "rows of heads must be dense");
  TORCH_CHECK(starts.size() == lengths.size(), "starts and lengths differ in length");
#if KVPAGE_ISA_AMX
  std::vector<Prompt> prompts;
  for (size_t i = 0; i < starts.size(); ++i) {
    TORCH_CHECK(starts[i] >= 0 && lengths[i] >= 0 && starts[i] + lengths[i] <= T, "prompt ", i, " outside the batch");
    if (lengths[i] > 0) prompts.push_back({starts[i], lengths[i], 0, 0, 0, 0});
  }
  if (prompts.empty()) return;
  int64_t k_total, v_total;
  place_scratch(prompts, KVH, &k_total, &v_total);
  std::vector<at::BFloat16> kpack(k_total), vpack(v_total);  // zeroed: pack_head writes only the n keys
  const auto* kp = key.data_ptr<at::BFloat16>();
  const auto* vp = value.data_ptr<at::BFloat16>();
  const int64_t sk = key.stride(0), sv = value.stride(0);
  const int64_t P = static_cast<int64_t>(prompts.size());
  at::parallel_for(0, P * KVH, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Prompt& p = prompts[i / KVH];
      const int64_t h = i % KVH;
      pack_head(kp, sk, vp, sv, h, p, kpack.data() + p.k_off + h * k_slots(p.n) * kD,
                vpack.data() + p.v_off + h * v_slots(p.n) * kD);
    }
  });
  attend_prompts(prompts, kpack.data(), vpack.data(), query.data_ptr<at::BFloat16>(), query.stride(0),
                 out.data_ptr<at::BFloat16>(), out.stride(0), H, H / KVH, scale);
#else
  (void)key, (void)value, (void)starts, (void)lengths;
#endif
}

// The same for prompts (or prompt chunks) whose keys are in the packed bf16 cache [2, blocks, block_size, KVH,
// 64]: prompt i has query rows starts[i] .. starts[i] + lengths[i] - 1, block table row seqs[i], and
// seq_lens[i] keys in the cache, of which the last lengths[i] are its own (causal among them); the
// seq_lens[i] - lengths[i] before them are visible to all its rows.
void prefill_attention_paged(const torch::Tensor& query, const torch::Tensor& kv_cache,
                             const torch::Tensor& block_tables, torch::Tensor& out, const std::vector<int64_t>& starts,
                             const std::vector<int64_t>& lengths, const std::vector<int64_t>& seq_lens,
                             const std::vector<int64_t>& seqs, double scale, int64_t max_scratch_bytes) {
  check_query_out(query, out, scale);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.scalar_type() == at::kBFloat16,
              "kv_cache must be a bfloat16 [2, blocks, block_size, kv_heads, 64] tensor");
  const kvpage::KVGeometry geo = kvpage::kv_geometry(kv_cache);
  const int64_t T = query.size(0), H = query.size(1), KVH = kv_cache.size(3), bs = kv_cache.size(2);
  const int64_t num_blocks = kv_cache.size(1);
  TORCH_CHECK(kv_cache.size(4) == 64, "head size must be 64");
  TORCH_CHECK(bs % 16 == 0, "the packed layout needs a block size that is a multiple of 16, got ", bs);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads must be a multiple of KV heads");
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
    kvpage::check_table_row(tables + seqs[i] * max_blocks, max_blocks, seq_lens[i], bs, num_blocks, "prompt",
                            static_cast<int64_t>(i));
    if (lengths[i] > 0) prompts.push_back({starts[i], lengths[i], seq_lens[i] - lengths[i], 0, 0, seqs[i]});
  }
  const auto* kcache = kv_cache.data_ptr<at::BFloat16>();
  const auto* vcache = kcache + geo.v_offset;
  // Prompts in groups whose copied keys fit max_scratch_bytes (many chunks after long cached prefixes in one
  // step would otherwise copy the whole of their caches at once); a prompt larger than the bound is one group.
  TORCH_CHECK(max_scratch_bytes > 0, "max_scratch_bytes must be positive");
  for (size_t first = 0; first < prompts.size();) {
    auto scratch_bytes = [&](const Prompt& p) { return KVH * (k_slots(p.keys()) + v_slots(p.keys())) * kD * 2; };
    size_t last = first;
    int64_t bytes = 0;
    do {
      bytes += scratch_bytes(prompts[last++]);
    } while (last < prompts.size() && bytes + scratch_bytes(prompts[last]) <= max_scratch_bytes);
    std::vector<Prompt> group(prompts.begin() + first, prompts.begin() + last);
    first = last;
    int64_t k_total, v_total;
    place_scratch(group, KVH, &k_total, &v_total);
    // not zeroed: pack_head_cached writes every K and V slot the products read
    std::unique_ptr<at::BFloat16[]> kpack(new at::BFloat16[k_total]), vpack(new at::BFloat16[v_total]);
    const int64_t P = static_cast<int64_t>(group.size());
    at::parallel_for(0, P * KVH, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const Prompt& p = group[i / KVH];
        const int64_t h = i % KVH;
        pack_head_cached(kcache, vcache, tables + p.seq * max_blocks, bs, geo.block_stride, KVH, h, p,
                         kpack.get() + p.k_off + h * k_slots(p.keys()) * kD,
                         vpack.get() + p.v_off + h * v_slots(p.keys()) * kD);
      }
    });
    attend_prompts(group, kpack.get(), vpack.get(), query.data_ptr<at::BFloat16>(), query.stride(0),
                   out.data_ptr<at::BFloat16>(), out.stride(0), H, H / KVH, scale);
  }
#else
  (void)geo, (void)tables, (void)max_blocks, (void)num_blocks, (void)T, (void)starts, (void)lengths, (void)seq_lens, (void)seqs;
#endif
}

}  // namespace kvpage::prefill
