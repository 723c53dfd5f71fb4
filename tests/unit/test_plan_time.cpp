// predict_step() against the step written out by hand for small models, and read_calibration()
// on good and bad files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "zeroshard/zeroshard.hpp"

using namespace zeroshard;

namespace {

// 1 GB/s and 10 us for both collectives, 1 G params/s update, 0.1 G params/s nvme step.
MachineRates rates() {
  MachineRates r;
  r.update_params_per_s = 1e9;
  r.reduce_scatter = {10e-6, 1.0, {}, {}, {}};
  r.all_gather = {10e-6, 1.0, {}, {}, {}};
  r.nvme_step_params_per_s = 1e8;
  return r;
}

// Two units of 4096 and 1000 bf16 parameters (alignment 128): on 2 ranks, shards of 2048 and
// 512 elements (the second padded from 1000 to 1024).
std::vector<PlanUnit> model() {
  return {{"a", {Param{"w", {64, 64}}}}, {"b", {Param{"v", {1000}}}}};
}

Config cfg(int stage, Tier tier = Tier::host) {
  Config c;
  c.stage = stage;
  c.dtype = DType::bf16;
  c.offload_optimizer.tier = tier;
  return c;
}

double coll(double elements) {  // one collective over a bf16 shard of `elements`
  return 10e-6 + elements * 2 / 1e9;
}

}  // namespace

TEST(PlanTime, EachStageSumsItsCollectivesAndItsUpdate) {
  const double shards = 2048 + 512;
  // Stage 0: reduce-scatter and all-gather of the gradients, every rank updates everything.
  StepPrediction p = predict_step(cfg(0, Tier::device), model(), 2, rates());
  EXPECT_DOUBLE_EQ(p.comm_s, 2 * (coll(2048) + coll(512)));
  EXPECT_DOUBLE_EQ(p.optimizer_s, 2 * shards / 1e9);
  // Stages 1-2: reduce-scatter, then the new parameters all-gathered; the shard updated.
  for (int stage : {1, 2}) {
    p = predict_step(cfg(stage), model(), 2, rates());
    EXPECT_DOUBLE_EQ(p.comm_s, 2 * (coll(2048) + coll(512))) << stage;
    EXPECT_DOUBLE_EQ(p.optimizer_s, shards / 1e9) << stage;
    EXPECT_DOUBLE_EQ(p.total_s, p.comm_s + p.optimizer_s) << stage;
  }
  // Stage 3: a gather in forward and one in backward, and the reduce-scatter; nothing after.
  p = predict_step(cfg(3), model(), 2, rates());
  EXPECT_DOUBLE_EQ(p.comm_s, 3 * (coll(2048) + coll(512)));
  // One rank: no collective at all, the whole (padded) unit updated.
  p = predict_step(cfg(2), model(), 1, rates());
  EXPECT_EQ(p.comm_s, 0);
  EXPECT_DOUBLE_EQ(p.optimizer_s, (4096 + 1024) / 1e9);
}

// The speculative step: unit "b" (1000 parameters, the last registered) lands first, after
// 1000/5096 of backward; unit "a" lands at backward's end. On one rank the shards are the
// padded units: a 4096 and b 1024 elements, updated at 1 G params/s.
TEST(PlanTime, SpeculationLeavesTheUpdateBackwardDidNotHide) {
  Config c = cfg(2);
  c.speculative_step = SpeculativeStep::on;
  MachineRates r = rates();
  const double a = 4096 / 1e9, b = 1024 / 1e9, full = a + b;
  // Beside the backward, each update also writes the second copy (12 bytes of f32 master and
  // moments read for ownership) and reads the bf16 gradient for the norm: 28 + 12 + 2 bytes
  // of the update's 28 (master and moments read and written, the gradient, the new bf16 copy).
  const double slower = (28.0 + 12 + 2) / 28;
  // Backward long enough: only unit a's update is left once its gradient lands.
  r.compute_s = 1.5 * 1e-3;  // backward 1 ms
  StepPrediction p = predict_step(c, model(), 1, r);
  EXPECT_NEAR(p.optimizer_s, a * slower, 1e-15);
  EXPECT_NEAR(p.rollback_s, full, 1e-15);
  EXPECT_NEAR(p.total_s, p.compute_s + p.optimizer_s, 1e-15);
  // Backward shorter than b's update: a waits for b, then all of it is left after backward.
  r.compute_s = 1.5 * 0.5e-6;  // backward 0.5 us; b lands after ~0.1 us and takes 1.5 us
  p = predict_step(c, model(), 1, r);
  EXPECT_NEAR(p.optimizer_s, 1000.0 / 5096 * 0.5e-6 + full * slower - 0.5e-6, 1e-15);
  // No compute given: nothing hides, and the update is the slower one.
  r.compute_s = 0;
  EXPECT_NEAR(predict_step(c, model(), 1, r).optimizer_s, full * slower, 1e-15);
  // Not taken off the host tier: no speculation in the prediction either.
  r.compute_s = 1.5e-3;
  c.offload_optimizer.tier = Tier::device;
  p = predict_step(c, model(), 1, r);
  EXPECT_NEAR(p.optimizer_s, full, 1e-15);
  EXPECT_EQ(p.rollback_s, 0);
}

TEST(PlanTime, ComputeHidesReductionsAndGathersButNotTheGatherAfterTheUpdate) {
  MachineRates r = rates();
  const double reduce = coll(2048) + coll(512);
  r.compute_s = reduce / 2;
  StepPrediction p = predict_step(cfg(2), model(), 2, r);
  EXPECT_DOUBLE_EQ(p.compute_s, r.compute_s);
  EXPECT_DOUBLE_EQ(p.comm_s, reduce / 2 + reduce);
  r.compute_s = 1;  // longer than every reduction: only the all-gather after the update shows
  EXPECT_DOUBLE_EQ(predict_step(cfg(2), model(), 2, r).comm_s, reduce);
  EXPECT_DOUBLE_EQ(predict_step(cfg(3), model(), 2, r).comm_s, 0);
  EXPECT_DOUBLE_EQ(predict_step(cfg(3), model(), 2, r).total_s, 1 + 2560 / 1e9);
}

