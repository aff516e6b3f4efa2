// bf16 x . W^T on AVX512_BF16 CPUs without AMX (AMD Zen 4 / Zen 5, Intel Xeons whose AMX is not exposed), for
// the bf16 layer projections of steps with more rows than the few-token and int8 paths take.
//
//   bf16_pack_weight(w [N, K], gated) -> [N / 16, K / 2, 16, 2]   once at load: 16-column panels of k pairs
//   bf16_linear(x [M, K], packed, N, bias, act) -> [M, N] bf16, or [M, N / 2] for a gated MLP's act(g) * u
//
// Why: oneDNN's packed bf16 product reaches ~75% of `vdpbf16ps`'s peak on SmolLM2's projections at 128 rows on
// a Zen 4 (0.35 of ~0.47 TFLOP/s on two cores: benchmarks/isa_rates.py), where the projections are ~60% of a
// decode step. The microkernel here holds an 8-row x 48-column tile of the output in 24 registers and runs the
// whole K: per k pair, three aligned panel loads, eight broadcasts of a row's pair, 24 `vdpbf16ps` (one load
// per ~2 products issued, under the two a cycle the core takes). A task is one 48-column panel triple over a
// chunk of rows, handed out by claims (a thread parked by the OS leaves its share to the other); the triple's
// panels (K x 96 bytes, 55 KB at K = 576) stay in L2 while the chunk's rows go past. Each output is one float32
// sum over k pairs in order, rounded once to bf16 (nearest even), as oneDNN rounds its float32 sums.
//
// Gated (the MLP's [gate; up] product, act SiLU or GELU-tanh): the packing interleaves gate panel j and up panel
// j, a 6-row x 64-column tile holds two such pairs, and its epilogue writes act(g) * u with g and u rounded to
// bf16 first: the bits of the plain product followed by silu_mul / gelu_mul, without writing [M, N] and
// reading it back (on a Zen 4, silu_mul was ~2.5% of a serving run's time: benchmarks/profile_step.py --ops).

#include "tensor.h"

#include "ops.h"
#include <ATen/Parallel.h>

#include "common.h"
#include "isa.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvpage::gemm {

namespace {

constexpr int64_t kPanel = 16;   // columns of a panel (one 512-bit vector of float32 sums)
constexpr int64_t kTriple = 3;   // panels per task and register tile
constexpr int64_t kRows = 8;     // rows per register tile at three panels
constexpr int64_t kQuad = 4;     // panels per gated task and register tile: two (gate, up) pairs
constexpr int64_t kGatedRows = 6;
using kvpage::amx::kActGeluTanh, kvpage::amx::kActNone, kvpage::amx::kActSilu;  // bf16_linear's act (ops.h)

#if KVPAGE_ISA_AVX512BF16
// Rows [0, R) of a (row stride lda, bf16 bits) times NP consecutive panels (each K / 2 x 16 pairs, `pstride`
// elements apart) into c (row stride ldc), + bias (float32, NP x 16, or null); with ACT, panels 2j and 2j + 1
// are gate and up, and c gets act(gate) * up, NP / 2 x 16 columns.
template <int R, int NP, int64_t ACT>
__attribute__((always_inline)) inline void tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kp,
                                                int64_t pstride, uint16_t* c, int64_t ldc, const float* bias) {
  __m512 acc[R][NP];
#pragma GCC unroll 24
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; ++k) {
    __m512bh w[NP];
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) w[j] = (__m512bh)_mm512_load_si512(b + j * pstride + 2 * kPanel * k);
#pragma GCC unroll 24
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * k, 4);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 3
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, w[j]);
    }
  }
  if constexpr (ACT != kActNone) {
#pragma GCC unroll 24
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
      for (int j = 0; j < NP / 2; ++j) {
        const __m512 g = kvpage::bf16_round(acc[i][2 * j]), u = kvpage::bf16_round(acc[i][2 * j + 1]);
        const __m512 y = ACT == kActSilu ? kvpage::silu_mul16(g, u, 0xFFFF) : kvpage::gelu_mul16(g, u, 0xFFFF);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc + kPanel * j), (__m256i)_mm512_cvtneps_pbh(y));
      }
  } else {
#pragma GCC unroll 24
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
      for (int j = 0; j < NP; ++j) {
        const __m512 s = bias == nullptr ? acc[i][j] : _mm512_add_ps(acc[i][j], _mm512_loadu_ps(bias + kPanel * j));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc + kPanel * j), (__m256i)_mm512_cvtneps_pbh(s));
      }
  }
}

