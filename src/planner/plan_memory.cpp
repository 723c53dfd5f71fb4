// plan_memory() (zeroshard/planner.hpp): an engine built on a communicator that answers one
// rank's collectives locally, finalized with a ledger that counts its buffers instead of
// allocating them.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>

#include "base/check.hpp"
#include "kernels/cpu/newton_schulz.hpp"
#include "src/comm/split_check.hpp"
#include "src/comm/work_state.hpp"
#include "src/engine_impl.hpp"
#include "src/muon_exchange.hpp"
#include "zeroshard/planner.hpp"

namespace zeroshard {

namespace fs = std::filesystem;

namespace {

// Rank `rank` of `size` ranks that all hold what this one holds: a gather repeats its part, a
// sum multiplies it, a broadcast keeps it. finalize() needs no more (the model check, the
// agreement on a failure); gradients are never reduced in a plan.
class PlanCommunicator final : public Communicator {
 public:
  PlanCommunicator(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::shared_ptr<Work> reduce_scatter(const void*, void*, int64_t, DType,
                                       std::string what) override {
    ZS_THROW(internal, "plan_memory(): a plan runs no " << what);
  }
  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t count, DType dtype,
                                   std::string what) override {
    const size_t bytes = size_t(count) * dtype_size(dtype);
    for (int r = 0; r < size_; ++r)
      if (static_cast<char*>(recv) + size_t(r) * bytes != send)
        std::memmove(static_cast<char*>(recv) + size_t(r) * bytes, send, bytes);
    return done_work(std::move(what));
  }
  std::shared_ptr<Work> all_reduce(double* x, int64_t n, ReduceOp op, std::string what) override {
    if (op == ReduceOp::sum)
      for (int64_t i = 0; i < n; ++i) x[i] *= size_;
    return done_work(std::move(what));
  }
  std::shared_ptr<Work> all_reduce_sum(void*, int64_t, DType, std::string what) override {
    ZS_THROW(internal, "plan_memory(): a plan runs no " << what);
  }
  std::shared_ptr<Work> broadcast(void*, int64_t, int, std::string what) override {
    return done_work(std::move(what));
  }
  std::shared_ptr<Work> all_to_all(const void*, const Pieces&, void*, const Pieces&, DType,
                                   std::string what) override {
    ZS_THROW(internal, "plan_memory(): a plan runs no " << what);
  }
  void barrier(std::string) override {}
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, std::string what) override {
    check_split(ranks, rank_, size_, what);
    const auto at = std::find(ranks.begin(), ranks.end(), rank_);
    return std::make_shared<PlanCommunicator>(int(at - ranks.begin()), int(ranks.size()));
  }
  void set_timeout(double) override {}

 private:
  int rank_, size_;
};

// The GPU a GPU engine's plan stands on, on a machine that need not have one: an engine with it
// finalizes as on the GPU (the same tiers, staging slots and pinned buffers, by
// Compute::streams()), and its ledger counts the memory that is never allocated. It runs nothing.
class PlanDevice final : public Compute {
 public:
  Device device() const override { return Device::cuda; }
  int device_index() const override { return 0; }
  bool streams() const override { return true; }
  Allocator* device_memory() override { return &none_; }
  Allocator* pinned_memory() override { return &none_; }
  void fill(void*, unsigned char, size_t) override { refuse("a fill"); }
  void convert(const void*, DType, void*, DType, int64_t) override { refuse("a conversion"); }
  void accumulate(float*, const void*, DType, int64_t) override { refuse("an accumulation"); }
  void update(const std::vector<cpu::UpdateHyper>&, const std::vector<UnitUpdate>&) override {
    refuse("an update");
  }
  void muon_average(const cpu::UpdateArgs&, const cpu::UpdateHyper&, int64_t, int64_t,
                    float*) override {
    refuse("Muon average");
  }
  void newton_schulz(float*, int64_t, int64_t, const cpu::NsOptions&, float*) override {
    refuse("Newton-Schulz iteration");
  }
  std::pair<double, bool> sum_squares(const std::vector<GradSpan>&) override { refuse("a norm"); }
  void copy(void*, const void*, size_t) override { refuse("a copy"); }
  void download(void*, const void*, size_t) override { refuse("a copy"); }
  void synchronize() override {}
  void hand_to_trainer() override {}
  std::shared_ptr<void> register_host(void*, size_t) override { return nullptr; }
  std::shared_ptr<Communicator> adapt(std::shared_ptr<Communicator> comm) override { return comm; }
  void before_collective() override {}
  void* stream() const override { return nullptr; }
  void set_stream(void*) override {}

