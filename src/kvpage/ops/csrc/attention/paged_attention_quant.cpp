// Paged attention and the cache write for quantized KV pages (int8, fp8 e4m3, fp8 e5m2; attention/quant_rows.h;
// also in the packed layouts, attention/packed_int8.h and packed_fp8.h): the same plan, tasks and partition merge as the
// other caches (attention/paged_attention.cpp dispatches here by the cache's dtype), with the codes read in
// registers as each row is read. Decode tasks take AMX tiles where the CPU has them: packed int8 pages byte
// tiles (attention/amx_int8.h), fp8 rows bf16 tiles (attention/amx_fp8.h).

#include "tensor.h"
#include <ATen/Parallel.h>

#include "common.h"
#include "ops.h"
#include "attention/amx_fp8.h"
#include "attention/amx_int8.h"
#include "attention/loop.h"
#include "attention/merge.h"
#include "attention/packed_fp8.h"
#include "attention/packed_int8.h"
#include "attention/plan.h"
#include "attention/quant_loop.h"
#include "attention/key_feedback.h"
#include "attention/quant_rows.h"

#include <cstdint>
#include <vector>

namespace {

using namespace kvpage::attn;

// Which AMX tiles decode tasks take, where the build, the CPU and the OS allow them and the caller asks:
//   int8: packed int8 pages on byte tiles (attention/amx_int8.h): query groups of up to 5 rows (three tile
//         rows each), head sizes 64, 128 and 256;
//   fp8:  fp8 rows on bf16 tiles (attention/amx_fp8.h): 16-key groups within a block, head sizes 64 and 128
//         (at 256 the loop is faster), query groups of up to 16.
enum class AmxDecode { kNone, kInt8, kFp8 };
AmxDecode amx_decode_tiles(const torch::Tensor& query, const torch::Tensor& kv_cache, bool packed, bool amx_decode) {
  const int64_t D = query.size(2), G = query.size(1) / kv_cache.size(3);
  const auto t = kv_cache.scalar_type();
  if (!amx_decode) return AmxDecode::kNone;
  if (KVPAGE_AMX_INT8 && packed && t == at::kChar && G <= 5 && (D == 64 || D == 128 || D == 256) &&
      amx_decode_available())
    return AmxDecode::kInt8;
  if (KVPAGE_ISA_AMX && !packed && (t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2) && G <= 16 &&
      kv_cache.size(2) % 16 == 0 && (D == 64 || D == 128) && amx_decode_available())
    return AmxDecode::kFp8;
  return AmxDecode::kNone;
}

template <KVCode C, typename Q>
void run_quant(const torch::Tensor& query, const torch::Tensor& kv_cache, const AttentionPlan& plan, double scale,
               bool packed, AmxDecode tiles, torch::Tensor& out) {
  const bool amx = tiles == AmxDecode::kInt8, amx_fp8 = tiles == AmxDecode::kFp8;
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const kvpage::KVGeometry geo = kvpage::kv_geometry(kv_cache);  // in bytes: one byte per element
  const int64_t G = H / kv_heads;
  const int64_t max_blocks = plan.block_tables.size(1);
  const int64_t* tables = plan.block_tables.data_ptr<int64_t>();
  const auto* kcache = static_cast<const uint8_t*>(kv_cache.data_ptr());
  const uint8_t* vcache = kcache + geo.v_offset;
  (void)packed;  // only KVPAGE_PACKED_INT8 builds have the packed loops
  (void)amx;     // nor the AMX one (KVPAGE_AMX_INT8)
  (void)amx_fp8;  // only KVPAGE_ISA_AMX builds have fp8 tiles
  run_tasks(plan, query.data_ptr<Q>(), H, D, scale, out.data_ptr<Q>(),
            [&](const Task& tk, float* q, float* pa, float* pm, float* pl, const kvpage::NextKeys& next,
                std::vector<float>& scratch) {
      for (int64_t r = 0; r < tk.nq * H; ++r) fwht_row(q + r * D, D);  // the keys' basis
      const auto [k_begin, k_end] = tk.keys(plan.partition_size);
      const int64_t* table = tables + tk.seq * max_blocks;
      (void)next;  // builds without the AVX2 loops have no use for it
#if KVPAGE_AMX_INT8
      if (amx && tk.nq == 1) {
        if (D == 64)
          attend_decode_int8_amx<64>(q, G, kv_heads, kcache, vcache, table, block_size, geo.block_stride, k_begin,
                                     k_end, pa, pm, pl, next);
        else if (D == 128)
          attend_decode_int8_amx<128>(q, G, kv_heads, kcache, vcache, table, block_size, geo.block_stride, k_begin,
                                      k_end, pa, pm, pl, next);
        else
          attend_decode_int8_amx<256>(q, G, kv_heads, kcache, vcache, table, block_size, geo.block_stride, k_begin,
                                      k_end, pa, pm, pl, next);
        return;
      }
#endif
#if KVPAGE_ISA_AMX
      if constexpr (C != KVCode::kInt8) {
        if (amx_fp8 && tk.nq == 1) {
          if (D == 64)
            attend_decode_fp8_amx<C, 64>(q, G, kv_heads, kcache, vcache, table, block_size, geo.block_stride,
                                         k_begin, k_end, pa, pm, pl, next);
          else
            attend_decode_fp8_amx<C, 128>(q, G, kv_heads, kcache, vcache, table, block_size, geo.block_stride,
                                          k_begin, k_end, pa, pm, pl, next);
          return;
        }
      }
#endif
#if KVPAGE_PACKED_INT8
      if (packed) {
#define KVPAGE_PACKED_TILE(d)                                                                                  \
  if constexpr (C == KVCode::kInt8)                                                                            \
    attend_tile_int8_packed<d>(q, tk.nq, H, G, kcache, vcache, table, block_size, geo.block_stride, kv_heads,  \
                               tk.pos0, k_begin, k_end, pa, pm, pl, plan.window, next);                        \
  else                                                                                                         \
    attend_tile_fp8_packed<C, d>(q, tk.nq, H, G, kcache, vcache, table, block_size, geo.block_stride, kv_heads, \
                                 tk.pos0, k_begin, k_end, pa, pm, pl, plan.window, next)
        if (D == 64) KVPAGE_PACKED_TILE(64);
        else if (D == 128) KVPAGE_PACKED_TILE(128);
        else KVPAGE_PACKED_TILE(256);
#undef KVPAGE_PACKED_TILE
        return;
      }
#endif
#if KVPAGE_ISA_AVX2
#define KVPAGE_QUANT_TILE(d)                                                                                   \
  if constexpr (d > 0)                                                                                         \
    attend_tile_codes<C, d>(q, tk.nq, H, G, kcache, vcache, table, block_size, geo.block_stride,               \
                            kv_heads, tk.pos0, k_begin, k_end, pa, pm, pl, plan.window, next);                 \
  else                                                                                                         \
    attend_tile_quant<C, d>(q, tk.nq, H, G, kcache, vcache, table, block_size, geo.block_stride,               \
                            kv_heads, D, tk.pos0, k_begin, k_end, pa, pm, pl, scratch, plan.window)
#else
#define KVPAGE_QUANT_TILE(d)                                                                                   \
  attend_tile_quant<C, d>(q, tk.nq, H, G, kcache, vcache, table, block_size, geo.block_stride, kv_heads,       \
                          D, tk.pos0, k_begin, k_end, pa, pm, pl, scratch, plan.window)
#endif
      if (D == 64) KVPAGE_QUANT_TILE(64);
      else if (D == 128) KVPAGE_QUANT_TILE(128);
      else if (D == 256) KVPAGE_QUANT_TILE(256);
      else KVPAGE_QUANT_TILE(0);
#undef KVPAGE_QUANT_TILE
    },
    [&] {
#if KVPAGE_AMX_INT8
      if (amx) amx_configure_int8(G);
#endif
#if KVPAGE_ISA_AMX
      if (amx_fp8) amx_configure_fp8(G);
#endif
    },
    [&] {
#if KVPAGE_ISA_AMX
      if (amx || amx_fp8) kvpage::amx_release();
#endif
    });
}

template <KVCode C, typename IN>
void write_quant(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
                 const torch::Tensor& slot_mapping, bool packed, const float* fb) {
  const int64_t N = key.size(0), kv_heads = key.size(1), D = key.size(2);
  const int64_t block_size = kv_cache.size(2), num_slots = kv_cache.size(1) * block_size;
  const int64_t head_stride = D + kScaleBytes, row = kv_heads * head_stride;
  const kvpage::KVGeometry geo = kvpage::kv_geometry(kv_cache);
  auto* kdst = static_cast<uint8_t*>(kv_cache.data_ptr());
  uint8_t* vdst = kdst + geo.v_offset;
  const IN* ksrc = key.data_ptr<IN>();
  const IN* vsrc = value.data_ptr<IN>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  (void)packed;  // only KVPAGE_PACKED_INT8 builds write the packed layouts
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    const int64_t lanes = fb != nullptr ? kFeedbackRows : 1;
    std::vector<float> buf(static_cast<size_t>(D * lanes));
    std::vector<uint8_t> rows(static_cast<size_t>(2 * head_stride)), keys, codes;
    if (fb != nullptr) {  // keys rounded with feedback (key_feedback.h): the chunk's keys first, kFeedbackRows
      // tokens of one KV head at a time, into rows of their own
      keys.resize(static_cast<size_t>((end - begin) * row));
      codes.resize(static_cast<size_t>(D * kFeedbackRows));
      const IN* src[kFeedbackRows];
      uint8_t* out[kFeedbackRows];
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t i0 = begin; i0 < end; i0 += kFeedbackRows) {
          const int64_t n = std::min(kFeedbackRows, end - i0);
          for (int64_t r = 0; r < n; ++r) {
            src[r] = ksrc + (i0 + r) * ks + h * D;
            out[r] = keys.data() + (i0 + r - begin) * row + h * head_stride;
          }
          quantize_keys_feedback<C>(src, n, D, fb + h * D * D, out, buf.data(), codes.data());
        }
    }
    // token i's key row of head h into dst: the chunk's rounded with feedback, or rounded here
    const auto put_key = [&](int64_t i, int64_t h, uint8_t* dst) {
      if (fb != nullptr) std::memcpy(dst, keys.data() + (i - begin) * row + h * head_stride, head_stride);
      else quantize_row<C>(ksrc + i * ks + h * D, dst, D, buf.data(), true);
    };
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " outside the KV cache (", num_slots, " slots)");
#if KVPAGE_PACKED_INT8
      if (packed) {  // quantized as rows, then put in their 16-key group (packed_int8.h, packed_fp8.h)
        const int64_t off = slot % block_size;
        const int64_t at = int8_group_offset(slot / block_size, off, geo.block_stride, kv_heads, D);
        for (int64_t h = 0; h < kv_heads; ++h) {
          put_key(i, h, rows.data());
          quantize_row<C>(vsrc + i * vs + h * D, rows.data() + head_stride, D, buf.data(), false);
          uint8_t* kg = kdst + at + h * 16 * head_stride;
          uint8_t* vg = vdst + at + h * 16 * head_stride;
          const uint8_t *kr = rows.data(), *vr = rows.data() + head_stride;
          if constexpr (C == KVCode::kInt8) put_packed_int8(kr, vr, kg, vg, off % 16, D);
          else put_packed_fp8(kr, vr, kg, vg, off % 16, D);
        }
        continue;
      }