// Compute hides collectives only as far as the two run side by side on the machine
// (comm_overlap): none where they take turns, and by default (1) all it can.
TEST(PlanTime, ComputeHidesOnlyWhatTheMachineOverlaps) {
  MachineRates r = rates();
  const double reduce = coll(2048) + coll(512);
  r.compute_s = reduce / 2;
  EXPECT_EQ(r.comm_overlap, 1);
  r.comm_overlap = 0;
  StepPrediction p = predict_step(cfg(2), model(), 2, r);
  EXPECT_DOUBLE_EQ(p.comm_s, 2 * reduce);
  EXPECT_DOUBLE_EQ(p.total_s, r.compute_s + 2 * reduce + 2560 / 1e9);
  r.comm_overlap = 0.5;  // half of the compute's window
  EXPECT_DOUBLE_EQ(predict_step(cfg(2), model(), 2, r).comm_s, 2 * reduce - reduce / 4);
  r.compute_s = 1;  // a window longer than the collectives (2 gathers, 1 reduction): half hidden
  EXPECT_DOUBLE_EQ(predict_step(cfg(3), model(), 2, r).comm_s, 3 * reduce / 2);
  for (double bad : {-0.1, 1.5}) {
    r.comm_overlap = bad;
    EXPECT_THROW(predict_step(cfg(2), model(), 2, r), Error) << bad;
  }
}

// Nodes of 2 ranks at 0.5 GB/s: on 4 ranks flat, each collective's ring leaves each node once
// with 3 shards; in groups of 2 (one per node) the gathers and reduce-scatters stay within the
// node (the calibrated rates, over 2 ranks' shards) and the all-reduce across groups sends
// 2 · (2 − 1) / 2 shards from each of a node's 2 ranks.
TEST(PlanTime, NodesAndShardGroups) {
  MachineRates r = rates();
  r.ranks_per_node = 2;
  r.link = LinkRates::uniform(0.5);
  // 4 ranks: shards of 1024 and 256 (1000 padded to 1024).
  const double flat_shards = 1024 + 256;
  StepPrediction p = predict_step(cfg(3, Tier::device), model(), 4, r);
  EXPECT_DOUBLE_EQ(p.inter_node_bytes, 3 * 3 * flat_shards * 2);  // 2 gathers + 1 reduce-scatter
  EXPECT_DOUBLE_EQ(p.comm_s, p.inter_node_bytes / 0.5e9);
  Config h = cfg(3, Tier::device);
  h.shard_group_size = 2;
  p = predict_step(h, model(), 4, r);
  const double group_shards = 2048 + 512;
  EXPECT_DOUBLE_EQ(p.inter_node_bytes, 2 * 1 * group_shards * 2);
  const double within = 3 * (coll(2048) + coll(512));
  EXPECT_DOUBLE_EQ(p.comm_s, within + p.inter_node_bytes / 0.5e9);
  // One node: nothing crosses, and the all-reduce across groups takes its calibrated time on
  // the group's shard; rings that cross without a link rate are refused.
  r.ranks_per_node = 4;
  r.all_reduce = {0, 1.0, {}, {}};
  p = predict_step(h, model(), 4, r);
  EXPECT_EQ(p.inter_node_bytes, 0);
  EXPECT_DOUBLE_EQ(p.comm_s, within + group_shards * 2 / 1e9);
  r.ranks_per_node = 2;
  r.link = {};
  EXPECT_THROW(predict_step(h, model(), 4, r), Error);
}

// Each kind crosses at its own rate: flat stage 3's gathers at the all-gather's, its
// reduce-scatter at the reduce-scatter's, the groups' all-reduce at the all-reduce's; a kind
// without a rate is refused only where it crosses.
TEST(PlanTime, EachCollectiveKindCrossesAtItsOwnRate) {
  MachineRates r = rates();
  r.ranks_per_node = 2;
  r.link = {2, {0, 0.25, {}, {}}, {0, 0.5, {}, {}}, {0, 0.4, {}, {}}};
  const double flat_out = 3 * (1024 + 256) * 2;  // bytes a node sends per collective
  StepPrediction p = predict_step(cfg(3, Tier::device), model(), 4, r);
  EXPECT_DOUBLE_EQ(p.comm_s, 2 * flat_out / 0.5e9 + flat_out / 0.25e9);
  Config h = cfg(3, Tier::device);
  h.shard_group_size = 2;
  p = predict_step(h, model(), 4, r);
  EXPECT_DOUBLE_EQ(p.comm_s, 3 * (coll(2048) + coll(512)) + 2 * (2048 + 512) * 2 / 0.4e9);
  // A link calibrated on 3 nodes: a node sends 2 blocks per reduce-scatter or all-gather block
  // and 4/3 of an all-reduce's buffer, so a node's bytes are timed as the size sending them.
  r.link.nodes = 3;
  p = predict_step(cfg(3, Tier::device), model(), 4, r);
  EXPECT_DOUBLE_EQ(p.comm_s, 2 * flat_out / 2 / 0.5e9 + flat_out / 2 / 0.25e9);
  p = predict_step(h, model(), 4, r);
  EXPECT_DOUBLE_EQ(p.comm_s, 3 * (coll(2048) + coll(512)) + 2 * (2048 + 512) * 2 * 3 / 4 / 0.4e9);
  // Measured points are interpolated at that size (latency and all), as within a node: per
  // unit, a gather sends 3 · 1024 · 2 and 3 · 256 · 2 bytes out of a node.
  r.link.nodes = 2;
  r.link.all_gather.warm = {{1000, 1e-3}, {100000, 2e-3}};
  p = predict_step(cfg(3, Tier::device), model(), 4, r);
  EXPECT_DOUBLE_EQ(p.comm_s, 2 * (2e-3 + 1e-3 * (flat_out - 2 * 1000) / 99000) + flat_out / 0.25e9);
  r.link.reduce_scatter.bandwidth_gbs = 0;  // hierarchical: no reduce-scatter crosses
  EXPECT_NO_THROW(predict_step(h, model(), 4, r));
  EXPECT_THROW(predict_step(cfg(3, Tier::device), model(), 4, r), Error);
}

