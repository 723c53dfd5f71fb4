#pragma once
// Shared pieces of the multi-rank tests: the world communicator, a model with uneven parameter
// sizes, and a deterministic trainer loop whose gradients depend on the parameters, the rank,
// the micro-step and the step, so a wrong reduction, shard or update shows up in the results.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "zeroshard/zeroshard.hpp"

/// Expects `stmt` to throw zeroshard::Error with code `code_` and a message containing `text`.
#define EXPECT_ZS_ERROR(stmt, code_, text)                                \
  do {                                                                    \
    try {                                                                 \
      stmt;                                                               \
      ADD_FAILURE() << #stmt " did not throw";                            \
    } catch (const ::zeroshard::Error& err) {                             \
      EXPECT_EQ(err.code(), ::zeroshard::ErrorCode::code_) << err.what(); \
      EXPECT_THAT(std::string(err.what()), ::testing::HasSubstr(text));   \
    }                                                                     \
  } while (0)

namespace zs_test {

/// MPI_COMM_WORLD, created once by the test main (mpi_main.cpp, as shared_dir()).
std::shared_ptr<zeroshard::Communicator> world();

/// An empty directory "zeroshard-<name>-<id>" under the temporary directory, the same on every
/// rank of this job and on no other: rank 0's pid is the id, since test processes that run at
/// once (ctest -j; a group on the asynchronous device beside the same group on the CPU) must
/// not share one. Collective.
std::filesystem::path shared_dir(const std::string& name);

/// A directory "zeroshard-<name>-<pid>" under the temporary directory, this process's own (a
/// rank's swap files), made here and removed when the process ends if the engines left it empty.
std::filesystem::path process_dir(const std::string& name);

/// Parameter specs of one unit: name and shape.
struct UnitSpec {
  std::string name;
  std::vector<std::pair<std::string, std::vector<int64_t>>> params;
};
/// Five units with sizes that never divide evenly (primes, a 1-element bias, an empty-ish unit).
std::vector<UnitSpec> uneven_model();
/// Deterministic initial values in [-1, 1) for a parameter.
std::vector<float> init_values(const std::string& unit, const std::string& param, int64_t numel);

/// Registers `model` with initial values (biases — names starting with 'b' — in `bias_group`)
/// and finalizes.
void register_model(zeroshard::Engine& e, const std::vector<UnitSpec>& model, int bias_group = 0);

/// The gradient of element i of unit u for (rank, micro-step, step), before loss scaling:
/// p - target, with a target that differs per rank and micro-step.
float synthetic_grad(float p, int unit, int64_t i, int rank, int micro, int64_t step);

struct TrainOptions {
  int steps = 20;
  /// Each micro-step writes the gradient of one micro-batch (engine accumulates), or with
  /// `merge_micro` one step writes the mean over `micro_batches` micro-batches at once.
  int micro_batches = 1;
  bool merge_micro = false;
  /// Called with (engine, unit, micro, step, grads) after the trainer wrote its gradients.
  std::function<void(zeroshard::Engine&, int, int, int64_t, std::vector<zeroshard::TensorView>&)>
      tamper;
  /// For an engine on a GPU (the harness itself is CUDA-free): copies `bytes` of device memory
  /// to the host. Parameters are then read through it, and gradients are written on the host
  /// and handed over with the copying grads_ready(unit, views).
  std::function<void(void* host, const void* device, size_t bytes)> download;
  /// With `download`: gradients go into the engine's own device buffers (grads() views) through
  /// this copy instead of the copying grads_ready().
  std::function<void(void* device, const void* host, size_t bytes)> upload;
  /// The order in which this rank's trainer goes through the units in a micro-step (a
  /// permutation of 0 … units − 1); null: from the last unit to the first.
  std::function<std::vector<int>(int rank, int64_t step, int micro, int units)> order;
  /// Called after the last micro-step, before step() (e.g. clip_grad_norm()).
  std::function<void(zeroshard::Engine&)> before_step;
};

/// Runs opt.steps steps: per micro-step, per unit, gather → gradient → grads_ready → release.
/// Units come in opt.order's order, by default that of a backward pass (last unit first).
std::vector<zeroshard::StepResult> train(zeroshard::Engine& e, const TrainOptions& opt);

/// float ↔ element of dtype, via the library's reference conversions.
float load(const void* base, zeroshard::DType dt, int64_t i);
void store(void* base, zeroshard::DType dt, int64_t i, float v);

}  // namespace zs_test
