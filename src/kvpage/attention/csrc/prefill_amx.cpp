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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "decode_amx.h"  // TileConfig, amx_permitted, exp16, KVPAGE_AMX

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#ifdef KVPAGE_AMX
constexpr int64_t kD = 64;

// Tiles (all full, amx_configure_full): 0-3 = scores of four 16-key blocks (16 x 16 float32), then the output
// accumulators (16 rows x 16 dims); 4/5 = Q (16 rows x 32 dims) during scores; 6/7 = K operands; during P.V
// 4 = P, 5/7 = V (pv_product64).

// Keys a prompt of n tokens occupies per KV head in the packed K (16-key blocks) and V (32-key blocks).
inline int64_t k_slots(int64_t n) { return (n + 15) / 16 * 16; }
inline int64_t v_slots(int64_t n) { return (n + 31) / 32 * 32; }

struct Prompt {
  int64_t start, n;
  int64_t k_off, v_off;  // element offsets of this prompt's packed K / V (KV head 0) in the scratch buffers
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
#ifdef KVPAGE_AMX
  return kvpage::amx_permitted();
#else
  return false;
#endif
}

// out[start:start+n] = causal softmax(q k^T * scale) v for every prompt (starts[i], lengths[i]); query
// [T, H, 64], key/value [T, KVH, 64] bf16 with dense rows (row strides free), out [T, H, 64] bf16.
void prefill_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                       torch::Tensor& out, const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths,
                       double scale) {
  TORCH_CHECK(prefill_amx_available(), "AMX tile products are not available on this CPU/OS");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention takes bfloat16 tensors");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && out.sizes() == query.sizes(),
              "query/out [T, H, D], key/value [T, KVH, D]");
  const int64_t T = query.size(0), H = query.size(1), KVH = key.size(1);
  TORCH_CHECK(query.size(2) == 64 && key.size(2) == 64 && value.sizes() == key.sizes(), "head size must be 64");
  TORCH_CHECK(key.size(0) == T && KVH > 0 && H % KVH == 0, "query heads must be a multiple of KV heads");
  for (const torch::Tensor* t : {&query, &key, &value, static_cast<const torch::Tensor*>(&out)})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == 64, "rows of heads must be dense");
  TORCH_CHECK(scale > 0, "scale must be positive");
  TORCH_CHECK(starts.size() == lengths.size(), "starts and lengths differ in length");
#ifdef KVPAGE_AMX
  const int64_t G = H / KVH;
  std::vector<Prompt> prompts;
  int64_t k_total = 0, v_total = 0, max_n = 0;
  for (size_t i = 0; i < starts.size(); ++i) {
    TORCH_CHECK(starts[i] >= 0 && lengths[i] >= 0 && starts[i] + lengths[i] <= T, "prompt ", i, " outside the batch");
    if (lengths[i] == 0) continue;
    const int64_t n = lengths[i];
    prompts.push_back({starts[i], n, k_total, v_total});
    k_total += KVH * k_slots(n) * kD;
    v_total += KVH * v_slots(n) * kD;
    max_n = std::max(max_n, n);
  }
  if (prompts.empty()) return;
  std::vector<at::BFloat16> kpack(k_total), vpack(v_total);  // zeroed: pack_head writes only the n keys
  const auto* qp = query.data_ptr<at::BFloat16>();
  const auto* kp = key.data_ptr<at::BFloat16>();
  const auto* vp = value.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t sq = query.stride(0), sk = key.stride(0), sv = value.stride(0), so = out.stride(0);
  const int64_t P = static_cast<int64_t>(prompts.size());
  at::parallel_for(0, P * KVH, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Prompt& p = prompts[i / KVH];
      const int64_t h = i % KVH;
      pack_head(kp, sk, vp, sv, h, p, kpack.data() + p.k_off + h * k_slots(p.n) * kD,
                vpack.data() + p.v_off + h * v_slots(p.n) * kD);
    }
  });

  // Tasks: (prompt, query head, 16-row block), the costliest (last rows of long prompts) first.
  struct Task {
    int32_t prompt, head;
    int64_t row0;
  };
  std::vector<Task> tasks;
  for (int64_t i = 0; i < P; ++i)
    for (int64_t r0 = 0; r0 < prompts[i].n; r0 += 16)
      for (int64_t hq = 0; hq < H; ++hq) tasks.push_back({static_cast<int32_t>(i), static_cast<int32_t>(hq), r0});
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.row0 > b.row0; });

  const int64_t max32 = (max_n + 31) / 32 * 32;
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
      const int64_t h = task.head / G, r0 = task.row0;
      const int64_t rows = std::min<int64_t>(16, p.n - r0);
      const at::BFloat16* kh = kpack.data() + p.k_off + h * k_slots(p.n) * kD;
      const at::BFloat16* vh = vpack.data() + p.v_off + h * v_slots(p.n) * kD;
      // Q rows r0..r0+15 of this head (a partial last block is staged with zero rows)
      const at::BFloat16* q = qp + (p.start + r0) * sq + task.head * kD;
      int64_t qstride = sq * 2;
      if (rows < 16) {
        std::memset(qstage, 0, sizeof(qstage));
        for (int64_t r = 0; r < rows; ++r) std::memcpy(qstage + r * kD, q + r * sq, kD * sizeof(at::BFloat16));
        q = qstage;
        qstride = kD * 2;
      }
      // 1. scores of key blocks 0 .. r0 / 16 (the diagonal block included)
      const int64_t nk16 = r0 / 16 + 1, nk32 = (r0 + 16 + 31) / 32, span = nk32 * 32;
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
      // 2. softmax per row over keys 0..r0+r; weights as bf16 with zeros up to the span
      for (int64_t r = 0; r < 16; ++r) {
        float* s = scores.data() + r * span;
        at::BFloat16* pr = probs.data() + r * span;
        const int64_t visible = r < rows ? r0 + r + 1 : 0;
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
#else
  (void)query, (void)key, (void)value, (void)out, (void)starts, (void)lengths, (void)scale;
#endif
}

}  // namespace

void register_prefill_ops(pybind11::module& m) {
  m.def("prefill_amx_available", &prefill_amx_available, "whether prefill_attention can run on this CPU/OS");
  m.def("prefill_attention", &prefill_attention,
        "causal attention of whole fresh prompts (bf16, head size 64) with AMX tiles, written into out",
        pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("out"),
        pybind11::arg("starts"), pybind11::arg("lengths"), pybind11::arg("scale"));
}