TEST(PlanTime, GradientAccumulationReducesEveryMicroStep) {
  Config c = cfg(3);
  c.gradient_accumulation_steps = 4;
  EXPECT_DOUBLE_EQ(predict_step(c, model(), 2, rates()).comm_s, 4 * 3 * (coll(2048) + coll(512)));
}

TEST(PlanTime, NvmeStepReplacesTheUpdate) {
  const StepPrediction p = predict_step(cfg(2, Tier::nvme), model(), 2, rates());
  EXPECT_EQ(p.optimizer_s, 0);
  EXPECT_DOUBLE_EQ(p.nvme_s, 2560 / 1e8);
}

// Stage 3's parameters: on the host tier a CPU engine's memory, as on the device tier; on the
// nvme tier each gather reads the rank's shard (2 per unit per step) beside the collectives,
// the slower of the two setting the pace, and the update writes every new shard.
TEST(PlanTime, ParametersOnTheNvmeTier) {
  const StepPrediction dev = predict_step(cfg(3), model(), 2, rates());
  Config host = cfg(3);
  host.offload_param.tier = Tier::host;
  EXPECT_DOUBLE_EQ(predict_step(host, model(), 2, rates()).total_s, dev.total_s);
  Config nv = cfg(3);
  nv.offload_param.tier = Tier::nvme;
  MachineRates r = rates();
  const double shards = (2048 + 512) * 2;  // bytes of this rank's shards
  const double gathers = 2 * (coll(2048) + coll(512)), reduce = coll(2048) + coll(512);
  // Reads faster than the gathers: hidden; only the writes show.
  r.param_read_gbs = 2 * shards / (gathers / 2) / 1e9;  // in half the gathers' time
  r.param_write_gbs = 1;
  StepPrediction p = predict_step(nv, model(), 2, r);
  EXPECT_DOUBLE_EQ(p.comm_s, dev.comm_s);
  EXPECT_DOUBLE_EQ(p.nvme_s, shards / 1e9);
  // Reads slower: they set the pace, and what they take beyond the gathers is the nvme tier's.
  r.param_read_gbs = 2 * shards / (3 * gathers) / 1e9;
  p = predict_step(nv, model(), 2, r);
  EXPECT_DOUBLE_EQ(p.comm_s, reduce + gathers);
  EXPECT_NEAR(p.nvme_s, 2 * gathers + shards / 1e9, 1e-15);
  EXPECT_NEAR(p.total_s, reduce + 3 * gathers + shards / 1e9 + p.optimizer_s, 1e-15);
  // Compute hides the reads too, after the collectives; one rank still reads and writes.
  r.compute_s = 1;
  EXPECT_DOUBLE_EQ(predict_step(nv, model(), 2, r).nvme_s, shards / 1e9);
  r.compute_s = 0;
  p = predict_step(nv, model(), 1, r);
  EXPECT_DOUBLE_EQ(p.comm_s, 0);
  const double whole = (4096 + 1024) * 2;
  EXPECT_DOUBLE_EQ(p.nvme_s, 2 * whole / (r.param_read_gbs * 1e9) + whole / 1e9);
  // With the state on the nvme tier too, the shards are written beside its records, at that
  // rate; without it, refused.
  Config both = nv;
  both.offload_optimizer.tier = Tier::nvme;
  EXPECT_THROW(predict_step(both, model(), 1, r), Error);
  r.param_write_with_records_gbs = 4;
  p = predict_step(both, model(), 1, r);
  EXPECT_DOUBLE_EQ(p.nvme_s, 5120 / 1e8 + 2 * whole / (r.param_read_gbs * 1e9) + whole / 4e9);
}

TEST(PlanTime, MeasuredPointsAreInterpolatedAndExtended) {
  CollectiveRate c{5e-6, 1.0};
  c.warm = {{1000, 1e-3}, {2000, 3e-3}};
  c.cold = {{1000, 2e-3}, {2000, 6e-3}};
  c.queued = {{1000, 3e-3}, {2000, 9e-3}};
  EXPECT_DOUBLE_EQ(c.seconds(500, Buffers::warm), 1e-3);
  EXPECT_DOUBLE_EQ(c.seconds(1500, Buffers::warm), 2e-3);
  EXPECT_DOUBLE_EQ(c.seconds(1500, Buffers::cold), 4e-3);
  EXPECT_DOUBLE_EQ(c.seconds(1500, Buffers::queued), 6e-3);
  EXPECT_DOUBLE_EQ(c.seconds(3000, Buffers::warm), 3e-3 + 1000 / 1e9);
  c.queued.clear();  // no queued measurement: the cold one
  EXPECT_DOUBLE_EQ(c.seconds(1500, Buffers::queued), 4e-3);
  c.cold.clear();  // no cold measurement either: the warm one
  EXPECT_DOUBLE_EQ(c.seconds(1500, Buffers::cold), 2e-3);
  EXPECT_DOUBLE_EQ(c.seconds(1500, Buffers::queued), 2e-3);
}

