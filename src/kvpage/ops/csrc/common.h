// Small helpers shared by kvpage's CPU kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa.h"

namespace kvpage {

// A projection's optional bias as float32 [N] (the converted copy kept alive in `held`), or null: what the
// panel GEMMs' epilogues add.
inline const float* float_bias(const c10::optional<at::Tensor>& bias, int64_t N, at::Tensor& held) {
  if (!bias.has_value()) return nullptr;
  held = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(held.dim() == 1 && held.size(0) == N, "bias must be [out_features]");
  return held.data_ptr<float>();
}

// A gated MLP's [gate; up] weight ([2 * inter, K], inter % 16 == 0) with its rows in groups of 16 interleaved: gate
// rows 16j..16j+15, then up rows 16j..16j+15, for each j, so a packed block of 32 columns (or two 16-column
// panels) holds matching gate and up columns and a gated epilogue writes act(gate) * up from one tile.
inline at::Tensor interleave_gate_up(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1);
  return w.contiguous().view({2, N / 32, 16, K}).permute({1, 0, 2, 3}).reshape({N, K});
}

// The keys a thread attends to after the current task: its sequence's block table and key range.
// (The paged-attention loops prefetch on across a task's end into these.)
struct NextKeys {
  const int64_t* table = nullptr;
  int64_t begin = 0, end = 0;
};

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

// 2^f on [-0.5, 0.5], degree 6, highest coefficient first: the one polynomial of exp_neg, exp16 and exp8
// (so vector lanes and scalar tails agree).
constexpr float kExp2Poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

// gelu_tanh(x) = 0.5 x (1 + tanh(kGeluC0 (x + kGeluC1 x^3))), sqrt(2 / pi) and the cubic's weight.
constexpr float kGeluC0 = 0.7978845608028654f, kGeluC1 = 0.044715f;

// exp(x) for x <= 0 (softmax weights), vectorizable: 2^(x log2 e) = 2^n * 2^f with a degree-6 polynomial
// for 2^f on [-0.5, 0.5] (relative error ~2e-7, close to libm's expf).
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;  // t <= 0
  const int32_t ni = -static_cast<int32_t>(0.5f - t);  // round(t) with conversions only (vectorizes)
  const float n = static_cast<float>(ni);
  const float f = t - n;
  float p = kExp2Poly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Poly[i];
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += ni << 23;
  float r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

// A task's partial results before its first key: R rows of unnormalized sums acc[R][D] at 0, row maxima at
// -inf, weight sums at 0 (every attention kernel starts so; the caller merges tasks afterwards).
inline void reset_partials(float* acc, float* m, float* l, int64_t R, int64_t D) {
  std::fill(m, m + R, -std::numeric_limits<float>::infinity());
  std::fill(l, l + R, 0.f);
  std::fill(acc, acc + R * D, 0.f);
}

// Chunks of [0, n) handed out in order to whichever thread asks next. A server's two cores are shared with its
// HTTP thread: when the OS parks one of a kernel's threads mid-call, the other takes the parked one's remaining
// chunks instead of idling at the closing barrier until it runs again (a static split of equal halves waited
// there for ~10% of the engine thread's time under `vllm bench serve` on the AMX Xeon).
class ChunkClaims {
 public:
  ChunkClaims(int64_t n, int64_t chunk) : n_(n), chunk_(std::max<int64_t>(1, chunk)) {}
  int64_t chunks() const { return (n_ + chunk_ - 1) / chunk_; }
  bool next(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (begin >= n_) return false;
    end = std::min(n_, begin + chunk_);
    return true;
  }

 private:
  const int64_t n_, chunk_;
  std::atomic<int64_t> next_{0};
};

// work(claims) on as many of the pool's threads as there are chunks; each thread sets itself up once (tile
// configuration, scratch) and then claims chunks until none are left. Claims: ChunkClaims or a type that hands
// out its own units through one (attention's RunClaims).
template <typename Claims, typename F>
void on_claiming_threads(Claims& claims, const F& work) {
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), claims.chunks());
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) { work(claims); });
}

// A GEMM's (row chunk, column tile) tasks over the threads: chunks of equal size, a multiple of mr rows, whose
// inputs (row_bytes a row) stay in L2 (~256 KiB) while every column tile passes by; tasks run chunk-major and
// are claimed in runs of consecutive tasks (ChunkClaims, about eight runs a thread), so a thread's consecutive
// tasks share their rows and a thread the OS parks leaves its remaining runs to the other. Equal chunks: 128
// rows cut as 108 + 20 left one thread 5x the other's work. Every output is one task's, so the split never
// changes a bit. fn(first row, rows, tile).
template <typename F>
void for_row_chunks_and_tiles(int64_t M, int64_t row_bytes, int64_t mr, int64_t tiles, const F& fn) {
  const int64_t mc_max = std::max<int64_t>(mr, (256 * 1024 / row_bytes) / mr * mr);
  const int64_t chunks = (M + mc_max - 1) / mc_max;
  const int64_t mc = ((M + chunks - 1) / chunks + mr - 1) / mr * mr;
  const int64_t tasks = chunks * tiles;
  ChunkClaims claims(tasks, tasks / (8 * at::get_num_threads()));
  on_claiming_threads(claims, [&](ChunkClaims& queue) {
    int64_t t0 = 0, t1 = 0;
    while (queue.next(t0, t1)) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t m0 = (t / tiles) * mc, rows = std::min(mc, M - m0);
        if (rows > 0) fn(m0, rows, t % tiles);
      }
    }
  });
}

