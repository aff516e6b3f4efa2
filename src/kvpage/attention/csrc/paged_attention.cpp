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

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"
#include "ops.h"
#include "decode_amx.h"
#include "packed_kv.h"
#include "decode_amx_pairs.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <string>
#include <vector>

namespace {

using kvpage::exp_neg;
using kvpage::reset_partials;
#if defined(__AVX512F__)
using kvpage::exp16;
#endif
#if KVPAGE_AVX2
using kvpage::exp8;
#endif
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
constexpr int64_t kMinPartition = 64;  // keys: below this, merging partitions costs more than a second thread saves

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KVPAGE_DPBF16 1
// q . k for bf16 vectors of length D (a multiple of 32): products are exact in float32, summed in float32.
inline float dot_bf16(const at::BFloat16* q, const at::BFloat16* k, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512i qv = _mm512_loadu_si512(reinterpret_cast<const void*>(q + d));
    const __m512i kv = _mm512_loadu_si512(reinterpret_cast<const void*>(k + d));
    acc = _mm512_dpbf16_ps(acc, (__m512bh)qv, (__m512bh)kv);
  }
  return _mm512_reduce_add_ps(acc);
}
#endif

// w[i] = exp(s[i] - mx) for i < n (every s[i] <= mx); returns the sum of the w[i].
inline float exp_shift_sum(float* s, int64_t n, float mx) {
#if defined(__AVX512F__)
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 w = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vmx), k);
    _mm512_mask_storeu_ps(s + i, k, w);
    vsum = _mm512_add_ps(vsum, w);
  }
  return _mm512_reduce_add_ps(vsum);
#else
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = exp_neg(s[i] - mx);
    sum += s[i];
  }
  return sum;
#endif
}

constexpr int64_t kPrefetchAhead = 2;  // blocks (the row-layout kernels' prefetch distance)

#if defined(__AVX512F__) || KVPAGE_AVX2
// Blocks are scattered, so the hardware prefetcher cannot run ahead across a block boundary. Made where a row
// kernel starts a block (key t), this picks the block kPrefetchAhead blocks later and fetches its K and V rows
// into L2 in parts, so the requests do not queue up behind each other: part(i, parts) fetches the i-th of
// `parts` equal shares (the AVX-512 kernel takes one share per KV head, the AVX2 kernel finer ones spread
// over its work).
template <typename KV>
struct BlockPrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t lines = 0;

  BlockPrefetch(const KV* kcache, const KV* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                int64_t row_stride, int64_t t, int64_t k_begin, int64_t k_end) {
    if (t % block_size != 0 && t != k_begin) return;  // not the start of a block
    const int64_t ahead = (t / block_size + kPrefetchAhead) * block_size;
    if (ahead >= k_end) return;
    const int64_t nb = table[ahead / block_size];
    k = reinterpret_cast<const char*>(kcache + nb * block_stride);
    v = reinterpret_cast<const char*>(vcache + nb * block_stride);
    lines = (std::min<int64_t>(block_size, k_end - ahead) * row_stride * static_cast<int64_t>(sizeof(KV)) + 63) / 64;
  }

  void part(int64_t idx, int64_t parts) const {
    for (int64_t i = idx * lines / parts; i < (idx + 1) * lines / parts; ++i) {
      _mm_prefetch(k + 64 * i, _MM_HINT_T1);
      _mm_prefetch(v + 64 * i, _MM_HINT_T1);
    }
  }
};
#endif

