// x . W^T straight from the checkpoint's Q4 / Q8 blocks with 8-bit integer products (AVX-512 VNNI), for steps
// of many rows on CPUs without AMX: one vpdpbusd multiplies 64 byte pairs, where vdpbf16ps multiplies 32 bf16
// pairs (on the 2-core Xeon without AMX, 2026-11-25: 1.9 G vpdpbusd/s against 1.35 G vdpbf16ps/s per core, so
// 2.8x the products per second; oneDNN's bf16 GEMM already runs at the vdpbf16ps peak there).
//
//   i8_pack_weight(qs, d, m, gated) -> (codes uint8 [P, nb, 512], scales float32 [P, nb, 32])   once at load
//   i8_linear(x [M, K] bf16 | f32, codes, scales, N, gated, bias) -> [M, N] (or [M, N / 2] gated), x's dtype
//
// Weights keep their exact values as unsigned byte codes u with a scale and an offset per 32-block of a column:
// w = d * u + m (Q4: u = q in 0..15; Q5_0 and Q4_K through the U8 form, kvpage/model/quant.py; Q8: u = q + 128
// and m = -128 d, exact). Activations are rounded per row
// and 32-block to int8 codes c with their own scale (x ~= dx * c, dx = absmax / 127, as llama.cpp's Q8
// activations), so each block's product is an exact integer sum (vpdpbusd: unsigned u times signed c):
//   sum_k w x = d dx (u . c) + m dx sum(c)  =  cvt(int sum) * dw * X1 + mw * X2
// with per-column dw, mw (scales[p, b] = [d x16, m x16]) and per-row X1 = dx, X2 = dx sum(c).
//
// Packed codes: panels of 16 output columns; per (panel, block) 512 bytes, byte q * 64 + c * 4 + e = the code of
// column 16 p + c at k = 32 b + 4 q + e: one 64-byte load feeds a vpdpbusd for 16 columns x 4 k. Gated weights
// ([gate; up], the MLP's input half) are packed with panel 2i = gate columns 16i.., panel 2i + 1 = up columns
// 16i..: a tile of two panels then holds matching gate and up columns, and silu(g) * u is its epilogue.

#include "tensor.h"
#include <ATen/Parallel.h>

#include "common.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace kvpage::gemm_i8 {

constexpr int64_t kQK = 32;       // weights per block
constexpr int64_t kNR = 16;       // columns per panel
constexpr int64_t kPanelBlock = kQK * kNR;  // bytes per (panel, block)
constexpr int64_t kMR = 6;        // rows per register tile

#if KVPAGE_ISA_AVX512 && defined(__AVX512VNNI__)
#define KVPAGE_I8_GEMM 1
#else
#define KVPAGE_I8_GEMM 0
#endif

bool i8_gemm_available() { return KVPAGE_I8_GEMM == 1; }

