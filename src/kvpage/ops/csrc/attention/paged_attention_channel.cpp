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
#include "attention/quant_loop.h"
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

// The filling block's keys of head h (from its residual block: bfloat16 rows of every head) and the run's value
// rows as float32 rows in L1, then the float main loop. Every block takes this path where the integer loop does
// not run (builds without AVX2, head sizes other than 64, 128, 256).
template <int64_t D>
inline void attend_run_float(const float* q, int64_t nq, int64_t H, int64_t G, int64_t h, const uint8_t* block,
                             const uint8_t* residual_page, int64_t off, int64_t n, int64_t t, int64_t n_bs,
                             int64_t kv_heads, int64_t Dd, int64_t pos0, int64_t window, float* kf, float* vf,
                             float* zero, float* step, float* sc, float* acc, float* m, float* l) {
  const int64_t head_keys = channel_block_bytes(n_bs, Dd), vrow = kv_heads * (Dd + kScaleBytes);
  if (residual_page != nullptr) {
    const auto* r = reinterpret_cast<const uint16_t*>(residual_page);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < Dd; ++d) kf[i * Dd + d] = bf16_float(r[((off + i) * kv_heads + h) * Dd + d]);
  } else {
    channel_params(block + h * head_keys, n_bs, Dd, zero, step);
    dequantize_channel_rows<D>(block + h * head_keys, off, n, Dd, zero, step, kf);
  }
  const uint8_t* vb = block + kv_heads * head_keys + off * vrow + h * (Dd + kScaleBytes);
  dequantize_block<KVCode::kInt8, D>(vb, vrow, n, Dd, vf);
  attend_block_rows<D>(q, nq, H, G, h, kf, vf, t, n, pos0, window, n_bs, Dd, sc, acc, m, l);
}

// The task's keys [k_begin, k_end) of sequence `seq_len` long (its block table `table`, its filling block's keys
// in page `residual` when seq_len is not a whole number of blocks), for its query rows (q: pre-scaled float32,
// rows r = j * H + head, row r sees keys <= pos0 + r / H and none before its window); float loop throughout.
template <int64_t D>
void attend_tile_channel(const float* q, int64_t nq, int64_t H, int64_t G, const uint8_t* pages, int64_t page,
                         const int64_t* table, int64_t residual, int64_t seq_len, int64_t block_size, int64_t kv_heads,
                         int64_t dim, int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m, float* l,
                         std::vector<float>& scratch, int64_t window) {
  const int64_t Dd = D > 0 ? D : dim, n_bs = block_size, R = nq * H;
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
    const uint8_t* rpage = b == filling ? pages + residual * page : nullptr;
    for (int64_t h = 0; h < kv_heads; ++h)
      attend_run_float<D>(q, nq, H, G, h, pages + table[b] * page, rpage, off, n, t, n_bs, kv_heads, Dd, pos0,
                          window, kf, vf, zero, step, sc, acc, m, l);
    t += n;
  }
}

#if KVPAGE_ISA_AVX2
// A head's block parameters as the integer loop uses them: step[d] and mid[d] = zero point + 128 steps, the key
// the code 128 stands for (ChannelLanes reads codes less 128).
inline void channel_steps(const uint8_t* head_block, int64_t n, int64_t D, float* mid, float* step) {
  channel_params(head_block, n, D, mid, step);
  const __m256 c128 = _mm256_set1_ps(128.f);
  for (int64_t d = 0; d < D; d += 8)
    _mm256_storeu_ps(mid + d, _mm256_fmadd_ps(_mm256_loadu_ps(step + d), c128, _mm256_loadu_ps(mid + d)));
}