#ifdef KVPAGE_DPBF16
// Key m of a 16-key chunk goes into slot kSlotKey[m] so that reduce16 leaves key i's sum in lane i.
constexpr int kSlotKey[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// Horizontal sums of 16 vectors at once (a transposing add tree: 45 shuffles/adds instead of 16 separate
// reductions). Lane 4i + p of the result holds the sum of v[4p + i].
inline __m512 reduce16(const __m512* v) {
  __m512 r[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)
    r[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k) {
    const __m512d a = _mm512_castps_pd(u[2 * k]), b = _mm512_castps_pd(u[2 * k + 1]);
    w[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512 bf16x16_to_ps(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The bf16-cache, bf16-query case of attend_tile, vectorized across keys: keys are taken 16 at a time, each
// query row gets its 16 scores from exact bf16 dot products (dpbf16) and one transposing reduction, and the
// softmax runs on the 16 lanes in registers. Values are widened to float once per chunk and shared by every
// row of the KV head's group. Float32 accumulators, running max and sum, as in attend_tile.
template <int64_t D>
void attend_tile_bf16(const at::BFloat16* const* qb, int64_t nq, int64_t H, int64_t G, const at::BFloat16* kcache,
                      const at::BFloat16* vcache, const int64_t* table, int64_t block_size, int64_t block_stride,
                      int64_t kv_heads,
                      int64_t pos0, int64_t k_begin, int64_t k_end, float* acc, float* m, float* l,
                      std::vector<float>& scratch, float scale) {
  static_assert(D % 32 == 0, "head size must be a multiple of 32");
  constexpr int64_t NC = D / 32;  // 512-bit chunks of a bf16 row
  constexpr int64_t NF = D / 16;  // 512-bit chunks of a float row
  const int64_t R = nq * H;
  const int64_t row_stride = kv_heads * D;
  scratch.resize(static_cast<size_t>(8 * D + R * 16));
  // the chunk's values as interleaved bf16 pairs: [pair][512-bit chunk c][lo, hi halves] = 8 x D floats' room
  auto* vpairs = reinterpret_cast<at::BFloat16*>(scratch.data());
  float* wts = scratch.data() + 8 * D;      // softmax weights, [r][i]
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vneg_inf = _mm512_set1_ps(neg_inf), vscale = _mm512_set1_ps(scale);
  reset_partials(acc, m, l, R, D);
  int64_t t = k_begin;
  while (t < k_end) {
    const int64_t off = t % block_size;
    const int64_t n = std::min<int64_t>({block_size - off, k_end - t, 16});
    const int64_t phys = table[t / block_size];
    const BlockPrefetch<at::BFloat16> prefetch(kcache, vcache, table, block_size, block_stride, row_stride, t,
                                               k_begin, k_end);
    for (int64_t h = 0; h < kv_heads; ++h) {
      prefetch.part(h, kv_heads);
      const at::BFloat16* kbase = kcache + phys * block_stride + off * row_stride + h * D;
      const at::BFloat16* vbase = vcache + phys * block_stride + off * row_stride + h * D;
      int64_t vis_max = 0;
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);  // keys after this query's position are masked
        vis_max = std::max(vis_max, visible);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = j * H + h * G + g;
          float* w = wts + r * 16;
          if (visible <= 0) {
            _mm512_storeu_ps(w, _mm512_setzero_ps());
            continue;
          }
          __m512i qv[NC];
          for (int64_t c = 0; c < NC; ++c) qv[c] = _mm512_loadu_si512(reinterpret_cast<const void*>(qb[r] + 32 * c));
          __m512 dots[16];
          for (int slot = 0; slot < 16; ++slot) {
            const int key = kSlotKey[slot];
            __m512 a = _mm512_setzero_ps();
            if (key < visible) {
              const at::BFloat16* k = kbase + key * row_stride;
              for (int64_t c = 0; c < NC; ++c)
                a = _mm512_dpbf16_ps(a, (__m512bh)qv[c],
                                     (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(k + 32 * c)));
            }
            dots[slot] = a;
          }
          const __mmask16 keep = static_cast<__mmask16>((1u << visible) - 1u);
          const __m512 s = _mm512_mask_blend_ps(keep, vneg_inf, _mm512_mul_ps(reduce16(dots), vscale));
          const float new_m = std::max(m[r], _mm512_reduce_max_ps(s));
          const float corr = exp_neg(m[r] - new_m);
          const __m512 e = exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_m)), keep);
          _mm512_storeu_ps(w, e);
          l[r] = l[r] * corr + _mm512_reduce_add_ps(e);
          m[r] = new_m;
          if (corr != 1.f) {
            float* a = acc + r * D;
            const __m512 vc = _mm512_set1_ps(corr);
            for (int64_t c = 0; c < NF; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), vc));
          }
        }
      }
      if (vis_max <= 0) continue;
      kvpage::interleave_value_pairs<NC>(vbase, row_stride, vis_max, vpairs);
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);
        if (visible <= 0) continue;
        const int64_t row_pairs = (visible + 1) / 2;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = j * H + h * G + g;
          float* a = acc + r * D;  // kept in the interleaved element order until the end of the task
          // The weights as bf16 pairs (w[2p] low, w[2p+1] high), like FlashAttention's bf16 P @ V.
          int32_t wp[8];
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(wp), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(wts + r * 16)));
          __m512 av[NF];
          for (int64_t c = 0; c < NF; ++c) av[c] = _mm512_loadu_ps(a + 16 * c);
          for (int64_t pr = 0; pr < row_pairs; ++pr) {
            const __m512bh wb = (__m512bh)_mm512_set1_epi32(wp[pr]);
            for (int64_t c = 0; c < NF; ++c)
              av[c] = _mm512_dpbf16_ps(av[c], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(vpairs + (pr * NC) * 64 + 32 * c)), wb);
          }
          for (int64_t c = 0; c < NF; ++c) _mm512_storeu_ps(a + 16 * c, av[c]);
        }
      }
    }
    t += n;
  }
  kvpage::restore_pair_order<D>(acc, R);
}
#endif

bool g_split_short = true;  // one stream's short contexts cut over the threads (set_split_short toggles, for A/B)

#ifdef KVPAGE_AMX
bool g_amx_decode = true;  // the AMX decode path when the CPU and OS allow it (set_amx_decode toggles, for A/B)

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

// Which kernel served the last call's decode tasks (diagnostics and tests).
const char* g_decode_kernel = "none";

struct Task {
  int64_t seq, row0, nq, part;  // query rows row0 .. row0+nq-1 of the flat batch, every head
  int64_t pos0;                 // absolute position of the first query of the tile

  // The keys [begin, end) this task attends to: its partition, up to its last query's position.
  std::pair<int64_t, int64_t> keys(int64_t partition_size) const {
    const int64_t begin = part * partition_size;
    return {begin, std::min(pos0 + nq, begin + partition_size)};
  }
};