// Q4 (qs uint8 [N, K / 2] in GGUF's nibble order, m given), Q8 (qs int8 [N, K], no m) or U8 (qs uint8 [N, K], one
// code per weight, m given) blocks as panels; d and m float16 or float32 [N, K / 32].
std::tuple<torch::Tensor, torch::Tensor> i8_pack_weight(const torch::Tensor& qs_in, const torch::Tensor& d_in,
                                                        const c10::optional<torch::Tensor>& m_in, bool gated) {
  const bool q8 = !m_in.has_value();
  TORCH_CHECK(d_in.dim() == 2 && (d_in.scalar_type() == at::kHalf || d_in.scalar_type() == at::kFloat),
              "d must be float16 or float32 [N, K / 32]");
  const int64_t N = d_in.size(0), nb = d_in.size(1), K = nb * kQK;
  const bool u8 = !q8 && qs_in.dim() == 2 && qs_in.size(1) == K;  // one code per weight
  TORCH_CHECK(qs_in.dim() == 2 && qs_in.size(0) == N && qs_in.size(1) == (q8 || u8 ? K : K / 2),
              q8 ? "Q8 qs must be int8 [N, K]" : "Q4 qs must be uint8 [N, K / 2] (or [N, K], one code per weight)");
  TORCH_CHECK(qs_in.scalar_type() == (q8 ? at::kChar : at::kByte), "qs has the wrong dtype for its kind");
  if (!q8) TORCH_CHECK(m_in->sizes() == d_in.sizes(), "m must be shaped like d");
  TORCH_CHECK(!gated || N % (2 * kNR) == 0, "a gated weight needs a multiple of 32 rows");
  const auto qs = qs_in.contiguous();
  const auto d = d_in.to(at::kFloat).contiguous();
  const auto m = q8 ? torch::Tensor() : m_in->to(at::kFloat).contiguous();
  const int64_t P = (N + kNR - 1) / kNR, F = N / 2;
  auto codes = at::zeros({P, nb, kPanelBlock}, qs.options().dtype(at::kByte));
  auto scales = at::zeros({P, nb, 2 * kNR}, d.options());
  const uint8_t* src = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = q8 ? nullptr : m.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t c = 0; c < kNR; ++c) {
        // the weight row (output column) that lands in column c of panel p
        const int64_t n = gated ? (p % 2 == 0 ? 0 : F) + (p / 2) * kNR + c : p * kNR + c;
        if (n >= N) continue;
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* dst = cp + (p * nb + b) * kPanelBlock + c * 4;
          for (int64_t j = 0; j < kQK; ++j) {
            uint8_t code;
            if (q8) {
              code = static_cast<uint8_t>(static_cast<int8_t>(src[n * K + b * kQK + j]) + 128);
            } else if (u8) {
              code = src[n * K + b * kQK + j];
            } else {
              const uint8_t byte = src[n * (K / 2) + b * 16 + (j % 16)];
              code = j < 16 ? (byte & 0x0F) : (byte >> 4);
            }
            dst[(j / 4) * 64 + (j % 4)] = code;
          }
          float* s = sp + (p * nb + b) * 2 * kNR;
          const float dw = dp[n * nb + b];
          s[c] = dw;
          s[kNR + c] = q8 ? -128.f * dw : mp[n * nb + b];
        }
      }
    }
  });
  return {codes, scales};
}

#if KVPAGE_I8_GEMM
// Rows' activations as two int8 codes per value, per 32-block: x ~= (256 hi + lo) dx / 256 with hi = round(x / dx),
// dx = absmax / 127, and lo the rounded remainder in 256ths of dx, so the integer 256 hi + lo carries ~16 bits
// (one byte alone, llama.cpp's Q8 activations, gave SmolLM2 96.3% teacher-forced top-1 agreement with float32;
// bf16 gives 99%+). Per row: blocks of 64 bytes, [hi x 32 | lo x 32]; X1 = dx / 256, X2 = X1 sum(256 hi + lo).
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* x1, float* x2) {
  const int64_t nb = K / kQK;
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const T* src = x + r * K + b * kQK;
        __m512 v[2];
        if constexpr (std::is_same_v<T, float>) {
          v[0] = _mm512_loadu_ps(src);
          v[1] = _mm512_loadu_ps(src + 16);
        } else {
          for (int h = 0; h < 2; ++h)
            v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * h))), 16));
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float inv = amax > 0.f ? 127.f / amax : 0.f, dx = amax / 127.f;
        const __m512 vi = _mm512_set1_ps(inv), k256 = _mm512_set1_ps(256.f);
        int8_t* dst = xq + (r * nb + b) * 2 * kQK;
        __m512i total = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
          const __m512 t = _mm512_mul_ps(v[h], vi);
          const __m512i hi = _mm512_cvtps_epi32(t);
          const __m512 rest = _mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(hi)), k256);  // in [-128, 128]
          const __m512i lo = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(rest), _mm512_set1_epi32(127)),
                                              _mm512_set1_epi32(-128));
          total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * h), _mm512_cvtepi32_epi8(hi));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + kQK + 16 * h), _mm512_cvtepi32_epi8(lo));
        }
        x1[r * nb + b] = dx / 256.f;
        x2[r * nb + b] = dx / 256.f * static_cast<float>(_mm512_reduce_add_epi32(total));
      }
    }
  });
}

using kvpage::store16;

// Sixteen lanes to p around the cache (non-temporal): float32 a whole aligned line, bf16 (rounded as store16)
// half of one, whose other half the next call writes.
inline void stream16(float* p, __m512 v) { _mm512_stream_ps(p, v); }
inline void stream16(at::BFloat16* p, __m512 v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), kvpage::bf16_bits16(v));
}