#if KVPAGE_ISA_AVX512
// The first min(left, 16) lanes.
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// Sixteen float32 lanes from float32 or bf16 (masked), and back (bf16 rounded to nearest even, as torch does).
inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 k) {
  const __m256i raw = _mm256_maskz_loadu_epi16(k, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
// Sixteen float32 lanes rounded to bf16 bits (nearest even), without AVX512_BF16.
inline __m256i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_cvtepi32_epi16(r);
}
inline void store16(at::BFloat16* p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(reinterpret_cast<void*>(p), k, bf16_bits16(v));
}

// exp(x) for 16 lanes with x <= 0 (same polynomial as exp_neg); lanes outside `keep` become 0.
inline __m512 exp16(__m512 x, __mmask16 keep) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 nn = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, nn);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_maskz_scalef_ps(keep, p, nn);
}

// silu(g) * u for 16 lanes: the one formula of the SiLU-gated MLP (silu_mul and amx_linear's gated epilogue
// must agree to the bit). exp16 is called with -g, which may be positive: e^87 at most, so g << 0 gives -0.
inline __m512 silu_mul16(__m512 g, __m512 u, __mmask16 keep) {
  const __m512 ex = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g), keep);
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), ex)), u);
}

// gelu_tanh(g) * u for 16 lanes (Gemma's gated MLP). 0.5 g (1 + tanh(y)), y = kGeluC0 (g + kGeluC1 g^3), is
// g / (1 + e^(-2y)): SiLU's form with 2y in place of g, so the same exponential and limits (g << 0 gives -0).
inline __m512 gelu_mul16(__m512 g, __m512 u, __mmask16 keep) {
  const __m512 g2 = _mm512_mul_ps(g, g);
  const __m512 minus_2y = _mm512_mul_ps(g, _mm512_fmadd_ps(g2, _mm512_set1_ps(-2.f * kGeluC0 * kGeluC1),
                                                            _mm512_set1_ps(-2.f * kGeluC0)));
  const __m512 ex = exp16(minus_2y, keep);
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), ex)), u);
}
#endif

#if KVPAGE_ISA_AVX2
// Sum and maximum of 8 lanes (AVX-512 builds use them too, in the quantized-row loop).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// exp(x) for 8 lanes (exp_neg's polynomial, so vector and scalar tails agree), x clamped to [-87, 87] so the
// exponent add stays in range (softmax calls it with x <= 0, SiLU with either sign).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 nn = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, nn);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(nn), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// silu(g) * u for 8 lanes (g << 0 gives -0).
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 ex = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), ex)), u);
}

// gelu_tanh(g) * u for 8 lanes (gelu_mul16's form).
inline __m256 gelu_mul8(__m256 g, __m256 u) {
  const __m256 minus_2y = _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(-2.f * kGeluC0 * kGeluC1),
                                                           _mm256_set1_ps(-2.f * kGeluC0)));
  const __m256 ex = exp8(minus_2y);
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), ex)), u);
}
#endif

// fn(i) for each i in [0, n) with x[i] >= t (NaN never is), in index order, a vector's compare mask at a time:
// in its uses few entries pass (the logits near a row's maximum, a top-k band), and a scalar branch per entry
// was most of a top-k draw's time (3.87 -> 2.60 ms at 128 rows of 49,152, AMX Xeon, 2026-12-01).
template <typename F>
inline void for_each_at_least(const float* x, int64_t n, float t, F&& fn) {
  int64_t i = 0;
#if KVPAGE_ISA_AVX512
  const __m512 vt = _mm512_set1_ps(t);
  for (; i + 16 <= n; i += 16)
    for (uint32_t hits = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vt, _CMP_GE_OQ); hits != 0; hits &= hits - 1)
      fn(i + __builtin_ctz(hits));
#elif KVPAGE_ISA_AVX2
  const __m256 vt = _mm256_set1_ps(t);
  for (; i + 8 <= n; i += 8) {
    const __m256 ge = _mm256_cmp_ps(_mm256_loadu_ps(x + i), vt, _CMP_GE_OQ);
    for (uint32_t hits = static_cast<uint32_t>(_mm256_movemask_ps(ge)); hits != 0; hits &= hits - 1)
      fn(i + __builtin_ctz(hits));
  }