// One task: nq query tokens x all H query heads (R = nq * H rows, ordered (query, head) like the query
// tensor) over keys [k_begin, k_end) of its sequence; row r only sees keys <= pos0 + r / H. Within each block
// every KV head is processed while the block's cache lines are hot (a token's heads are adjacent in the
// layout), and each K/V row serves the G query heads of its group. Float32 accumulators, running max and sum.
template <typename KV, int64_t DC>
void attend_tile(const float* q, int64_t nq, int64_t H, int64_t G, const KV* kcache, const KV* vcache,
                 const int64_t* table, int64_t block_size, int64_t block_stride, int64_t kv_heads, int64_t D_rt,
                 int64_t pos0,
                 int64_t k_begin, int64_t k_end, float* acc, float* m, float* l, std::vector<float>& scratch,
                 const at::BFloat16* const* qb, float scale) {
  // DC > 0: the head size is a compile-time constant, so the per-element loops unroll fully.
  const int64_t D = DC > 0 ? DC : D_rt;
  // qb (optional): each row's unscaled bf16 query, for exact bf16 dot products straight from the cache
  const int64_t R = nq * H;
  const int64_t row_stride = kv_heads * D;
  scratch.resize(static_cast<size_t>(block_size * D + R * block_size));
  float* rows = scratch.data();                 // one head's keys (then values) of this block as float, [i][d]
  float* sc = scratch.data() + block_size * D;  // scores, then weights, [r][i]
  const float neg_inf = -std::numeric_limits<float>::infinity();
  reset_partials(acc, m, l, R, D);
  const bool direct = qb != nullptr;
  int64_t t = k_begin;
  while (t < k_end) {
    const int64_t off = t % block_size;
    const int64_t n = std::min(block_size - off, k_end - t);
    const int64_t phys = table[t / block_size];
    for (int64_t h = 0; h < kv_heads; ++h) {
      const KV* kbase = kcache + phys * block_stride + off * row_stride + h * D;
      const KV* vbase = vcache + phys * block_stride + off * row_stride + h * D;
      if (!direct)
        for (int64_t i = 0; i < n; ++i) load_row(kbase + i * row_stride, rows + i * D, D);
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);  // keys after this query's position are masked
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = j * H + h * G + g;
          float* s = sc + r * block_size;
          if (visible <= 0) {
            for (int64_t i = 0; i < n; ++i) s[i] = 0.f;
            continue;
          }
          float bmax = neg_inf;
#ifdef KVPAGE_DPBF16
          if (direct) {
            if constexpr (std::is_same_v<KV, at::BFloat16>) {
              for (int64_t i = 0; i < visible; ++i) {
                s[i] = dot_bf16(qb[r], kbase + i * row_stride, D) * scale;
                bmax = std::max(bmax, s[i]);
              }
            }
          } else
#endif
          {
            const float* qr = q + r * D;
            for (int64_t i = 0; i < visible; ++i) {
              s[i] = dot(qr, rows + i * D, D);
              bmax = std::max(bmax, s[i]);
            }
          }
          const float new_m = std::max(m[r], bmax);
          const float corr = exp_neg(m[r] - new_m);
          const float sum = exp_shift_sum(s, visible, new_m);
          for (int64_t i = visible; i < n; ++i) s[i] = 0.f;
          l[r] = l[r] * corr + sum;
          m[r] = new_m;
          if (corr != 1.f) {
            float* a = acc + r * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= corr;
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) load_row(vbase + i * row_stride, rows + i * D, D);
      for (int64_t j = 0; j < nq; ++j) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = j * H + h * G + g;
          float* a = acc + r * D;
          const float* w = sc + r * block_size;
          float local[DC > 0 ? DC : 1];
          if constexpr (DC > 0) {
            for (int64_t d = 0; d < DC; ++d) local[d] = a[d];
            for (int64_t i = 0; i < n; ++i) {
              const float wi = w[i];
              const float* v = rows + i * DC;
#pragma omp simd
              for (int64_t d = 0; d < DC; ++d) local[d] += wi * v[d];
            }
            for (int64_t d = 0; d < DC; ++d) a[d] = local[d];
          } else {
            for (int64_t i = 0; i < n; ++i) {
              const float wi = w[i];
              const float* v = rows + i * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += wi * v[d];
            }
          }
        }
      }
    }
    t += n;
  }
}

#if KVPAGE_AVX2
// Eight KV elements as float32: float32 rows load as they are; float16 widens exactly in one F16C conversion
// (every AVX2 CPU has F16C; the scalar path otherwise). bf16 rows go through load16 below.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}

// Sixteen KV elements as two float32 vectors. float32 and float16 rows keep their order (lo = elements 0-7, hi
// = 8-15). A bf16 value is the high half of its float32, so a bf16 row is read as eight 32-bit words of two
// values each: shifting a word left by 16 gives the even element as a float32, masking off its low half the odd
// one (both exact), so lo = elements 0, 2, .., 14 and hi = 1, 3, .., 15: one load and two cheap operations
// instead of two widening loads and two shifts.
// The query and output rows a bf16 cache meets are kept in that even/odd order (kPairOrder).
template <typename KV>
constexpr bool kPairOrder = std::is_same_v<KV, at::BFloat16>;

template <typename KV>
inline void load16(const KV* p, __m256& lo, __m256& hi) {
  if constexpr (kPairOrder<KV>) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    lo = load8(p);
    hi = load8(p + 8);
  }
}

// Rows of D values between natural order and the even/odd order of load16 for bf16, within each 16 values.
inline void to_pair_order(const float* src, float* dst, int64_t D) {
  for (int64_t c = 0; c < D; c += 16)
    for (int64_t j = 0; j < 8; ++j) {
      dst[c + j] = src[c + 2 * j];
      dst[c + 8 + j] = src[c + 2 * j + 1];
    }
}
inline void from_pair_order(float* row, int64_t D) {
  float tmp[16];
  for (int64_t c = 0; c < D; c += 16) {
    for (int64_t j = 0; j < 8; ++j) {
      tmp[2 * j] = row[c + j];
      tmp[2 * j + 1] = row[c + 8 + j];
    }
    std::memcpy(row + c, tmp, sizeof(tmp));
  }
}

