// Paged attention on CPU for kvpage.
//
// KV layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim], float32, bfloat16 or float16,
// contiguous or block-major (common.h kv_geometry: the engine keeps a block's K and V adjacent).
// A flat batch holds, for sequence s, query rows query_start_loc[s] .. query_start_loc[s+1]-1; they are the
// last q_len tokens of a context of seq_lens[s] tokens, so query j sits at position seq_len - q_len + j and
// attends to keys 0..that position (causal, with any cached prefix in front).
//
// One task = (sequence, query token, KV head, context partition). A task reads each key/value row of its
// partition once and uses it for every query head of the KV head's group (GQA), keeping a block-wise online
// softmax in float32. Long contexts are split into partitions whose partial results are merged afterwards,
// so a single long sequence still keeps every core busy.

#include "tensor.h"
#include <ATen/Parallel.h>

#include <type_traits>

#include "common.h"
#include "ops.h"
#include "attention/amx_rows.h"
#include "attention/packed_kv.h"
#include "attention/amx_packed.h"
#include "attention/amx_pairs.h"
#include "attention/avx2.h"
#include "attention/avx512_bf16.h"
#include "attention/prompt_bf16.h"
#include "attention/loop.h"
#include "attention/merge.h"
#include "attention/plan.h"
#include "attention/portable.h"

#if KVPAGE_ISA_AVX512
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <string>
#include <vector>

