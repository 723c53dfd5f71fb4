#pragma once
/// \file param.hpp
/// A parameter as the trainer registers it with Engine::add_unit().

#include <cstdint>
#include <string>
#include <vector>

#include "zeroshard/types.hpp"

namespace zeroshard {

/// One parameter of a unit. The engine owns the parameter and gradient memory; the trainer
/// reads and writes it through the views that params(), gather() and grads() return.
struct Param {
  std::string name;
  std::vector<int64_t> shape;
  int group = 0;  ///< parameter group: 0 is Config::optimizer, others come from add_group()
  /// Optional initial values, shape_numel(shape) elements of any dtype on the CPU, read during
  /// finalize() (keep them alive until then). Without them the parameter starts at zero.
  TensorView init{};
};

}  // namespace zeroshard