// R rows (x codes at xq, row stride 2K) times NP consecutive panels (codes at w, scales at s; panels nb blocks
// apart) over the whole K. Every block's int32 sums are scaled into float32 accumulators, then reset.
// Output: plain (NP panels -> columns n0.., `cols` real ones) or gated (panel 0 = gate, 1 = up: 16 columns).
template <int R, int NP, bool GATED, typename OUT>
void tile(const int8_t* xq, const float* x1, const float* x2, int64_t K, const uint8_t* w, const float* s,
          OUT* out, int64_t ldo, int64_t cols, const float* bias, bool stream) {
  static_assert(!GATED || NP == 2, "the gated epilogue pairs two panels");
  const int64_t nb = K / kQK;
  __m512 f[R][NP];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) f[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[R][NP];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_si512();
    const uint8_t* wb = w + b * kPanelBlock;
    const int8_t* xb = xq + b * 2 * kQK;
    // the high bytes, then x256, then the low bytes: one int32 sum of u . (256 hi + lo) per lane (< 2^28)
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      if (half == 1) {
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
          for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_slli_epi32(acc[i][j], 8);
      }
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        __m512i wv[NP];
#pragma GCC unroll 2
        for (int j = 0; j < NP; ++j) wv[j] = _mm512_load_si512(wb + j * nb * kPanelBlock + q * 64);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
          const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + i * 2 * K + half * kQK + q * 4));
#pragma GCC unroll 2
          for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], wv[j], xv);
        }
      }
    }
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      const float* sb = s + (j * nb + b) * 2 * kNR;
      const __m512 dw = _mm512_load_ps(sb), mw = _mm512_load_ps(sb + kNR);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][j]), dw);
        f[i][j] = _mm512_fmadd_ps(t, _mm512_set1_ps(x1[i * nb + b]), f[i][j]);
        f[i][j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x2[i * nb + b]), f[i][j]);
      }
    }
  }
  if constexpr (GATED) {
    for (int i = 0; i < R; ++i) store16(out + i * ldo, kvpage::silu_mul16(f[i][0], f[i][1], 0xFFFF), 0xFFFF);
  } else if (stream && cols == NP * kNR) {  // whole panels: each row's lines in turn, around the cache
    __m512 bv[NP];
    for (int j = 0; j < NP; ++j) bv[j] = bias != nullptr ? _mm512_loadu_ps(bias + j * kNR) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NP; ++j) stream16(out + i * ldo + j * kNR, _mm512_add_ps(f[i][j], bv[j]));
  } else {
    for (int j = 0; j < NP; ++j) {
      const int64_t left = cols - j * kNR;
      if (left <= 0) break;
      const __mmask16 k = kvpage::tail_mask(left);
      const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(k, bias + j * kNR) : _mm512_setzero_ps();
      for (int i = 0; i < R; ++i) store16(out + i * ldo + j * kNR, _mm512_add_ps(f[i][j], bv), k);
    }
  }
}

template <int NP, bool GATED, typename OUT>
void rows_times_panels(int64_t rows, const int8_t* xq, const float* x1, const float* x2, int64_t K,
                       const uint8_t* w, const float* s, OUT* out, int64_t ldo, int64_t cols, const float* bias,
                       bool stream) {
  const int64_t nb = K / kQK;
  int64_t r = 0;
#define KVPAGE_I8_TILE(R_) \
  tile<R_, NP, GATED, OUT>(xq + r * 2 * K, x1 + r * nb, x2 + r * nb, K, w, s, out + r * ldo, ldo, cols, bias, stream)
  for (; r + kMR <= rows; r += kMR) KVPAGE_I8_TILE(kMR);
  switch (rows - r) {
    case 1: KVPAGE_I8_TILE(1); break;
    case 2: KVPAGE_I8_TILE(2); break;
    case 3: KVPAGE_I8_TILE(3); break;
    case 4: KVPAGE_I8_TILE(4); break;
    case 5: KVPAGE_I8_TILE(5); break;
    default: break;
  }
#undef KVPAGE_I8_TILE
}