namespace {

using namespace kvpage::attn;


#if KVPAGE_ISA_AMX
// The AMX decode kernel for a head size and a group size (<= 8, checked by the caller) known at compile time.
template <int64_t D>
void dispatch_decode_amx(int64_t G, const at::BFloat16* q, int64_t kv_heads, const at::BFloat16* kc,
                         const at::BFloat16* vc, const int64_t* table, int64_t block_size, int64_t block_stride,
                         int64_t k_begin,
                         int64_t k_end, float* acc, float* m, float* l, std::vector<float>& scratch, float scale) {
  switch (G) {
#define KVPAGE_AMX_CASE(g)                                                                                     \
  case g:                                                                                                      \
    return kvpage::attend_decode_amx<D, g>(q, kv_heads, kc, vc, table, block_size, block_stride, k_begin,      \
                                           k_end, acc, m, l, scratch, scale);
    KVPAGE_AMX_CASE(1) KVPAGE_AMX_CASE(2) KVPAGE_AMX_CASE(3) KVPAGE_AMX_CASE(4)
    KVPAGE_AMX_CASE(5) KVPAGE_AMX_CASE(6) KVPAGE_AMX_CASE(7) KVPAGE_AMX_CASE(8)
#undef KVPAGE_AMX_CASE
    default:
      TORCH_CHECK(false, "AMX decode: group size ", G, " has no instance");
  }
}
#endif

// The kernel configuration's run-time attention switch (kvpage.envs: KVPAGE_AMX_DECODE), passed with every call
// rather than held in a global (KVPAGE_SPLIT_SHORT is the plan's: attention/plan.h).
struct AttentionOptions {
  bool amx_decode;  // AMX tile products for decode tasks where the CPU and OS allow them
  bool avx2_row_decode;  // bf16 row-layout decode on the AVX2 loop on AVX-512 builds (ops/kernels.py says where)
};

// Which kernel served the last call's decode tasks (diagnostics and tests).
const char* g_decode_kernel = "none";

template <typename KV>
constexpr const char* avx2_kernel_name() {
  return std::is_same_v<KV, float> ? "avx2-f32" : std::is_same_v<KV, at::Half> ? "avx2-f16" : "avx2-bf16";
}

template <typename KV, typename Q>
void run_attention(const torch::Tensor& query, const torch::Tensor& kv_cache, const AttentionPlan& plan, double scale,
                   bool packed, const AttentionOptions& opt, torch::Tensor& out) {
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const kvpage::KVGeometry geo = kvpage::kv_geometry(kv_cache);
  const int64_t block_stride = geo.block_stride;
  const int64_t G = H / kv_heads;
  const int64_t max_blocks = plan.block_tables.size(1);
  const int64_t* tables = plan.block_tables.data_ptr<int64_t>();
  const Q* qptr = query.data_ptr<Q>();
  Q* optr = out.data_ptr<Q>();
  const KV* kcache = kv_cache.data_ptr<KV>();
  const KV* vcache = kcache + geo.v_offset;
  const std::vector<Task>& tasks = plan.tasks;
  const std::vector<int64_t>& offset = plan.offset;
  const int64_t partition_size = plan.partition_size;
  const bool few_tasks = plan.few_tasks;
  const int64_t window = plan.window;
  const int64_t T = plan.num_tasks();
  std::vector<float> part_acc(static_cast<size_t>(offset[T] * D));
  std::vector<float> part_m(static_cast<size_t>(offset[T])), part_l(static_cast<size_t>(offset[T]));
  bool use_dp = false;
#if KVPAGE_ISA_AVX512BF16
  use_dp = std::is_same_v<KV, at::BFloat16> && std::is_same_v<Q, at::BFloat16> && D % 32 == 0;
#endif

  bool use_amx = false;
#if KVPAGE_ISA_AMX
  // Only for small batches (few tasks, contexts split into partitions): there the KV tends to sit in cache and
  // the AMX kernel is twice as fast; with many sequences streaming from memory the AVX-512 kernel is faster.
  use_amx = !packed && window == 0 && few_tasks && !plan.invariant && use_dp && opt.amx_decode &&
            (D == 64 || D == 128) && G <= 8 &&
            block_size % 16 == 0 &&
            partition_size % 16 == 0 && kvpage::amx_permitted();
#endif

  bool use_amx_packed = false;
#if KVPAGE_ISA_AMX
  // Decode tasks over the packed layout: AMX products straight from the cache (any batch size: nothing is
  // rearranged on the way, unlike the row-layout AMX kernel above).
  use_amx_packed = packed && opt.amx_decode && G <= 16 && kvpage::amx_permitted();
#endif
  bool use_amx_pairs = false;
#if KVPAGE_ISA_AMX
  use_amx_pairs = use_amx_packed && D == 64 && H <= 16;
#endif
  // Row-layout tasks of a head size the AVX2 loop is built for take it on every AVX2 build (AVX-512 ones too)
  // where the alternative is the generic loop (float32 and float16 caches, float32 queries: on a Zen 5 float16
  // rows in a seventh of the generic loop's time). bf16 caches with bf16 queries keep the AVX-512 row loop
  // (dpbf16: 4x the multiply-adds per instruction) for prompt tiles everywhere and for decode on Intel CPUs,
  // where the packed layout was built because arithmetic, not memory, limited decode; on AMD CPUs decode
  // streams the cache, and at 64 sequences x 8K keys on a Zen 5 the AVX2 loop reads bf16 rows in half the
  // AVX-512 row loop's time (the caller's avx2_row_decode: ops/kernels.py, with the layout choice).
  const bool avx2_sizes = KVPAGE_ISA_AVX2 && !packed && (D == 64 || D == 128 || D == 256);
  const bool avx2_bf16_decode = KVPAGE_ISA_AVX2_ONLY || opt.avx2_row_decode;
  g_decode_kernel = use_amx_pairs ? "amx-pairs" : use_amx_packed ? "amx-packed" : packed ? "avx512-packed" : use_amx ? "amx-rows"
                  : (avx2_sizes && (!use_dp || avx2_bf16_decode)) ? avx2_kernel_name<KV>()
                  : (use_dp && (D == 64 || D == 128 || D == 256)) ? "avx512-rows"
                  : "generic";
  auto work = [&](RunClaims& claims) {
#if KVPAGE_ISA_AMX
    if (use_amx) kvpage::amx_configure(G);
#if KVPAGE_PACKED
    if (use_amx_pairs) kvpage::amx_configure_pairs(H);
    else if (use_amx_packed) kvpage::amx_configure_packed(G);
#endif
#endif
    std::vector<float> qbuf(static_cast<size_t>(kTile * H * D));
    std::vector<const at::BFloat16*> qptrs(static_cast<size_t>(kTile * H));
    std::vector<float> scratch;
    for (int64_t begin = 0, end = 0; claims.next(begin, end);)
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& tk = tasks[ti];
      const Q* qrows = qptr + tk.row0 * H * D;
      const at::BFloat16* const* qb = nullptr;
      // this task on the AVX2 loop (the AMX row kernel keeps the decode tasks it takes)
      const bool avx2_task = avx2_sizes && (!use_dp || (avx2_bf16_decode && tk.nq == 1)) && !(use_amx && tk.nq == 1);
      if (use_dp) {
        for (int64_t r = 0; r < tk.nq * H; ++r) qptrs[r] = reinterpret_cast<const at::BFloat16*>(qrows + r * D);
        qb = qptrs.data();
      }
      if (!use_dp || avx2_task) {
        for (int64_t i = 0; i < tk.nq * H * D; ++i) qbuf[i] = to_float(qrows[i]) * static_cast<float>(scale);
      }
      const auto [k_begin, k_end] = tk.keys(partition_size);
      const int64_t* table = tables + tk.seq * max_blocks;
      float* pa = part_acc.data() + offset[ti] * D;
      float* pm = part_m.data() + offset[ti];
      float* pl = part_l.data() + offset[ti];
      const float sc = static_cast<float>(scale);
      const kvpage::NextKeys next = next_keys(plan, tables, max_blocks, ti, end);  // the prefetch runs on into it
#if KVPAGE_PACKED
      if constexpr (std::is_same_v<KV, at::BFloat16>) {
        if (packed) {
#if KVPAGE_ISA_AMX
          if (use_amx_pairs && tk.nq == 1) {
#if KVPAGE_ISA_AMX
            kvpage::attend_decode_amx_pairs(qb[0], G, kv_heads, kcache, vcache, table, block_size, block_stride,
                                            k_begin, k_end, pa,
                                            pm, pl, scratch, sc, next);
#endif
            continue;
          }
          if (use_amx_packed && tk.nq == 1) {
            // (a decode query's k_begin is already its window's edge: the kernel masks the keys before it)
            if (D == 64)
              kvpage::attend_decode_amx_packed<64>(qb[0], G, kv_heads, kcache, vcache, table, block_size,
                                                   block_stride, k_begin,
                                                   k_end, pa, pm, pl, scratch, sc, next);
            else if (D == 128)
              kvpage::attend_decode_amx_packed<128>(qb[0], G, kv_heads, kcache, vcache, table, block_size,
                                                    block_stride, k_begin,
                                                    k_end, pa, pm, pl, scratch, sc, next);
            else
              kvpage::attend_decode_amx_packed<256>(qb[0], G, kv_heads, kcache, vcache, table, block_size,
                                                    block_stride, k_begin,
                                                    k_end, pa, pm, pl, scratch, sc, next);
            continue;
          }
#endif
          if (D == 64)
            kvpage::attend_tile_packed<64>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads,
                                           tk.pos0,
                                           k_begin, k_end, pa, pm, pl, scratch, sc, window, next);
          else if (D == 128)
            kvpage::attend_tile_packed<128>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride,
                                            kv_heads, tk.pos0,
                                            k_begin, k_end, pa, pm, pl, scratch, sc, window, next);
          else
            kvpage::attend_tile_packed<256>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride,
                                            kv_heads, tk.pos0,
                                            k_begin, k_end, pa, pm, pl, scratch, sc, window, next);
          continue;
        }
      }