// Each collective of the step takes the points of the buffers the engine runs it on: the whole
// gradient buffers' reductions at stages 0-1 and the gather of the new parameters at stages 1-2,
// all in flight at once (queued); stage 0's gather back into each unit's buffer, one at a time,
// and stage 3's gathers of each unit's own shard (cold); the staging slots' reductions at stages
// 2-3, reused (warm).
TEST(PlanTime, EachCollectiveTakesThePointsOfItsBuffers) {
  MachineRates r = rates();
  // Shards of 2048 and 512 bf16 elements: 4096 and 1024 bytes. Warm 1 ms, cold 10 ms, queued
  // 100 ms per call at either size (at or below the smallest measured size).
  for (CollectiveRate* c : {&r.reduce_scatter, &r.all_gather}) {
    c->warm = {{4096, 1e-3}};
    c->cold = {{4096, 10e-3}};
    c->queued = {{4096, 100e-3}};
  }
  const double warm = 2 * 1e-3, cold = 2 * 10e-3, queued = 2 * 100e-3;  // two units
  EXPECT_DOUBLE_EQ(predict_step(cfg(0, Tier::device), model(), 2, r).comm_s, queued + cold);
  EXPECT_DOUBLE_EQ(predict_step(cfg(1), model(), 2, r).comm_s, 2 * queued);
  EXPECT_DOUBLE_EQ(predict_step(cfg(2), model(), 2, r).comm_s, warm + queued);
  EXPECT_DOUBLE_EQ(predict_step(cfg(3), model(), 2, r).comm_s, 2 * cold + warm);
}

TEST(PlanTime, RefusesWhatItDoesNotModel) {
  Config gpu = cfg(2);
  gpu.device = Device::cuda;  // its optimizer on the host: PCIe rates needed
  EXPECT_THROW(predict_step(gpu, model(), 2, rates()), Error);
  Config params = cfg(3);
  params.offload_param.tier = Tier::nvme;  // without the parameter tier's rates
  EXPECT_THROW(predict_step(params, model(), 2, rates()), Error);
  MachineRates none = rates();
  none.all_gather.bandwidth_gbs = 0;
  EXPECT_THROW(predict_step(cfg(2), model(), 2, none), Error);
  none = rates();
  none.nvme_step_params_per_s = 0;
  EXPECT_THROW(predict_step(cfg(2, Tier::nvme), model(), 2, none), Error);
  EXPECT_NO_THROW(predict_step(cfg(2), model(), 2, none));  // not needed off the nvme tier
}

namespace {

// A GPU engine's rates: rates() for the collectives and the CPU update, a 4 G params/s GPU
// update, 1 GB/s up and 2 GB/s down.
MachineRates gpu_rates() {
  MachineRates r = rates();
  r.gpu_update_params_per_s = 4e9;
  r.h2d_gbs = 1;
  r.d2h_gbs = 2;
  return r;
}

Config on_gpu(Config c, Tier params = Tier::device) {
  c.device = Device::cuda;
  c.offload_param.tier = params;
  return c;
}

}  // namespace

// A GPU engine: its collectives as a CPU engine's (at the rates given: the GPUs'); the update on
// the GPU with the state there, else on the CPU with the reduced gradient shards downloaded
// (hidden with the reductions) and each unit's new shard uploaded as soon as the update finished
// it (a pipeline: the uploads show where they outlast the update, and the last unit's always);
// stage 3's shards off the GPU uploaded before every gather, on the compute stream (not hidden).
TEST(PlanTime, GpuEnginesCopyOverPcie) {
  const double shards = 2048 + 512, bytes = shards * 2;  // this rank's, on 2 ranks
  const MachineRates r = gpu_rates();
  for (int stage : {0, 1, 2, 3}) {  // the state in GPU memory: no copies
    const StepPrediction cpu = predict_step(cfg(stage, Tier::device), model(), 2, r);
    const StepPrediction p = predict_step(on_gpu(cfg(stage, Tier::device)), model(), 2, r);
    EXPECT_DOUBLE_EQ(p.comm_s, cpu.comm_s) << stage;
    EXPECT_DOUBLE_EQ(p.optimizer_s, cpu.optimizer_s / 4) << stage;
    EXPECT_EQ(p.pcie_s, 0) << stage;
  }
  // Stage 1, the optimizer on the host: down in bytes / 2 GB/s. Up at 1 GB/s, unit a's 4096 B
  // after its update (2048 params at 1 G/s), then unit b's 1024 B: the pipeline ends after a's
  // update and both uploads.
  StepPrediction p = predict_step(on_gpu(cfg(1)), model(), 2, r);
  EXPECT_DOUBLE_EQ(p.optimizer_s, shards / 1e9);
  EXPECT_DOUBLE_EQ(p.pcie_s, bytes / 2e9 + (2048 / 1e9 + bytes / 1e9 - shards / 1e9));
  EXPECT_DOUBLE_EQ(p.total_s, p.comm_s + p.optimizer_s + p.pcie_s);
  // A slower update hides all uploads but the last unit's; compute hides the downloads with the
  // reductions.
  MachineRates slow = r;
  slow.update_params_per_s = 1e8;
  const double last = 512 * 2 / 1e9;
  EXPECT_DOUBLE_EQ(predict_step(on_gpu(cfg(1)), model(), 2, slow).pcie_s, bytes / 2e9 + last);
  slow.compute_s = 1;
  EXPECT_NEAR(predict_step(on_gpu(cfg(1)), model(), 2, slow).pcie_s, last, 1e-15);
  // Every micro-step's reduced shard comes down.
  Config k2 = on_gpu(cfg(2));
  k2.gradient_accumulation_steps = 2;
  EXPECT_NEAR(predict_step(k2, model(), 2, slow).pcie_s, last, 1e-15);  // downloads hidden
  slow.compute_s = 0;
  EXPECT_DOUBLE_EQ(predict_step(k2, model(), 2, slow).pcie_s, 2 * bytes / 2e9 + last);
  // One GPU: no collectives, the same copies of whole units (4096 and 1024 elements).
  p = predict_step(on_gpu(cfg(2)), model(), 1, r);
  const double whole = (4096 + 1024) * 2;
  EXPECT_EQ(p.comm_s, 0);
  EXPECT_DOUBLE_EQ(p.pcie_s, whole / 2e9 + (4096 / 1e9 + whole / 1e9 - whole / 2 / 1e9));
  // Stage 3 with the shards on the host: each goes up before its gather, twice a step, and the
  // trainer's compute hides none of it; the update writes them where they are (no pipeline).
  const StepPrediction dev = predict_step(on_gpu(cfg(3)), model(), 2, r);
  p = predict_step(on_gpu(cfg(3), Tier::host), model(), 2, r);
  EXPECT_DOUBLE_EQ(p.comm_s, dev.comm_s);
  EXPECT_DOUBLE_EQ(p.pcie_s, bytes / 2e9 + 2 * bytes / 1e9);
  MachineRates busy = r;
  busy.compute_s = 1;
  EXPECT_DOUBLE_EQ(predict_step(on_gpu(cfg(3), Tier::host), model(), 2, busy).pcie_s,
                   2 * bytes / 1e9);
  // The state on the GPU needs no PCIe rate (none given: no copies, and no 0 / 0).
  busy.h2d_gbs = busy.d2h_gbs = 0;
  p = predict_step(on_gpu(cfg(3, Tier::device)), model(), 2, busy);
  EXPECT_EQ(p.pcie_s, 0);
  EXPECT_TRUE(std::isfinite(p.total_s));
}