// One dot product q . k over D values, q in load16's order for KV.
template <typename KV, int64_t D>
inline float dot1(const float* q, const KV* k) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    __m256 lo, hi;
    load16(k + c, lo, hi);
    a = _mm256_fmadd_ps(lo, _mm256_loadu_ps(q + c), a);
    a = _mm256_fmadd_ps(hi, _mm256_loadu_ps(q + c + 8), a);
  }
  return kvpage::hsum8(a);
}

// Eight dot products q . k_i (k_i = k + i * stride, D values each) as one vector, lane i = key i: eight
// accumulators over the dims, then a horizontal-add tree (no per-key horizontal reduction). q is in load16's
// order for KV.
template <typename KV, int64_t D>
inline __m256 dot8(const float* q, const KV* k, int64_t stride) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    const __m256 qlo = _mm256_loadu_ps(q + c), qhi = _mm256_loadu_ps(q + c + 8);
    for (int i = 0; i < 8; ++i) {
      __m256 lo, hi;
      load16(k + i * stride + c, lo, hi);
      a[i] = _mm256_fmadd_ps(lo, qlo, a[i]);
      a[i] = _mm256_fmadd_ps(hi, qhi, a[i]);
    }
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// attend_tile for float32, bf16 or float16 KV and head size D on AVX2 + FMA (same contract: q pre-scaled, rows
// r = j * H + head, row r sees keys <= pos0 + r / H). K and V rows are read where they lie in the cache (no
// copy; 16-bit values widened to float32 in registers, so every cache computes the same float32 arithmetic
// on its stored values); scores come eight keys
// at a time (dot8), the weights through exp8, and P.V keeps each row's output in registers 64 dims at a time
// while the block's values stream past.
template <typename KV, int64_t D>
void attend_tile_avx2(const float* q, int64_t nq, int64_t H, int64_t G, const KV* kcache, const KV* vcache,
                      const int64_t* table, int64_t block_size, int64_t block_stride, int64_t kv_heads, int64_t pos0,
                      int64_t k_begin, int64_t k_end, float* acc, float* m, float* l, std::vector<float>& scratch) {
  static_assert(D % 64 == 0, "head size must be a multiple of 64");
  const int64_t R = nq * H;
  const int64_t row_stride = kv_heads * D;
  scratch.resize(static_cast<size_t>(R * block_size + 8 + (kPairOrder<KV> ? R * D : 0)));
  float* sc = scratch.data();  // this block's weights, [r][i]
  if constexpr (kPairOrder<KV>) {  // queries in load16's order; the outputs accumulate in it too
    float* qp = scratch.data() + R * block_size + 8;
    for (int64_t r = 0; r < R; ++r) to_pair_order(q + r * D, qp + r * D, D);
    q = qp;
  }
  reset_partials(acc, m, l, R, D);
  int64_t t = k_begin;
  while (t < k_end) {
    const int64_t off = t % block_size;
    const int64_t n = std::min(block_size - off, k_end - t);
    const int64_t phys = table[t / block_size];
    const BlockPrefetch<KV> prefetch(kcache, vcache, table, block_size, block_stride, row_stride, t, k_begin,
                                     k_end);
    // The block kPrefetchAhead ahead is fetched in small parts spread over this block's work: one part per
    // eight keys of each query row's scores, as many during P.V (side by side on random 16-token blocks,
    // 16-64 sequences x 256-4096 keys: 1.35-1.45x the bandwidth of fetching a head's share at once, which
    // queues more misses than the core can track and stalls it).
    const int64_t groups = (n + 7) / 8, parts = 2 * kv_heads * G * groups;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const KV* kbase = kcache + phys * block_stride + off * row_stride + h * D;
      const KV* vbase = vcache + phys * block_stride + off * row_stride + h * D;
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);  // keys after this query's position are masked
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = j * H + h * G + g;
          float* s = sc + r * block_size;
          if (visible <= 0) {
            std::fill(s, s + n, 0.f);
            continue;
          }
          const float* qr = q + r * D;
          __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
          int64_t i = 0;
          for (; i + 8 <= visible; i += 8) {
            if (j == 0) prefetch.part((h * G + g) * groups + i / 8, parts);
            const __m256 d8 = dot8<KV, D>(qr, kbase + i * row_stride, row_stride);
            _mm256_storeu_ps(s + i, d8);
            vmax = _mm256_max_ps(vmax, d8);
          }
          float bmax = kvpage::hmax8(vmax);
          for (; i < visible; ++i) {  // the block's last < 8 visible keys, one by one
            s[i] = dot1<KV, D>(qr, kbase + i * row_stride);
            bmax = std::max(bmax, s[i]);
          }
          const float new_m = std::max(m[r], bmax);
          const float corr = exp_neg(m[r] - new_m);
          const __m256 vm = _mm256_set1_ps(new_m);
          __m256 vsum = _mm256_setzero_ps();
          i = 0;
          for (; i + 8 <= visible; i += 8) {
            const __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
            _mm256_storeu_ps(s + i, w);
            vsum = _mm256_add_ps(vsum, w);
          }
          float sum = kvpage::hsum8(vsum);
          for (; i < visible; ++i) {
            s[i] = exp_neg(s[i] - new_m);
            sum += s[i];
          }
          for (i = visible; i < n; ++i) s[i] = 0.f;
          l[r] = l[r] * corr + sum;
          m[r] = new_m;
          if (corr != 1.f) {
            const __m256 vc = _mm256_set1_ps(corr);
            float* a = acc + r * D;
            for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(a + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), vc));
          }
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t visible = std::min(n, pos0 + j + 1 - t);
        if (visible <= 0) continue;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = j * H + h * G + g;
          const float* w = sc + r * block_size;
          if (j == 0)
            for (int64_t gi = 0; gi < groups; ++gi) prefetch.part(parts / 2 + (h * G + g) * groups + gi, parts);
          for (int64_t d0 = 0; d0 < D; d0 += 64) {
            float* a = acc + r * D + d0;
            __m256 o[8];
            for (int c = 0; c < 8; ++c) o[c] = _mm256_loadu_ps(a + 8 * c);
            for (int64_t i = 0; i < visible; ++i) {
              const __m256 wv = _mm256_set1_ps(w[i]);
              const KV* v = vbase + i * row_stride + d0;
              for (int c = 0; c < 4; ++c) {
                __m256 lo, hi;
                load16(v + 16 * c, lo, hi);
                o[2 * c] = _mm256_fmadd_ps(wv, lo, o[2 * c]);
                o[2 * c + 1] = _mm256_fmadd_ps(wv, hi, o[2 * c + 1]);
              }
            }
            for (int c = 0; c < 8; ++c) _mm256_storeu_ps(a + 8 * c, o[c]);
          }
        }
      }
    }
    t += n;
  }
  if constexpr (kPairOrder<KV>)
    for (int64_t r = 0; r < R; ++r) from_pair_order(acc + r * D, D);
}
#endif