#endif
#if KVPAGE_ISA_AVX2
      if (avx2_task) {
        if (D == 64)
          attend_tile_avx2<KV, 64>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride,
                                   kv_heads, tk.pos0, k_begin, k_end, pa, pm, pl, scratch, window, next);
        else if (D == 128)
          attend_tile_avx2<KV, 128>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride,
                                    kv_heads, tk.pos0, k_begin, k_end, pa, pm, pl, scratch, window, next);
        else
          attend_tile_avx2<KV, 256>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride,
                                    kv_heads, tk.pos0, k_begin, k_end, pa, pm, pl, scratch, window, next);
        continue;
      }
#endif
#if KVPAGE_ISA_AVX512BF16
      if constexpr (std::is_same_v<KV, at::BFloat16>) {
#if KVPAGE_ISA_AMX
        if (use_amx && tk.nq == 1) {
          if (D == 64)
            dispatch_decode_amx<64>(G, qb[0], kv_heads, kcache, vcache, table, block_size, block_stride, k_begin,
                                    k_end, pa, pm, pl,
                                    scratch, sc);
          else
            dispatch_decode_amx<128>(G, qb[0], kv_heads, kcache, vcache, table, block_size, block_stride, k_begin,
                                     k_end, pa, pm,
                                     pl, scratch, sc);
          continue;
        }
#endif
        if (use_dp && (D == 64 || D == 128 || D == 256)) {
          // prompt tiles: scored a block of rows at a time against transposed keys (prompt_bf16.h: 1.5-1.9x
          // this loop's speed at SmolLM2's heads; at Gemma 3's 256-wide heads within 10%, so they stay here)
          if (tk.nq > 1 && D <= 128) {
            if (D == 64)
              attend_prompt_bf16<64>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads,
                                     tk.pos0, k_begin, k_end, pa, pm, pl, scratch, sc, window, next);
            else
              attend_prompt_bf16<128>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads,
                                      tk.pos0, k_begin, k_end, pa, pm, pl, scratch, sc, window, next);
            continue;
          }
          if (D == 64)
            attend_tile_bf16<64>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, tk.pos0,
                                 k_begin, k_end, pa, pm, pl, scratch, sc, window, next);
          else if (D == 128)
            attend_tile_bf16<128>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, tk.pos0,
                                  k_begin, k_end, pa, pm, pl, scratch, sc, window, next);
          else
            attend_tile_bf16<256>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, tk.pos0,
                                  k_begin, k_end, pa, pm, pl, scratch, sc, window, next);
          continue;
        }
      }