#endif
  for (; i < n; ++i)
    if (x[i] >= t) fn(i);
}

#if KVPAGE_ISA_AVX512BF16
// float32 lanes rounded to bf16 and back (nearest even): what a bf16 output holds, for epilogues that must give
// the bits of a separate bf16 product followed by another kernel (the gated GEMMs' silu_mul / gelu_mul).
inline __m512 bf16_round(__m512 v) {
  const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

// Values of keys 2p and 2p+1 interleaved per element, the operand layout of dpbf16: vpairs holds, per pair
// p and 512-bit chunk c, the unpacklo and unpackhi halves (64 bf16). Rows at or past `valid` become zero
// (they may hold anything, NaN included).
template <int64_t NC>
inline void interleave_value_pairs(const at::BFloat16* vbase, int64_t row_stride, int64_t valid,
                                   at::BFloat16* vpairs) {
  const int64_t pairs = (valid + 1) / 2;
  for (int64_t pr = 0; pr < pairs; ++pr) {
    const at::BFloat16* va = vbase + 2 * pr * row_stride;
    const bool has_b = 2 * pr + 1 < valid;
    for (int64_t c = 0; c < NC; ++c) {
      const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(va + 32 * c));
      const __m512i b = has_b ? _mm512_loadu_si512(reinterpret_cast<const void*>(va + row_stride + 32 * c))
                              : _mm512_setzero_si512();
      _mm512_storeu_si512(reinterpret_cast<void*>(vpairs + (pr * NC + c) * 64), _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(reinterpret_cast<void*>(vpairs + (pr * NC + c) * 64 + 32), _mm512_unpackhi_epi16(a, b));
    }
  }
}

// Accumulators filled from interleave_value_pairs operands hold, in element e of 512-bit chunk c, 128-bit
// lane L, d = 32c + 8L + (e < 4 ? e : e + 4) for the low half (e in 0..15 as 4 lanes x 4) and the same + 4
// for the high half: put R rows of D floats back in natural order.
template <int64_t D>
inline void restore_pair_order(float* acc, int64_t R) {
  float tmp[D];
  for (int64_t r = 0; r < R; ++r) {
    float* a = acc + r * D;
    for (int64_t c = 0; c < D / 32; ++c)
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t e = 0; e < 16; ++e) tmp[32 * c + 8 * (e / 4) + 4 * half + e % 4] = a[32 * c + 16 * half + e];
    std::copy(tmp, tmp + D, a);
  }
}
#endif

// Where a layer's K and V blocks lie, in elements from the cache's data pointer. The cache is a
// [2, num_blocks, block_size, kv_heads, D] tensor whose block interior [block_size, kv_heads, D] is dense; the
// engine allocates it block-major (storage [num_blocks, 2, ...], so a block's K and V are one contiguous
// stretch, which streams faster from memory than two stretches half the size), and a plain contiguous
// [2, num_blocks, ...] tensor works too. v_offset: from a block's K to its V; block_stride: from one block's K
// to the next block's.
struct KVGeometry {
  int64_t v_offset, block_stride;
};
inline KVGeometry kv_geometry(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, block_size, heads, dim]");
  const int64_t block = kv_cache.size(2) * kv_cache.size(3) * kv_cache.size(4), nb = kv_cache.size(1);
  TORCH_CHECK(kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4) &&
                  kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4),
              "kv_cache blocks must be dense [block_size, heads, dim]");
  const bool contiguous = kv_cache.stride(1) == block && kv_cache.stride(0) == nb * block;
  const bool block_major = kv_cache.stride(1) == 2 * block && kv_cache.stride(0) == block;
  TORCH_CHECK(contiguous || block_major || nb <= 1,
              "kv_cache must be contiguous or a block-major view ([blocks, 2, ...] storage transposed)");
  return {kv_cache.stride(0), nb <= 1 ? block : kv_cache.stride(1)};
}

// A sequence's `keys` keys must fit its block-table row (max_blocks entries) and every block they use, from
// entry `first` on (a sliding window reads no earlier one), must lie in the cache: the kernels dereference these
// ids unchecked. `what` and `i` name the sequence in the error.
inline void check_table_row(const int64_t* row, int64_t max_blocks, int64_t keys, int64_t block_size,
                            int64_t num_blocks, const char* what, int64_t i, int64_t first = 0) {
  const int64_t used = (keys + block_size - 1) / block_size;
  TORCH_CHECK(used <= max_blocks, what, " ", i, ": ", keys, " keys need more blocks than its table row holds");
  for (int64_t b = first; b < used; ++b)
    TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, what, " ", i, ": block ", row[b], " outside the cache");
}

}  // namespace kvpage
