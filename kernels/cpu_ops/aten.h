// What the kernel files need of ATen: the Tensor type, at::empty / at::empty_like,
// TORCH_CHECK, AT_DISPATCH_*, at::parallel_for, and pybind11's plain GIL release
// (PyEval_SaveThread: a matmul lets the event loop run). Not <torch/extension.h>: that
// header (torch's whole C++ API and pybind11) takes ~20 s to compile in every file that
// includes it; bind.cpp, which makes the Python module, takes torch/python.h.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <pybind11/gil_simple.h>