template <typename KV>
constexpr const char* avx2_kernel_name() {
  return std::is_same_v<KV, float> ? "avx2-f32" : std::is_same_v<KV, at::Half> ? "avx2-f16" : "avx2-bf16";
}

template <typename KV, typename Q>
void run_attention(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens, double scale,
                   int64_t partition_size, bool packed, torch::Tensor& out) {  // partition_size: keys per task, at most
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const kvpage::KVGeometry geo = kvpage::kv_geometry(kv_cache);
  const int64_t block_stride = geo.block_stride;
  const int64_t G = H / kv_heads;
  const int64_t S = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const Q* qptr = query.data_ptr<Q>();
  Q* optr = out.data_ptr<Q>();
  const KV* kcache = kv_cache.data_ptr<KV>();
  const KV* vcache = kcache + geo.v_offset;

  // Tasks: (sequence, tile of up to kTile query tokens, context partition), all heads. Contexts are split
  // into partitions only when there are too few tiles to keep every core busy.
  int64_t base_tasks = 0;
  for (int64_t s = 0; s < S; ++s) base_tasks += (qsl[s + 1] - qsl[s] + kTile - 1) / kTile;
  const int64_t threads = at::get_num_threads();
  const bool few_tasks = base_tasks < 4 * threads;
  if (!few_tasks) partition_size = std::numeric_limits<int64_t>::max() / 4 / 16 * 16;  // no split (a multiple of 16)
  if (g_split_short && base_tasks > 0 && base_tasks < threads) {
    // Fewer tiles than threads (one stream's decode): contexts shorter than a partition would leave threads
    // idle, so cut them into one part per idle thread, in multiples of 16 keys and at least kMinPartition.
    int64_t longest = 0;
    for (int64_t s = 0; s < S; ++s) longest = std::max(longest, lens[s]);
    const int64_t ways = (threads + base_tasks - 1) / base_tasks;
    const int64_t part = ((longest + ways - 1) / ways + 15) / 16 * 16;
    partition_size = std::min(partition_size, std::max(kMinPartition, part));
  }
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    for (int64_t j0 = 0; j0 < q_len; j0 += kTile) {
      const int64_t nq = std::min(kTile, q_len - j0);
      const int64_t pos0 = lens[s] - q_len + j0;
      const int64_t parts = (pos0 + nq + partition_size - 1) / partition_size;
      for (int64_t p = 0; p < parts; ++p) tasks.push_back({s, qsl[s] + j0, nq, p, pos0});
    }
  }
  const int64_t T = static_cast<int64_t>(tasks.size());
  std::vector<int64_t> offset(static_cast<size_t>(T + 1), 0);  // first partial row of each task
  for (int64_t ti = 0; ti < T; ++ti) offset[ti + 1] = offset[ti] + tasks[ti].nq * H;
  std::vector<float> part_acc(static_cast<size_t>(offset[T] * D));
  std::vector<float> part_m(static_cast<size_t>(offset[T])), part_l(static_cast<size_t>(offset[T]));
  bool use_dp = false;
#ifdef KVPAGE_DPBF16
  use_dp = std::is_same_v<KV, at::BFloat16> && std::is_same_v<Q, at::BFloat16> && D % 32 == 0;
#endif

  bool use_amx = false;
#ifdef KVPAGE_AMX
  // Only for small batches (few tasks, contexts split into partitions): there the KV tends to sit in cache and
  // the AMX kernel is twice as fast; with many sequences streaming from memory the AVX-512 kernel is faster.
  use_amx = !packed && few_tasks && use_dp && g_amx_decode && (D == 64 || D == 128) && G <= 8 && block_size % 16 == 0 &&
            partition_size % 16 == 0 && kvpage::amx_permitted();
#endif

  bool use_amx_packed = false;
