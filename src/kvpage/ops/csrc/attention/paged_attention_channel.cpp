// int8 pages with keys per channel (attention/channel_keys.h). The cache write: each new token's value as an
// int8 row at its slot and its key, unrounded (bfloat16), at its residual slot; then every block whose last
// key this write brought is rounded per channel from its residual block into its page (kv_channel.write_pages
// is the torch oracle, byte for byte). The attention: the plan's tasks as for the other caches, each block's
// keys of a head dequantized (codes x step + zero point per channel; the filling block's keys from its
// residual block) and its value rows into L1-resident float32 rows, then the float main loop that the row
// pages' dequantizing path runs too (quant_rows.h attend_block_rows).

#include "tensor.h"
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "common.h"
#include "ops.h"
#include "attention/channel_keys.h"
#include "attention/loop.h"
#include "attention/merge.h"
#include "attention/plan.h"
#include "attention/quant_rows.h"

namespace {

using namespace kvpage::attn;

template <typename IN>
void write_channel(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& pages,
                   const torch::Tensor& slot_mapping, const torch::Tensor& residual_slots, int64_t block_size) {
  const int64_t N = key.size(0), H = key.size(1), D = key.size(2), n = block_size;
  const int64_t page = pages.size(1), num_slots = pages.size(0) * n;
  const int64_t kbytes = H * channel_block_bytes(n, D), row = H * (D + kScaleBytes);
  auto* base = pages.data_ptr<uint8_t>();
  const IN* ksrc = key.data_ptr<IN>();
  const IN* vsrc = value.data_ptr<IN>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* rslots = residual_slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots && rslots[i] >= 0 && rslots[i] < num_slots, "slot ",
                slots[i], " or residual slot ", rslots[i], " outside the KV cache (", num_slots, " slots)");
    TORCH_CHECK(slots[i] % n == rslots[i] % n, "a token's residual slot must sit at its offset in the block");
  }
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(D));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t off = slots[i] % n;
      uint8_t* v = base + (slots[i] / n) * page + kbytes + off * row;
      auto* r = reinterpret_cast<uint16_t*>(base + (rslots[i] / n) * page) + off * H * D;
      for (int64_t h = 0; h < H; ++h) {
        quantize_row<KVCode::kInt8>(vsrc + i * vs + h * D, v + h * (D + kScaleBytes), D, buf.data(), false);
        for (int64_t d = 0; d < D; ++d) r[h * D + d] = bf16_bits(kvpage::to_float(ksrc[i * ks + h * D + d]));
      }
    }
  });
  std::vector<int64_t> done;  // tokens that complete their block
  for (int64_t i = 0; i < N; ++i)
    if (slots[i] % n == n - 1) done.push_back(i);
  at::parallel_for(0, static_cast<int64_t>(done.size()) * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> keys(static_cast<size_t>(n * D)), lo(static_cast<size_t>(D)), hi(static_cast<size_t>(D));
    for (int64_t j = begin; j < end; ++j) {
      const int64_t i = done[j / H], h = j % H;
      const auto* r = reinterpret_cast<const uint16_t*>(base + (rslots[i] / n) * page);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < D; ++d) keys[t * D + d] = bf16_float(r[(t * H + h) * D + d]);
      uint8_t* out = base + (slots[i] / n) * page + h * channel_block_bytes(n, D);
      round_channel_block(keys.data(), D, n, D, out, lo.data(), hi.data());
    }
  });
}

// Keys [off, off + n) of one head's rounded block (head_block: its bytes) as float32 rows of D: codes x step +
// zero point, per channel (zero, step: channel_params of the block).
template <int64_t D>
inline void dequantize_channel_rows(const uint8_t* head_block, int64_t off, int64_t n, int64_t dim, const float* zero,
                                    const float* step, float* out) {
  const int64_t Dd = D > 0 ? D : dim;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* c = head_block + (off + i) * Dd;
    float* o = out + i * Dd;
#if KVPAGE_ISA_AVX2
    if constexpr (D > 0) {
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + d))));
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(x, _mm256_loadu_ps(step + d), _mm256_loadu_ps(zero + d)));
      }
      continue;
    }
#endif
    for (int64_t d = 0; d < Dd; ++d) o[d] = static_cast<float>(c[d]) * step[d] + zero[d];
  }
}

