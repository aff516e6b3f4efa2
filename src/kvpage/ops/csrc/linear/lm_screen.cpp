// The greedy argmax of a float32 lm head without its whole float32 product (AVX2 builds; model/lm_screen.py).
//
//   lm_screen_prepare(w [N, K] float32) -> codes int8 [N, Kp], scale, code_sum, err_norm, w_norm
//   lm_screen_argmax(hidden [M, K], w, prepared..., outliers [k], w_out [k, N]) -> argmax [M], candidates [M]
//
// Each vocabulary row is kept as int8 codes times a per-row scale (W_n = s_n q_n + e_n). A hidden row h is
// split into its outlier channels O (a fixed set of the model's few large channels, multiplied exactly in float32
// from w_out) and the rest, rounded to 7-bit codes c with step t (h_rest = t c + d). Byte products (vpmaddubsw:
// the codes offset to 1..127 times the weight codes, pairs at most 2 x 127 x 127, clear of the 16-bit
// saturation) give c . q_n exactly in int32, and
//   approx_n = h_O . W_n,O + t s_n (c . q_n)
//   |f_n - approx_n| <= t |c| |e_n| + |d| |W_n| + g |h| |W_n|   (Cauchy-Schwarz; g ~ (K + O) 2^-24 covers the
//                                                                  float32 rounding of f_n and approx_n)
// where f_n is the float32 product the panel GEMM (gemm_f32.cpp) would give: one FMA chain in k order. Every n
// whose upper bound reaches the largest lower bound is a candidate; the true maximum is among them. Their
// float32 products in any order (eight lanes) narrow them to those within the two orders' rounding of the best,
// whose f_n are computed exactly as that GEMM computes them, so the argmax (first index on ties) is the same bits
// as the whole product's. SmolLM2's rows have ~60-360 candidates of 49,152, a few of them near enough to the
// best to take the exact chain (docs/model.md).
#include "tensor.h"

#include <ATen/Parallel.h>

#include "common.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvpage::gemm {

#if KVPAGE_ISA_AVX2_ONLY
// gemm_f32.cpp: rows of x times one 16-column panel of a packed weight
void rows_times_panel(int64_t rows, const float* a, int64_t lda, const float* b, int64_t K, float* c, int64_t ldc,
                      int64_t cols, const float* bias);
#endif

namespace {

constexpr int64_t kPanel = 16;      // f32_pack_weight's panel width
constexpr int64_t kCodeMax = 63;    // hidden codes -63..63, offset by 64 into 1..127
// weight codes -127..127. Codes of 7 bits (-63..63), whose two pair sums fit 16 bits and could be added before
// one widening multiply-add, had twice the rounding: 4x-13x the candidates, each a float32 row read from memory,
// and the head's time at 1.0-1.6x this one's (docs/model.md)
constexpr float kWeightMax = 127.f;
constexpr int64_t kNB = 96;          // vocabulary rows per block (their codes stay in L2 while every row reads them)
// float32's own rounding, relative to |h| |W_n|: a k-order FMA chain over K terms is within gamma_K = K u / (1 - K u)
// of the real product (u = 2^-24), and the screen's outlier part within gamma_O; 10% and a few u more cover the
// rest (the scaling products, the final additions, the bound's own arithmetic)
double round_slack(int64_t K, int64_t O) { return 1.1 * static_cast<double>(K + O + 8) * 0x1p-24; }

int64_t padded(int64_t K) { return (K + 63) / 64 * 64; }

#if KVPAGE_ISA_AVX2_ONLY
// One row's float32 product as the panel GEMM computes it (gemm_f32.cpp: each output one FMA chain in k
// order from zero), eight rows at a time so that the chains overlap.
void exact_products(const float* h, const float* w, int64_t K, const int64_t* idx, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const float* r[8];
    for (int j = 0; j < 8; ++j) r[j] = w + idx[i + j] * K;
    __m128 s0 = _mm_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int64_t k = 0; k < K; ++k) {
      const __m128 a = _mm_set_ss(h[k]);
      s0 = _mm_fmadd_ss(a, _mm_set_ss(r[0][k]), s0);
      s1 = _mm_fmadd_ss(a, _mm_set_ss(r[1][k]), s1);
      s2 = _mm_fmadd_ss(a, _mm_set_ss(r[2][k]), s2);
      s3 = _mm_fmadd_ss(a, _mm_set_ss(r[3][k]), s3);
      s4 = _mm_fmadd_ss(a, _mm_set_ss(r[4][k]), s4);
      s5 = _mm_fmadd_ss(a, _mm_set_ss(r[5][k]), s5);
      s6 = _mm_fmadd_ss(a, _mm_set_ss(r[6][k]), s6);
      s7 = _mm_fmadd_ss(a, _mm_set_ss(r[7][k]), s7);
    }
    out[i] = _mm_cvtss_f32(s0), out[i + 1] = _mm_cvtss_f32(s1), out[i + 2] = _mm_cvtss_f32(s2);
    out[i + 3] = _mm_cvtss_f32(s3), out[i + 4] = _mm_cvtss_f32(s4), out[i + 5] = _mm_cvtss_f32(s5);
    out[i + 6] = _mm_cvtss_f32(s6), out[i + 7] = _mm_cvtss_f32(s7);
  }
  for (; i < n; ++i) {
    const float* r = w + idx[i] * K;
    __m128 s = _mm_setzero_ps();
    for (int64_t k = 0; k < K; ++k) s = _mm_fmadd_ss(_mm_set_ss(h[k]), _mm_set_ss(r[k]), s);
    out[i] = _mm_cvtss_f32(s);
  }
}