#endif
      const int64_t at = (slot / block_size) * geo.block_stride + (slot % block_size) * row;
      for (int64_t h = 0; h < kv_heads; ++h) {
        put_key(i, h, kdst + at + h * head_stride);
        quantize_row<C>(vsrc + i * vs + h * D, vdst + at + h * head_stride, D, buf.data(), false);
      }
    }
  });
}

template <template <KVCode> class F, typename... A>
void by_code(at::ScalarType t, A&&... args) {
  if (t == at::kChar) F<KVCode::kInt8>::run(args...);
  else if (t == at::kFloat8_e4m3fn) F<KVCode::kE4M3>::run(args...);
  else if (t == at::kFloat8_e5m2) F<KVCode::kE5M2>::run(args...);
  else TORCH_CHECK(false, "not a quantized KV dtype: ", t);
}

template <KVCode C>
struct Attend {
  static void run(const torch::Tensor& query, const torch::Tensor& kv_cache, const AttentionPlan& plan, double scale,
                  bool packed, AmxDecode tiles, torch::Tensor& out) {
    if (query.scalar_type() == at::kFloat) run_quant<C, float>(query, kv_cache, plan, scale, packed, tiles, out);
    else run_quant<C, at::BFloat16>(query, kv_cache, plan, scale, packed, tiles, out);
  }
};