#endif
      if (D == 64)
        attend_tile<KV, 64>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, D,
                            tk.pos0, k_begin, k_end, pa, pm, pl, scratch, qb, sc, window);
      else if (D == 128)
        attend_tile<KV, 128>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, D,
                             tk.pos0, k_begin, k_end, pa, pm, pl, scratch, qb, sc, window);
      else if (D == 256)
        attend_tile<KV, 256>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, D,
                             tk.pos0, k_begin, k_end, pa, pm, pl, scratch, qb, sc, window);
      else
        attend_tile<KV, 0>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, D,
                           tk.pos0, k_begin, k_end, pa, pm, pl, scratch, qb, sc, window);
    }
#if KVPAGE_ISA_AMX
    if (use_amx || use_amx_packed) kvpage::amx_release();
#endif
  };
  run_claimed(plan, work);

  merge_partitions(plan, H, D, part_acc, part_m, part_l, optr);
}

template <typename KV, typename IN>
void write_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
                 const torch::Tensor& slot_mapping) {
  const int64_t N = key.size(0), row = key.size(1) * key.size(2);
  const int64_t block_size = kv_cache.size(2), num_slots = kv_cache.size(1) * block_size;
  const kvpage::KVGeometry geo = kvpage::kv_geometry(kv_cache);
  KV* kdst = kv_cache.data_ptr<KV>();
  KV* vdst = kdst + geo.v_offset;
  const IN* ksrc = key.data_ptr<IN>();
  const IN* vsrc = value.data_ptr<IN>();
  const int64_t ks = key.stride(0), vs = value.stride(0);  // token rows may be views into a wider qkv output
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " outside the KV cache (", num_slots, " slots)");
      const int64_t at = (slot / block_size) * geo.block_stride + (slot % block_size) * row;
      if constexpr (std::is_same_v<KV, IN>) {
        std::memcpy(kdst + at, ksrc + i * ks, sizeof(KV) * row);
        std::memcpy(vdst + at, vsrc + i * vs, sizeof(KV) * row);
      } else {
        for (int64_t e = 0; e < row; ++e) {
          kdst[at + e] = static_cast<KV>(to_float(ksrc[i * ks + e]));
          vdst[at + e] = static_cast<KV>(to_float(vsrc[i * vs + e]));
        }
      }
    }
  });
}