// A row's float32 products with the rows idx[0..n) in any order (four 8-lane chains over k, then a tree):
// within gamma_K |h| |W_n| of the real product, as the exact chain is, so the two differ by at most twice that.
void fast_products(const float* h, const float* w, int64_t K, const int64_t* idx, int64_t n, float* out) {
  constexpr int64_t kAhead = 4;  // rows fetched ahead: the candidates lie far apart in the head, each a DRAM trip
  const auto fetch = [&](int64_t i) {
    const char* r = reinterpret_cast<const char*>(w + idx[i] * K);
    for (int64_t b = 0; b < K * 4; b += 64) _mm_prefetch(r + b, _MM_HINT_T0);
  };
  for (int64_t i = 0; i < std::min(n, kAhead); ++i) fetch(i);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) fetch(i + kAhead);
    const float* r = w + idx[i] * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(h + k), _mm256_loadu_ps(r + k), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(h + k + 8), _mm256_loadu_ps(r + k + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(h + k + 16), _mm256_loadu_ps(r + k + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(h + k + 24), _mm256_loadu_ps(r + k + 24), a3);
    }
    float s = kvpage::hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; ++k) s = std::fma(h[k], r[k], s);
    out[i] = s;
  }
}

// Integer dot products of MT hidden code rows (u, Kp apart) with NT weight code rows (q, Kp apart):
// out[mt * ldo + nt] = sum_k u[k] q[k] (u offset by 64: the caller takes 64 x the code sums off). Each byte
// product's pair sums (at most 2 x 127 x 127) widened by one multiply-add against ones.
template <int MT, int NT>
inline void dot_tile(const uint8_t* u, const int8_t* q, int64_t Kp, int32_t* out, int64_t ldo) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MT][NT];
  for (int mt = 0; mt < MT; ++mt)
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt] = _mm256_setzero_si256();
  const auto ld = [](const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  for (int64_t k = 0; k < Kp; k += 64) {
    __m256i u0[MT], u1[MT];  // held in registers for all NT weight rows (MT x NT <= 8 accumulators)
    for (int mt = 0; mt < MT; ++mt) u0[mt] = ld(u + mt * Kp + k), u1[mt] = ld(u + mt * Kp + k + 32);
    for (int nt = 0; nt < NT; ++nt)
      for (int mt = 0; mt < MT; ++mt) {
        const __m256i p0 = _mm256_maddubs_epi16(u0[mt], ld(q + nt * Kp + k));
        const __m256i p1 = _mm256_maddubs_epi16(u1[mt], ld(q + nt * Kp + k + 32));
        acc[mt][nt] = _mm256_add_epi32(acc[mt][nt], _mm256_add_epi32(_mm256_madd_epi16(p0, ones),
                                                                     _mm256_madd_epi16(p1, ones)));
      }
  }
  for (int mt = 0; mt < MT; ++mt) {
    const __m256i z = _mm256_setzero_si256();
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[mt][0], NT > 1 ? acc[mt][NT > 1 ? 1 : 0] : z),
                                        _mm256_hadd_epi32(NT > 2 ? acc[mt][NT > 2 ? 2 : 0] : z,
                                                          NT > 3 ? acc[mt][NT > 3 ? 3 : 0] : z));
    alignas(16) int32_t t[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
    for (int nt = 0; nt < NT; ++nt) out[mt * ldo + nt] = t[nt];
  }
}

