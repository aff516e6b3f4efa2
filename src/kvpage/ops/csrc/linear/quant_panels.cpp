// Few-token products from Q4 / Q8 blocks with the float32 panel GEMM's sums (AVX2 + FMA builds without
// AVX-512, where float32 models run that GEMM): a token row's outputs are bit-identical whichever of the two
// a step takes, so a request's logits do not depend on how many tokens share its step.
//
//   quant_panel_linear(x [M, K] float32, codes, d, m, gated) -> [M, N] float32 ([M, N / 2] gated)
//
// Weights in the panel GEMM's order (kvpage/model/quant.py, QuantWeight.as_panels): 16 output columns per
// panel, k-major, N a multiple of 16 (P = N / 16 panels, nb = K / 32 blocks):
//   Q4: codes uint8 [P, K, 8]: byte j of row k holds column j's code (low nibble) and column j + 8's (high);
//       d, m float16 [P, nb, 16]: weight = d * q + m.
//   Q8: codes int8 [P, K, 16]; d float16 [P, nb, 16]: weight = d * q.
// Each weight is rebuilt in registers as the float32 value the loader's dequantization gives (d * q is exact
// in float32 for 4- and 8-bit q and a float16 d, so one FMA with m rounds once, as the loader's d * q + m
// does), and each output is one float32 FMA chain over k in order from zero, then + bias (0 without one):
// gemm_f32.cpp's tile, term for term. The reads stay those of the blocks (0.625 bytes per Q4 weight with
// its scales here, 4 for the float32 panel).

#include "tensor.h"

#include "ops.h"
#include <ATen/Parallel.h>

#include "common.h"
#include "linear/panel_step.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kNR = 16;  // columns per panel, as gemm_f32.cpp's
constexpr int64_t kQK = 32;  // weights per block along k
constexpr int64_t kMR = 4;   // token rows per pass over a panel

#if KVPAGE_ISA_AVX2_ONLY
inline __m256 half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Rows [0, R) of x times panel p's weights into out (row stride N), columns n0..n0+15. The accumulators are
// named variables for the reason gemm_f32.cpp's are (GCC mirrors an array of them on the stack). Tried here and
// not kept (one token row, the family-23 EPYC): software prefetch of the panel two on (each panel's codes and
// scales are sequential streams), two panels per pass (four chains), and each block of four panels rebuilt
// into an L1 buffer before eight chains of products over it: 18.3, 19.0 and 23.0 ms against 17.8 ms for a
// pass of SmolLM2's projections and lm head. Nor, in a stand-alone copy of this loop, were 128-bit halves or
// codes turned into floats by exponent tricks (OR with 2^23's bits, then a subtraction, or an exact FMA and an
// add, instead of the conversion): more instructions per weight, and the loop is bound by their number.
template <int R, bool Q4>
void panel_rows(const float* x, int64_t K, const void* codes, const at::Half* d, const at::Half* m, float* out,
                int64_t N, int64_t n0, const float* bias) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 l0 = zero, h0 = zero, l1 = zero, h1 = zero, l2 = zero, h2 = zero, l3 = zero, h3 = zero;
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  const int64_t nb = K / kQK;
#define KVPAGE_QP_ROW(i) KVPAGE_PANEL_ROW(R, i, x, K, k, wlo, whi)
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 dlo = half8(d + b * kNR), dhi = half8(d + b * kNR + 8);
    [[maybe_unused]] __m256 mlo = zero, mhi = zero;
    if constexpr (Q4) {
      mlo = half8(m + b * kNR);
      mhi = half8(m + b * kNR + 8);
    }
    for (int64_t k = b * kQK; k < (b + 1) * kQK; ++k) {
      __m256 wlo, whi;
      if constexpr (Q4) {
        const uint8_t* c = static_cast<const uint8_t*>(codes) + k * 8;
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
        wlo = _mm256_fmadd_ps(dlo, _mm256_cvtepi32_ps(_mm256_and_si256(e, low4)), mlo);
        whi = _mm256_fmadd_ps(dhi, _mm256_cvtepi32_ps(_mm256_srli_epi32(e, 4)), mhi);
      } else {
        const int8_t* c = static_cast<const int8_t*>(codes) + k * kNR;
        wlo = _mm256_mul_ps(dlo, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                     _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)))));
        whi = _mm256_mul_ps(dhi, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                     _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8)))));
      }
      KVPAGE_QP_ROW(0) KVPAGE_QP_ROW(1) KVPAGE_QP_ROW(2) KVPAGE_QP_ROW(3)
    }
  }