#if KVPAGE_PACKED
// Token rows into the packed layout (packed_kv.h); bf16 cache.
template <typename IN>
void write_cache_packed(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
                        const torch::Tensor& slot_mapping) {
  const int64_t N = key.size(0), kv_heads = key.size(1), D = key.size(2);
  const int64_t block_size = kv_cache.size(2), num_slots = kv_cache.size(1) * block_size;
  const kvpage::KVGeometry geo = kvpage::kv_geometry(kv_cache);
  at::BFloat16* kdst = kv_cache.data_ptr<at::BFloat16>();
  at::BFloat16* vdst = kdst + geo.v_offset;
  const IN* ksrc = key.data_ptr<IN>();
  const IN* vsrc = value.data_ptr<IN>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
#if KVPAGE_ISA_AVX512
  // word offsets of one dim pair of 16 consecutive keys: one 16-key row (16 words) apart
  const __m512i rows16 = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
#endif
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> krow(std::is_same_v<IN, float> ? D : 0), vrow(std::is_same_v<IN, float> ? D : 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " outside the KV cache (", num_slots, " slots)");
      const int64_t off = slot % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        // bf16 rows are read in place; float32 ones rounded into krow / vrow first
        const at::BFloat16* kr = krow.data();
        const at::BFloat16* vr = vrow.data();
        if constexpr (std::is_same_v<IN, at::BFloat16>) {
          kr = ksrc + i * ks + h * D;
          vr = vsrc + i * vs + h * D;
        } else {
          for (int64_t d = 0; d < D; ++d) {
            krow[d] = static_cast<at::BFloat16>(ksrc[i * ks + h * D + d]);
            vrow[d] = static_cast<at::BFloat16>(vsrc[i * vs + h * D + d]);
          }
        }
        // K: the token's dim pairs are 32-bit words one 16-key row (64 bytes) apart; V: its elements every
        // other bf16 of its key pair's row (packed_kv.h).
        const int64_t base = kvpage::packed_group_offset(slot / block_size, off, geo.block_stride, kv_heads,
                                                         D) + h * 16 * D;
        auto* k32 = reinterpret_cast<uint32_t*>(kdst + base + (off % 16) * 2);
        const auto* kw = reinterpret_cast<const uint32_t*>(kr);
        at::BFloat16* vpair = vdst + base + ((off % 16) / 2) * 2 * D;
#if KVPAGE_ISA_AVX512
        // 16 dim pairs per scatter; 16 values per masked store into the low or high halves of a pair row
        for (int64_t p = 0; p < D / 2; p += 16)
          _mm512_i32scatter_epi32(k32 + p * 16, rows16, _mm512_loadu_si512(kw + p), 4);
        const __mmask32 half = off % 2 ? 0xAAAAAAAAu : 0x55555555u;
        for (int64_t d = 0; d < D; d += 16) {
          __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + d)));
          if (off % 2) w = _mm512_slli_epi32(w, 16);
          _mm512_mask_storeu_epi16(vpair + 2 * d, half, w);
        }
#else
        for (int64_t p = 0; p < D / 2; ++p) k32[p * 16] = kw[p];
        for (int64_t d = 0; d < D; ++d) vpair[2 * d + off % 2] = vr[d];
#endif
      }
    }
  });
}
#endif