// A bus bandwidth as nccl-tests report it: a ring's reduce-scatter and all-gather of a B-byte
// block per rank among n take (n - 1) B / bus, an all-reduce of B among r groups
// 2 (r - 1) / r B / bus.
TEST(PlanTime, CollectivesAtABusBandwidth) {
  MachineRates r = gpu_rates();
  r.comm_overlap = 0.5;
  set_bus_bandwidth(r, 100, 8);
  EXPECT_DOUBLE_EQ(r.reduce_scatter.seconds(1e6, Buffers::queued), 7 * 1e6 / 100e9);
  EXPECT_DOUBLE_EQ(r.all_gather.seconds(1e6, Buffers::cold), 7 * 1e6 / 100e9);
  EXPECT_EQ(r.comm_overlap, 0.5);   // the machine's, as it was
  set_bus_bandwidth(r, 100, 8, 2);  // groups of 2, all-reduced across 4
  EXPECT_DOUBLE_EQ(r.reduce_scatter.seconds(1e6, Buffers::warm), 1e6 / 100e9);
  EXPECT_DOUBLE_EQ(r.all_reduce.seconds(1e6, Buffers::warm), 2 * 3.0 / 4 * 1e6 / 100e9);
  EXPECT_THROW(set_bus_bandwidth(r, 0, 8), Error);
  EXPECT_THROW(set_bus_bandwidth(r, 100, 8, 3), Error);
}

// Typed bandwidths: the CPU update moves its format's bytes per parameter (master, moments
// read and written; the gradient read; a low-precision copy written), the nvme step reads and
// writes its records; 0 leaves a rate as it was.
TEST(PlanTime, TypedBandwidthsOverTheBytesOfEachFormat) {
  Config c;
  c.dtype = DType::bf16;
  EXPECT_EQ(update_bytes_per_param(c), 28);  // 2·(4 + 4 + 4) + 2 + 2
  EXPECT_EQ(record_bytes_per_param(c), 12);
  c.dtype = DType::f32;
  EXPECT_EQ(update_bytes_per_param(c), 28);  // 2·(4 + 4 + 4) + 4, the master is the parameter
  c.dtype = DType::bf16;
  c.optimizer_state = StateFormat::q8;
  c.bf16_master = true;
  EXPECT_EQ(record_bytes_per_param(c), 4);  // 2 + 1 + 1
  EXPECT_EQ(update_bytes_per_param(c), 12);
  c.optimizer.kind = OptimizerKind::sgd;  // no momentum: no state
  EXPECT_EQ(record_bytes_per_param(c), 2);
  MachineRates r = rates();
  c = Config{};
  c.dtype = DType::bf16;
  set_typed_rates(r, c, 1, {28, 0});
  EXPECT_DOUBLE_EQ(r.update_params_per_s, 1e9);
  EXPECT_EQ(r.nvme_step_params_per_s, 1e8);  // as it was
  set_typed_rates(r, c, 1, {0, 2.4});
  EXPECT_DOUBLE_EQ(r.nvme_step_params_per_s, 1e8);
  EXPECT_EQ(r.param_read_gbs, 2.4);
  EXPECT_EQ(r.param_write_with_records_gbs, 2.4);
  EXPECT_TRUE(r.newton_schulz.empty());
  set_typed_rates(r, c, 1, {0, 0, 0, 0, 0, 3});  // Muon's iteration: 3 GFLOP/s at every size
  ASSERT_EQ(r.newton_schulz.size(), 1u);
  EXPECT_DOUBLE_EQ(r.newton_schulz[0].second, 1.5e9);  // multiply-adds per second
  EXPECT_THROW(set_typed_rates(r, c, 1, {-1, 0}), Error);
}

// Stage 3's shards on the nvme tier of a GPU engine: read ahead beside the uploads and gathers
// they feed, the slower setting the pace.
TEST(PlanTime, GpuShardsReadFromNvme) {
  const double bytes = (2048 + 512) * 2;
  const double reduce = coll(2048) + coll(512), gathers = 2 * reduce;
  const double ups = 2 * bytes / 1e9;  // before each gather
  MachineRates r = gpu_rates();
  r.param_write_gbs = 1;
  r.param_read_gbs = 2 * bytes / (gathers + ups) / 2 / 1e9;  // reads take twice as long
  const StepPrediction p = predict_step(on_gpu(cfg(3), Tier::nvme), model(), 2, r);
  EXPECT_DOUBLE_EQ(p.comm_s, reduce + gathers);
  EXPECT_DOUBLE_EQ(p.pcie_s, bytes / 2e9 + ups);
  EXPECT_NEAR(p.nvme_s, (gathers + ups) + bytes / 1e9, 1e-15);
}

