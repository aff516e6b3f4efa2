// Key rows rounded with feedback (attention/kv_quant.py quantize_rows with `feedback`, the oracle; keys_feedback
// makes the matrices): a row's channels, in the keys' rotated basis, are rounded in order, and channel i's
// rounding error r moves every later channel j by -r * fb[i][j] before it is rounded. fb comes from the layer's
// queries, so the error a score sees, q . e, is smaller on average than with each channel rounded alone; the
// codes and the scale are stored as any row's, so every reader takes them as they are.
//
// The rounding of channel i waits for channels 0..i-1, so a row is a chain of D steps; the lanes version runs
// kW rows of one KV head side by side instead (lane r = row r, the rows transposed into channel vectors), so a
// step is one vector division, rounding and value, and each update of a later channel one product and one
// difference for all kW rows. Every operation is the oracle's, in its order, so the bytes equal it: the product
// and the difference are two roundings there, so each product passes through an empty asm that the compiler
// cannot see into and so cannot fuse with the difference (an optimize("fp-contract=off") attribute did the same
// but kept the lanes' inline helpers from being inlined: 5x slower).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

#include "attention/quant_codes.h"
#include "attention/quant_rows.h"

namespace kvpage::attn {

// Each one-byte code's value (decode1), for the lanes' lookups.
template <KVCode C>
inline const float* code_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[static_cast<size_t>(b)] = decode1<C>(static_cast<uint8_t>(b));
    return t;
  }();
  return table.data();
}

// a * b, rounded, never fused with what follows (see above)
inline float product(float a, float b) {
  float p = a * b;
  asm("" : "+x"(p));
  return p;
}

// One key row: D values of src (rotated here) -> D codes and the scale at row; buf holds D floats.
template <KVCode C, typename IN>
inline void quantize_key_feedback(const IN* src, uint8_t* row, int64_t D, float* buf, const float* fb) {
  for (int64_t d = 0; d < D; ++d) buf[d] = to_float(src[d]);
  fwht(buf, D);
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(buf[d]));
  const uint16_t bits = scale_bits<C>(amax);
  const float s = scale_value(bits);
  for (int64_t i = 0; i < D; ++i) {
    const float w = buf[i];
    const uint8_t c = encode1<C>(s > 0.f ? w / s : 0.f);
    row[i] = c;
    const float r = w - product(decode1<C>(c), s);
    const float* f = fb + i * D;
    for (int64_t j = i + 1; j < D; ++j) buf[j] = buf[j] - product(r, f[j]);
  }
  std::memcpy(row + D, &bits, sizeof(bits));
}

#if KVPAGE_ISA_AVX2
constexpr int kFeedbackGroups = 4;  // groups of kW rows whose chains of D steps interleave

// NG groups of kW rows (rows src[0..n), n <= NG * kW) of one KV head -> codes and scales at out[r]; D a power of
// two from kW to 256. t: NG * D * kW floats (group g's rows transposed at t + g * D * kW, then each channel's
// rounding errors), codes: NG * D * kW bytes (scratch). A channel's step is a chain (division, rounding, its
// value back, the error, the next channel's update): ~50-70 cycles, for kW rows; NG groups side by side keep
// NG chains in flight.
template <class V>
inline typename V::F product(typename V::F a, typename V::F b) {
  typename V::F p = V::mul(a, b);
#if KVPAGE_ISA_AVX512
  asm("" : "+v"(p));
#else
  asm("" : "+x"(p));
#endif
  return p;
}

// One row (a decode step of one sequence), the row's own vectors updated: channel i's step is a scalar division,
// rounding and value, and its error goes to the row's vectors from the one holding channel i + 1 on (fb[i] is
// zero up to i, and channels up to i are never read again). A token's write on the AMX Xeon: 3 KV heads of 64
// 5.4 us against 8.0 us on the lanes with one row in them; one head of 256 7.8 against 19.1 us (plain rounding:
// 1.3 and 1.1 us).
template <class V, KVCode C, typename IN>
void quantize_key_feedback_row(const IN* src, uint8_t* out, int64_t D, const float* fb) {
  using F = typename V::F;
  constexpr int W = V::kW;
  alignas(64) float x[256];
  F v[256 / W];
  const int64_t nv = D / W;
  for (int64_t i = 0; i < nv; ++i) v[i] = V::load(src + W * i);
  fwht_lanes<V>(v, nv);
  F top = V::set(0.f);
  for (int64_t i = 0; i < nv; ++i) top = V::max(top, V::abs(v[i]));
  const uint16_t bits = scale_bits<C>(V::hmax(top));
  const float s = scale_value(bits);
  for (int64_t i = 0; i < nv; ++i) V::store(x + W * i, v[i]);
  for (int64_t i = 0; i < D; ++i) {
    const float w = x[i];
    const uint8_t c = encode1<C>(s > 0.f ? w / s : 0.f);
    out[i] = c;
    const F r = V::set(w - product(decode1<C>(c), s));
    const float* f = fb + i * D;
    for (int64_t k = (i + 1) / W; k < nv; ++k)
      V::store(x + W * k, V::sub(V::load(x + W * k), product<V>(r, V::load(f + W * k))));
  }
  std::memcpy(out + D, &bits, sizeof(bits));
}

