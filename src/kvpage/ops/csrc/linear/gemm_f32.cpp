// float32 x . W^T for the float32 fast path on AVX2 + FMA CPUs (no AVX-512, no bf16), where every
// projection of a batched step is a float32 GEMM with a short inner dimension (576-1536 for SmolLM2).
//
//   f32_pack_weight(w [N, K]) -> [ceil(N / 16), K, 16]     once at load: 16-column panels, k-major
//   f32_linear(x [M, K], packed, N, bias) -> [M, N]
//
// The microkernel holds a 6-row x 16-column tile of the output in 12 registers and runs the whole K: per k,
// two aligned loads of the panel, six broadcasts of x, twelve FMAs (the register tile of BLIS's Haswell
// kernel). Each output is one float32 sum in k order. 1.1-1.65x oneDNN's packed product on a pass of
// SmolLM2's layer projections at 1-2048 rows on a Zen 3 (benchmarks/linear.py --dtype float32).

#include "tensor.h"

#include "ops.h"
#include <ATen/Parallel.h>

#include "common.h"
#include "linear/panel_step.h"

#include <algorithm>
#include <cstdint>

namespace kvpage::gemm {

constexpr int64_t kNR = 16;  // panel width (two 8-lane vectors)
constexpr int64_t kMR = 6;   // rows per register tile

#if KVPAGE_ISA_AVX2_ONLY
// Rows [0, R) of x (row stride lda) times one panel (K x 16), written to c (row stride ldc): `cols` <= 16 of
// the panel's columns are real (the last panel of an N that is not a multiple of 16). The accumulators are
// named variables, not an array: GCC kept an array's copy on the stack in sync every iteration (12 stores per
// 12 FMAs, 32 GFLOP/s on one core instead of ~100).
template <int R>
void tile(const float* a, int64_t lda, const float* b, int64_t K, float* c, int64_t ldc, int64_t cols,
          const float* bias) {
  static_assert(R >= 1 && R <= kMR, "1..6 rows");
  const __m256 zero = _mm256_setzero_ps();
  __m256 l0 = zero, h0 = zero, l1 = zero, h1 = zero, l2 = zero, h2 = zero, l3 = zero, h3 = zero, l4 = zero,
         h4 = zero, l5 = zero, h5 = zero;
#define KVPAGE_GEMM_ROW(i) KVPAGE_PANEL_ROW(R, i, a, lda, k, b0, b1)
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_load_ps(b + kNR * k), b1 = _mm256_load_ps(b + kNR * k + 8);
    KVPAGE_GEMM_ROW(0) KVPAGE_GEMM_ROW(1) KVPAGE_GEMM_ROW(2) KVPAGE_GEMM_ROW(3) KVPAGE_GEMM_ROW(4)
    KVPAGE_GEMM_ROW(5)
  }
#undef KVPAGE_GEMM_ROW
  alignas(32) float buf[kNR] = {};
  if (bias != nullptr) std::copy(bias, bias + cols, buf);  // the panel's real columns only
  const __m256 bias_lo = _mm256_load_ps(buf), bias_hi = _mm256_load_ps(buf + 8);
  const auto store = [&](int64_t r, __m256 lo, __m256 hi) {
    lo = _mm256_add_ps(lo, bias_lo);
    hi = _mm256_add_ps(hi, bias_hi);
    float* o = c + r * ldc;
    if (cols == kNR) {
      _mm256_storeu_ps(o, lo);
      _mm256_storeu_ps(o + 8, hi);
    } else {
      _mm256_store_ps(buf, lo);
      _mm256_store_ps(buf + 8, hi);
      std::copy(buf, buf + cols, o);
    }
  };
  store(0, l0, h0);
  if constexpr (R > 1) store(1, l1, h1);
  if constexpr (R > 2) store(2, l2, h2);
  if constexpr (R > 3) store(3, l3, h3);
  if constexpr (R > 4) store(4, l4, h4);
  if constexpr (R > 5) store(5, l5, h5);
}

void rows_times_panel(int64_t rows, const float* a, int64_t lda, const float* b, int64_t K, float* c, int64_t ldc,
                      int64_t cols, const float* bias) {
  int64_t r = 0;
  for (; r + kMR <= rows; r += kMR) tile<kMR>(a + r * lda, lda, b, K, c + r * ldc, ldc, cols, bias);
  switch (rows - r) {
    case 1: tile<1>(a + r * lda, lda, b, K, c + r * ldc, ldc, cols, bias); break;
    case 2: tile<2>(a + r * lda, lda, b, K, c + r * ldc, ldc, cols, bias); break;
    case 3: tile<3>(a + r * lda, lda, b, K, c + r * ldc, ldc, cols, bias); break;
    case 4: tile<4>(a + r * lda, lda, b, K, c + r * ldc, ldc, cols, bias); break;
    case 5: tile<5>(a + r * lda, lda, b, K, c + r * ldc, ldc, cols, bias); break;
    default: break;
  }
}
#endif

bool f32_gemm_available() { return KVPAGE_ISA_AVX2_ONLY == 1; }

torch::Tensor f32_pack_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "weight must be float32 [out_features, in_features]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kNR - 1) / kNR;
  // [P, K, 16]: panel p holds columns 16p..16p+15 of W^T, k-major; columns past N are zero. One read of w and one
  // write of the panels, panels split over the threads, each panel's rows read 64 k at a time (torch's zero-fill,
  // copy and transposing copy took 2.2x as long for Gemma 3's head on a Zen 3)
  const auto wc = w.contiguous();
  auto out = at::empty({P, K, kNR}, w.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  constexpr int64_t kChunk = 64;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(kNR, N - p * kNR);
      float* panel = dst + p * K * kNR;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t k1 = std::min(K, k0 + kChunk);
        for (int64_t j = 0; j < kNR; ++j) {
          if (j >= cols) {  // past N: zero columns (no row of w behind them)
            for (int64_t k = k0; k < k1; ++k) panel[k * kNR + j] = 0.f;
            continue;
          }
          const float* row = src + (p * kNR + j) * K;
          for (int64_t k = k0; k < k1; ++k) panel[k * kNR + j] = row[k];
        }
      }
    }
  });
  return out;
}

torch::Tensor f32_linear(torch::Tensor x, const torch::Tensor& packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(f32_gemm_available(), "f32_linear needs an AVX2 + FMA build without AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [tokens, in_features]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kNR && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "packed must come from f32_pack_weight");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " features, the packed weight ", packed.size(1));
  TORCH_CHECK(N > (P - 1) * kNR && N <= P * kNR, "N = ", N, " does not match ", P, " panels");
  torch::Tensor b;
  const float* bp = kvpage::float_bias(bias, N, b);
  x = x.contiguous();
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if KVPAGE_ISA_AVX2_ONLY
  const float* a = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* c = out.data_ptr<float>();
  kvpage::for_row_chunks_and_tiles(M, 4 * K, kMR, P, [&](int64_t m0, int64_t rows, int64_t p) {
    const int64_t n0 = p * kNR, cols = std::min(kNR, N - n0);
    rows_times_panel(rows, a + m0 * K, K, w + p * K * kNR, K, c + m0 * N + n0, N, cols,
                     bp == nullptr ? nullptr : bp + n0);
  });
#endif
  return out;
}

}  // namespace kvpage::gemm