// What a GPU engine's step needs and lacks is said, with the command that measures it; a
// choice the GPU engine refuses is refused.
TEST(PlanTime, GpuEnginesRefuseWhatIsNotMeasured) {
  MachineRates r = gpu_rates();
  r.gpu_update_params_per_s = 0;
  auto says = [](const Config& c, const MachineRates& m, const std::string& what) {
    try {
      predict_step(c, model(), 2, m);
      ADD_FAILURE() << "predicted without " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  says(on_gpu(cfg(2, Tier::device)), r, "GPU update rate");
  EXPECT_NO_THROW(predict_step(on_gpu(cfg(2)), model(), 2, r));  // the update on the CPU
  r = gpu_rates();
  r.h2d_gbs = 0;
  says(on_gpu(cfg(2)), r, "zeroshard calibrate --device cuda");
  says(on_gpu(cfg(3), Tier::host), r, "zeroshard calibrate --device cuda");
  EXPECT_NO_THROW(predict_step(on_gpu(cfg(2, Tier::device)), model(), 2, r));
  says(on_gpu(cfg(0)), gpu_rates(), "stage >= 1");  // stage 0 keeps whole gradients on the GPU
}

namespace {

// A file holding `text`, removed when this goes.
struct TempFile {
  explicit TempFile(const std::string& text) {
    static int n = 0;
    path = (std::filesystem::temp_directory_path() /
            ("zs-cal-" + std::to_string(::getpid()) + "-" + std::to_string(n++)))
               .string();
    std::ofstream(path) << text;
  }
  ~TempFile() { std::filesystem::remove(path); }
  std::string path;
};

const char* kGood = R"({"schema": "zeroshard-calibration/1",
  "optimizer": {"adamw": {"f32": {"params_per_s": 2e9}, "bf16": {"params_per_s": 3e9}}},
  "newton_schulz": {"points_madds_per_s": [[1e7, 2e10], [3e9, 5e10]]},
  "collectives": {
    "reduce_scatter": {"latency_s": 1e-5, "bandwidth_gbs": 2, "points_bytes_s": [[4096, 1e-5], [8192, 3e-5]],
                       "cold": {"latency_s": 2e-5, "bandwidth_gbs": 1, "points_bytes_s": [[4096, 2e-5], [8192, 5e-5]]},
                       "queued": {"latency_s": 3e-5, "bandwidth_gbs": 1, "points_bytes_s": [[4096, 3e-5], [8192, 7e-5]]}},
    "all_gather": {"latency_s": 1e-5, "bandwidth_gbs": 4, "points_bytes_s": [[4096, 1e-5]]},
    "all_reduce": {"latency_s": 1e-5, "bandwidth_gbs": 3, "points_bytes_s": [[4096, 1e-5]]},
    "world": 3},
  "nvme": {"step_params_per_s": 5e7, "param_tier": {"read_gbs": 1.5, "write_gbs": 0.7,
                                                         "write_with_records_gbs": 3}}})";

// kGood's nvme section, as it stands there.
const std::string kNvme =
    R"({"step_params_per_s": 5e7, "param_tier": {"read_gbs": 1.5, "write_gbs": 0.7,
                                                         "write_with_records_gbs": 3}})";

// An engine's settings as far as a calibration file's rates depend on them.
Config with(DType dtype, StateFormat moments = StateFormat::f32, bool bf16_master = false) {
  Config c;
  c.dtype = dtype;
  c.optimizer_state = moments;
  c.bf16_master = bf16_master;
  return c;
}

std::string replace(std::string s, const std::string& from, const std::string& to) {
  s.replace(s.find(from), from.size(), to);
  return s;
}