template <int MT>
void dot_rows(const uint8_t* u, const int8_t* q, int64_t Kp, int64_t n, int32_t* out, int64_t ldo) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) dot_tile<MT, 4>(u, q + j * Kp, Kp, out + j, ldo);
  if (n - j == 3) dot_tile<MT, 3>(u, q + j * Kp, Kp, out + j, ldo);
  if (n - j == 2) dot_tile<MT, 2>(u, q + j * Kp, Kp, out + j, ldo);
  if (n - j == 1) dot_tile<MT, 1>(u, q + j * Kp, Kp, out + j, ldo);
}

#endif

// A hidden row's codes and the two factors of its bound: bound_n = a |e_n| + b |W_n|; hn = |h|.
struct RowCodes {
  float t, a, b;
  double hn;
};

RowCodes row_codes(const float* h, int64_t K, int64_t Kp, const uint8_t* is_out, double slack, uint8_t* u) {
  float top = 0.f;
  for (int64_t i = 0; i < K; ++i)
    if (!is_out[i]) top = std::max(top, std::fabs(h[i]));
  const float t = top / static_cast<float>(kCodeMax);
  const float inv = t > 0.f ? 1.f / t : 0.f;
  double cn = 0., dn = 0., hn = 0.;
  for (int64_t i = 0; i < K; ++i) {
    hn += static_cast<double>(h[i]) * h[i];
    if (is_out[i]) {
      u[i] = 64;
      continue;
    }
    const float c = std::clamp(std::nearbyint(h[i] * inv), -static_cast<float>(kCodeMax), static_cast<float>(kCodeMax));
    u[i] = static_cast<uint8_t>(static_cast<int>(c) + 64);
    const double d = static_cast<double>(h[i]) - static_cast<double>(t) * c;
    cn += static_cast<double>(c) * c;
    dn += d * d;
  }
  for (int64_t i = K; i < Kp; ++i) u[i] = 64;  // padding: weight codes 0 there
  const double up = 1.0 + 1e-6;  // float32 rounding of the factors, upwards
  return {t, static_cast<float>(t * std::sqrt(cn) * up),
          static_cast<float>((std::sqrt(dn) + slack * std::sqrt(hn)) * up), std::sqrt(hn)};
}

}  // namespace

std::vector<torch::Tensor> lm_screen_prepare(const torch::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat, "weight must be float32 [vocab, hidden]");
  const torch::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Kp = padded(K);
  auto codes = at::zeros({N, Kp}, w.options().dtype(at::kChar));
  auto scale = at::empty({N}, w.options()), err = at::empty({N}, w.options()), norm = at::empty({N}, w.options());
  auto sums = at::empty({N}, w.options().dtype(at::kInt));
  const float* wp = w.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float *sp = scale.data_ptr<float>(), *ep = err.data_ptr<float>(), *np = norm.data_ptr<float>();
  int32_t* tp = sums.data_ptr<int32_t>();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* r = wp + n * K;
      float top = 0.f;
      for (int64_t i = 0; i < K; ++i) top = std::max(top, std::fabs(r[i]));
      const float s = top / kWeightMax, inv = top > 0.f ? kWeightMax / top : 0.f;
      double e2 = 0., w2 = 0.;
      int32_t total = 0;
      for (int64_t i = 0; i < K; ++i) {
        const float c = std::clamp(std::nearbyint(r[i] * inv), -kWeightMax, kWeightMax);
        cp[n * Kp + i] = static_cast<int8_t>(c);
        total += static_cast<int32_t>(c);
        const double e = static_cast<double>(r[i]) - static_cast<double>(s) * c;
        e2 += e * e;
        w2 += static_cast<double>(r[i]) * r[i];
      }
      sp[n] = s;
      tp[n] = total;
      ep[n] = static_cast<float>(std::sqrt(e2) * (1.0 + 1e-6));
      np[n] = static_cast<float>(std::sqrt(w2) * (1.0 + 1e-6));
    }
  });
  return {codes, scale, sums, err, norm};
}

