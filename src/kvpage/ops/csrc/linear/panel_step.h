// One k step of a float32 panel product (AVX2): for token row i (a literal), acc l_i += x[i][k] * wlo and
// h_i += x[i][k] * whi, one FMA each, rows [0, R) only. gemm_f32.cpp's tile and quant_panels.cpp's rows both
// take their steps from here, over k in order from zero, so a row's outputs are the same bits whichever of
// the two computes them: the many-token and the few-token steps of a float32 model.
#pragma once

#define KVPAGE_PANEL_ROW(R, i, x, ld, k, wlo, whi)              \
  if constexpr ((R) > (i)) {                                    \
    const __m256 av = _mm256_broadcast_ss((x) + (i) * (ld) + (k)); \
    l##i = _mm256_fmadd_ps(av, (wlo), l##i);                    \
    h##i = _mm256_fmadd_ps(av, (whi), h##i);                    \
  }