#if defined(KVPAGE_AMX) && defined(KVPAGE_PACKED)
  // Decode tasks over the packed layout: AMX products straight from the cache (any batch size: nothing is
  // rearranged on the way, unlike the row-layout AMX kernel above).
  use_amx_packed = packed && g_amx_decode && G <= 16 && kvpage::amx_permitted();
#endif
  bool use_amx_pairs = false;
#ifdef KVPAGE_AMX_PAIRS
  use_amx_pairs = use_amx_packed && D == 64 && H <= 16;
#endif
  g_decode_kernel = use_amx_pairs ? "amx-pairs" : use_amx_packed ? "amx-packed" : packed ? "avx512-packed" : use_amx ? "amx-rows"
                  : (use_dp && (D == 64 || D == 128)) ? "avx512-rows"
                  : (KVPAGE_AVX2 && (D == 64 || D == 128)) ? avx2_kernel_name<KV>()
                  : "generic";
  auto work = [&](int64_t begin, int64_t end) {
#ifdef KVPAGE_AMX
    if (use_amx) kvpage::amx_configure(G);
#if defined(KVPAGE_PACKED)
    if (use_amx_pairs) kvpage::amx_configure_pairs(H);
    else if (use_amx_packed) kvpage::amx_configure_packed(G);
#endif
#endif
    std::vector<float> qbuf(static_cast<size_t>(kTile * H * D));
    std::vector<const at::BFloat16*> qptrs(static_cast<size_t>(kTile * H));
    std::vector<float> scratch;
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& tk = tasks[ti];
      const Q* qrows = qptr + tk.row0 * H * D;
      const at::BFloat16* const* qb = nullptr;
      if (use_dp) {
        for (int64_t r = 0; r < tk.nq * H; ++r) qptrs[r] = reinterpret_cast<const at::BFloat16*>(qrows + r * D);
        qb = qptrs.data();
      } else {
        for (int64_t i = 0; i < tk.nq * H * D; ++i) qbuf[i] = to_float(qrows[i]) * static_cast<float>(scale);
      }
      const auto [k_begin, k_end] = tk.keys(partition_size);
      const int64_t* table = tables + tk.seq * max_blocks;
      float* pa = part_acc.data() + offset[ti] * D;
      float* pm = part_m.data() + offset[ti];
      float* pl = part_l.data() + offset[ti];
      const float sc = static_cast<float>(scale);
#ifdef KVPAGE_PACKED
      if constexpr (std::is_same_v<KV, at::BFloat16>) {
        if (packed) {
          // The prefetch runs on into the thread's next task.
          kvpage::NextKeys next;
          if (ti + 1 < end) {
            const Task& nt = tasks[ti + 1];
            next.table = tables + nt.seq * max_blocks;
            std::tie(next.begin, next.end) = nt.keys(partition_size);
          }
#if defined(KVPAGE_AMX)
          if (use_amx_pairs && tk.nq == 1) {
#ifdef KVPAGE_AMX_PAIRS
            kvpage::attend_decode_amx_pairs(qb[0], G, kv_heads, kcache, vcache, table, block_size, block_stride,
                                            k_begin, k_end, pa,
                                            pm, pl, scratch, sc, next);
#endif
            continue;
          }
          if (use_amx_packed && tk.nq == 1) {
            if (D == 64)
              kvpage::attend_decode_amx_packed<64>(qb[0], G, kv_heads, kcache, vcache, table, block_size,
                                                   block_stride, k_begin,
                                                   k_end, pa, pm, pl, scratch, sc, next);
            else
              kvpage::attend_decode_amx_packed<128>(qb[0], G, kv_heads, kcache, vcache, table, block_size,
                                                    block_stride, k_begin,
                                                    k_end, pa, pm, pl, scratch, sc, next);
            continue;
          }
#endif
          if (D == 64)
            kvpage::attend_tile_packed<64>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads,
                                           tk.pos0,
                                           k_begin, k_end, pa, pm, pl, scratch, sc, next);
          else
            kvpage::attend_tile_packed<128>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride,
                                            kv_heads, tk.pos0,
                                            k_begin, k_end, pa, pm, pl, scratch, sc, next);
          continue;
        }
      }
#endif
#ifdef KVPAGE_DPBF16
      if constexpr (std::is_same_v<KV, at::BFloat16>) {
#ifdef KVPAGE_AMX
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
        if (use_dp && (D == 64 || D == 128)) {
          if (D == 64)
            attend_tile_bf16<64>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, tk.pos0,
                                 k_begin,
                                 k_end, pa, pm, pl, scratch, sc);
          else
            attend_tile_bf16<128>(qb, tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, tk.pos0,
                                  k_begin,
                                  k_end, pa, pm, pl, scratch, sc);
          continue;
        }
      }
#endif
#if KVPAGE_AVX2
      if (D == 64) {
        attend_tile_avx2<KV, 64>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads,
                                 tk.pos0, k_begin, k_end, pa, pm, pl, scratch);
        continue;
      }
      if (D == 128) {
        attend_tile_avx2<KV, 128>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride,
                                  kv_heads, tk.pos0, k_begin, k_end, pa, pm, pl, scratch);
        continue;
      }
#endif
      if (D == 64)
        attend_tile<KV, 64>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, D,
                            tk.pos0,
                            k_begin, k_end, pa, pm, pl, scratch, qb, sc);
      else if (D == 128)
        attend_tile<KV, 128>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, D,
                             tk.pos0,
                             k_begin, k_end, pa, pm, pl, scratch, qb, sc);
      else
        attend_tile<KV, 0>(qbuf.data(), tk.nq, H, G, kcache, vcache, table, block_size, block_stride, kv_heads, D,
                           tk.pos0,
                           k_begin, k_end, pa, pm, pl, scratch, qb, sc);
    }