// A query row q (D floats) times the steps as int16 lanes at out (returns their scale: q x step ~= out x scale) and
// q . mid at *bias: one pass for the products (kept in registers where D allows), their largest magnitude and
// the bias, one to round them 16 at a time.
template <int64_t D>
inline float channel_query(const float* q, const float* step, const float* mid, int16_t* out, float* bias) {
  static_assert(D % 16 == 0, "16 lanes at a time");
  __m256 x[D / 8];
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  for (int64_t k = 0; k < D / 8; ++k) {
    const __m256 qv = _mm256_loadu_ps(q + 8 * k);
    x[k] = _mm256_mul_ps(qv, _mm256_loadu_ps(step + 8 * k));
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[k]));
    b = _mm256_fmadd_ps(qv, _mm256_loadu_ps(mid + 8 * k), b);
  }
  *bias = kvpage::hsum8(b);
  const float top = kvpage::hmax8(amax);
  const __m256 inv = _mm256_set1_ps(top > 0.f ? kI16Max / top : 0.f);
  for (int64_t k = 0; k < D / 8; k += 2) {  // |x x inv| <= 32767 (packs saturates); rounded to nearest even
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(x[k], inv)), hi = _mm256_cvtps_epi32(_mm256_mul_ps(x[k + 1], inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * k),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), _MM_SHUFFLE(3, 1, 2, 0)));
  }
  return top / kI16Max;
}

