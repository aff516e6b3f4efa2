// bf16 linear layers (y = x . W^T + b) as AMX tile products over a weight packed once in the operand order.
//
// Why: a decode step multiplies ~10-300 token rows by every weight matrix of the model (~270 MB for
// SmolLM2-135M, read from memory once per step), and oneDNN's pre-packed bf16 GEMM ran those calls at
// 0.6-1.1 TFLOP/s with the weights streaming, i.e. neither at the tile unit's rate nor at the memory's. Here:
//   - the weight is stored as the product's B operand, [N/32][K/32][2 column tiles][16 k pairs][16][2], so a
//     32-column block is one contiguous run of K * 64 bytes;
//   - the threads claim runs of column blocks (one at a time, or groups of four with 256 rows or more) in order
//     (common.h ChunkClaims); every block is read from memory once and then serves all row tiles from cache
//     (2 x 2 output tiles per product group, each operand tile used twice);
//   - the next block's (group's) lines are requested into L2 spread over the current one's products, so the
//     memory stream overlaps the tile work instead of stalling the first tile load of every block.
// For the MLP's [gate; up] projection the weight is packed so that each 32-column block holds 16 gate columns
// and the same 16 up columns; the epilogue then writes act(gate) * up directly (act: SiLU for Llama-family MLPs,
// GELU-tanh for Gemma's), and the two [rows, inter] halves are never written out and read back.
// Activations are read in place (tile stride = the row pitch); a last partial row tile is staged zero-padded.
// With `stream` (the lm head: a [rows, 32768] slice of logits, 8-16 MB, read once by the logits pass) the
// output lines go around the cache (non-temporal stores): every output row of a column block is 64 KB from the
// last, so plain stores read each line for ownership first and the rows of a block fought over the same few
// cache sets; SmolLM2's head at 192 / 256 rows took 3x as long as with streamed lines (AMX Xeon, 2026-11-29:
// benchmarks/linear.py --stream).
// Every output element is one float32 sum over K in a fixed order whatever the number of rows (the result of a
// row does not depend on the batch it came in), rounded once to bf16.
#include "tensor.h"

#include "ops.h"
#include <ATen/Parallel.h>