template <bool GATED, typename OUT>
void run(const int8_t* xq, const float* x1, const float* x2, int64_t M, int64_t K, const uint8_t* codes,
         const float* scales, int64_t N, int64_t P, OUT* out, const float* bias, bool stream_in) {
  const int64_t nb = K / kQK;
  const int64_t pairs = (P + 1) / 2;        // tiles of two panels (the last may have one)
  const int64_t ldo = GATED ? N / 2 : N;
  // streamed lines need every row's panels on 64-byte lines: N % 16 == 0 and an aligned start
  const bool stream = stream_in && !GATED && N % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0;
  kvpage::for_row_chunks_and_tiles(M, 2 * K, kMR, pairs, [&](int64_t m0, int64_t rows, int64_t pr) {
    const int64_t p = 2 * pr;
    const uint8_t* w = codes + p * nb * kPanelBlock;
    const float* s = scales + p * nb * 2 * kNR;
    const int8_t* xr = xq + m0 * 2 * K;
    const float* a1 = x1 + m0 * nb;
    const float* a2 = x2 + m0 * nb;
    if constexpr (GATED) {
      rows_times_panels<2, true, OUT>(rows, xr, a1, a2, K, w, s, out + m0 * ldo + pr * kNR, ldo, kNR, nullptr,
                                      false);
    } else {
      const int64_t n0 = p * kNR, cols = std::min<int64_t>(2 * kNR, N - n0);
      const float* bp = bias != nullptr ? bias + n0 : nullptr;
      if (p + 1 < P)
        rows_times_panels<2, false, OUT>(rows, xr, a1, a2, K, w, s, out + m0 * ldo + n0, ldo, cols, bp, stream);
      else
        rows_times_panels<1, false, OUT>(rows, xr, a1, a2, K, w, s, out + m0 * ldo + n0, ldo, cols, bp, stream);
    }
    if (stream) _mm_sfence();  // this task's streamed lines visible before the call returns
  });
}
#endif

torch::Tensor i8_linear(torch::Tensor x, const torch::Tensor& codes, const torch::Tensor& scales, int64_t N, bool gated,
                         const c10::optional<torch::Tensor>& bias_in, bool stream) {
  TORCH_CHECK(i8_gemm_available(), "i8_linear needs an AVX-512 VNNI build");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be bf16 or float32 [tokens, in_features]");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kPanelBlock && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous() && scales.dim() == 3 && scales.size(2) == 2 * kNR &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1),
              "codes and scales must come from i8_pack_weight");
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0), nb = codes.size(1);
  TORCH_CHECK(K == nb * kQK, "x has ", K, " features, the packed weight ", nb * kQK);
  TORCH_CHECK(N > (P - 1) * kNR && N <= P * kNR, "N = ", N, " does not match ", P, " panels");
  TORCH_CHECK(!gated || (N % (2 * kNR) == 0 && !bias_in.has_value()), "gated needs N % 32 == 0 and no bias");
  torch::Tensor bias;
  const float* bp = kvpage::float_bias(bias_in, N, bias);
  x = x.contiguous();
  auto out = at::empty({M, gated ? N / 2 : N}, x.options());
  if (M == 0 || N == 0) return out;
#if KVPAGE_I8_GEMM
  auto xq = at::empty({M, 2 * K}, x.options().dtype(at::kChar));
  auto xs = at::empty({2, M, nb}, x.options().dtype(at::kFloat));
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* x1 = xs.data_ptr<float>();
  float* x2 = x1 + M * nb;
  if (x.scalar_type() == at::kFloat)
    quantize_rows<float>(x.data_ptr<float>(), M, K, xqp, x1, x2);
  else
    quantize_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), M, K, xqp, x1, x2);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
#define KVPAGE_I8_RUN(G_, T_) run<G_, T_>(xqp, x1, x2, M, K, cp, sp, N, P, out.data_ptr<T_>(), bp, stream)
  if (x.scalar_type() == at::kFloat) {
    if (gated) KVPAGE_I8_RUN(true, float);
    else KVPAGE_I8_RUN(false, float);
  } else {
    if (gated) KVPAGE_I8_RUN(true, at::BFloat16);
    else KVPAGE_I8_RUN(false, at::BFloat16);
  }
#undef KVPAGE_I8_RUN
#endif
  return out;
}

}  // namespace kvpage::gemm_i8