// Whether this build and cache can use the packed layout (packed_kv.h; int8 and fp8 pages: packed_int8.h,
// packed_fp8.h). The cache's own limits come first, so a cache no build could pack is told so on every build.
void check_packed(const torch::Tensor& kv_cache) {
  const bool codes = is_quantized_kv(kv_cache);
  TORCH_CHECK(codes || kv_cache.scalar_type() == at::kBFloat16,
              "the packed KV layout is bfloat16, int8 or fp8 only");
  TORCH_CHECK(kv_cache.size(2) % 16 == 0, "the packed KV layout needs a block size that is a multiple of 16");
  if (codes) {
    const int64_t D = kv_cache.size(4) - 2;
    TORCH_CHECK(D == 64 || D == 128 || D == 256, "the packed int8 and fp8 KV layouts need head size 64, 128 or 256");
    TORCH_CHECK(KVPAGE_PACKED_INT8,
                "this build has no packed int8 or fp8 KV layout (needs AVX512-VNNI and AVX512-BF16)");
    return;
  }
  TORCH_CHECK(kv_cache.size(4) == 64 || kv_cache.size(4) == 128 || kv_cache.size(4) == 256,
              "the packed KV layout needs head size 64, 128 or 256");
  TORCH_CHECK(KVPAGE_PACKED, "this build has no packed KV layout (needs AVX512-BF16)");
}

void check_common(const torch::Tensor& kv_cache) {
  kvpage::kv_geometry(kv_cache);  // shape and strides
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16 ||
                  kv_cache.scalar_type() == at::kHalf || is_quantized_kv(kv_cache),
              "kv_cache must be float32, bfloat16, float16, int8, float8_e4m3fn or float8_e5m2");
}

}  // namespace

void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping,
                       bool packed, c10::optional<torch::Tensor> key_feedback) {
  check_common(kv_cache);
  if (packed) check_packed(kv_cache);
  TORCH_CHECK(key.sizes() == value.sizes() && key.dim() == 3, "key/value must be [tokens, kv_heads, dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == key.size(0), "bad slot_mapping");
  // Each token's heads must be one dense row; the rows themselves may be strided (no copy of a qkv view).
  const auto dense_rows = [](const torch::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); };
  if (!dense_rows(key)) key = key.contiguous();
  if (!dense_rows(value)) value = value.contiguous();
  TORCH_CHECK(key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16, "key must be float32/bfloat16");
  if (is_quantized_kv(kv_cache)) {
    TORCH_CHECK(value.scalar_type() == key.scalar_type(), "key and value dtypes differ");
    reshape_and_cache_quant(key, value, kv_cache, slot_mapping, packed, key_feedback);
    return;
  }
  TORCH_CHECK(!key_feedback.has_value(), "key_feedback is for quantized pages, not ", kv_cache.scalar_type(), " ones");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4), "key shape does not match the cache");
#if KVPAGE_PACKED
  if (packed) {
    if (key.scalar_type() == at::kFloat) write_cache_packed<float>(key, value, kv_cache, slot_mapping);
    else write_cache_packed<at::BFloat16>(key, value, kv_cache, slot_mapping);
    return;
  }
#endif
  if (kv_cache.scalar_type() == at::kFloat) {
    if (key.scalar_type() == at::kFloat) write_cache<float, float>(key, value, kv_cache, slot_mapping);
    else write_cache<float, at::BFloat16>(key, value, kv_cache, slot_mapping);
  } else if (kv_cache.scalar_type() == at::kHalf) {
    if (key.scalar_type() == at::kFloat) write_cache<at::Half, float>(key, value, kv_cache, slot_mapping);
    else write_cache<at::Half, at::BFloat16>(key, value, kv_cache, slot_mapping);
  } else {
    if (key.scalar_type() == at::kFloat) write_cache<at::BFloat16, float>(key, value, kv_cache, slot_mapping);
    else write_cache<at::BFloat16, at::BFloat16>(key, value, kv_cache, slot_mapping);
  }
}

