#include "apps/report/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace zsdemo {

using zeroshard::MemKind;
using zeroshard::Tier;

namespace {

double mib(int64_t b) {
  return double(b) / double(1 << 20);
}

std::string si(double x) {
  char buf[32];
  if (x >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2f M", x / 1e6);
  else if (x >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1f k", x / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", x);
  return buf;
}

int64_t total(const MemCells& m) {
  int64_t s = 0;
  for (const auto& row : m)
    for (int64_t b : row) s += b;
  return s;
}

int64_t model_states(const MemCells& m) {
  int64_t s = 0;
  for (const auto& row : m)
    for (int k = 0; k < int(MemKind::buffer); ++k) s += row[size_t(k)];
  return s;
}

}  // namespace

void print_header(const RunSummary& s) {
  const DemoOptions& o = *s.options;
  const zeroshard::Config& c = o.config;
  std::printf(
      "zeroshard demo: GPT of %lld layers x %lld wide, %lld heads, context %lld, vocabulary %lld: "
      "%s parameters in %zu units\n",
      (long long)s.shape.layers, (long long)s.shape.dim, (long long)s.shape.heads,
      (long long)s.shape.seq, (long long)s.shape.vocab, si(double(s.params)).c_str(),
      s.units.size());
  std::printf("  data:   %s; %d ranks x %lld sequences x %d micro-steps = %lld tokens per step\n",
              s.data_source.c_str(), s.world, (long long)o.batch, c.gradient_accumulation_steps,
              (long long)s.tokens_per_step);
  std::printf(
      "  engine: ZeRO stage %d, %s parameters and gradients, %s (peak lr %g, %lld warm-up steps, "
      "cosine), clipping %g%s%s\n",
      c.stage, zeroshard::dtype_name(c.dtype), zeroshard::optimizer_name(c.optimizer.kind),
      double(c.optimizer.lr), (long long)o.warmup, c.gradient_clipping,
      c.shard_group_size > 0 && c.shard_group_size < s.world
          ? (", sharded within groups of " + std::to_string(c.shard_group_size) + " ranks").c_str()
          : "",
      o.config_path.empty() ? "" : (", config " + o.config_path).c_str());
  std::printf(
      "  tiers:  optimizer state (%s moments) + %s master weights on %s, parameter shards on %s\n",
      zeroshard::state_format_name(c.optimizer_state), c.bf16_master ? "bf16" : "f32",
      zeroshard::tier_name(c.offload_optimizer.tier),
      zeroshard::tier_name(c.stage == 3 ? c.offload_param.tier : Tier::device));
  std::printf("  validation loss before training: %.4f (uniform guess: %.4f)\n\n", s.val_before,
              std::log(double(s.shape.vocab)));
  std::fflush(stdout);
}

void print_progress(const RunSummary& s, const StepLog& log, double window_s, int64_t window_steps,
                    double elapsed_s) {
  const auto& r = log.result;
  const double tps = window_s > 0 ? double(s.tokens_per_step * window_steps) / window_s : 0;
  const int width = int(std::to_string(s.options->steps).size());
  std::printf("step %*lld/%lld  loss %.4f  %7.0f tok/s  grad norm %6.3f  lr %.2e", width,
              (long long)log.step, (long long)s.options->steps, log.loss, tps,
              r.skipped ? 0.0 : r.grad_norm, double(log.lr));
  if (s.options->config.dtype == zeroshard::DType::f16)
    std::printf("  loss scale %g", double(r.loss_scale));
  if (r.skipped) std::printf("  (overflow: step skipped)");
  if (r.speculation_kept + r.speculation_dropped > 0)  // rank 0's units updated during backward
    std::printf("  speculated: %d kept, %d dropped", r.speculation_kept, r.speculation_dropped);
  std::printf("  %6.1f s\n", elapsed_s);
  std::fflush(stdout);
}

void print_final(const RunSummary& s) {
  const int n = s.world;
  const double first = s.steps.empty() ? 0 : s.steps.front().loss;
  const double last = s.steps.empty() ? 0 : s.steps.back().loss;
  std::printf(
      "\ntrained %lld steps in %.1f s: %.0f tokens/s; training loss %.4f -> %.4f, validation loss "
      "%.4f -> %.4f\n",
      (long long)s.steps.size(), s.train_wall_s,
      s.train_wall_s > 0 ? double(s.tokens_per_step) * double(s.steps.size()) / s.train_wall_s
                         : 0.0,
      first, last, s.val_before, s.val_after);
  if (!s.sample.empty()) std::printf("\nsample (temperature 0.8):\n  %s\n", s.sample.c_str());

  // --- The ledger: tier × kind per rank, next to plain data parallel.
  std::printf(
      "\nmemory per rank (MiB, the engine's ledger) vs plain data parallel (a stage-0 engine on "
      "the same model)\n");
  std::printf("  %-20s", "tier / kind");
  for (int r = 0; r < n; ++r) std::printf(" %9s", ("rank " + std::to_string(r)).c_str());
  std::printf(" %14s\n", "data parallel");
  const bool dp = s.options->dp_reference;
  // One cell of the data-parallel column: "-" when it was not measured.
  auto dp_cell = [&](int64_t bytes) {
    if (dp)
      std::printf(" %14.2f\n", mib(bytes));
    else
      std::printf(" %14s\n", "-");
  };
  for (int t = 0; t < zeroshard::kNumTiers; ++t) {
    for (int k = 0; k < zeroshard::kNumMemKinds; ++k) {
      bool any = s.dp_bytes[size_t(t)][size_t(k)] != 0;
      for (int r = 0; r < n; ++r) any |= s.rank_bytes[size_t(r)][size_t(t)][size_t(k)] != 0;
      if (!any) continue;
      std::string label =
          std::string(zeroshard::tier_name(Tier(t))) + " " + zeroshard::mem_kind_name(MemKind(k));
      std::printf("  %-20s", label.c_str());
      for (int r = 0; r < n; ++r)
        std::printf(" %9.2f", mib(s.rank_bytes[size_t(r)][size_t(t)][size_t(k)]));
      dp_cell(s.dp_bytes[size_t(t)][size_t(k)]);
    }
  }
  std::printf("  %-20s", "model states");
  for (int r = 0; r < n; ++r) std::printf(" %9.2f", mib(model_states(s.rank_bytes[size_t(r)])));
  dp_cell(model_states(s.dp_bytes));
  std::printf("  %-20s", "total");
  for (int r = 0; r < n; ++r) std::printf(" %9.2f", mib(total(s.rank_bytes[size_t(r)])));
  dp_cell(total(s.dp_bytes));
  std::printf("  buffers on rank 0:");
  for (const auto& b : s.rank0.buffers)
    if (b.bytes) std::printf(" %s %.2f", b.name.c_str(), mib(b.bytes));
  std::printf("\n");
  const int64_t ms = model_states(s.rank_bytes[0]), dms = model_states(s.dp_bytes);
  if (ms > 0 && dp)
    std::printf(
        "  plain data parallel holds %.2fx the model states of rank 0 (%.2f vs %.2f MiB), "
        "%.2fx counting working buffers\n",
        double(dms) / double(ms), mib(dms), mib(ms),
        double(total(s.dp_bytes)) / double(std::max<int64_t>(1, total(s.rank_bytes[0]))));

  // --- Step-time breakdown: compute, exposed communication, optimizer.
  const RankTimes* t0 = s.times.empty() ? nullptr : &s.times[0];
  if (!t0 || t0->steps == 0) return;
  RankTimes mean;
  for (const RankTimes& t : s.times) {
    mean.interval += t.interval / n, mean.optimizer += t.optimizer / n,
        mean.exposed += t.exposed / n;
    mean.busy += t.busy / n, mean.compute += t.compute / n;
    mean.newton_schulz += t.newton_schulz / n;
  }
  mean.steps = t0->steps;
  std::printf("\nstep time (ms per step, mean of steps 2..%lld)\n", (long long)(t0->steps + 1));
  std::printf("  %-44s", "");
  for (int r = 0; r < n; ++r) std::printf(" %8s", ("rank " + std::to_string(r)).c_str());
  std::printf(" %8s %7s\n", "mean", "share");
  auto row = [&](const char* label, auto get, bool share) {
    std::printf("  %-44s", label);
    for (const RankTimes& t : s.times) std::printf(" %8.1f", 1e3 * get(t) / double(t.steps));
    std::printf(" %8.1f", 1e3 * get(mean) / double(mean.steps));
    if (share) std::printf(" %6.1f%%", 100.0 * get(mean) / std::max(1e-12, mean.interval));
    std::printf("\n");
  };
  row(
      "step interval", [](const RankTimes& t) { return t.interval; }, false);
  row(
      "compute: forward + backward (trainer)", [](const RankTimes& t) { return t.compute; }, true);
  row(
      "exposed communication (waits)", [](const RankTimes& t) { return t.exposed; }, true);
  row(
      "optimizer", [](const RankTimes& t) { return t.optimizer; }, true);
  if (mean.newton_schulz > 0)
    row(
        "  of which Muon's Newton-Schulz iteration",
        [](const RankTimes& t) { return t.newton_schulz; }, true);
  row(
      "other (engine bookkeeping, logging)",
      [](const RankTimes& t) { return t.interval - t.compute - t.exposed - t.optimizer; }, true);
  row(
      "communication busy (hidden or not)", [](const RankTimes& t) { return t.busy; }, false);
  std::printf("  %-44s", "communication hidden behind compute");
  for (const RankTimes& t : s.times)
    std::printf(" %7.0f%%", t.busy > 0 ? 100.0 * (1.0 - std::min(1.0, t.exposed / t.busy)) : 100.0);
  std::printf(" %7.0f%%\n",
              mean.busy > 0 ? 100.0 * (1.0 - std::min(1.0, mean.exposed / mean.busy)) : 100.0);
  std::printf("  %-44s", "collectives sent (MiB per step; ring count)");
  for (const RankTimes& t : s.times)
    std::printf(" %8.2f", mib(int64_t(t.comm_bytes / double(t.steps))));
  std::printf("\n  %-44s", "  of which to other hosts");
  for (const RankTimes& t : s.times)
    std::printf(" %8.2f", mib(int64_t(t.inter_node_bytes / double(t.steps))));
  std::printf("\n");
  std::fflush(stdout);
}

void write_json(const RunSummary& s, const std::string& path) {
  using nlohmann::json;
  const DemoOptions& o = *s.options;
  const zeroshard::Config& c = o.config;
  auto cells = [](const MemCells& m) {
    json j = json::object();
    for (int t = 0; t < zeroshard::kNumTiers; ++t) {
      json row = json::object();
      for (int k = 0; k < zeroshard::kNumMemKinds; ++k)
        row[zeroshard::mem_kind_name(MemKind(k))] = m[size_t(t)][size_t(k)];
      j[zeroshard::tier_name(Tier(t))] = row;
    }
    return j;
  };
  auto buffers = [](const zeroshard::MemoryReport& r) {
    json j = json::object();
    for (const auto& b : r.buffers)
      j[b.name] = {{"tier", zeroshard::tier_name(b.tier)}, {"bytes", b.bytes}, {"peak", b.peak}};
    return j;
  };
  json j;
  j["world_size"] = s.world;
  j["config"] = {{"stage", c.stage},
                 {"dtype", zeroshard::dtype_name(c.dtype)},
                 {"optimizer", zeroshard::optimizer_name(c.optimizer.kind)},
                 {"optimizer_state", zeroshard::state_format_name(c.optimizer_state)},
                 {"master_weights", c.bf16_master ? "bf16" : "f32"},
                 {"gradient_accumulation_steps", c.gradient_accumulation_steps},
                 {"shard_alignment", c.shard_alignment},
                 {"grad_buffers", c.grad_buffers},
                 {"max_live_units", c.max_live_units},
                 {"offload_optimizer", zeroshard::tier_name(c.offload_optimizer.tier)},
                 {"offload_param", zeroshard::tier_name(c.offload_param.tier)},
                 {"gradient_clipping", c.gradient_clipping},
                 {"peak_lr", c.optimizer.lr}};
  j["model"] = {{"vocab", s.shape.vocab},   {"seq", s.shape.seq},     {"dim", s.shape.dim},
                {"layers", s.shape.layers}, {"heads", s.shape.heads}, {"params", s.params}};
  j["units"] = json::array();
  for (const UnitRow& u : s.units)
    j["units"].push_back({{"name", u.name},
                          {"numel", u.numel},
                          {"padded_numel", u.padded_numel},
                          {"shard_numel", u.shard_numel}});
  j["batch"] = o.batch;
  j["tokens_per_step"] = s.tokens_per_step;
  j["losses"] = json::array();
  j["steps"] = json::array();
  for (const StepLog& l : s.steps) {
    j["losses"].push_back(l.loss);
    j["steps"].push_back({{"step", l.step},
                          {"loss", l.loss},
                          {"grad_norm", l.result.skipped ? -1.0 : l.result.grad_norm},
                          {"skipped", l.result.skipped},
                          {"loss_scale", l.result.loss_scale},
                          {"speculation_kept", l.result.speculation_kept},
                          {"speculation_dropped", l.result.speculation_dropped},
                          {"lr", l.lr}});
  }
  j["validation_loss"] = {{"before", s.val_before}, {"after", s.val_after}};
  j["train_wall_s"] = s.train_wall_s;
  j["memory"] = {{"ranks", json::array()}, {"peak_ranks", json::array()}};
  for (const MemCells& m : s.rank_bytes) j["memory"]["ranks"].push_back(cells(m));
  for (const MemCells& m : s.rank_peak) j["memory"]["peak_ranks"].push_back(cells(m));
  j["memory"]["rank0_buffers"] = buffers(s.rank0);
  if (s.options->dp_reference) {
    j["memory"]["data_parallel"] = cells(s.dp_bytes);
    j["memory"]["data_parallel_rank0_buffers"] = buffers(s.dp0);
  }
  j["time"] = json::array();
  for (const RankTimes& t : s.times)
    j["time"].push_back(
        {{"steps", t.steps},
         {"interval_s", t.interval},
         {"optimizer_s", t.optimizer},
         {"newton_schulz_s", t.newton_schulz},
         {"comm_exposed_s", t.exposed},
         {"comm_busy_s", t.busy},
         {"compute_s", t.compute},
         {"comm_bytes", t.comm_bytes},
         {"inter_node_bytes", t.inter_node_bytes},
         {"comm_hidden_fraction", t.busy > 0 ? 1.0 - std::min(1.0, t.exposed / t.busy) : 1.0}});
  j["sample"] = s.sample;
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) throw std::runtime_error("cannot write " + path);
}

}  // namespace zsdemo
