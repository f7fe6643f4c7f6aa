// The parts of torch the kernels use (the tensor type, its factories, dtypes, TORCH_CHECK),
// without <torch/extension.h>: that header brings pybind11 and every ATen operator and
// multiplies each source file's compile time (docs/decisions.md#torch-lite-header).
// Only bindings.cpp, the Python
// module itself, includes <torch/extension.h>. The kernels name at:: (torch::Tensor is the
// same type: at::Tensor).
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