template <KVCode C>
struct Write {
  static void run(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
                  const torch::Tensor& slot_mapping, bool packed, const float* fb) {
    if (key.scalar_type() == at::kFloat) write_quant<C, float>(key, value, kv_cache, slot_mapping, packed, fb);
    else write_quant<C, at::BFloat16>(key, value, kv_cache, slot_mapping, packed, fb);
  }
};

}  // namespace

bool is_quantized_kv(const torch::Tensor& kv_cache) {
  const auto t = kv_cache.scalar_type();
  return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

const char* paged_attention_quant(const torch::Tensor& query, const torch::Tensor& kv_cache,
                                  const AttentionPlan& plan, double scale, bool packed, bool amx_decode,
                                  torch::Tensor& out) {
  TORCH_CHECK(query.size(2) + kScaleBytes == kv_cache.size(4), "a quantized cache row is head_dim + 2 bytes: ",
              "head_dim of query ", query.size(2), ", cache rows ", kv_cache.size(4));
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "query must be float32 or bfloat16");
  const AmxDecode tiles = amx_decode_tiles(query, kv_cache, packed, amx_decode);
  by_code<Attend>(kv_cache.scalar_type(), query, kv_cache, plan, scale, packed, tiles, out);
  if (tiles == AmxDecode::kInt8) return "amx-int8-packed";  // decode tasks on tiles (prompt tiles keep the VNNI loop)
  if (tiles == AmxDecode::kFp8) return "amx-fp8-rows";  // decode tasks on tiles (prompt rows keep the dpbf16 loop)
  if (packed)  // check_packed: a KVPAGE_PACKED_INT8 build
    return kv_cache.scalar_type() == at::kChar ? "avx512-int8-packed" : "avx512-fp8-packed";
  const int64_t D = query.size(2);  // run_quant's templated head sizes take quant_loop.h's loop
  if (!KVPAGE_ISA_AVX2) return "generic-quant";
  if (D != 64 && D != 128 && D != 256) return "avx2-quant";
  if (kv_cache.scalar_type() == at::kChar) return KVPAGE_ISA_AVX512 ? "avx512-int8-quant" : "avx2-int8-quant";
  return KVPAGE_ISA_AVX512BF16 ? "avx512-fp8-quant" : "avx2-fp8-quant";
}

void reshape_and_cache_quant(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
                             const torch::Tensor& slot_mapping, bool packed,
                             const c10::optional<torch::Tensor>& key_feedback) {
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) + kScaleBytes == kv_cache.size(4),
              "key shape does not match the quantized cache (rows of head_dim + 2 bytes)");
  const float* fb = nullptr;
  if (key_feedback.has_value()) {
    const torch::Tensor& f = *key_feedback;
    TORCH_CHECK(f.scalar_type() == at::kFloat && f.is_contiguous() && f.dim() == 3 && f.size(0) == key.size(1) &&
                    f.size(1) == key.size(2) && f.size(2) == key.size(2),
                "key_feedback must be contiguous float32 [kv_heads, head_dim, head_dim], got ", f.sizes());
    fb = f.data_ptr<float>();
  }
  by_code<Write>(kv_cache.scalar_type(), key, value, kv_cache, slot_mapping, packed, fb);
}
