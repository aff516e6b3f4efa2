// The tensor API kvpage's kernels are written against: ATen alone. <torch/extension.h> (pybind11 and torch's
// C++ frontend on top of ATen) costs ~30 s more compile per translation unit on a 2-core machine, so only
// bindings.cpp includes it; torch::Tensor stays the one name for at::Tensor that both see.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace torch {
using at::Tensor;
}  // namespace torch