#ifdef KVPAGE_AMX
    if (use_amx || use_amx_packed) kvpage::amx_release();
#endif
  };
  // Each thread takes one contiguous run of tasks (so the prefetch can run on into its next task), the runs cut
  // at equal estimated cost rather than equal task counts: contexts vary several-fold within a batch, and a
  // prompt tile (up to kTile queries) costs several decode tasks per key.
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), T);
  std::vector<double> cost(static_cast<size_t>(T + 1), 0.0);  // running sum
  for (int64_t ti = 0; ti < T; ++ti) {
    const auto [kb, ke] = tasks[ti].keys(partition_size);
    cost[ti + 1] = cost[ti] + static_cast<double>(ke - kb + 32) * (1.0 + 0.6 * static_cast<double>(tasks[ti].nq - 1));
  }
  std::vector<int64_t> cut(static_cast<size_t>(nt + 1), T);
  cut[0] = 0;
  for (int64_t c = 1; c < nt; ++c) cut[c] = std::lower_bound(cost.begin(), cost.end(), cost[T] * c / nt) - cost.begin();
  at::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      if (cut[c] < cut[c + 1]) work(cut[c], cut[c + 1]);
  });

  // Merge each tile's partitions and write normalized outputs (row r of a task = query r / H, head r % H).
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
      for (int64_t r = 0; r < tk.nq * H; ++r) {
        Q* o = optr + (tk.row0 * H + r) * D;
        if (t1 == t0 + 1) {  // one partition: normalize directly
          const float inv = 1.f / part_l[offset[t0] + r];
          const float* a = part_acc.data() + (offset[t0] + r) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<Q>(a[d] * inv);
          continue;
        }
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
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<Q>(acc[d] * inv);
      }
    }
  });
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

#ifdef KVPAGE_PACKED
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
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // word offsets of one dim pair of 16 consecutive keys: one 16-key row (16 words) apart
  const __m512i rows16 = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
#endif
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> krow(static_cast<size_t>(D)), vrow(static_cast<size_t>(D));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " outside the KV cache (", num_slots, " slots)");
      const int64_t off = slot % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t d = 0; d < D; ++d) {
          krow[d] = static_cast<at::BFloat16>(ksrc[i * ks + h * D + d]);
          vrow[d] = static_cast<at::BFloat16>(vsrc[i * vs + h * D + d]);
        }
        // K: the token's dim pairs are 32-bit words one 16-key row (64 bytes) apart; V: its elements every
        // other bf16 of its key pair's row (packed_kv.h).
        const int64_t base = kvpage::packed_group_offset(slot / block_size, off, geo.block_stride, kv_heads,
                                                         D) + h * 16 * D;
        auto* k32 = reinterpret_cast<uint32_t*>(kdst + base + (off % 16) * 2);
        const auto* kw = reinterpret_cast<const uint32_t*>(krow.data());
        at::BFloat16* vpair = vdst + base + ((off % 16) / 2) * 2 * D;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        // 16 dim pairs per scatter; 16 values per masked store into the low or high halves of a pair row
        for (int64_t p = 0; p < D / 2; p += 16)
          _mm512_i32scatter_epi32(k32 + p * 16, rows16, _mm512_loadu_si512(kw + p), 4);
        const __mmask32 half = off % 2 ? 0xAAAAAAAAu : 0x55555555u;
        for (int64_t d = 0; d < D; d += 16) {
          __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow.data() + d)));
          if (off % 2) w = _mm512_slli_epi32(w, 16);
          _mm512_mask_storeu_epi16(vpair + 2 * d, half, w);
        }
#else
        for (int64_t p = 0; p < D / 2; ++p) k32[p * 16] = kw[p];
        for (int64_t d = 0; d < D; ++d) vpair[2 * d + off % 2] = vrow[d];
#endif
      }
    }
  });
}
#endif

// Whether this build and cache can use the packed layout (packed_kv.h).
void check_packed(const torch::Tensor& kv_cache) {
#ifdef KVPAGE_PACKED
  TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "the packed KV layout is bfloat16 only");
  TORCH_CHECK(kv_cache.size(2) % 16 == 0, "the packed KV layout needs a block size that is a multiple of 16");
  TORCH_CHECK(kv_cache.size(4) == 64 || kv_cache.size(4) == 128, "the packed KV layout needs head size 64 or 128");
#else
  (void)kv_cache;
  TORCH_CHECK(false, "this build has no packed KV layout (needs AVX512-BF16)");
#endif
}

void check_common(const torch::Tensor& kv_cache) {
  kvpage::kv_geometry(kv_cache);  // shape and strides
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16 ||
                  kv_cache.scalar_type() == at::kHalf,
              "kv_cache must be float32, bfloat16 or float16");
}