// `rows` rows times NP panels into c (row stride ldc): register tiles of as many rows as 24 accumulators hold,
// then 4, then 1.
template <int NP, int64_t ACT = kActNone>
void rows_times_panels(int64_t rows, const uint16_t* a, int64_t K, const uint16_t* b, uint16_t* c, int64_t ldc,
                       const float* bias) {
  constexpr int R = 24 / NP;
  const int64_t kp = K / 2, pstride = K * kPanel;
  int64_t r = 0;
  for (; r + R <= rows; r += R) tile<R, NP, ACT>(a + r * K, K, b, kp, pstride, c + r * ldc, ldc, bias);
  for (; r + 4 <= rows; r += 4) tile<4, NP, ACT>(a + r * K, K, b, kp, pstride, c + r * ldc, ldc, bias);
  for (; r < rows; ++r) tile<1, NP, ACT>(a + r * K, K, b, kp, pstride, c + r * ldc, ldc, bias);
}

// The gated product: tasks of (row chunk, four panels = two gate / up pairs), the last possibly one pair.
template <int64_t ACT>
void gated_product(int64_t M, const uint16_t* a, int64_t K, const uint16_t* w, int64_t P, uint16_t* c) {
  const int64_t quads = (P + kQuad - 1) / kQuad, ldc = P / 2 * kPanel;
  kvpage::for_row_chunks_and_tiles(M, 2 * K, kGatedRows, quads, [&](int64_t m0, int64_t rows, int64_t t) {
    const int64_t p0 = kQuad * t;
    const uint16_t* bt = w + p0 * K * kPanel;
    uint16_t* ct = c + m0 * ldc + p0 / 2 * kPanel;
    if (P - p0 >= kQuad) rows_times_panels<4, ACT>(rows, a + m0 * K, K, bt, ct, ldc, nullptr);
    else rows_times_panels<2, ACT>(rows, a + m0 * K, K, bt, ct, ldc, nullptr);
  });
}
#endif

}  // namespace

bool bf16_gemm_available() { return KVPAGE_ISA_AVX512BF16 == 1; }

torch::Tensor bf16_pack_weight(const torch::Tensor& w, bool gated) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "weight must be bf16 [out_features, in_features]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % (gated ? 2 * kPanel : kPanel) == 0 && K % 2 == 0, "bf16_pack_weight needs out_features % ",
              gated ? 2 * kPanel : kPanel, " == 0", gated ? " ([gate; up], each a multiple of 16)" : "",
              " and even in_features, got [", N, ", ", K, "]");
  // gated: panel 2j holds gate's columns 16j.., panel 2j + 1 up's
  const torch::Tensor rows = gated ? kvpage::interleave_gate_up(w) : w.contiguous();
  // [P, K/2, 16, 2]: panel p, k pair j holds (W[16p + i][2j], W[16p + i][2j + 1]) for i < 16
  return rows.view({N / kPanel, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor bf16_linear(torch::Tensor x, const torch::Tensor& packed, int64_t N, c10::optional<torch::Tensor> bias,
                          int64_t act) {
  TORCH_CHECK(bf16_gemm_available(), "bf16_linear needs an AVX512_BF16 build");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [tokens, in_features]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "packed must come from bf16_pack_weight");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K, "x has ", K, " features, the packed weight ", packed.size(1) * 2);
  TORCH_CHECK(N == P * kPanel, "N = ", N, " does not match ", P, " panels");
  TORCH_CHECK(act == kActNone || act == kActSilu || act == kActGeluTanh,
              "act must be 0 (none), 1 (SiLU) or 2 (GELU-tanh), got ", act);
  const bool gated = act != kActNone;
  TORCH_CHECK(!gated || N % (2 * kPanel) == 0, "a gated product needs N % 32 == 0 (a gated packing), got ", N);
  TORCH_CHECK(!(gated && bias.has_value() && bias->defined()), "a gated product (act) takes no bias");
  torch::Tensor b;
  const float* bp = kvpage::float_bias(bias, N, b);
  x = x.contiguous();
  auto out = at::empty({M, gated ? N / 2 : N}, x.options());
  if (M == 0 || N == 0) return out;
#if KVPAGE_ISA_AVX512BF16
  const auto* a = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* c = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (gated) {
    if (act == kActSilu) gated_product<kActSilu>(M, a, K, w, P, c);
    else gated_product<kActGeluTanh>(M, a, K, w, P, c);
    return out;
  }
  const int64_t triples = (P + kTriple - 1) / kTriple;
  kvpage::for_row_chunks_and_tiles(M, 2 * K, kRows, triples, [&](int64_t m0, int64_t rows, int64_t t) {
    const int64_t p0 = kTriple * t, np = std::min(kTriple, P - p0);
    const uint16_t* bt = w + p0 * K * kPanel;
    uint16_t* ct = c + m0 * N + p0 * kPanel;
    const float* bias_t = bp == nullptr ? nullptr : bp + p0 * kPanel;
    if (np == 3) rows_times_panels<3>(rows, a + m0 * K, K, bt, ct, N, bias_t);
    else if (np == 2) rows_times_panels<2>(rows, a + m0 * K, K, bt, ct, N, bias_t);
    else rows_times_panels<1>(rows, a + m0 * K, K, bt, ct, N, bias_t);
  });
#endif
  return out;
}

}  // namespace kvpage::gemm