// As attend_tile_channel, with the complete blocks read in registers (quant_loop.h's int8 loop): a key is
// codes x step + zero point per channel, so q . k = (q x step) . (codes - 128) + q . (zero + 128 x step). Per
// block, KV head and query row, q x step is brought to int16 lanes (its own scale) against the codes less 128
// (ChannelLanes), and the second term, the same for every key of the block, is added to the block's scores. As
// in the int8 rows' loop, consecutive complete blocks go in units of up to the lanes' kUnitKeys: one softmax
// step and one integer P.V sum (pv_rows) per unit. The filling block takes the float path.
template <int64_t D>
void attend_tile_channel_codes(const float* q, int64_t nq, int64_t H, int64_t G, const uint8_t* pages, int64_t page,
                               const int64_t* table, int64_t residual, int64_t seq_len, int64_t block_size,
                               int64_t kv_heads, int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m,
                               float* l, std::vector<float>& scratch, int64_t window, const kvpage::NextKeys& next) {
  using L = CodeLanes<KVCode::kInt8>;
  using KL = ChannelLanes;
  static_assert(D % L::kW == 0, "rows are read kW codes at a time");
  const int64_t n_bs = block_size, R = nq * H, head_keys = channel_block_bytes(n_bs, D);
  const int64_t values_at = kv_heads * head_keys, vrow = kv_heads * (D + kScaleBytes);
  const int64_t blocks = std::clamp<int64_t>(L::kUnitKeys / n_bs, 1, kUnitBlocks), U = blocks * n_bs;
  const int64_t ws = U + 2, ss = U + 8, G16 = (G + 15) / 16 * 16;
  thread_local std::vector<int16_t> q16, w16;
  q16.resize(static_cast<size_t>(G * D));
  w16.resize(static_cast<size_t>(G * ws));
  scratch.resize(static_cast<size_t>(R * n_bs + 2 * n_bs * D + 2 * blocks * D + U + 4 + U + G * ss + 2 * G16 +
                                     2 * G + 8));
  float* fsc = scratch.data();      // the float path's scores (the filling block)
  float* kf = fsc + R * n_bs;       // and its key and value rows
  float* vf = kf + n_bs * D;
  float* zero = vf + n_bs * D;      // each run's zero points (+ 128 steps) and steps (the current KV head)
  float* step = zero + blocks * D;
  float* ones = step + blocks * D;  // the key rows' factor (score_rows reads four at a time)
  float* vs = ones + U + 4;         // the value rows' scales
  float* sc = vs + U;               // scores, then weights x value scales, of the head's G rows: [g][i]
  float* corr = sc + G * ss;
  float* wscale = corr + G16;
  float* qs = wscale + G16;         // per row: its int16 lanes' scale, and q . zero
  float* bias = qs + G;
  std::fill(ones, ones + U + 4, 1.f);
  int16_t* const q16p = q16.data();
  int16_t* const w16p = w16.data();
  const UnitBuffers buffers{sc, ss, vs, corr, wscale, w16p, ws};
  const int64_t half = (page + 1) / 2;  // the prefetch takes a page as two halves of n_bs rows
  const int64_t half_rows = (half + n_bs - 1) / n_bs;
  const int64_t filling = seq_len % n_bs ? seq_len / n_bs : -1;
  reset_partials(acc, m, l, R, D);
  for (int64_t t = k_begin; t < k_end;) {
    if (t / n_bs == filling) {  // the last block, partly written: its keys unrounded in the residual group
      const int64_t off = t % n_bs, n = std::min(n_bs - off, k_end - t);
      for (int64_t h = 0; h < kv_heads; ++h)
        attend_run_float<D>(q, nq, H, G, h, pages + table[t / n_bs] * page, pages + residual * page, off, n, t, n_bs,
                            kv_heads, D, pos0, window, kf, vf, zero, step, fsc, acc, m, l);
      t += n;
      continue;
    }
    // the unit: complete blocks from t (it stops before the filling block)
    LineStream ls;
    const UnitRuns unit(table, n_bs, t, k_end, blocks, filling, [&](int64_t u) {
      ls.add(BlockPrefetch<uint8_t>(pages, pages + half, table, n_bs, page, half_rows, u, k_begin, k_end, next,
                                    std::max<int64_t>(kPrefetchAhead, blocks)));
    });
    const int runs = unit.count;
    const int64_t n = unit.n;
    const uint8_t* blk[kUnitBlocks];
    for (int b = 0; b < runs; ++b) blk[b] = pages + unit.block[b] * page;
    ls.pace(kv_heads * (2 + G + n / 3 + D / L::kW + runs * G));  // about the step() calls of this unit
    for (int64_t h = 0; h < kv_heads; ++h) {
      ls.step();
      float vtop = 0.f;
      for (int b = 0; b < runs; ++b) {
        channel_steps(blk[b] + h * head_keys, n_bs, D, zero + b * D, step + b * D);  // zero <- + 128 steps
        const uint8_t* vb = blk[b] + values_at + unit.off[b] * vrow + h * (D + kScaleBytes);
        for (int64_t i = 0; i < unit.len[b]; ++i) {
          vs[unit.start[b] + i] = row_scale(vb + i * vrow, D);
          vtop = std::max(vtop, vs[unit.start[b] + i]);
        }
      }
      const float winv = L::weight_inv(vtop), wfactor = L::weight_factor(vtop);
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);  // keys after this query's position are masked
        const int64_t first = window_first(window, pos0 + j, t, n);  // and keys before its window
        if (visible <= first) continue;
        const int64_t r0 = j * H + h * G;
        ValueRun vrun[kUnitBlocks];
        int nv = 0;
        // run by run: q x step in int16 lanes, the run's scores (score_rows stores four lanes past a run's last
        // key: they land on the next run's, written after it), then its q . mid on them
        for (int b = 0; b < runs; ++b) {
          int64_t lo, hi;
          unit.part(b, first, visible, lo, hi);
          if (lo >= hi) continue;
          for (int64_t g = 0; g < G; ++g)
            qs[g] = channel_query<D>(q + (r0 + g) * D, step + b * D, zero + b * D, q16p + g * D, bias + g);
          ls.step();
          const uint8_t* kb = blk[b] + h * head_keys + unit.off[b] * D;
#define KVPAGE_SCORE(gt) \
  score_rows<KL, gt, D>(q16p + g0 * D, qs + g0, kb, D, lo, hi, ones, sc + g0 * ss + unit.start[b], ss, ls)
          KVPAGE_ROW_BATCHES(KVPAGE_SCORE)
#undef KVPAGE_SCORE
          for (int64_t g = 0; g < G; ++g) {
            float* s = sc + g * ss + unit.start[b];
            const __m256 vb8 = _mm256_set1_ps(bias[g]);
            int64_t i = lo;
            for (; i + 8 <= hi; i += 8) _mm256_storeu_ps(s + i, _mm256_add_ps(_mm256_loadu_ps(s + i), vb8));
            for (; i < hi; ++i) s[i] += bias[g];
          }
          vrun[nv++] = {blk[b] + values_at + (unit.off[b] + lo) * vrow + h * (D + kScaleBytes), hi - lo};
        }
        unit_softmax_pv<L, D>(buffers, first, visible, winv, wfactor, G, m + r0, l + r0, acc + r0 * D, vrun, nv,
                              vrow, ls);
      }
    }
    ls.rest();
    t += n;
  }
}
#endif