// The task's keys [k_begin, k_end) of sequence `seq_len` long (its block table `table`, its filling block's keys
// in page `residual` when seq_len is not a whole number of blocks), for its query rows (q: pre-scaled float32,
// rows r = j * H + head, row r sees keys <= pos0 + r / H and none before its window).
template <int64_t D>
void attend_tile_channel(const float* q, int64_t nq, int64_t H, int64_t G, const uint8_t* pages, int64_t page,
                         const int64_t* table, int64_t residual, int64_t seq_len, int64_t block_size, int64_t kv_heads,
                         int64_t dim, int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m, float* l,
                         std::vector<float>& scratch, int64_t window) {
  const int64_t Dd = D > 0 ? D : dim, n_bs = block_size;
  const int64_t head_keys = channel_block_bytes(n_bs, Dd), values_at = kv_heads * head_keys;
  const int64_t vrow = kv_heads * (Dd + kScaleBytes);
  const int64_t R = nq * H;
  scratch.resize(static_cast<size_t>(R * n_bs + 2 * n_bs * Dd + 2 * Dd + 8));
  float* sc = scratch.data();
  float* kf = sc + R * n_bs;
  float* vf = kf + n_bs * Dd;
  float* zero = vf + n_bs * Dd;
  float* step = zero + Dd;
  const int64_t filling = seq_len % n_bs ? seq_len / n_bs : -1;
  reset_partials(acc, m, l, R, Dd);
  for (int64_t t = k_begin; t < k_end;) {
    const int64_t off = t % n_bs, b = t / n_bs;
    const int64_t n = std::min(n_bs - off, k_end - t);
    const uint8_t* block = pages + table[b] * page;
    for (int64_t h = 0; h < kv_heads; ++h) {
      if (b == filling) {
        const auto* r = reinterpret_cast<const uint16_t*>(pages + residual * page);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t d = 0; d < Dd; ++d) kf[i * Dd + d] = bf16_float(r[((off + i) * kv_heads + h) * Dd + d]);
      } else {
        channel_params(block + h * head_keys, n_bs, Dd, zero, step);
        dequantize_channel_rows<D>(block + h * head_keys, off, n, Dd, zero, step, kf);
      }
      dequantize_block<KVCode::kInt8, D>(block + values_at + off * vrow + h * (Dd + kScaleBytes), vrow, n, Dd, vf);
      attend_block_rows<D>(q, nq, H, G, h, kf, vf, t, n, pos0, window, n_bs, Dd, sc, acc, m, l);
    }
    t += n;
  }
}

template <typename Q>
void attend_channel(const torch::Tensor& query, const torch::Tensor& pages, const AttentionPlan& plan,
                    const torch::Tensor& residual_tables, double scale, int64_t kv_heads, torch::Tensor& out) {
  const int64_t H = query.size(1), D = query.size(2), G = H / kv_heads, bs = plan.block_size;
  const int64_t max_blocks = plan.block_tables.size(1), page = pages.size(1);
  const int64_t* tables = plan.block_tables.data_ptr<int64_t>();
  const int64_t* rtables = residual_tables.data_ptr<int64_t>();
  const int64_t* lens = plan.seq_lens.data_ptr<int64_t>();
  const Q* qptr = query.data_ptr<Q>();
  const uint8_t* base = pages.data_ptr<uint8_t>();
  const int64_t T = plan.num_tasks();
  std::vector<float> part_acc(static_cast<size_t>(plan.offset[T] * D));
  std::vector<float> part_m(static_cast<size_t>(plan.offset[T])), part_l(static_cast<size_t>(plan.offset[T]));
  run_claimed(plan, [&](RunClaims& claims) {
    std::vector<float> qbuf(static_cast<size_t>(kTile * H * D)), scratch;
    for (int64_t begin = 0, end = 0; claims.next(begin, end);)
      for (int64_t ti = begin; ti < end; ++ti) {
        const Task& tk = plan.tasks[ti];
        const Q* qrows = qptr + tk.row0 * H * D;
        for (int64_t i = 0; i < tk.nq * H * D; ++i) qbuf[i] = kvpage::to_float(qrows[i]) * static_cast<float>(scale);
        const auto [k_begin, k_end] = tk.keys(plan.partition_size);
        const int64_t len = lens[tk.seq];
        const int64_t residual = len % bs ? rtables[tk.seq * max_blocks + len / bs] : 0;
        float* pa = part_acc.data() + plan.offset[ti] * D;
        float* pm = part_m.data() + plan.offset[ti];
        float* pl = part_l.data() + plan.offset[ti];
#define KVPAGE_CHANNEL_TILE(d)                                                                                  \
  attend_tile_channel<d>(qbuf.data(), tk.nq, H, G, base, page, tables + tk.seq * max_blocks, residual, len, bs, \
                         kv_heads, D, tk.pos0, k_begin, k_end, pa, pm, pl, scratch, plan.window)
        if (D == 64) KVPAGE_CHANNEL_TILE(64);
        else if (D == 128) KVPAGE_CHANNEL_TILE(128);
        else if (D == 256) KVPAGE_CHANNEL_TILE(256);
        else KVPAGE_CHANNEL_TILE(0);
#undef KVPAGE_CHANNEL_TILE
      }
  });
  merge_partitions(plan, H, D, part_acc, part_m, part_l, out.data_ptr<Q>());
}

}  // namespace