std::vector<torch::Tensor> lm_screen_argmax(torch::Tensor hidden, const torch::Tensor& weight,
                                            const torch::Tensor& codes, const torch::Tensor& scale,
                                            const torch::Tensor& code_sum, const torch::Tensor& err_norm,
                                            const torch::Tensor& w_norm, const torch::Tensor& outliers,
                                            const torch::Tensor& w_out) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "hidden must be float32 [rows, hidden]");
  hidden = hidden.contiguous();
  const int64_t M = hidden.size(0), K = hidden.size(1), Kp = padded(K);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.size(1) == K,
              "weight must be the float32 [vocab, hidden] head, contiguous");
  const int64_t N = weight.size(0);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(0) == N && codes.size(1) == Kp,
              "codes must come from lm_screen_prepare of this weight");
  for (const auto* v : {&scale, &err_norm, &w_norm})
    TORCH_CHECK(v->scalar_type() == at::kFloat && v->numel() == N && v->is_contiguous(), "per-row factors: float32 [N]");
  TORCH_CHECK(code_sum.scalar_type() == at::kInt && code_sum.numel() == N, "code_sum must be int32 [N]");
  const int64_t O = outliers.numel();
  TORCH_CHECK(O > 0 && outliers.scalar_type() == at::kLong && w_out.scalar_type() == at::kFloat &&
                  w_out.is_contiguous() && w_out.dim() == 3 && w_out.size(0) == (N + kPanel - 1) / kPanel &&
                  w_out.size(1) == O && w_out.size(2) == kPanel,
              "w_out must be f32_pack_weight of the head's outlier columns [vocab, outliers]");
  auto argmax = at::empty({M}, hidden.options().dtype(at::kLong));
  auto cands = at::empty({M}, hidden.options().dtype(at::kLong));
  if (M == 0) return {argmax, cands};
