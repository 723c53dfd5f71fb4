#pragma once
// Shared pieces of the extension module zeroshard._core: the tensor bridge (DLPack / buffer
// protocol <-> TensorView, never copying), parsing of the enums from strings, and the functions
// that bind each part of the API.
//
// Errors: everything here throws zeroshard::Error; module.cpp translates it, in one place, to the
// Python exception class of its ErrorCode with the same message.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>
#include <vector>

#include "zeroshard/zeroshard.hpp"

namespace zeroshard::py {

namespace nb = nanobind;

/// Any-dtype, any-shape array as nanobind imports it (writable or read-only).
using Array = nb::ndarray<>;
using ArrayRO = nb::ndarray<nb::ro>;

/// The DLPack dtype of a zeroshard element type (bf16 is DLPack's kDLBfloat, 16 bits).
nb::dlpack::dtype to_dlpack(DType t);
/// "float32", "bfloat16", "float64", "int64", ... for error messages.
std::string dlpack_dtype_name(nb::dlpack::dtype t);

/// What the caller requires of a tensor that crosses into C++.
struct TensorRequest {
  std::string what;        ///< names the argument in errors, e.g. "grads_ready(): gradient of 'w'"
  bool any_dtype = false;  ///< raw bytes (broadcast): skip the f32/bf16/f16 check
  bool has_dtype = false;  ///< `dtype` must match exactly
  DType dtype = DType::f32;
  int64_t numel = -1;  ///< >= 0: the element count must match
  /// Also take a CUDA tensor (DLPack kDLCUDA), imported as TensorView{..., Device::cuda, its
  /// device index}; only where the C++ call reads device memory (grads_ready() of a GPU engine).
  /// Otherwise a CUDA tensor is refused like any non-CPU one: never copied to the host here.
  bool allow_cuda = false;
};

/// A tensor imported without copying, and the view of it that C++ reads or writes. Holding the
/// Imported keeps the producer's memory alive (the DLPack capsule owns a reference).
struct Imported {
  Array array;       // writable import (empty if imported read-only)
  ArrayRO array_ro;  // read-only import
  TensorView view;
  int64_t nbytes = 0;
};

/// Imports `obj` (anything with __dlpack__ or the buffer protocol: torch tensors, NumPy arrays)
/// without copying. Throws Error(invalid_argument) naming `req.what` if it is not a CPU tensor
/// (or, with `req.allow_cuda`, a CUDA tensor), is not C-contiguous, has an unsupported or
/// different dtype, or the wrong element count; it never falls back to a converted copy.
Imported import_tensor(nb::handle obj, const TensorRequest& req, bool writable);

/// A view of engine-owned memory, exported without copying, on the view's own device (a
/// TensorView on cuda becomes a DLPack kDLCUDA array of its device index, which
/// torch.from_dlpack() turns into a CUDA tensor over the same memory); `owner` (the Python
/// object that owns the memory) stays alive as long as the returned array or any tensor made
/// from it does.
nb::object export_view(const TensorView& v, const std::vector<int64_t>& shape, nb::handle owner);
/// A 1-D float32 array that owns `values` (moved in).
nb::object export_owned(std::vector<float>&& values);

DType parse_dtype(nb::handle h);  // DType, or "f32"/"float32"/"bf16"/"fp16"/torch.float16...
Tier parse_tier(nb::handle h);    // Tier, or "device"/"none", "host"/"cpu", "nvme"
OptimizerKind parse_optimizer(nb::handle h);  // OptimizerKind, or "adam"/"adamw"/"sgd"/"lion"
StateFormat parse_state_format(nb::handle h);
SpeculativeStep parse_speculative_step(
    nb::handle h);  // SpeculativeStep, a bool, or "auto"  // StateFormat, or "f32"/"bf16"/"8bit"
/// Device, or "cpu"/"cuda", or "cuda:N" / torch.device("cuda", N): then *index is set to N (and
/// left alone otherwise; `index` may be null to refuse an index).
Device parse_device(nb::handle h, int* index);

/// A Config from a Config (copied), a dict of zeroshard/DeepSpeed keys, or a JSON file path.
Config coerce_config(nb::handle h);
/// OptimizerOptions from the struct or a dict of its fields.
OptimizerOptions coerce_optimizer(nb::handle h);

void bind_errors(nb::module_& m);
void bind_config(nb::module_& m);
void bind_engine(nb::module_& m);
/// SameBytes / same_bytes(): the memory-ceiling kernel the benchmarks compare the step against.
void bind_kernels(nb::module_& m);

}  // namespace zeroshard::py