 private:
  [[noreturn]] static void refuse(const char* what) {
    ZS_THROW(internal, "plan_memory(): a plan's GPU runs no " << what);
  }
  struct NoMemory final : Allocator {
    void* allocate(size_t, const std::string& name) override {
      ZS_THROW(internal, "plan_memory(): a plan allocates nothing (" << name << ")");
    }
    void deallocate(void*) noexcept override {}
  } none_;
};

// A temporary directory for the plan's sparse swap files, removed with it.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "zeroshard-plan-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) ZS_THROW(io_error, "plan_memory(): cannot create " << tmpl);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// The configured nvme paths, each distinct one (as the swap space tells them apart) mapped to a
// directory of its own under `tmp`: the files are striped over as many paths as configured.
void redirect(std::vector<std::string>& paths, const fs::path& tmp,
              std::map<std::string, std::string>& seen) {
  for (std::string& p : paths) {
    const std::string key = fs::path(p).lexically_normal().string();
    auto it = seen.find(key);
    if (it == seen.end()) {
      const fs::path d = tmp / ("path" + std::to_string(seen.size()));
      fs::create_directories(d);
      it = seen.emplace(key, d.string()).first;
    }
    p = it->second;
  }
}

}  // namespace

struct PlanAccess {
  // An engine on `comm`, on the plan's GPU for a GPU engine.
  static Engine engine(const Config& cfg, std::shared_ptr<Communicator> comm) {
    return Engine(std::make_unique<Engine::Impl>(
        cfg, std::move(comm),
        cfg.device == Device::cpu ? nullptr : std::make_unique<PlanDevice>()));
  }
  static MemoryReport plan(Engine& e) {
    Engine::Impl& m = *e.impl_;
    m.res.ledger.count_only();
    e.finalize();
    return e.memory();
  }
};

MemoryReport plan_memory(const Config& cfg, const std::vector<PlanUnit>& units, int world, int rank,
                         const std::vector<OptimizerOptions>& groups) {
  if (world < 1 || rank < 0 || rank >= world)
    ZS_THROW(invalid_argument, "plan_memory(): rank " << rank << " of " << world << " ranks");
  Config c = cfg;
  TempDir tmp;
  std::map<std::string, std::string> seen;
  redirect(c.offload_optimizer.nvme_paths, tmp.path, seen);
  redirect(c.offload_param.nvme_paths, tmp.path, seen);
  std::vector<PlanUnit> bare = units;
  for (PlanUnit& u : bare)
    for (Param& p : u.params) p.init = TensorView{};
  Engine e = PlanAccess::engine(c, std::make_shared<PlanCommunicator>(rank, world));
  for (const OptimizerOptions& g : groups) e.add_group(g);
  for (PlanUnit& u : bare) e.add_unit(u.name, std::move(u.params));
  return PlanAccess::plan(e);
}

