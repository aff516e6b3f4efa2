// One row's token draw (sampler.cpp), shared by sample_rows and the logits pass that draws each row while it
// is still in cache (fused_ops.cpp logits_draw).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace kvpage::sampling {

// A thread's working space for sample_row, sized once per vocabulary (reserve).
struct Scratch {
  std::vector<float> e;
  std::vector<double> block_sum;
  std::vector<double> mass;
  std::vector<float> pick;
  std::vector<int32_t> idx;  // entries that can hold a filter's boundary, and their bins
  std::vector<int32_t> bin;
  std::vector<std::pair<float, int32_t>> cand;  // top-k: (logit, token) in the band below the maximum
  void reserve(int64_t V);
};

// W draws (uniforms u[W] in [0, 1)) from float32 logits x[V] under temperature T > 0, top-k k (0: off), top-p
// and min-p; a row with nothing drawable gives its argmax.
void sample_row(const float* x, int64_t V, float T, int64_t k, float top_p, float min_p, const double* u,
                int64_t W, int64_t* out, Scratch& s);

}  // namespace kvpage::sampling

#include "row_mask.h"  // mask_row: a row limited to its allowed tokens