template <typename Q>
void attend_channel(const torch::Tensor& query, const torch::Tensor& pages, const AttentionPlan& plan,
                    const torch::Tensor& residual_tables, double scale, int64_t kv_heads, torch::Tensor& out) {
  const int64_t H = query.size(1), D = query.size(2), G = H / kv_heads, bs = plan.block_size;
  const int64_t max_blocks = plan.block_tables.size(1), page = pages.size(1);
  const int64_t* tables = plan.block_tables.data_ptr<int64_t>();
  const int64_t* rtables = residual_tables.data_ptr<int64_t>();
  const int64_t* lens = plan.seq_lens.data_ptr<int64_t>();
  const uint8_t* base = pages.data_ptr<uint8_t>();
  run_tasks(plan, query.data_ptr<Q>(), H, D, scale, out.data_ptr<Q>(),
            [&](const Task& tk, float* q, float* pa, float* pm, float* pl, const kvpage::NextKeys& next,
                std::vector<float>& scratch) {
    const auto [k_begin, k_end] = tk.keys(plan.partition_size);
    const int64_t len = lens[tk.seq];
    const int64_t residual = len % bs ? rtables[tk.seq * max_blocks + len / bs] : 0;
    const int64_t* table = tables + tk.seq * max_blocks;
    (void)next;  // builds without the AVX2 loop have no use for it
#if KVPAGE_ISA_AVX2
#define KVPAGE_CHANNEL_TILE(d)                                                                                    \
  if constexpr (d > 0)                                                                                            \
    attend_tile_channel_codes<d>(q, tk.nq, H, G, base, page, table, residual, len, bs, kv_heads, tk.pos0,         \
                                 k_begin, k_end, pa, pm, pl, scratch, plan.window, next);                         \
  else                                                                                                            \
    attend_tile_channel<d>(q, tk.nq, H, G, base, page, table, residual, len, bs, kv_heads, D, tk.pos0, k_begin,   \
                           k_end, pa, pm, pl, scratch, plan.window)
#else
#define KVPAGE_CHANNEL_TILE(d)                                                                                    \
  attend_tile_channel<d>(q, tk.nq, H, G, base, page, table, residual, len, bs, kv_heads, D, tk.pos0, k_begin,     \
                         k_end, pa, pm, pl, scratch, plan.window)
#endif
    if (D == 64) KVPAGE_CHANNEL_TILE(64);
    else if (D == 128) KVPAGE_CHANNEL_TILE(128);
    else if (D == 256) KVPAGE_CHANNEL_TILE(256);
    else KVPAGE_CHANNEL_TILE(0);
#undef KVPAGE_CHANNEL_TILE
  });
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
#if KVPAGE_ISA_AVX512
  const char* loop = "avx512-int8-channel";
#elif KVPAGE_ISA_AVX2
  const char* loop = "avx2-int8-channel";
#else
  const char* loop = "channel-dequantized";
#endif
  note_decode_kernel(D == 64 || D == 128 || D == 256 ? loop : "channel-dequantized");
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