template <class V, KVCode C, typename IN, int NG>
void quantize_keys_feedback_lanes(const IN* const* src, int64_t n, int64_t D, const float* fb, uint8_t* const* out,
                                  float* t, uint8_t* codes) {
  using F = typename V::F;
  constexpr int W = V::kW;
  alignas(64) float s[NG * W], safe[NG * W], row[256];
  uint16_t bits[NG * W];
  F x[256 / W];
  const int64_t nv = D / W;
  for (int r = 0; r < NG * W; ++r) {
    float* tg = t + (r / W) * D * W + r % W;
    if (r >= n) {  // an idle lane: zeros, which stay zeros
      for (int64_t d = 0; d < D; ++d) tg[d * W] = 0.f;
      s[r] = 0.f, safe[r] = 1.f, bits[r] = 0;
      continue;
    }
    for (int64_t i = 0; i < nv; ++i) x[i] = V::load(src[r] + W * i);
    fwht_lanes<V>(x, nv);
    F top = V::set(0.f);
    for (int64_t i = 0; i < nv; ++i) top = V::max(top, V::abs(x[i]));
    bits[r] = scale_bits<C>(V::hmax(top));
    s[r] = scale_value(bits[r]);
    safe[r] = s[r] > 0.f ? s[r] : 1.f;
    for (int64_t i = 0; i < nv; ++i) V::store(row + W * i, x[i]);
    for (int64_t d = 0; d < D; ++d) tg[d * W] = row[d];
  }
  // Left-looking, kCols channels of each group held in registers: a block's channels first take every earlier
  // channel's error in order (those errors were stored over the channels' own slots in t), then are rounded in
  // turn, each passing its error to the block's later channels. Each channel j thus takes the errors of
  // channels 0, 1, ..., j - 1 in that order, as the oracle's right-looking loop gives them.
  constexpr int kCols = NG > 2 ? 4 : 8;
  F vs[NG], vsafe[NG];
  for (int g = 0; g < NG; ++g) vs[g] = V::load(s + g * W), vsafe[g] = V::load(safe + g * W);
  const float* table = code_table<C>();
  for (int64_t b = 0; b < D; b += kCols) {
    F tb[NG][kCols];
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < kCols; ++c) tb[g][c] = V::load(t + (g * D + b + c) * W);
    for (int64_t i = 0; i < b; ++i) {
      const float* f = fb + i * D + b;
      for (int g = 0; g < NG; ++g) {
        const F r = V::load(t + (g * D + i) * W);
        for (int c = 0; c < kCols; ++c) tb[g][c] = V::sub(tb[g][c], product<V>(r, V::set(f[c])));
      }
    }
    for (int c = 0; c < kCols; ++c) {
      const int64_t i = b + c;
      const float* f = fb + i * D + b;
      for (int g = 0; g < NG; ++g) {
        const F v = V::div(tb[g][c], vsafe[g]);  // a zero row's lanes: 0 / 1
        uint8_t* code = codes + (g * D + i) * W;
        F value;
        if constexpr (C == KVCode::kInt8) {  // encode_lanes' int8 codes, and their values without a lookup
          const typename V::I q = V::round(V::min(V::set(code_max<C>()), V::max(V::set(-code_max<C>()), v)));
          V::store_codes(q, true, code);
          value = V::tofloat(q);
        } else {
          encode_lanes<V, C>(v, code);
          value = V::gather(table, code);
        }
        const F r = V::sub(tb[g][c], product<V>(value, vs[g]));
        V::store(t + (g * D + i) * W, r);
        for (int c2 = c + 1; c2 < kCols; ++c2) tb[g][c2] = V::sub(tb[g][c2], product<V>(r, V::set(f[c2])));
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* cg = codes + (r / W) * D * W + r % W;
    for (int64_t d = 0; d < D; ++d) out[r][d] = cg[d * W];
    std::memcpy(out[r] + D, &bits[r], sizeof(uint16_t));
  }
}
#endif

#if KVPAGE_ISA_AVX2
constexpr int64_t kFeedbackRows = RowLanes::kW * kFeedbackGroups;
#else
constexpr int64_t kFeedbackRows = 1;
#endif

// Rows src[0..n), n <= kFeedbackRows, of one KV head: the lanes where the head size takes them (as many groups
// as the rows fill), else one row at a time. t: kFeedbackRows * D floats, codes: kFeedbackRows * D bytes.
template <KVCode C, typename IN>
inline void quantize_keys_feedback(const IN* const* src, int64_t n, int64_t D, const float* fb, uint8_t* const* out,
                                   float* t, uint8_t* codes) {
#if KVPAGE_ISA_AVX2
  if (D >= RowLanes::kW && D <= 256 && (D & (D - 1)) == 0) {
    if (n == 1) return quantize_key_feedback_row<RowLanes, C>(src[0], out[0], D, fb);
    switch ((n + RowLanes::kW - 1) / RowLanes::kW) {
      case 1: quantize_keys_feedback_lanes<RowLanes, C, IN, 1>(src, n, D, fb, out, t, codes); return;
      case 2: quantize_keys_feedback_lanes<RowLanes, C, IN, 2>(src, n, D, fb, out, t, codes); return;
      case 3: quantize_keys_feedback_lanes<RowLanes, C, IN, 3>(src, n, D, fb, out, t, codes); return;
      default: quantize_keys_feedback_lanes<RowLanes, C, IN, kFeedbackGroups>(src, n, D, fb, out, t, codes); return;
    }
  }
#endif
  for (int64_t r = 0; r < n; ++r) quantize_key_feedback<C>(src[r], out[r], D, t, fb);
}

}  // namespace kvpage::attn