#undef KVPAGE_QP_ROW
  const __m256 bias_lo = bias != nullptr ? _mm256_loadu_ps(bias + n0) : zero;
  const __m256 bias_hi = bias != nullptr ? _mm256_loadu_ps(bias + n0 + 8) : zero;
  const auto store = [&](int64_t r, __m256 lo, __m256 hi) {
    _mm256_storeu_ps(out + r * N + n0, _mm256_add_ps(lo, bias_lo));
    _mm256_storeu_ps(out + r * N + n0 + 8, _mm256_add_ps(hi, bias_hi));
  };
  store(0, l0, h0);
  if constexpr (R > 1) store(1, l1, h1);
  if constexpr (R > 2) store(2, l2, h2);
  if constexpr (R > 3) store(3, l3, h3);
}

template <bool Q4>
void rows_times_panel(int64_t rows, const float* x, int64_t K, const void* codes, const at::Half* d,
                      const at::Half* m, float* out, int64_t N, int64_t n0, const float* bias) {
  switch (rows) {
    case 1: panel_rows<1, Q4>(x, K, codes, d, m, out, N, n0, bias); break;
    case 2: panel_rows<2, Q4>(x, K, codes, d, m, out, N, n0, bias); break;
    case 3: panel_rows<3, Q4>(x, K, codes, d, m, out, N, n0, bias); break;
    default: panel_rows<4, Q4>(x, K, codes, d, m, out, N, n0, bias); break;
  }
}
#endif

}  // namespace

torch::Tensor quant_panel_linear(torch::Tensor x, const torch::Tensor& codes, const torch::Tensor& d,
                                 const c10::optional<torch::Tensor>& m, const c10::optional<torch::Tensor>& bias,
                                 bool gated) {
  TORCH_CHECK(kvpage::gemm::f32_gemm_available(), "quant panels need an AVX2 + FMA build without AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [tokens, in_features]");
  const bool q4 = codes.scalar_type() == at::kByte;
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(2) == (q4 ? 8 : kNR) &&
                  (q4 || codes.scalar_type() == at::kChar),
              "codes must be uint8 [panels, K, 8] (Q4) or int8 [panels, K, 16] (Q8) from QuantWeight.as_panels");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0), N = P * kNR, nb = K / kQK;
  TORCH_CHECK(K % kQK == 0 && codes.size(1) == K, "x has ", K, " features, the panels ", codes.size(1));
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 3 && d.size(0) == P &&
                  d.size(1) == nb && d.size(2) == kNR,
              "d must be float16 [panels, K / 32, 16]");
  TORCH_CHECK(q4 == m.has_value(), q4 ? "Q4 panels need m" : "Q8 panels take no m");
  if (q4)
    TORCH_CHECK(m->scalar_type() == at::kHalf && m->is_contiguous() && m->sizes() == d.sizes(),
                "m must be float16 [panels, K / 32, 16]");
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "bias must be [out_features]");
  }
  TORCH_CHECK(!gated || N % 2 == 0, "gated needs W = [gate; up]");
  auto out = at::empty({M, N}, x.options());
#if KVPAGE_ISA_AVX2_ONLY
  if (M > 0) {
    const float* xp = x.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    const void* cp = codes.data_ptr();
    const at::Half* dp = d.data_ptr<at::Half>();
    const at::Half* mp = q4 ? m->data_ptr<at::Half>() : nullptr;
    const int64_t code_bytes = K * (q4 ? 8 : kNR), scales = nb * kNR;
    at::parallel_for(0, P, std::max<int64_t>(1, P / (4 * at::get_num_threads())), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t r = 0; r < M; r += kMR) {
          const int64_t rows = std::min(kMR, M - r);
          const char* c = static_cast<const char*>(cp) + p * code_bytes;
          float* o = out.data_ptr<float>() + r * N;
          if (q4) rows_times_panel<true>(rows, xp + r * K, K, c, dp + p * scales, mp + p * scales, o, N, p * kNR, bp);
          else rows_times_panel<false>(rows, xp + r * K, K, c, dp + p * scales, nullptr, o, N, p * kNR, bp);
        }
    });
  }
#endif
  return gated ? silu_mul(out) : out;
}