void expect_refused(const std::string& text, const std::string& says) {
  try {
    read_calibration(TempFile(text).path, with(DType::bf16));
    ADD_FAILURE() << "accepted a file that should say " << says;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(PlanTime, ReadsACalibrationFile) {
  const TempFile file(kGood);
  const std::string& p = file.path;
  const MachineRates b = read_calibration(p, with(DType::bf16));
  EXPECT_EQ(b.update_params_per_s, 3e9);
  EXPECT_EQ(read_calibration(p, with(DType::f32)).update_params_per_s, 2e9);
  EXPECT_EQ(b.reduce_scatter.bandwidth_gbs, 2);
  ASSERT_EQ(b.reduce_scatter.warm.size(), 2u);
  ASSERT_EQ(b.reduce_scatter.cold.size(), 2u);
  EXPECT_EQ(b.reduce_scatter.cold[1].second, 5e-5);
  ASSERT_EQ(b.reduce_scatter.queued.size(), 2u);
  EXPECT_EQ(b.reduce_scatter.queued[1].second, 7e-5);
  EXPECT_EQ(b.all_gather.bandwidth_gbs, 4);
  EXPECT_TRUE(b.all_gather.cold.empty());
  ASSERT_EQ(b.newton_schulz.size(), 2u);
  EXPECT_EQ(b.newton_schulz[1].first, 3e9);
  EXPECT_EQ(b.newton_schulz[1].second, 5e10);
  EXPECT_TRUE(  // files from before it was measured
      read_calibration(
          TempFile(
              replace(kGood,
                      R"("newton_schulz": {"points_madds_per_s": [[1e7, 2e10], [3e9, 5e10]]},)",
                      ""))
              .path,
          with(DType::bf16))
          .newton_schulz.empty());
  EXPECT_TRUE(b.all_gather.queued.empty());  // not in the file: as files from before it
  EXPECT_EQ(b.all_reduce.bandwidth_gbs, 3);
  EXPECT_EQ(b.nvme_step_params_per_s, 5e7);
  EXPECT_EQ(b.param_read_gbs, 1.5);
  EXPECT_EQ(b.param_write_gbs, 0.7);
  EXPECT_EQ(b.param_write_with_records_gbs, 3);
  EXPECT_EQ(b.comm_overlap, 1);  // not in the file: as files from before it was measured
  EXPECT_EQ(read_calibration(
                TempFile(replace(kGood, "\"world\": 3", "\"world\": 3, \"overlap\": 0.25")).path,
                with(DType::bf16))
                .comm_overlap,
            0.25);
  expect_refused(replace(kGood, "\"world\": 3", "\"world\": 3, \"overlap\": 1.5"),
                 "collectives.overlap");
  EXPECT_EQ(read_calibration(TempFile(replace(kGood, kNvme, "null")).path, with(DType::bf16))
                .nvme_step_params_per_s,
            0);
}

// A calibration made with --device cuda: its PCIe rates and the GPU update's, per dtype and
// moments' format; without the section, none.
TEST(PlanTime, ReadsTheGpusRates) {
  EXPECT_EQ(read_calibration(TempFile(kGood).path, with(DType::bf16)).h2d_gbs, 0);
  const std::string text = replace(kGood, R"("nvme": {)", R"("gpu": {"h2d_gbs": 25, "d2h_gbs": 20,
    "adamw": {"bf16": {"params_per_s": 4e10, "state_formats": {"8bit": {"params_per_s": 5e10}}},
              "f32": {"params_per_s": 3e10}}},
  "nvme": {)");
  const TempFile file(text);
  const MachineRates b = read_calibration(file.path, with(DType::bf16));
  EXPECT_EQ(b.h2d_gbs, 25);
  EXPECT_EQ(b.d2h_gbs, 20);
  EXPECT_EQ(b.gpu_update_params_per_s, 4e10);
  EXPECT_EQ(b.update_params_per_s, 3e9);  // the CPU's stays
  EXPECT_EQ(read_calibration(file.path, with(DType::f32)).gpu_update_params_per_s, 3e10);
  EXPECT_EQ(read_calibration(file.path, with(DType::bf16, StateFormat::q8)).gpu_update_params_per_s,
            5e10);
  EXPECT_EQ(
      read_calibration(file.path, with(DType::bf16, StateFormat::bf16)).gpu_update_params_per_s, 0);
  expect_refused(replace(text, R"("d2h_gbs": 20,)", ""), "gpu.d2h_gbs");
}

// A calibration of one rank per node on 3 nodes.
TEST(PlanTime, ReadsTheLinkFromACalibrationOfOneRankPerNode) {
  const LinkRates l = read_link_calibration(TempFile(kGood).path);
  EXPECT_EQ(l.nodes, 3);
  EXPECT_EQ(l.reduce_scatter.bandwidth_gbs, 2);
  ASSERT_EQ(l.reduce_scatter.warm.size(), 2u);
  EXPECT_TRUE(l.reduce_scatter.cold.empty());  // the link's rate, not the memory's
  EXPECT_TRUE(l.reduce_scatter.queued.empty());
  EXPECT_EQ(l.all_gather.bandwidth_gbs, 4);
  EXPECT_EQ(l.all_reduce.bandwidth_gbs, 3);
  try {
    read_link_calibration(TempFile(replace(kGood, R"("world": 3)", R"("world": 1)")).path);
    ADD_FAILURE() << "took a link from one rank";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--map-by node"), std::string::npos) << e.what();
  }
  try {
    read_link_calibration(
        TempFile(replace(kGood, R"("bandwidth_gbs": 3)", R"("bandwidth_gbs": 0)")).path);
    ADD_FAILURE() << "took an unmeasured all-reduce";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("collectives.all_reduce is not measured"),
              std::string::npos)
        << e.what();
  }
}

TEST(PlanTime, RefusesBadCalibrationFiles) {
  EXPECT_THROW(read_calibration("/nonexistent/zs-cal.json", with(DType::bf16)), Error);
  expect_refused("{", "calibration file");
  expect_refused(replace(kGood, "zeroshard-calibration/1", "zeroshard-calibration/9"),
                 "zeroshard-calibration/9");
  expect_refused(replace(kGood, R"("bf16": {"params_per_s": 3e9})", R"("bf16": {})"),
                 "optimizer.adamw");
  expect_refused(replace(kGood, R"("bandwidth_gbs": 4)", R"("bandwidth_gbs": "fast")"),
                 "collectives");
  expect_refused(replace(kGood, "[8192, 3e-5]", "[2048, 3e-5]"), "sizes must increase");
}

// Each moment format moves its own bytes: its rates are its own, and a format the file did not
// measure is said to be unmeasured rather than taken at f32's rate.
TEST(PlanTime, ReadsEachMomentFormatsOwnRates) {
  const std::string text = replace(
      replace(kGood, R"("bf16": {"params_per_s": 3e9})",
              R"("bf16": {"params_per_s": 3e9,
                                  "state_formats": {"8bit": {"params_per_s": 1.5e9},
                                                    "8bit/bf16": {"params_per_s": 1.7e9}}})"),
      kNvme,
      R"({"step_params_per_s": 5e7, "state_formats": {"8bit": {"step_params_per_s": 9e7}}})");
  const TempFile file(text);
  const MachineRates q8 = read_calibration(file.path, with(DType::bf16, StateFormat::q8));
  EXPECT_EQ(q8.update_params_per_s, 1.5e9);
  EXPECT_EQ(q8.nvme_step_params_per_s, 9e7);
  EXPECT_EQ(read_calibration(file.path, with(DType::bf16, StateFormat::f32)).update_params_per_s,
            3e9);
  const MachineRates bf = read_calibration(file.path, with(DType::bf16, StateFormat::bf16));
  EXPECT_EQ(bf.update_params_per_s, 0);
  EXPECT_EQ(bf.nvme_step_params_per_s, 0);

  Config cfg;
  cfg.stage = 1;
  cfg.dtype = DType::bf16;
  cfg.optimizer_state = StateFormat::q8;
  cfg.offload_optimizer.tier = Tier::nvme;
  const std::vector<PlanUnit> units = {{"u", {Param{"w", {1 << 20}}}}};
  const StepPrediction p = predict_step(cfg, units, 1, q8);
  EXPECT_DOUBLE_EQ(p.nvme_s, double(1 << 20) / 9e7);
  cfg.optimizer_state = StateFormat::bf16;
  cfg.offload_optimizer.tier = Tier::host;
  try {
    predict_step(cfg, units, 1, bf);
    ADD_FAILURE() << "predicted with an unmeasured rate";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16 moments is not measured"), std::string::npos)
        << e.what();
  }
  // A bf16 master has rates of its own (calibration_format() names them), not its moments'.
  EXPECT_EQ(calibration_format(with(DType::bf16, StateFormat::q8, true)), "8bit/bf16");
  EXPECT_EQ(calibration_format(with(DType::bf16)), "f32");
  EXPECT_EQ(
      read_calibration(file.path, with(DType::bf16, StateFormat::q8, true)).update_params_per_s,
      1.7e9);
  cfg.optimizer_state = StateFormat::f32;
  cfg.bf16_master = true;
  try {
    predict_step(cfg, units, 1, read_calibration(file.path, cfg));
    ADD_FAILURE() << "predicted with an unmeasured rate";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("f32 moments and a bf16 master is not measured"),
              std::string::npos)
        << e.what();
  }
}