namespace {

// The rank of a shard group of `ranks` whose Muon buffers are the largest: the exchange (its
// largest matrix) and the iteration's scratch, both f32 on one tier, with the engine's owners
// (muon_matrices()). Every other rank holds what it holds but for those two buffers and the last
// rank's padding.
int largest_muon_rank(const Config& cfg, const std::vector<PlanUnit>& units,
                      const std::vector<OptimizerOptions>& groups, int ranks) {
  std::vector<OptimizerOptions> all_groups = {cfg.optimizer};
  all_groups.insert(all_groups.end(), groups.begin(), groups.end());
  std::vector<double> load(size_t(ranks), 0.0);
  std::vector<int64_t> biggest(size_t(ranks), 0), scratch(size_t(ranks), 0);
  for (const PlanUnit& u : units)
    for (const MuonMatrix& m :
         muon_matrices(plan_unit(u.name, u.params, ranks, padding_grain(cfg)), all_groups, load)) {
      const size_t r = size_t(m.owner);
      biggest[r] = std::max(biggest[r], m.numel());
      scratch[r] = std::max(scratch[r], cpu::newton_schulz_scratch(m.rows, m.cols));
    }
  int most = 0;
  for (int r = 1; r < ranks; ++r)
    if (biggest[size_t(r)] + scratch[size_t(r)] > biggest[size_t(most)] + scratch[size_t(most)])
      most = r;
  return most;
}

}  // namespace

std::vector<PlanChoice> plan_choices(const Config& base, const std::vector<PlanUnit>& units,
                                     int world, const std::vector<OptimizerOptions>& groups) {
  std::vector<PlanChoice> out;
  std::optional<Error> refused;
  bool muon = base.optimizer.kind == OptimizerKind::muon;
  for (const OptimizerOptions& g : groups) muon |= g.kind == OptimizerKind::muon;
  const int muon_rank =
      muon ? largest_muon_rank(base, units, groups,
                               base.shard_group_size > 0 ? base.shard_group_size : world)
           : 0;
  for (int stage = 0; stage <= 3; ++stage)
    for (Tier opt : {Tier::device, Tier::host, Tier::nvme})
      for (Tier par : {Tier::device, Tier::host, Tier::nvme}) {
        if ((stage < 3 && par != Tier::device) || (stage == 0 && opt == Tier::nvme)) continue;
        // Groups smaller than the world shard: stage 0 shards nothing, so it has none.
        if (stage == 0 && base.shard_group_size > 0 && base.shard_group_size < world) continue;
        Config cfg = base;
        cfg.stage = stage;
        cfg.offload_optimizer.tier = opt;
        cfg.offload_param.tier = par;
        // The plan lays swap files out in a directory of its own: any path stands for a disk.
        for (OffloadOptions* o : {&cfg.offload_optimizer, &cfg.offload_param})
          if (o->nvme_paths.empty()) o->nvme_paths = {"nvme"};
        // A choice the engine refuses (Config::validate(): a GPU engine's, or Muon's with
        // stage 3's parameters on nvme beside the state in memory) is not a choice; where every
        // choice is refused, the base is, and the first reason is said.
        try {
          cfg.validate();
        } catch (const Error& e) {
          if (!refused) refused = e;
          continue;
        }
        PlanChoice c{stage, opt, par, {}, 0, cfg};
        // Shards differ only where the padding falls (the last rank); Muon's buffers follow the
        // matrices a rank orthogonalises: the rank with the largest is planned too.
        std::vector<int> ranks = {0, world - 1};
        if (muon && muon_rank != 0 && muon_rank != world - 1) ranks.push_back(muon_rank);
        for (int r : ranks) {
          const MemoryReport m = plan_memory(cfg, units, world, r, groups);
          for (int t = 0; t < kNumTiers; ++t) {
            int64_t sum = 0;
            for (int k = 0; k < kNumMemKinds; ++k) sum += m.bytes[t][k];
            c.tier_bytes[t] = std::max(c.tier_bytes[t], sum);
          }
          c.model_states = std::max(c.model_states, m.model_state_bytes());
          if (world == 1) break;
        }
        out.push_back(c);
      }
  if (out.empty() && refused) throw *refused;  // `base` itself is refused
  return out;
}

}  // namespace zeroshard
