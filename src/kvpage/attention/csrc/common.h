// Small helpers shared by kvpage's CPU kernels.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvpage {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) for x <= 0 (softmax weights), vectorizable: 2^(x log2 e) = 2^n * 2^f with a degree-6 polynomial
// for 2^f on [-0.5, 0.5] (relative error ~2e-7, close to libm's expf).
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;  // t <= 0
  const int32_t ni = -static_cast<int32_t>(0.5f - t);  // round(t) with conversions only (vectorizes)
  const float n = static_cast<float>(ni);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += ni << 23;
  float r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

}  // namespace kvpage