// Muon: each unit's matrices are orthogonalised by their owners (the costliest first, to the
// least busy rank), one per owner and round, each round waiting for its slowest; the pieces of
// a matrix held away from its owner go to it and back (f32, point to point) after backward,
// hidden by nothing.
TEST(PlanTime, MuonAddsItsBusiestOwnersIterationAndItsExchange) {
  MachineRates r = rates();
  r.newton_schulz = {{1e6, 1e9}, {1e8, 4e9}};  // multiply-adds per second, faster when larger
  Config c = cfg(2);
  c.optimizer.kind = OptimizerKind::muon;
  OptimizerOptions adamw;
  adamw.kind = OptimizerKind::adamw;
  // One unit of two 64 x 64 matrices and a vector (AdamW, group 1), one of a 32 x 128 matrix.
  const std::vector<PlanUnit> units = {
      {"a", {Param{"w1", {64, 64}}, Param{"w2", {64, 64}}, Param{"b", {64}, 1}}},
      {"b", {Param{"w3", {32, 128}}}}};
  Config plain = c;
  plain.optimizer.kind = OptimizerKind::adamw;
  const StepPrediction base = predict_step(plain, units, 2, r, {adamw});
  const StepPrediction p = predict_step(c, units, 2, r, {adamw});
  // 5 steps of 2·m²·n + m³ multiply-adds (m ≤ n): 64 x 64 is 3 · 64³ · 5, at 1.59e9/s (log
  // interpolation between the points); 32 x 128: (2 · 32² · 128 + 32³) · 5.
  const double sq = 3.0 * 64 * 64 * 64 * 5, wide = (2.0 * 32 * 32 * 128 + 32.0 * 32 * 32) * 5;
  auto secs = [](double madds) {  // the rate at madds, interpolated on a log scale
    const double t = std::log(madds / 1e6) / std::log(1e8 / 1e6);
    return madds / std::exp(std::log(1e9) + t * std::log(4.0));
  };
  // Unit a: one matrix per rank (in parallel); unit b: one matrix, on one rank.
  EXPECT_NEAR(p.newton_schulz_s, secs(sq) + secs(wide), 1e-15);
  EXPECT_NEAR(p.optimizer_s, base.optimizer_s + p.newton_schulz_s, 1e-15);
  // Unit a: 4096·2 + 64 elements padded to 8448 (shards of 128-element multiples: 4224). w1
  // [0, 4096) is rank 0's, and in its shard; w2 [4096, 8192) is rank 1's, whose shard starts at
  // 4224: rank 0 sends it 128 elements and gets them back. Unit b: 4096, shards of 2048; w3 goes
  // to rank 0 (both as busy), and rank 1's 2048 elements cross, both ways. Each way is timed
  // as an all-gather moving as much per rank: one of a block that size at 2 ranks.
  auto f32 = [](double elements) { return 10e-6 + elements * 4 / 1e9; };
  EXPECT_NEAR(p.comm_s - base.comm_s, 2 * (f32(128) + f32(2048)), 1e-15);
  // Before point-to-point: an all-gather and a reduce-scatter of every unit's whole shard.
  EXPECT_LT(p.comm_s - base.comm_s, 0.64 * 2 * (f32(4224) + f32(2048)));
  // One rank: the iteration of every matrix, no exchange.
  const StepPrediction one = predict_step(c, units, 1, r, {adamw});
  EXPECT_NEAR(one.newton_schulz_s, 2 * secs(sq) + secs(wide), 1e-15);
  EXPECT_DOUBLE_EQ(one.comm_s, 0);
  // Not measured: refused by name.
  MachineRates none = r;
  none.newton_schulz.clear();
  try {
    (void)predict_step(c, units, 2, none, {adamw});
    FAIL() << "Muon predicted without its iteration's rate";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--ns-gflops"), std::string::npos) << e.what();
  }
}
