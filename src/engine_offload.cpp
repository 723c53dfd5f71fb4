// Engine: the NVMe tier. Swap files and staging pools (set-up), initial values, the gradient
// cache, the swap-pipelined optimizer step with its all-or-nothing commit, stage-3 parameter
// swap-in for gather(), and state access (read_shard/write_shard/commit_shards) from disk.
// See engine_offload.hpp for what lives where.
#include "src/engine_offload.hpp"

#include <tbb/task_arena.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "src/base/check.hpp"
#include "src/engine_impl.hpp"
#include "offload/io_backend.hpp"
#include "offload/swap_pipeline.hpp"

namespace zeroshard {

using offload::IoBatch;
using offload::Piece;

namespace {
size_t a4k(size_t n) {
  return (n + 4095) / 4096 * 4096;
}
}  // namespace

Engine::Impl::~Impl() = default;

bool Engine::Impl::opt_nvme() const {
  return nv && nv->opt;
}
bool Engine::Impl::par_nvme() const {
  return nv && nv->par;
}

// The lowest failing rank's error is broadcast, so every rank's message names the path, unit
// and operation that failed. Costs one small all-reduce when nothing failed.
std::optional<Error> Engine::Impl::agree(const std::optional<Error>& mine,
                                         const std::string& what) {
  if (world == 1) return mine;
  double first = mine ? double(rank) : double(world);
  comm->all_reduce(&first, 1, ReduceOp::min, what + " (failure check)")->wait();
  if (first >= world) return std::nullopt;
  const int src = int(first);
  std::string msg = rank == src ? std::string(mine->what()) : std::string();
  double meta[2] = {rank == src ? double(int(mine->code())) : 0.0, double(msg.size())};
  comm->broadcast(meta, int64_t(sizeof meta), src, what + " (failure code)")->wait();
  msg.resize(size_t(meta[1]));
  if (!msg.empty())
    comm->broadcast(msg.data(), int64_t(msg.size()), src, what + " (failure message)")->wait();
  const ErrorCode code = ErrorCode(int(meta[0]));
  if (rank == src) return Error(code, msg);
  return Error(code, "rank " + std::to_string(rank) + ": " + what + " failed on rank " +
                         std::to_string(src) + ": " + msg);
}

RecordLayout Engine::Impl::record_layout(const Unit& u) const {
  RecordLayout r;
  const size_t S = size_t(u.layout.shard_numel);
  r.sec = a4k(S * 4);
  r.record = r.sec * size_t(1 + num_states());
  r.grad_off = r.record;
  r.grad_sec = opt_nvme() ? a4k(S * (cfg.gradient_accumulation_steps > 1 ? 4 : pbytes)) : 0;
  r.lowp_off = r.grad_off + r.grad_sec;
  r.lowp_sec = par_nvme() ? a4k(S * pbytes) : 0;
  r.total = r.lowp_off + r.lowp_sec;
  return r;
}

// ---- set-up ------------------------------------------------------------------------------------

void Engine::Impl::nvme_setup() {
  nv = std::make_unique<NvmeState>();
  NvmeState& n = *nv;
  n.opt = cfg.offload_optimizer.tier == Tier::nvme;
  n.par = cfg.stage == 3 && cfg.offload_param.tier == Tier::nvme;
  n.preallocate = offload::testing::hooks().preallocate;
  n.units.resize(units.size());

  // One run directory per distinct path, shared by both tiers' files.
  std::map<std::string, size_t> dir_of;
  auto dirs_for = [&](const std::vector<std::string>& paths) {
    std::vector<const offload::RunDir*> out;
    for (const std::string& p : paths) {
      std::string key = std::filesystem::path(p).lexically_normal().string();
      auto it = dir_of.find(key);
      if (it == dir_of.end()) {
        n.dirs.emplace_back(p, rank);
        it = dir_of.emplace(key, n.dirs.size() - 1).first;
      }
      out.push_back(&n.dirs[it->second]);
    }
    return out;
  };
  n.dirs.reserve(cfg.offload_optimizer.nvme_paths.size() + cfg.offload_param.nvme_paths.size());
  const int k = cfg.gradient_accumulation_steps;
  const size_t gbytes = k > 1 ? 4 : pbytes;
  int64_t max_shard = 0;
  size_t max_slot = 0;
  for (const Unit& u : units) {
    max_shard = std::max(max_shard, u.layout.shard_numel);
    max_slot = std::max(max_slot, record_layout(u).total);
  }
  const int ns = num_states();
  int64_t sum_shard = 0;
  for (const Unit& u : units) sum_shard += u.layout.shard_numel;

  if (n.opt) {
    n.opt_store =
        offload::SwapStore("optimizer state", "optim.swap",
                           dirs_for(cfg.offload_optimizer.nvme_paths), cfg.aio.block_size);
    for (size_t i = 0; i < units.size(); ++i) {
      const RecordLayout L = record_layout(units[i]);
      n.units[i].rec[0] = n.opt_store.add_extent(L.record);
      n.units[i].rec[1] = n.opt_store.add_extent(L.record);
      n.units[i].grad = n.opt_store.add_extent(size_t(units[i].layout.shard_numel) * gbytes);
    }
    n.opt_store.open(n.preallocate);
    const int count = cfg.offload_optimizer.buffer_count;
    const bool pin = cfg.offload_optimizer.pin_memory;
    n.swap_pool = offload::PinnedPool(&ledger, "swap_staging", count, max_slot, pin);
    // Gradient cache: reduce-scatter output, then (accumulation) the f32 sum.
    n.grad_acc_off = a4k(size_t(max_shard) * pbytes);
    n.grad_pool =
        offload::PinnedPool(&ledger, "grad_cache", cfg.grad_buffers + 1,
                            n.grad_acc_off + (k > 1 ? a4k(size_t(max_shard) * 4) : 0), pin);
    for (int i = 0; i < n.grad_pool.count(); ++i)  // reduced shards land here from the GPU
      if (auto h = dev->register_host(n.grad_pool.data(i), n.grad_pool.bytes()))
        n.dma.push_back(std::move(h));
    n.read_ahead = cfg.swap_read_ahead > 0 ? cfg.swap_read_ahead : std::max(1, count - 2);
    n.read_ahead = std::min(n.read_ahead, count - 1);
    // The ledger's nvme column: one slot of each state (what the tier holds), and the rest of
    // the files (the second record slots and alignment) as "swap_reserve".
    int64_t logical = 0;
    auto charge = [&](MemKind kind, const char* name, int64_t bytes) {
      if (bytes <= 0) return;
      n.charges.push_back(std::make_unique<DiskCharge>(&ledger, kind, name, bytes));
      logical += bytes;
    };
    charge(MemKind::master, "master", sum_shard * 4);
    charge(MemKind::optim_state, "optim_state", int64_t(ns) * sum_shard * 4);
    charge(MemKind::grad, "grad", sum_shard * int64_t(gbytes));
    charge(MemKind::buffer, "swap_reserve", int64_t(n.opt_store.file_bytes()) - logical);
  }
  if (n.par) {
    n.par_store = offload::SwapStore("parameters", "param.swap",
                                     dirs_for(cfg.offload_param.nvme_paths), cfg.aio.block_size);
    for (size_t i = 0; i < units.size(); ++i) {
      n.units[i].par[0] = n.par_store.add_extent(size_t(units[i].layout.shard_numel) * pbytes);
      n.units[i].par[1] = n.par_store.add_extent(size_t(units[i].layout.shard_numel) * pbytes);
    }
    n.par_store.open(n.preallocate);
    n.param_pool = offload::PinnedPool(&ledger, "param_staging", cfg.offload_param.buffer_count,
                                       size_t(max_shard) * pbytes, cfg.offload_param.pin_memory);
    const int64_t held = sum_shard * int64_t(pbytes);
    n.charges.push_back(std::make_unique<DiskCharge>(&ledger, MemKind::param, "param", held));
    n.charges.push_back(std::make_unique<DiskCharge>(&ledger, MemKind::buffer, "swap_reserve",
                                                     int64_t(n.par_store.file_bytes()) - held));
    if (!n.opt)  // the two-pass update computes the new shards on copies of the state
      n.scratch = Buffer(&ledger, Tier::host, MemKind::buffer, "update_scratch",
                         size_t(res.threads()) * 3 * size_t(Resources::kChunk) * 4);
  }

  // One ring for both tiers: the files of both stores and every staging slot, registered once.
  offload::BackendSetup setup;
  std::vector<std::string> names;
  for (offload::SwapStore* st : {&n.opt_store, &n.par_store}) {
    std::vector<int> fds = st->fds();
    if (fds.empty()) continue;
    st->set_file_base(int(setup.fds.size()));
    setup.fds.insert(setup.fds.end(), fds.begin(), fds.end());
    for (std::string& s : st->file_names()) names.push_back(std::move(s));
  }
  n.swap_pool.append_iovecs(setup.buffers);
  n.grad_pool.append_iovecs(setup.buffers);
  n.param_pool.append_iovecs(setup.buffers);
  setup.queue_depth = cfg.aio.queue_depth;
  n.io = std::make_unique<offload::IoQueue>(offload::make_backend(setup), std::move(names));
}

// Initial values go through f32 once, as in memory: the record's master is the shard of
// `whole`, its optimizer state zero, and the low-precision shard is rounded from the master.
// Writes overlap (one per free staging slot); nvme_finish_load() waits for them all.
void Engine::Impl::nvme_load_initial(int id, const float* whole) {
  NvmeState& n = *nv;
  Unit& u = units[size_t(id)];
  NvmeUnit& nu = n.units[size_t(id)];
  const int64_t S = u.layout.shard_numel;
  const float* shard = whole ? whole + rank * S : nullptr;
  auto slot_of = [&](offload::PinnedPool& pool) {
    for (;;) {
      int s = pool.try_acquire();
      if (s >= 0) return s;
      // Wait for the oldest write of that pool to free its slot.
      auto it = std::find_if(n.init_writes.begin(), n.init_writes.end(),
                             [&](auto& w) { return w.second.first == &pool; });
      ZS_CHECK(it != n.init_writes.end());
      n.io->settle(*it->first);
      if (!n.deferred) n.deferred = it->first->error();
      pool.release(it->second.second);
      n.init_writes.erase(it);
    }
  };
  const std::string at = "rank " + std::to_string(rank) + ": nvme swap: writing the initial ";
  if (n.opt) {
    const RecordLayout L = record_layout(u);
    int s = slot_of(n.swap_pool);
    char* b = n.swap_pool.data(s);
    std::memset(b, 0, L.record);
    if (shard) std::memcpy(b, shard, size_t(S) * 4);
    std::vector<Piece> ps;
    n.opt_store.pieces(nu.rec[0], b, &n.swap_pool, true, ps);
    n.init_writes.push_back(
        {n.io->submit(std::move(ps), at + "optimizer state of unit '" + u.layout.name + "'"),
         {&n.swap_pool, s}});
    nu.cur = 0;
  } else if (shard && !u.master_buf.empty()) {
    std::memcpy(u.master, shard,
                size_t(S) * 4);  // optimizer in memory (stage 3, parameters on nvme)
  }
  if (n.par) {
    int s = slot_of(n.param_pool);
    char* b = n.param_pool.data(s);
    std::memset(b, 0, n.param_pool.bytes());
    if (shard) cpu::convert(res.isa(), shard, DType::f32, b, pdt, S);
    std::vector<Piece> ps;
    n.par_store.pieces(nu.par[0], b, &n.param_pool, true, ps);
    n.init_writes.push_back(
        {n.io->submit(std::move(ps), at + "parameters of unit '" + u.layout.name + "'"),
         {&n.param_pool, s}});
    nu.pcur = 0;
  } else if (whole) {
    // Parameters in memory: the whole unit in stages 1–2, the shard in stage 3.
    if (cfg.stage == 3)
      write_params(u.param, shard, S);
    else
      write_params(u.param, whole, u.layout.padded_numel);
  }
}

void Engine::Impl::nvme_finish_load() {
  NvmeState& n = *nv;
  for (auto& [batch, where] : n.init_writes) {
    n.io->settle(*batch);
    if (!n.deferred) n.deferred = batch->error();
    where.first->release(where.second);
  }
  n.init_writes.clear();
  if (n.deferred) {
    Error e = *n.deferred;
    n.deferred.reset();
    throw e;
  }
}

// ---- the gradient cache (offload_optimizer nvme)
// -------------------------------------------------

namespace {

// The update writes only the elements of parameters; a staging slot's padding would hold what an
// earlier unit left there. Padding is zero everywhere else (gather buffers, checkpoints).
void zero_padding(const Unit& u, char* shard, size_t esize) {
  int64_t at = 0;
  for (const GroupRun& r : u.shard_runs) {
    if (r.begin > at) std::memset(shard + size_t(at) * esize, 0, size_t(r.begin - at) * esize);
    at = std::max(at, r.end);
  }
  if (u.layout.shard_numel > at)
    std::memset(shard + size_t(at) * esize, 0, size_t(u.layout.shard_numel - at) * esize);
}

// Removes `id` from a deque of unit ids.
void erase_id(std::deque<int>& d, int id) {
  auto it = std::find(d.begin(), d.end(), id);
  if (it != d.end()) d.erase(it);
}

}  // namespace

// grads_ready(): the unit's reduce-scatter lands in its cache slot. Under accumulation a unit
// keeps its slot across micro-steps (the sum lives there) unless it was evicted meanwhile.
void Engine::Impl::nvme_grad_target(int id) {
  NvmeState& n = *nv;
  NvmeUnit& nu = n.units[size_t(id)];
  // Writes that finished give their slots back.
  auto reap = [&](bool block) {
    while (!n.evicting.empty()) {
      NvmeUnit& v = n.units[size_t(n.evicting.front())];
      if (!block && !v.grad_write->done()) return;
      n.io->settle(*v.grad_write);
      if (!n.deferred) n.deferred = v.grad_write->error();
      v.grad_write.reset();
      n.grad_pool.release(v.wslot);
      v.wslot = -1;
      n.evicting.pop_front();
      block = false;
    }
  };
  // Writes the oldest cached gradient other than `id` to its extent.
  auto evict = [&]() -> bool {
    for (int v : n.grad_fifo) {
      if (v == id) continue;
      finish_reduction(v);  // its reduction must have landed (it usually has, long ago)
      NvmeUnit& w = n.units[size_t(v)];
      Unit& wu = units[size_t(v)];
      char* slot = n.grad_pool.data(w.gslot);
      char* data = cfg.gradient_accumulation_steps > 1 ? slot + n.grad_acc_off : slot;
      std::vector<Piece> ps;
      n.opt_store.pieces(w.grad, data, &n.grad_pool, true, ps);
      w.grad_write = n.io->submit(std::move(ps), "rank " + std::to_string(rank) +
                                                     ": nvme swap write of the gradient of unit '" +
                                                     wu.layout.name + "'");
      w.wslot = w.gslot;
      w.gslot = -1;
      w.grad_on_disk = true;
      erase_id(n.grad_fifo, v);
      n.evicting.push_back(v);
      return true;
    }
    return false;
  };
  if (nu.gslot < 0) {
    reap(false);
    for (;;) {
      nu.gslot = n.grad_pool.try_acquire();
      if (nu.gslot >= 0) break;
      if (!n.evicting.empty())
        reap(true);
      else
        ZS_CHECK(evict());
    }
    n.grad_fifo.push_back(id);
  }
  units[size_t(id)].grad_shard = n.grad_pool.data(nu.gslot);
  // Keep a slot free for the next unit: its eviction then overlaps this unit's reduction.
  if (n.grad_pool.free_count() == 0 && n.evicting.empty()) evict();
}

// finish_reduction(): the reduce-scatter output is in the unit's slot. Accumulate it (reading an
// evicted partial sum back first) and, once final, take its sum of squares for the norm.
void Engine::Impl::nvme_grad_reduced(int id) {
  NvmeState& n = *nv;
  NvmeUnit& nu = n.units[size_t(id)];
  Unit& u = units[size_t(id)];
  const int k = cfg.gradient_accumulation_steps;
  const int64_t S = u.layout.shard_numel;
  ZS_CHECK(nu.gslot >= 0);
  char* slot = n.grad_pool.data(nu.gslot);
  if (k == 1) {
    nu.sumsq = res.parallel_sum(S, [&](int64_t b, int64_t e) {
      return cpu::sum_squares(res.isa(), slot + size_t(b) * pbytes, pdt, e - b);
    });
    return;
  }
  float* acc = reinterpret_cast<float*>(slot + n.grad_acc_off);
  if (u.micro_done == 0) {
    res.parallel_chunks(S, [&](int64_t b, int64_t e) {
      cpu::convert(res.isa(), slot + size_t(b) * pbytes, pdt, acc + b, DType::f32, e - b);
    });
  } else {
    if (nu.grad_on_disk) {
      // The partial sum was evicted: wait for its write, then read it back.
      if (nu.grad_write) {
        n.io->settle(*nu.grad_write);
        if (!n.deferred) n.deferred = nu.grad_write->error();
        nu.grad_write.reset();
        n.grad_pool.release(nu.wslot);
        nu.wslot = -1;
        erase_id(n.evicting, id);
      }
      std::vector<Piece> ps;
      n.opt_store.pieces(nu.grad, reinterpret_cast<char*>(acc), &n.grad_pool, false, ps);
      auto rd =
          n.io->submit(std::move(ps), "rank " + std::to_string(rank) +
                                          ": nvme swap read of the accumulated gradient of unit '" +
                                          u.layout.name + "'");
      n.io->settle(*rd);
      if (!n.deferred) n.deferred = rd->error();  // reported at step(), on every rank
      nu.grad_on_disk = false;
    }
    res.parallel_chunks(S, [&](int64_t b, int64_t e) {
      cpu::accumulate(res.isa(), acc + b, slot + size_t(b) * pbytes, pdt, e - b);
    });
  }
  if (u.micro_done + 1 == k)
    nu.sumsq = res.parallel_sum(S, [&](int64_t b, int64_t e) {
      return cpu::sum_squares(res.isa(), acc + b, DType::f32, e - b);
    });
}

std::optional<Error> Engine::Impl::nvme_settle_grads() {
  NvmeState& n = *nv;
  for (int v : n.evicting) {
    NvmeUnit& w = n.units[size_t(v)];
    n.io->settle(*w.grad_write);
    if (!n.deferred) n.deferred = w.grad_write->error();
    w.grad_write.reset();
    n.grad_pool.release(w.wslot);
    w.wslot = -1;
  }
  n.evicting.clear();
  std::optional<Error> e = std::move(n.deferred);
  n.deferred.reset();
  return e;
}

void Engine::Impl::nvme_forget_grads() {
  NvmeState& n = *nv;
  nvme_settle_grads();
  for (NvmeUnit& w : n.units) {
    if (w.gslot >= 0) n.grad_pool.release(w.gslot);
    w.gslot = -1;
    w.grad_on_disk = false;
    w.sumsq = 0;
  }
  n.grad_fifo.clear();
  n.deferred.reset();
}

double Engine::Impl::nvme_sumsq() const {
  double s = 0.0;
  for (const NvmeUnit& w : nv->units) s += w.sumsq;  // unit order, as the in-memory path sums
  return s;
}

// ---- the optimizer step ------------------------------------------------------------------------

// Appended to a failed step's error: what the trainer may rely on.
std::string Engine::Impl::not_applied(int64_t step) const {
  return "; step " + std::to_string(step) +
         " was not applied on any rank: parameters and optimizer state are those of " +
         (step > 1 ? "step " + std::to_string(step - 1) : std::string("finalize()")) +
         " (save a checkpoint and stop, or retry the step)";
}

// Reads unit k+1 … k+read_ahead while unit k is updated in its slot and unit k−1 is written back
// to the other record slot. Commits (flips every unit's slot) only when every rank wrote every
// unit; otherwise restores the low-precision parameters it changed in memory and throws.
void Engine::Impl::nvme_update(const std::vector<cpu::UpdateHyper>& hyper) {
  NvmeState& n = *nv;
  const int k = cfg.gradient_accumulation_steps;
  const DType gdt = k > 1 ? DType::f32 : pdt;
  const std::string r = "rank " + std::to_string(rank) + ": nvme swap ";
  if (n.par) nvme_drop_param_reads();
  std::vector<UpdateTask> tasks;
  offload::PipelineHooks h;
  h.read = [&](int i, int slot) {
    Unit& u = units[size_t(i)];
    NvmeUnit& nu = n.units[size_t(i)];
    const RecordLayout L = record_layout(u);
    char* base = n.swap_pool.data(slot);
    std::vector<Piece> ps;
    n.opt_store.pieces(nu.rec[nu.cur], base, &n.swap_pool, false, ps);
    if (nu.gslot < 0) {
      ZS_CHECK(nu.grad_on_disk);
      n.opt_store.pieces(nu.grad, base + L.grad_off, &n.swap_pool, false, ps);
    }
    return std::vector<std::shared_ptr<IoBatch>>{
        n.io->submit(std::move(ps), r + "read of unit '" + u.layout.name +
                                        "' (optimizer state, slot " + std::to_string(nu.cur) +
                                        ", and gradient) in step " + std::to_string(steps))};
  };
  h.update = [&](int i, int slot) {
    Unit& u = units[size_t(i)];
    NvmeUnit& nu = n.units[size_t(i)];
    const RecordLayout L = record_layout(u);
    char* base = n.swap_pool.data(slot);
    float* master = reinterpret_cast<float*>(base);
    float* s0 = num_states() >= 1 ? reinterpret_cast<float*>(base + L.sec) : nullptr;
    float* s1 = num_states() >= 2 ? reinterpret_cast<float*>(base + 2 * L.sec) : nullptr;
    const char* grad = base + L.grad_off;
    if (nu.gslot >= 0) grad = n.grad_pool.data(nu.gslot) + (k > 1 ? n.grad_acc_off : 0);
    void* out = n.par      ? static_cast<void*>(base + L.lowp_off)
                : staged() ? u.param_upload_buf.data()  // parameters on a GPU
                           : own_param(u);
    if (n.par) zero_padding(u, base + L.lowp_off, pbytes);
    tasks.clear();
    unit_tasks(u, hyper, master, s0, s1, grad, gdt, out, tasks);
    res.parallel_for(int64_t(tasks.size()), [&](int64_t t) {
      cpu::optimizer_update(res.isa(), *tasks[size_t(t)].h, tasks[size_t(t)].a);
    });
    if (staged()) upload_params(u);
    if (nu.gslot >= 0) {  // the cached gradient is spent
      n.grad_pool.release(nu.gslot);
      nu.gslot = -1;
      erase_id(n.grad_fifo, i);
    }
  };
  h.write = [&](int i, int slot) {
    Unit& u = units[size_t(i)];
    NvmeUnit& nu = n.units[size_t(i)];
    const RecordLayout L = record_layout(u);
    char* base = n.swap_pool.data(slot);
    std::vector<Piece> ps;
    n.opt_store.pieces(nu.rec[1 - nu.cur], base, &n.swap_pool, true, ps);
    std::vector<std::shared_ptr<IoBatch>> out{n.io->submit(
        std::move(ps), r + "write of unit '" + u.layout.name + "' (optimizer state, slot " +
                           std::to_string(1 - nu.cur) + ") in step " + std::to_string(steps))};
    if (n.par) {
      std::vector<Piece> pp;
      n.par_store.pieces(nu.par[1 - nu.pcur], base + L.lowp_off, &n.swap_pool, true, pp);
      out.push_back(n.io->submit(
          std::move(pp), r + "write of unit '" + u.layout.name + "' (parameters, slot " +
                             std::to_string(1 - nu.pcur) + ") in step " + std::to_string(steps)));
    }
    return out;
  };
  const offload::PipelineResult pr =
      offload::run_pipeline(*n.io, n.swap_pool, int(units.size()), n.read_ahead, h);
  std::optional<Error> failed = agree(pr.error, "step " + std::to_string(steps) + " (nvme swap)");
  nvme_forget_grads();
  if (!failed) {
    for (NvmeUnit& nu : n.units) {
      nu.cur = 1 - nu.cur;
      if (n.par) nu.pcur = 1 - nu.pcur;
    }
    return;
  }
  // Parameters kept in memory were overwritten for the units already updated: rebuild them
  // from the master weights of the committed slot, which this step never wrote.
  std::string restore_error;
  if (!n.par) {
    for (int i = 0; i < pr.updated; ++i) {
      Unit& u = units[size_t(i)];
      try {
        std::vector<float> master = nvme_read_state(u, StateKind::master);
        if (uploads_pending) dev->synchronize();  // the failed step's uploads, first
        write_params(own_param(u), master.data(), u.layout.shard_numel);
      } catch (const Error& e) {
        restore_error +=
            std::string("; restoring the parameters of unit '") + u.layout.name +
            "' from their last committed master weights failed too, so they are wrong in memory "
            "(the optimizer state on disk is intact): " +
            e.what();
      }
    }
  }
  throw Error(failed->code(), std::string(failed->what()) + not_applied(steps) + restore_error);
}

// Parameters on nvme, optimizer state in memory: the new low-precision shards are computed on
// copies of the state and written to the other parameter slot first; only once every rank has
// written them is the state updated in place (the same kernel on the same values: bitwise the
// same result) and the slots flipped. A failed write leaves memory untouched. Costs a second
// pass of the update, on a combination that only saves 2 bytes per parameter of memory.
void Engine::Impl::nvme_param_update(const std::vector<cpu::UpdateHyper>& hyper) {
  NvmeState& n = *nv;
  const int k = cfg.gradient_accumulation_steps;
  const DType gdt = k > 1 ? DType::f32 : pdt;
  nvme_drop_param_reads();
  const int nslots = std::max(1, res.threads());
  float* scratch = n.scratch.as<float>();
  std::vector<UpdateTask> tasks;
  auto grad_of = [&](const Unit& u) -> const void* {
    return k > 1 ? static_cast<const void*>(u.accum) : u.grad_shard;
  };
  offload::PipelineHooks h;
  h.read = [](int, int) { return std::vector<std::shared_ptr<IoBatch>>{}; };
  h.update = [&](int i, int slot) {
    Unit& u = units[size_t(i)];
    zero_padding(u, n.param_pool.data(slot), pbytes);
    tasks.clear();
    unit_tasks(u, hyper, u.master, u.state0, u.state1, grad_of(u), gdt, n.param_pool.data(slot),
               tasks);
    res.parallel_for(int64_t(tasks.size()), [&](int64_t t) {
      int ti = tbb::this_task_arena::current_thread_index();
      if (ti < 0 || ti >= nslots) ti = 0;  // outside the arena the loop runs serially
      float* sc = scratch + size_t(ti) * 3 * size_t(Resources::kChunk);
      cpu::UpdateArgs a = tasks[size_t(t)].a;
      const size_t bytes = size_t(a.n) * 4;
      std::memcpy(sc, a.master, bytes);
      a.master = sc;
      if (a.state0)
        a.state0 = static_cast<float*>(std::memcpy(sc + Resources::kChunk, a.state0, bytes));
      if (a.state1)
        a.state1 = static_cast<float*>(std::memcpy(sc + 2 * Resources::kChunk, a.state1, bytes));
      cpu::optimizer_update(res.isa(), *tasks[size_t(t)].h, a);
    });
  };
  h.write = [&](int i, int slot) {
    Unit& u = units[size_t(i)];
    NvmeUnit& nu = n.units[size_t(i)];
    std::vector<Piece> ps;
    n.par_store.pieces(nu.par[1 - nu.pcur], n.param_pool.data(slot), &n.param_pool, true, ps);
    return std::vector<std::shared_ptr<IoBatch>>{n.io->submit(
        std::move(ps), "rank " + std::to_string(rank) + ": nvme swap write of unit '" +
                           u.layout.name + "' (parameters, slot " + std::to_string(1 - nu.pcur) +
                           ") in step " + std::to_string(steps))};
  };
  const offload::PipelineResult pr =
      offload::run_pipeline(*n.io, n.param_pool, int(units.size()), 0, h);
  if (std::optional<Error> failed =
          agree(pr.error, "step " + std::to_string(steps) + " (nvme swap)"))
    throw Error(failed->code(), std::string(failed->what()) + not_applied(steps));
  tasks.clear();
  for (Unit& u : units)
    unit_tasks(u, hyper, u.master, u.state0, u.state1, grad_of(u), gdt, nullptr, tasks);
  res.parallel_for(int64_t(tasks.size()), [&](int64_t t) {
    cpu::optimizer_update(res.isa(), *tasks[size_t(t)].h, tasks[size_t(t)].a);
  });
  for (NvmeUnit& nu : n.units) nu.pcur = 1 - nu.pcur;
}

// ---- stage-3 parameter swap-in ------------------------------------------------------------------

namespace {

std::shared_ptr<IoBatch> read_param(NvmeState& n, const std::string& who, int slot, NvmeUnit& nu) {
  std::vector<Piece> ps;
  n.par_store.pieces(nu.par[nu.pcur], n.param_pool.data(slot), &n.param_pool, false, ps);
  nu.pslot = slot;
  return n.io->submit(std::move(ps), who);
}

}  // namespace

// start_gather(): the unit's shard, read from its committed slot (usually read ahead already).
// Ranks agree on the outcome before the all-gather, so a failed read fails gather() on every
// rank (one small all-reduce per gathered unit) instead of feeding peers garbage or hanging.
const void* Engine::Impl::nvme_param_source(int id) {
  NvmeState& n = *nv;
  NvmeUnit& nu = n.units[size_t(id)];
  Unit& u = units[size_t(id)];
  if (nu.pslot < 0) {
    int slot = n.param_pool.try_acquire();
    while (slot < 0) {
      // Take back a read-ahead of another unit, else wait for a prefetched all-gather.
      bool freed = false;
      for (size_t v = 0; v < units.size() && !freed; ++v) {
        NvmeUnit& w = n.units[v];
        if (int(v) != id && w.pslot >= 0 && units[v].gather_slot < 0) {
          if (w.pread) n.io->settle(*w.pread);
          w.pread.reset();
          n.param_pool.release(w.pslot);
          w.pslot = -1;
          freed = true;
        }
      }
      for (size_t v = 0; v < units.size() && !freed; ++v) {
        if (int(v) != id && n.units[v].pslot >= 0 && units[v].gather_work) {
          wait_for(*units[v].gather_work);
          nvme_param_done(int(v));
          freed = true;
        }
      }
      ZS_CHECK(freed);
      slot = n.param_pool.try_acquire();
    }
    nu.pread =
        read_param(n,
                   "rank " + std::to_string(rank) + ": nvme swap read of unit '" + u.layout.name +
                       "' (parameters, slot " + std::to_string(nu.pcur) + ") for gather()",
                   slot, nu);
  }
  std::optional<Error> mine;
  if (nu.pread) {
    n.io->settle(*nu.pread);
    mine = nu.pread->error();
    nu.pread.reset();
  }
  if (std::optional<Error> e = agree(mine, "gather() of unit '" + u.layout.name + "'")) {
    n.param_pool.release(nu.pslot);
    nu.pslot = -1;
    throw Error(e->code(), std::string(e->what()) +
                               "; the parameters on disk are those of the last completed step");
  }
  return n.param_pool.data(nu.pslot);
}

// Around gather(): start reading the units the recorded order gathers next, while staging
// slots allow (one stays free for a gather that must read synchronously), so the drive works
// ahead of the prefetched all-gather. No collective: ranks may differ here freely.
void Engine::Impl::nvme_param_read_ahead() {
  NvmeState& n = *nv;
  if (!cfg.prefetch || !order_recorded) return;
  const size_t window = size_t(n.param_pool.count());
  for (size_t p = gather_pos; p < gather_order.size() && p < gather_pos + window; ++p) {
    if (n.param_pool.free_count() <= 1) return;
    const int v = gather_order[p];
    NvmeUnit& w = n.units[size_t(v)];
    if (units[size_t(v)].gather_slot >= 0 || w.pslot >= 0) continue;
    const int slot = n.param_pool.try_acquire();
    w.pread = read_param(n,
                         "rank " + std::to_string(rank) + ": nvme swap read of unit '" +
                             units[size_t(v)].layout.name + "' (parameters, slot " +
                             std::to_string(w.pcur) + ", read ahead)",
                         slot, w);
  }
}

void Engine::Impl::nvme_param_done(int id) {
  NvmeUnit& nu = nv->units[size_t(id)];
  if (nu.pslot >= 0 && !nu.pread) {
    nv->param_pool.release(nu.pslot);
    nu.pslot = -1;
  }
}

// Before a step changes the committed slots: reads ahead and prefetched all-gathers would hold
// the old parameters; drop them (the all-gathers are collectives already issued on every rank,
// so waiting for them is local).
void Engine::Impl::nvme_drop_param_reads() {
  NvmeState& n = *nv;
  if (!n.par) return;
  for (size_t v = 0; v < units.size(); ++v) {
    Unit& u = units[v];
    NvmeUnit& w = n.units[v];
    if (w.pread) {
      n.io->settle(*w.pread);
      w.pread.reset();
    }
    if (u.gather_slot >= 0 && !u.gathered) {
      wait_for(*u.gather_work);
      gather_pool.release(u.gather_slot);
      u.gather_slot = -1;
      u.gather_work.reset();
    }
    if (w.pslot >= 0) {
      n.param_pool.release(w.pslot);
      w.pslot = -1;
    }
  }
}

// ---- state access
// --------------------------------------------------------------------------------

std::vector<float> Engine::Impl::nvme_read_state(const Unit& u, StateKind kind) const {
  NvmeState& n = *nv;
  const NvmeUnit& nu = n.units[size_t(&u - units.data())];
  const int64_t S = u.layout.shard_numel;
  std::vector<float> out(static_cast<size_t>(S));
  Ledger* l = const_cast<Ledger*>(&ledger);  // a transient buffer, but a byte held all the same
  const std::string who =
      "rank " + std::to_string(rank) + ": nvme swap read of unit '" + u.layout.name + "' ";
  if (kind == StateKind::param) {
    Buffer tmp(l, Tier::host, MemKind::buffer, "swap_readback", a4k(size_t(S) * pbytes));
    std::vector<Piece> ps;
    n.par_store.pieces(nu.par[nu.pcur], tmp.as<char>(), nullptr, false, ps);
    auto b =
        n.io->submit(std::move(ps), who + "(parameters, slot " + std::to_string(nu.pcur) + ")");
    n.io->wait(*b);
    cpu::convert(res.isa(), tmp.data(), pdt, out.data(), DType::f32, S);
    return out;
  }
  const int section = kind == StateKind::master ? 0 : kind == StateKind::state0 ? 1 : 2;
  if (section > num_states())
    ZS_THROW(invalid_argument, "read_shard(): " << where(u) << ": optimizer "
                                                << optimizer_name(cfg.optimizer.kind)
                                                << " keeps no such state");
  const RecordLayout L = record_layout(u);
  Buffer tmp(l, Tier::host, MemKind::buffer, "swap_readback", L.record);
  std::vector<Piece> ps;
  n.opt_store.pieces(nu.rec[nu.cur], tmp.as<char>(), nullptr, false, ps);
  auto b =
      n.io->submit(std::move(ps), who + "(optimizer state, slot " + std::to_string(nu.cur) + ")");
  n.io->wait(*b);
  std::memcpy(out.data(), tmp.as<char>() + size_t(section) * L.sec, size_t(S) * 4);
  return out;
}

// Restoring one state of one unit: the record is rewritten whole into the other slot and that
// unit's slot flipped, so a failure leaves the unit as it was.
void Engine::Impl::nvme_write_state(Unit& u, StateKind kind, const std::vector<float>& v) {
  NvmeState& n = *nv;
  NvmeUnit& nu = n.units[size_t(&u - units.data())];
  const int section = kind == StateKind::master ? 0 : kind == StateKind::state0 ? 1 : 2;
  if (section > num_states())
    ZS_THROW(invalid_argument, "write_shard(): " << where(u) << ": no such writable state");
  const RecordLayout L = record_layout(u);
  Buffer tmp(&ledger, Tier::host, MemKind::buffer, "swap_readback", L.record);
  const std::string who = "rank " + std::to_string(rank) + ": nvme swap ";
  std::vector<Piece> ps;
  n.opt_store.pieces(nu.rec[nu.cur], tmp.as<char>(), nullptr, false, ps);
  auto rd = n.io->submit(std::move(ps), who + "read of unit '" + u.layout.name +
                                            "' (optimizer state) for write_shard()");
  n.io->wait(*rd);
  std::memcpy(tmp.as<char>() + size_t(section) * L.sec, v.data(), v.size() * 4);
  ps.clear();
  n.opt_store.pieces(nu.rec[1 - nu.cur], tmp.as<char>(), nullptr, true, ps);
  auto wr = n.io->submit(std::move(ps), who + "write of unit '" + u.layout.name +
                                            "' (optimizer state) for write_shard()");
  n.io->wait(*wr);
  nu.cur = 1 - nu.cur;
}

// commit_shards(): low-precision parameters rebuilt from the master weights, wherever each lives.
void Engine::Impl::nvme_commit_shards() {
  NvmeState& n = *nv;
  std::vector<std::shared_ptr<Work>> works;
  for (size_t i = 0; i < units.size(); ++i) {
    Unit& u = units[i];
    NvmeUnit& nu = n.units[i];
    const int64_t S = u.layout.shard_numel;
    std::vector<float> master =
        n.opt ? nvme_read_state(u, StateKind::master) : std::vector<float>(u.master, u.master + S);
    if (n.par) {
      Buffer tmp(&ledger, Tier::host, MemKind::buffer, "swap_readback", a4k(size_t(S) * pbytes));
      cpu::convert(res.isa(), master.data(), DType::f32, tmp.data(), pdt, S);
      std::vector<Piece> ps;
      n.par_store.pieces(nu.par[1 - nu.pcur], tmp.as<char>(), nullptr, true, ps);
      auto wr = n.io->submit(std::move(ps), "rank " + std::to_string(rank) +
                                                ": nvme swap write of unit '" + u.layout.name +
                                                "' (restored parameters)");
      n.io->wait(*wr);
      nu.pcur = 1 - nu.pcur;
    } else {
      write_params(own_param(u), master.data(), S);
      if (cfg.stage == 1 || cfg.stage == 2) {
        dev->before_collective();
        works.push_back(comm->all_gather(own_param(u), u.param, S, pdt,
                                         "unit '" + u.layout.name + "' (restored parameters)"));
      }
    }
  }
  for (auto& w : works) w->wait();
}

// ---- public accessors
// ------------------------------------------------------------------------------

SwapStats Engine::swap_stats() const {
  SwapStats s;
  const Impl& m = *impl_;
  if (!m.nv || !m.nv->io) return s;
  const offload::IoCounters c = m.nv->io->counters();
  s.bytes_read = c.bytes_read;
  s.bytes_written = c.bytes_written;
  s.requests = c.requests;
  s.resubmitted = c.resubmitted;
  s.wait_s = m.nv->io->wait_seconds();
  return s;
}

std::vector<std::string> Engine::swap_files() const {
  std::vector<std::string> out;
  const Impl& m = *impl_;
  if (!m.nv) return out;
  if (m.nv->opt)
    for (const auto& p : m.nv->opt_store.paths()) out.push_back(p.string());
  if (m.nv->par)
    for (const auto& p : m.nv->par_store.paths()) out.push_back(p.string());
  return out;
}

}  // namespace zeroshard