#if KVPAGE_ISA_AVX2_ONLY
  const float* hp = hidden.data_ptr<float>();
  const int64_t* op = outliers.data_ptr<int64_t>();
  std::vector<uint8_t> is_out(K, 0);
  for (int64_t j = 0; j < O; ++j) {
    TORCH_CHECK(op[j] >= 0 && op[j] < K, "outlier channel ", op[j], " is outside 0..", K - 1);
    is_out[op[j]] = 1;
  }
  const double slack = round_slack(K, O);
  std::vector<uint8_t> u(M * Kp);
  std::vector<RowCodes> rc(M);
  std::vector<float> hout(M * O);  // each row's outlier channels
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      rc[m] = row_codes(hp + m * K, K, Kp, is_out.data(), slack, u.data() + m * Kp);
      for (int64_t j = 0; j < O; ++j) hout[m * O + j] = hp[m * K + op[j]];
    }
  });
  // pass 1, block by block of the vocabulary: every row's approximate products and bounds; a row's running
  // floor (the largest lower bound its thread has seen) rises as blocks pass, and only the tokens whose upper
  // bound reaches it are kept (index and upper bound, per thread and row), instead of a [rows, vocab] buffer of
  // every upper bound (25 MB at 128 rows of SmolLM2's head, 134 MB of Gemma 3's 262k-row one)
  struct Kept {
    int32_t n;
    float ub;
  };
  const int threads = at::get_num_threads();
  std::vector<float> lmax(static_cast<size_t>(threads) * M, -std::numeric_limits<float>::infinity());
  std::vector<std::vector<Kept>> kept(static_cast<size_t>(threads) * M);
  const int8_t* qp = codes.data_ptr<int8_t>();
  const float *sp = scale.data_ptr<float>(), *ep = err_norm.data_ptr<float>(), *np = w_norm.data_ptr<float>();
  const float* wo = w_out.data_ptr<float>();  // [panels, O, 16]
  const int32_t* qs = code_sum.data_ptr<int32_t>();
  const int64_t blocks = (N + kNB - 1) / kNB;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> dots(M * kNB);
    std::vector<float> outs(M * kNB);  // the outlier channels' products, float32
    alignas(32) float ubl[kNB];         // one row's upper bounds in this block
    const size_t th = static_cast<size_t>(at::get_thread_num());
    float* lm = lmax.data() + th * M;
    std::vector<Kept>* keep = kept.data() + th * M;
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kNB, nb = std::min(kNB, N - n0);
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) dot_rows<2>(u.data() + m * Kp, qp + n0 * Kp, Kp, nb, dots.data() + m * kNB, kNB);
      for (; m < M; ++m) dot_rows<1>(u.data() + m * Kp, qp + n0 * Kp, Kp, nb, dots.data() + m * kNB, kNB);
      for (int64_t p = 0; p * kPanel < nb; ++p)
        rows_times_panel(M, hout.data(), O, wo + (n0 / kPanel + p) * O * kPanel, O, outs.data() + p * kPanel, kNB,
                         std::min(kPanel, nb - p * kPanel), nullptr);
      for (m = 0; m < M; ++m) {
        const float* xo = outs.data() + m * kNB;
        const int32_t* d = dots.data() + m * kNB;
        const __m256 vt = _mm256_set1_ps(rc[m].t), va = _mm256_set1_ps(rc[m].a), vb = _mm256_set1_ps(rc[m].b);
        const __m256 grow = _mm256_set1_ps(1.f + 1e-5f), rel = _mm256_set1_ps(1e-6f);
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 lo = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        int64_t i = 0;
        for (; i + 8 <= nb; i += 8) {
          const int64_t n = n0 + i;
          __m256 x = _mm256_loadu_ps(xo + i);
          const __m256i cq = _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + i)),
                                              _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + n)), 6));
          x = _mm256_fmadd_ps(_mm256_mul_ps(vt, _mm256_loadu_ps(sp + n)), _mm256_cvtepi32_ps(cq), x);
          __m256 bd = _mm256_fmadd_ps(va, _mm256_loadu_ps(ep + n), _mm256_mul_ps(vb, _mm256_loadu_ps(np + n)));
          bd = _mm256_fmadd_ps(rel, _mm256_andnot_ps(sign, x), _mm256_mul_ps(bd, grow));
          _mm256_store_ps(ubl + i, _mm256_add_ps(x, bd));
          lo = _mm256_max_ps(lo, _mm256_sub_ps(x, bd));
        }
        float l = kvpage::hmax8(lo);
        for (; i < nb; ++i) {
          const int64_t n = n0 + i;
          float x = xo[i];
          x += rc[m].t * sp[n] * static_cast<float>(d[i] - 64 * qs[n]);
          const float bd = (rc[m].a * ep[n] + rc[m].b * np[n]) * (1.f + 1e-5f) + 1e-6f * std::fabs(x);
          ubl[i] = x + bd;
          l = std::max(l, x - bd);
        }
        const float floor_ = std::max(lm[m], l);
        lm[m] = floor_;
        const __m256 vf = _mm256_set1_ps(floor_);
        for (i = 0; i + 8 <= nb; i += 8) {
          const __m256 reach = _mm256_cmp_ps(_mm256_load_ps(ubl + i), vf, _CMP_GE_OQ);
          unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(reach));
          for (; bits; bits &= bits - 1) {
            const int64_t j = i + __builtin_ctz(bits);
            keep[m].push_back({static_cast<int32_t>(n0 + j), ubl[j]});
          }
        }
        for (; i < nb; ++i)
          if (ubl[i] >= floor_) keep[m].push_back({static_cast<int32_t>(n0 + i), ubl[i]});
      }
    }
  });
  // pass 2: each row's candidates (upper bound >= the largest lower bound of all blocks), in token order,
  // multiplied exactly, the first largest kept
  const float* wp = weight.data_ptr<float>();
  int64_t* ap = argmax.data_ptr<int64_t>();
  int64_t* cp = cands.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    std::vector<int64_t> idx;
    std::vector<float> val;
    for (int64_t m = m0; m < m1; ++m) {
      float floor_ = -std::numeric_limits<float>::infinity();
      for (int th = 0; th < threads; ++th) floor_ = std::max(floor_, lmax[static_cast<size_t>(th) * M + m]);
      idx.clear();
      for (int th = 0; th < threads; ++th)
        for (const Kept& k : kept[static_cast<size_t>(th) * M + m])
          if (k.ub >= floor_) idx.push_back(k.n);
      std::sort(idx.begin(), idx.end());
      const auto screened = static_cast<int64_t>(idx.size());
      // the candidates' float32 products in any order first; only those that can still be the largest within
      // the two orders' rounding (twice gamma_K |h| |W_n|) take the panel GEMM's exact chain
      val.resize(idx.size());
      fast_products(hp + m * K, wp, K, idx.data(), static_cast<int64_t>(idx.size()), val.data());
      const float tol = static_cast<float>(2.0 * slack * rc[m].hn * (1.0 + 1e-6));
      float top = -std::numeric_limits<float>::infinity();
      for (size_t c = 0; c < idx.size(); ++c) top = std::max(top, val[c] - tol * np[idx[c]]);
      size_t keep = 0;
      for (size_t c = 0; c < idx.size(); ++c)
        if (val[c] + tol * np[idx[c]] >= top) idx[keep++] = idx[c];
      idx.resize(keep);
      val.resize(keep);
      exact_products(hp + m * K, wp, K, idx.data(), static_cast<int64_t>(keep), val.data());
      int64_t best = idx.empty() ? 0 : idx[0];
      float bv = val.empty() ? 0.f : val[0];
      for (size_t c = 1; c < idx.size(); ++c)
        if (val[c] > bv) bv = val[c], best = idx[c];
      ap[m] = best;
      cp[m] = screened;
    }
  });
#else
  TORCH_CHECK(false, "lm_screen_argmax needs an AVX2 + FMA build without AVX-512 (as f32_linear)");
#endif
  return {argmax, cands};
}

}  // namespace kvpage::gemm
