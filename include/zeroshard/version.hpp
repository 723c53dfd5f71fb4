#pragma once
/// \file version.hpp
#define ZEROSHARD_VERSION_MAJOR 0
#define ZEROSHARD_VERSION_MINOR 1
#define ZEROSHARD_VERSION_PATCH 0
#include "zeroshard/export.hpp"

namespace zeroshard {
/// "0.1.0"
ZS_API const char* version();
}  // namespace zeroshard
