#pragma once
/// \file zeroshard.hpp
/// Umbrella header: everything a trainer needs.

#include "zeroshard/calibration.hpp"
#include "zeroshard/checkpoint.hpp"
#include "zeroshard/communicator.hpp"
#include "zeroshard/config.hpp"
#include "zeroshard/config_fields.hpp"
#include "zeroshard/device.hpp"
#include "zeroshard/engine.hpp"
#include "zeroshard/error.hpp"
#include "zeroshard/export.hpp"
#include "zeroshard/launch.hpp"
#include "zeroshard/memory.hpp"
#include "zeroshard/param.hpp"
#include "zeroshard/planner.hpp"
#include "zeroshard/quantize.hpp"
#include "zeroshard/types.hpp"
#include "zeroshard/version.hpp"