// The batch description must fit the query and the cache: the kernels index with these numbers unchecked, so a
// bad offset or block id would read outside the tensors. O(sequences + blocks), against the kernel's
// O(keys x heads x head_dim). block_tables must already be contiguous (the caller makes it so).
void check_batch(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                 const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens) {
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int64 [seqs] tensor");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) == S + 1,
              "query_start_loc must be a contiguous int64 tensor of seqs + 1 = ", S + 1, " offsets");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.size(0) >= S,
              "block_tables must be an int64 [seqs, max_blocks] tensor with a row per sequence");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t bs = kv_cache.size(2), num_blocks = kv_cache.size(1), max_blocks = block_tables.size(1);
  TORCH_CHECK(qsl[0] == 0 && qsl[S] == query.size(0), "query_start_loc must run from 0 to the ", query.size(0),
              " query rows, got ", qsl[0], " .. ", qsl[S]);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(q_len >= 0, "query_start_loc decreases at sequence ", s);
    TORCH_CHECK(lens[s] >= q_len, "sequence ", s, " has fewer keys (", lens[s], ") than queries (", q_len, ")");
    kvpage::check_table_row(tables + s * max_blocks, max_blocks, lens[s], bs, num_blocks, "sequence", s);
  }
}

}  // namespace

void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping,
                       bool packed) {
  check_common(kv_cache);
  if (packed) check_packed(kv_cache);
  TORCH_CHECK(key.sizes() == value.sizes() && key.dim() == 3, "key/value must be [tokens, kv_heads, dim]");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4), "key shape does not match the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == key.size(0), "bad slot_mapping");
  // Each token's heads must be one dense row; the rows themselves may be strided (no copy of a qkv view).
  const auto dense_rows = [](const torch::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); };
  if (!dense_rows(key)) key = key.contiguous();
  if (!dense_rows(value)) value = value.contiguous();
  TORCH_CHECK(key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16, "key must be float32/bfloat16");
#ifdef KVPAGE_PACKED
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

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                              int64_t partition_size, bool packed) {
  check_common(kv_cache);
  if (packed) {
    check_packed(kv_cache);
    TORCH_CHECK(query.scalar_type() == at::kBFloat16, "the packed KV layout needs bfloat16 queries");
    TORCH_CHECK(partition_size % 16 == 0, "the packed KV layout needs partitions of a multiple of 16 keys");
  }
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, dim]");
  TORCH_CHECK(query.size(2) == kv_cache.size(4), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(1) / kv_cache.size(3) <= kMaxGroup, "query group too large");
  TORCH_CHECK(partition_size > 0, "partition_size must be positive");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  check_batch(query, kv_cache, block_tables, query_start_loc, seq_lens);
  auto out = torch::empty_like(query);
  const bool kv_bf16 = kv_cache.scalar_type() == at::kBFloat16;
  if (kv_cache.scalar_type() == at::kHalf) {
    if (query.scalar_type() == at::kFloat)
      run_attention<at::Half, float>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, partition_size,
                                     packed, out);
    else {
      TORCH_CHECK(query.scalar_type() == at::kBFloat16, "query must be float32 or bfloat16");
      run_attention<at::Half, at::BFloat16>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                            partition_size, packed, out);
    }
  } else if (query.scalar_type() == at::kFloat) {
    if (kv_bf16) run_attention<at::BFloat16, float>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                                    partition_size, packed, out);
    else run_attention<float, float>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                     partition_size, packed, out);
  } else {
    TORCH_CHECK(query.scalar_type() == at::kBFloat16, "query must be float32 or bfloat16");
    if (kv_bf16) run_attention<at::BFloat16, at::BFloat16>(query, kv_cache, block_tables, query_start_loc, seq_lens,
                                                           scale, partition_size, packed, out);
    else run_attention<float, at::BFloat16>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                            partition_size, packed, out);
  }
  return out;
}

void register_fused_ops(pybind11::module& m);  // fused_ops.cpp
void register_quant_ops(pybind11::module& m);  // quant_linear.cpp
void register_linear_ops(pybind11::module& m);  // linear_amx.cpp
void register_prefill_ops(pybind11::module& m);  // prefill_amx.cpp
void register_decode_ops(pybind11::module& m);  // decode_layers.cpp
void register_gemm_ops(pybind11::module& m);  // gemm_f32.cpp
void register_sampler_ops(pybind11::module& m);  // sampler.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_fused_ops(m);
  register_quant_ops(m);
  register_linear_ops(m);
  register_prefill_ops(m);
  register_decode_ops(m);
  register_sampler_ops(m);
  register_gemm_ops(m);
  m.def("reshape_and_cache", &reshape_and_cache, "scatter new K/V rows to their slots", pybind11::arg("key"),
        pybind11::arg("value"), pybind11::arg("kv_cache"), pybind11::arg("slot_mapping"),
        pybind11::arg("packed") = false);
  m.def("paged_attention", &paged_attention, "varlen causal attention over a paged KV cache", pybind11::arg("query"),
        pybind11::arg("kv_cache"), pybind11::arg("block_tables"), pybind11::arg("query_start_loc"),
        pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("partition_size"),
        pybind11::arg("packed") = false);
  m.def("last_decode_kernel", [] { return std::string(g_decode_kernel); },
        "the kernel that served the last paged_attention call's decode tasks");
  // Whether this build has the packed bf16 KV layout (packed_kv.h).
  m.def("has_packed_layout", [] {
#ifdef KVPAGE_PACKED
    return true;
#else
    return false;
#endif
  });
  m.def("set_split_short", [](bool on) { g_split_short = on; });
  // Whether decode tasks may use AMX tile products; returns whether this build and machine can at all.
  m.def("set_amx_decode", [](bool on) {
#ifdef KVPAGE_AMX
    g_amx_decode = on;
    return kvpage::amx_permitted();
#else
    (void)on;
    return false;
#endif
  });
}