torch::Tensor paged_attention_planned(torch::Tensor query, torch::Tensor kv_cache, const AttentionPlan& plan,
                                      double scale, bool packed, bool amx_decode, bool avx2_row_decode) {
  const AttentionOptions opt{amx_decode, avx2_row_decode};
  check_common(kv_cache);
  if (packed) {
    check_packed(kv_cache);
    TORCH_CHECK(query.scalar_type() == at::kBFloat16 || is_quantized_kv(kv_cache),
                "the packed bf16 KV layout needs bfloat16 queries");
    TORCH_CHECK(plan.partition_size % 16 == 0, "the packed KV layout needs partitions of a multiple of 16 keys");
  }
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, dim]");
  const bool quantized = is_quantized_kv(kv_cache);
  TORCH_CHECK(query.size(2) == kv_cache.size(4) - (quantized ? 2 : 0), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(1) / kv_cache.size(3) <= kMaxGroup, "query group too large");
  TORCH_CHECK(query.size(0) == plan.num_rows, "query_start_loc must run from 0 to the ", query.size(0),
              " query rows, got 0 .. ", plan.num_rows);
  TORCH_CHECK(query.size(1) == plan.num_heads, "the plan is for queries of ", plan.num_heads, " heads, got ",
              query.size(1));
  TORCH_CHECK(kv_cache.size(1) == plan.num_blocks && kv_cache.size(2) == plan.block_size,
              "the plan was checked against ", plan.num_blocks, " blocks of ", plan.block_size,
              " tokens; this cache has ", kv_cache.size(1), " of ", kv_cache.size(2));
  query = query.contiguous();
  auto out = at::empty_like(query);
  if (quantized) {
    g_decode_kernel = paged_attention_quant(query, kv_cache, plan, scale, packed, opt.amx_decode, out);
    return out;
  }
  const bool kv_bf16 = kv_cache.scalar_type() == at::kBFloat16;
  if (kv_cache.scalar_type() == at::kHalf) {
    if (query.scalar_type() == at::kFloat)
      run_attention<at::Half, float>(query, kv_cache, plan, scale, packed, opt, out);
    else {
      TORCH_CHECK(query.scalar_type() == at::kBFloat16, "query must be float32 or bfloat16");
      run_attention<at::Half, at::BFloat16>(query, kv_cache, plan, scale, packed, opt, out);
    }
  } else if (query.scalar_type() == at::kFloat) {
    if (kv_bf16) run_attention<at::BFloat16, float>(query, kv_cache, plan, scale, packed, opt, out);
    else run_attention<float, float>(query, kv_cache, plan, scale, packed, opt, out);
  } else {
    TORCH_CHECK(query.scalar_type() == at::kBFloat16, "query must be float32 or bfloat16");
    if (kv_bf16) run_attention<at::BFloat16, at::BFloat16>(query, kv_cache, plan, scale, packed, opt, out);
    else run_attention<float, at::BFloat16>(query, kv_cache, plan, scale, packed, opt, out);
  }
  return out;
}

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                              int64_t partition_size, bool packed, bool split_short, bool amx_decode,
                              bool avx2_row_decode) {
  check_common(kv_cache);
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, dim]");
  const auto plan = plan_attention(block_tables, query_start_loc, seq_lens, query.size(1), kv_cache.size(1),
                                   kv_cache.size(2), partition_size, split_short);
  return paged_attention_planned(query, kv_cache, *plan, scale, packed, amx_decode, avx2_row_decode);
}

std::string last_decode_kernel() { return g_decode_kernel; }
void note_decode_kernel(const char* name) { g_decode_kernel = name; }

bool has_packed_layout() { return KVPAGE_PACKED == 1; }

bool has_packed_int8_layout() { return KVPAGE_PACKED_INT8 == 1; }

bool amx_decode_available() {
#if KVPAGE_ISA_AMX
  return kvpage::amx_permitted();
#else
  return false;
#endif
}

bool amx_int8_decode_available() {
#if KVPAGE_AMX_INT8
  return kvpage::amx_permitted();
#else
  return false;
#endif
}