torch::Tensor paged_attention_channel(torch::Tensor query, torch::Tensor pages, const AttentionPlan& plan,
                                      torch::Tensor residual_tables, double scale) {
  TORCH_CHECK(pages.dim() == 2 && pages.scalar_type() == at::kByte && pages.is_contiguous(),
              "pages must be a contiguous uint8 [blocks, page_bytes] tensor");
  TORCH_CHECK(query.dim() == 3 && (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16),
              "query must be float32 or bfloat16 [tokens, heads, dim]");
  TORCH_CHECK(query.size(0) == plan.num_rows && query.size(1) == plan.num_heads, "query does not match the plan");
  TORCH_CHECK(pages.size(0) == plan.num_blocks, "the plan was checked against ", plan.num_blocks, " blocks, not ",
              pages.size(0));
  const int64_t D = query.size(2), bs = plan.block_size;
  const int64_t per_head = channel_page_bytes(bs, 1, D);
  TORCH_CHECK(pages.size(1) % per_head == 0, "pages of ", pages.size(1), " bytes are not ", bs,
              "-token blocks of heads of size ", D);
  const int64_t kv_heads = pages.size(1) / per_head;
  TORCH_CHECK(kv_heads > 0 && query.size(1) % kv_heads == 0, "query heads must be a multiple of the KV heads");
  TORCH_CHECK(residual_tables.scalar_type() == at::kLong && residual_tables.sizes() == plan.block_tables.sizes(),
              "residual tables must be int64 and shaped as the block tables");
  residual_tables = residual_tables.contiguous();
  const int64_t S = plan.seq_lens.size(0), max_blocks = residual_tables.size(1);
  const int64_t* lens = plan.seq_lens.data_ptr<int64_t>();
  const int64_t* rt = residual_tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    if (lens[s] % bs) {
      const int64_t r = rt[s * max_blocks + lens[s] / bs];
      TORCH_CHECK(r >= 0 && r < plan.num_blocks, "sequence ", s, ": residual block ", r, " outside the cache");
    }
  query = query.contiguous();
  auto out = at::empty_like(query);
  if (query.scalar_type() == at::kFloat) attend_channel<float>(query, pages, plan, residual_tables, scale, kv_heads, out);
  else attend_channel<at::BFloat16>(query, pages, plan, residual_tables, scale, kv_heads, out);
  return out;
}

void reshape_and_cache_channel(torch::Tensor key, torch::Tensor value, torch::Tensor pages, torch::Tensor slot_mapping,
                               torch::Tensor residual_slots, int64_t block_size) {
  TORCH_CHECK(pages.dim() == 2 && pages.scalar_type() == at::kByte && pages.is_contiguous(),
              "pages must be a contiguous uint8 [blocks, page_bytes] tensor");
  TORCH_CHECK(key.sizes() == value.sizes() && key.dim() == 3, "key/value must be [tokens, kv_heads, dim]");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
                  (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16),
              "key and value must both be float32 or bfloat16");
  TORCH_CHECK(block_size > 0 && pages.size(1) == channel_page_bytes(block_size, key.size(1), key.size(2)),
              "pages of ", pages.size(1), " bytes do not hold ", block_size, " tokens of ", key.size(1),
              " heads of size ", key.size(2), " (", channel_page_bytes(block_size, key.size(1), key.size(2)), ")");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == key.size(0) &&
                  residual_slots.scalar_type() == at::kLong && residual_slots.size(0) == key.size(0),
              "bad slot_mapping or residual_slots");
  key = key.contiguous();
  value = value.contiguous();
  slot_mapping = slot_mapping.contiguous();
  residual_slots = residual_slots.contiguous();
  if (key.scalar_type() == at::kFloat)
    write_channel<float>(key, value, pages, slot_mapping, residual_slots, block_size);
  else
    write_channel<at::BFloat16>(key, value, pages, slot_mapping, residual_slots, block_size);
}