#include "attention/amx_rows.h"  // TileConfig, amx_permitted, KVPAGE_ISA_AMX

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvpage::amx {

#if KVPAGE_ISA_AMX
// Tiles (all full, amx_configure_full): 0-3 = output [2 row tiles][2 column tiles] (16 x 16 float32), 4/5 =
// activation rows (16 x 32 bf16), 6/7 = weight (16 k pairs x 16 columns x 2).

// One 32-column block (weights wb) times row tiles a0 (and a1 when TWO) over K = 32 * KB; lines of the next
// block are requested into L2, `per_kb` of them per k step, starting at pf[*pf_line]. After each k step
// `drain(kb)` writes out part of the previous block's outputs (vector work that the tile unit's products hide).
template <bool TWO, class Drain>
inline void block_product(const at::BFloat16* a0, const at::BFloat16* a1, int64_t lda, const at::BFloat16* wb,
                          int64_t KB, const char* pf, int64_t pf_lines, int64_t per_kb, int64_t* pf_line,
                          const Drain& drain) {
  _tile_zero(0);
  _tile_zero(1);
  if (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  int64_t line = *pf_line;
  for (int64_t kb = 0; kb < KB; ++kb) {
    for (int64_t i = 0; i < per_kb && line < pf_lines; ++i, ++line) _mm_prefetch(pf + 64 * line, _MM_HINT_T1);
    // Loads ordered so that each one waits only for a product issued two places earlier (tiles are not
    // renamed: a load into a tile waits for every product reading it).
    _tile_loadd(4, a0 + kb * 32, lda);
    _tile_loadd(6, wb + kb * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, wb + kb * 1024 + 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    if (TWO) {
      _tile_loadd(5, a1 + kb * 32, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    drain(kb);
  }
  *pf_line = line;
}

// A finished block's accumulators (tiles 0-3 stored as [4][16 rows][16] float32: row tile t in 0/1, t + 1 in
// 2/3) whose rows are written out while the next block's products run: writing them right after the
// products left the tile unit idle for the stores and conversions (~25% of a 256-row product at K = 640).
struct Pending {
  const float* buf = nullptr;
  int64_t t = 0, nb = 0;
  int rows = 0, done = 0;  // its valid output rows (row tile t's 16, then t + 1's), and how many are written
};
#endif

bool amx_linear_available() {
#if KVPAGE_ISA_AMX
  return kvpage::amx_permitted();
#else
  return false;
#endif
}

// w [N, K] bf16 -> the packed operand (N and K multiples of 32).
torch::Tensor amx_pack_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "weight must be a 2-D bfloat16 tensor");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "weight sides must be multiples of 32, got ", N, " x ", K);
  // [N/32][2][16 n][K/32][16 pairs][2] -> [N/32][K/32][2][16 pairs][16 n][2]
  return w.contiguous().view({N / 32, 2, 16, K / 32, 16, 2}).permute({0, 3, 1, 4, 2, 5}).contiguous().view({N, K});
}

// w = [gate; up] ([2 * inter, K] bf16, inter % 16 == 0) -> packed so that every 32-column block holds 16
// gate columns and the same 16 up columns: amx_linear(..., act) then returns act(gate) * up.
torch::Tensor amx_pack_gate_up(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % 32 == 0, "gate_up weight must be [2 * inter, K] with inter % 16 == 0");
  return amx_pack_weight(kvpage::interleave_gate_up(w));
}

torch::Tensor amx_linear(const torch::Tensor& x_in, const torch::Tensor& wp,
                         const c10::optional<torch::Tensor>& bias_in, int64_t act, bool stream) {
  TORCH_CHECK(amx_linear_available(), "AMX tile products are not available on this CPU/OS");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be a 2-D bfloat16 tensor");
  TORCH_CHECK(wp.dim() == 2 && wp.scalar_type() == at::kBFloat16 && wp.is_contiguous(),
              "weight must be a contiguous bfloat16 tensor from amx_pack_weight");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = wp.size(0);
  TORCH_CHECK(wp.size(1) == K, "x has ", K, " columns, the weight ", wp.size(1));
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "weight sides must be multiples of 32, got ", N, " x ", K);
  TORCH_CHECK(act == kActNone || act == kActSilu || act == kActGeluTanh,
              "act must be 0 (none), 1 (SiLU) or 2 (GELU-tanh), got ", act);
  const bool gated = act != kActNone;
  const bool has_bias = bias_in.has_value() && bias_in->defined();
  TORCH_CHECK(!(gated && has_bias), "a gated product (act) takes no bias");
  const int64_t out_cols = gated ? N / 2 : N;
  auto y = at::empty({M, out_cols}, x_in.options());
  if (M == 0) return y;
#if KVPAGE_ISA_AMX
  torch::Tensor bias;
  if (has_bias) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.numel() == N, "bias has ", bias.numel(), " elements, expected ", N);
  }
  const torch::Tensor x = x_in.contiguous();
  const auto* xp = x.data_ptr<at::BFloat16>();
  // Row tiles: full ones read x in place; a last partial one reads a zero-padded copy of its rows.
  const int64_t row_tiles = (M + 15) / 16, tail = M % 16;
  std::vector<at::BFloat16> stage(tail != 0 ? 16 * K : 0, at::BFloat16(0.0f));
  if (tail != 0) std::memcpy(stage.data(), xp + (M - tail) * K, tail * K * sizeof(at::BFloat16));
  auto row_tile = [&](int64_t t) { return (tail != 0 && t == row_tiles - 1) ? stage.data() : xp + 16 * t * K; };
  const int64_t lda = K * 2;

  const auto* wptr = wp.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t KB = K / 32, NB = N / 32;
  const int64_t block_lines = KB * 32;  // 2 KiB of weights per k step
  // Rows are taken chunk_tiles tiles at a time so that a chunk's activations (about 1 MiB: 896 rows at K = 576,
  // 320 at K = 1536, never under 256 rows) stay in the 2 MiB L2 while the thread sweeps its column blocks;
  // longer inputs (prompts) read the weights once per chunk. A fixed 256 rows read them twice as often: a pass
  // of SmolLM2's layers took 0.89-0.91x / 0.96-1.03x / 0.94-0.98x the time at 512 / 1024 / 2048 rows with 1 MiB
  // chunks (two builds alternating, three rounds each: AMX Xeon, 2026-11-29).
  const int64_t chunk_tiles = std::clamp<int64_t>((1 << 20) / (32 * K) / 2 * 2, 16, 64);
  // Column blocks go G at a time: for each pair of row tiles the thread runs through the G blocks of its group
  // before the next pair, so a row's outputs of one task lie side by side (G lines, or G half lines gated)
  // instead of one line every 32 columns. With many rows that paid: the projections of a pass of SmolLM2's
  // layers at 256 / 384 / 512 / 2048 rows took 0.93x / 0.89x / 0.88x / 0.93x the time with G = 4 (weights
  // cold, both orders alternating in one process, the same bits: AMX Xeon, 2026-12-02), but 1.03-1.10x at 64-128
  // rows, where each block serves few row tiles and is best streamed alone.
  const int64_t G = std::min<int64_t>(NB, std::min(row_tiles, chunk_tiles) >= 16 ? 4 : 1), NG = (NB + G - 1) / G;
  const int64_t steps = (std::min(row_tiles, chunk_tiles) + 1) / 2 * KB;  // k steps a block spends on a chunk
  // At most 8 lines (512 bytes) requested per k step, ~20 GB/s a core at the products' pace, more than memory
  // serves: with few rows a block's products are over too soon to fetch all of the next one, and bursts of more
  // requests held up the operand tile loads behind them (a cold pass of SmolLM2's projections at 64 rows
  // 0.92x the time with the cap, and none slower at 32-256 rows: AMX Xeon, 2026-11-29).
  // (a group's lines over its products: G blocks' lines over G blocks' steps, the same rate as one block's)
  const int64_t per_kb = std::min<int64_t>(8, (block_lines + steps - 1) / steps);
  // Tasks (row chunk, group of column blocks), row chunk major, claimed about eight runs a thread at a time
  // (common.h ChunkClaims: a thread the OS parks leaves its blocks to the other).
  const int64_t tasks = (row_tiles + chunk_tiles - 1) / chunk_tiles * NG;
  kvpage::ChunkClaims claims(tasks, NG / (8 * at::get_num_threads()));
  // Streamed lines need 64-byte rows (N % 32 == 0 holds) from a 64-byte aligned start (torch's allocator's).
  const bool stream_out = stream && !gated && reinterpret_cast<uintptr_t>(yp) % 64 == 0;
  kvpage::on_claiming_threads(claims, [&](kvpage::ChunkClaims& queue) {
    kvpage::amx_configure_full();
    alignas(64) float buf[1024];  // the pending block's accumulators (written out before the next are stored)
    Pending pend;
    // Output row `u` of the pending block (u < 16: row tile t from tiles 0/1, else t + 1 from tiles 2/3): two
    // 16-column halves plus bias, or gated one 16-column block act(gate) * up, each rounded to bf16 first as the
    // separate projection and silu_mul / gelu_mul would (and stored as they round).
    auto write_row = [&](int u) {
      const int pair = u / 16, r = u % 16;
      const float* g = pend.buf + pair * 512 + r * 16;
      const int64_t row = 16 * (pend.t + pair) + r;
      if (gated) {
        const __m512 gv = kvpage::bf16_round(_mm512_load_ps(g)), uv = kvpage::bf16_round(_mm512_load_ps(g + 256));
        at::BFloat16* yr = yp + row * out_cols + pend.nb * 16;
        if (act == kActSilu)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr),
                              (__m256i)_mm512_cvtneps_pbh(kvpage::silu_mul16(gv, uv, 0xFFFF)));
        else
          kvpage::store16(yr, kvpage::gelu_mul16(gv, uv, 0xFFFF), 0xFFFF);
        return;
      }
      __m512 lo = _mm512_load_ps(g), hi = _mm512_load_ps(g + 256);
      if (bp != nullptr) {
        lo = _mm512_add_ps(lo, _mm512_loadu_ps(bp + pend.nb * 32));
        hi = _mm512_add_ps(hi, _mm512_loadu_ps(bp + pend.nb * 32 + 16));
      }
      at::BFloat16* yr = yp + row * N + pend.nb * 32;
      if (stream_out) {  // one whole line, written around the cache
        _mm256_stream_si256(reinterpret_cast<__m256i*>(yr), (__m256i)_mm512_cvtneps_pbh(lo));
        _mm256_stream_si256(reinterpret_cast<__m256i*>(yr + 16), (__m256i)_mm512_cvtneps_pbh(hi));
        return;
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr), (__m256i)_mm512_cvtneps_pbh(lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr + 16), (__m256i)_mm512_cvtneps_pbh(hi));
    };
    auto drain_to = [&](int upto) {
      for (; pend.done < upto; ++pend.done) write_row(pend.done);
    };
    // Stores the accumulators of the block just multiplied (row tiles t, and t + 1 when two) and makes them
    // the pending block, after writing out what is left of the previous one.
    auto retire = [&](int64_t t, int64_t nb, bool two) {
      drain_to(pend.rows);
      _tile_stored(0, buf, 64);
      _tile_stored(1, buf + 256, 64);
      if (two) {
        _tile_stored(2, buf + 512, 64);
        _tile_stored(3, buf + 768, 64);
      }
      pend.buf = buf;
      pend.t = t;
      pend.nb = nb;
      pend.rows = static_cast<int>(std::min<int64_t>(two ? 32 : 16, M - 16 * t));
      pend.done = 0;
    };
    // A thread holds its next claim while it works on the current one, so that it knows which block it will
    // read next and can request those lines while the current block's products run (with claims of one block,
    // as the layer projections of small models get, there was nothing to prefetch otherwise).
    int64_t first = 0, last = 0, next_first = 0, next_last = 0;
    bool have = queue.next(first, last);
    bool have_next = have && queue.next(next_first, next_last);
    while (have) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t g = task % NG, t0 = task / NG * chunk_tiles, t1 = std::min(row_tiles, t0 + chunk_tiles);
        const int64_t nb0 = g * G, nb1 = std::min(NB, nb0 + G);
        const int64_t next = task + 1 < last ? task + 1 : have_next ? next_first : -1;
        // the next group's lines (one run: its blocks are consecutive) while this one is multiplied (none when
        // the next task reuses this group)
        const int64_t ng = next >= 0 ? next % NG : -1;
        const char* pf = next >= 0 ? reinterpret_cast<const char*>(wptr + ng * G * KB * 1024) : nullptr;
        const int64_t pf_lines = next >= 0 && ng != g ? (std::min(NB, ng * G + G) - ng * G) * block_lines : 0;
        int64_t pf_line = 0;
        for (int64_t t = t0; t < t1; t += 2) {
          for (int64_t nb = nb0; nb < nb1; ++nb) {
            const at::BFloat16* wb = wptr + nb * KB * 1024;
            const int total = pend.rows;
            auto drain = [&](int64_t kb) { drain_to(static_cast<int>((kb + 1) * total / KB)); };
            if (t + 1 < t1) {
              block_product<true>(row_tile(t), row_tile(t + 1), lda, wb, KB, pf, pf_lines, per_kb, &pf_line, drain);
              retire(t, nb, true);
            } else {
              block_product<false>(row_tile(t), nullptr, lda, wb, KB, pf, pf_lines, per_kb, &pf_line, drain);
              retire(t, nb, false);
            }
          }
        }
      }
      first = next_first;
      last = next_last;
      have = have_next;
      if (have) have_next = queue.next(next_first, next_last);
    }
    drain_to(pend.rows);
    if (stream_out) _mm_sfence();  // this thread's streamed lines visible before the call returns
    _tile_release();
  });
#endif
  return y;
}

}  // namespace kvpage::amx
