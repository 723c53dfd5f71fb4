// The demo's driver: flags → corpus and tokenizer → engine and model → training with progress
// lines → validation, sample → each rank's ledger and timings gathered to rank 0 → report.
#include "apps/demo.hpp"

#ifdef ZSDEMO_HAVE_BLAS
#include <cblas.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "apps/cli/demo_options.hpp"
#include "apps/data/corpus.hpp"
#include "apps/model/gpt.hpp"
#ifdef ZSDEMO_HAVE_CUDA
#include "apps/model/ops_cuda.hpp"
#endif
#include "apps/report/report.hpp"
#include "apps/train/trainer.hpp"
#include "zeroshard/device.hpp"
#include "zeroshard/zeroshard.hpp"

namespace zsdemo {
namespace {

using zeroshard::Communicator;
using zeroshard::ReduceOp;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// --device cuda: this rank's GPU (local rank modulo the GPUs, made current for the model) and
// the engine's communicator: NCCL when every local rank has a GPU of its own, else the MPI one,
// which stages GPU buffers through host memory so that ranks can share a GPU.
std::shared_ptr<Communicator> gpu_setup(zeroshard::Config& c, std::shared_ptr<Communicator> mpi) {
#ifdef ZSDEMO_HAVE_CUDA
  const zeroshard::LaunchInfo li = zeroshard::launch_info();
  std::string why;
  const int gpus = zeroshard::cuda_device_count(&why);
  if (gpus == 0) throw std::runtime_error("--device cuda: no usable GPU: " + why);
  c.device_index = li.local_rank % gpus;
  gpu::set_device(c.device_index);
  if (gpus >= li.local_size) return zeroshard::make_nccl_communicator(c.device_index, mpi);
  return mpi;
#else
  (void)c;
  (void)mpi;
  throw std::runtime_error("--device cuda: this build has no CUDA (ZEROSHARD_WITH_CUDA=OFF)");
#endif
}

// The flags that make the run (the engine compares its own Config at finalize()), one per line.
std::string run_flags(const DemoOptions& o) {
  std::ostringstream os;
  os << "--layers " << o.layers << "\n--dim " << o.dim << "\n--heads " << o.heads << "\n--seq "
     << o.seq << "\n--batch " << o.batch << "\n--corpus-chars " << o.corpus_chars << "\n--seed "
     << o.seed << "\n--steps " << o.steps << "\n--warmup " << o.warmup << "\n--save-every "
     << o.save_every << "\n--resume " << o.resume << "\n--save " << o.save_root << "\n--sample "
     << o.sample_chars << "\n--text " << (o.text_path.empty() ? "(generated)" : "(a file)")
     << "\n--no-dp-reference " << !o.dp_reference << "\n";
  return os.str();
}

// Every rank must run the same training: flags that differ (another --steps on one rank) would
// pair different collectives and fail late, with a message about something else. Each rank
// compares its flags with rank 0's and every rank fails at once, naming the first difference.
void check_same_flags(const DemoOptions& o, Communicator& comm) {
  if (comm.size() == 1) return;
  const std::string mine = run_flags(o);
  double len = double(mine.size());
  comm.broadcast(&len, sizeof len, 0, "the demo's flags (length)")->wait();
  std::string theirs(size_t(len), '\0');
  if (comm.rank() == 0) theirs = mine;
  comm.broadcast(theirs.data(), theirs.size(), 0, "the demo's flags")->wait();
  std::string why;
  if (theirs != mine) {
    std::istringstream a(theirs), b(mine);
    std::string la, lb;
    while (std::getline(a, la) && std::getline(b, lb) && la == lb) {
    }
    why = "rank " + std::to_string(comm.rank()) + " has " + lb + " where rank 0 has " + la;
  }
  double differs[1] = {why.empty() ? 0.0 : 1.0};
  comm.all_reduce(differs, 1, ReduceOp::max, "whether the demo's flags agree")->wait();
  if (differs[0] > 0)
    throw std::runtime_error(why.empty()
                                 ? "another rank was given other flags (its message names them)"
                                 : why + ": every rank must be given the same flags");
}

std::string read_file(const std::string& path) {
  // A directory opens as a stream that reads nothing; say what it is rather than "0 tokens".
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw std::runtime_error("--text " + path + " is a directory, not a text file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read --text " + path);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// Sums equal-length vectors of doubles over ranks: each rank fills its own slot of a
// world-sized table, the rest zero, so the sum is every rank's values, exactly (byte counts
// stay far below 2^53).
std::vector<double> gather_rows(Communicator& comm, const std::vector<double>& mine,
                                const char* what) {
  const size_t w = size_t(comm.size()), k = mine.size();
  std::vector<double> all(w * k, 0.0);
  std::copy(mine.begin(), mine.end(), all.begin() + long(size_t(comm.rank()) * k));
  comm.all_reduce(all.data(), int64_t(all.size()), ReduceOp::sum, what)->wait();
  return all;
}

std::vector<double> flatten(const MemCells& m) {
  std::vector<double> v;
  for (const auto& row : m)
    for (int64_t b : row) v.push_back(double(b));
  return v;
}

MemCells unflatten(const double* v) {
  MemCells m{};
  for (size_t t = 0; t < m.size(); ++t)
    for (size_t k = 0; k < m[t].size(); ++k) m[t][k] = int64_t(v[t * m[t].size() + k]);
  return m;
}

int train_and_report(DemoOptions& o) {
#ifdef ZSDEMO_HAVE_MPI
  std::shared_ptr<Communicator> comm = zeroshard::make_mpi_communicator();
#else
  if (zeroshard::launch_info().world_size > 1)
    throw std::runtime_error("this build has no MPI (ZEROSHARD_WITH_MPI=OFF): run one rank");
  std::shared_ptr<Communicator> comm = zeroshard::make_self_communicator();
#endif
  check_same_flags(o, *comm);
  const int rank = comm->rank(), world = comm->size();
  const bool talk = rank == 0;

#ifdef ZSDEMO_HAVE_BLAS
  // Ranks share the machine's cores: one BLAS thread per core per rank unless told otherwise.
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  openblas_set_num_threads(o.blas_threads > 0
                               ? o.blas_threads
                               : std::max(1, cores / zeroshard::launch_info().local_size));
#endif

  // Every rank builds the same text and vocabulary, then samples only its own slice.
  const std::string text =
      o.text_path.empty() ? generate_corpus(o.seed, o.corpus_chars) : read_file(o.text_path);
  const CharTokenizer tok(text);
  GptShape shape{tok.vocab_size(), o.seq, o.dim, o.layers, o.heads};
  BatchSampler data(tok.encode(text), rank, world, o.seq, o.seed);
  if (o.warmup < 0) o.warmup = std::max<int64_t>(1, o.steps / 10);

  const bool on_gpu = o.config.device == zeroshard::Device::cuda;
  // First: it picks the GPU (Config::device_index) the engine is then built for.
  std::shared_ptr<Communicator> engine_comm = on_gpu ? gpu_setup(o.config, comm) : comm;
  zeroshard::Engine engine(o.config, engine_comm);
  register_gpt(engine, shape, o.seed, /*with_init=*/true);
  // On the GPU the model queues its work on the engine's compute stream.
  Gpt model =
      on_gpu ? Gpt(shape, o.batch, zeroshard::Device::cuda, engine.stream()) : Gpt(shape, o.batch);

  RunSummary s;
  s.options = &o;
  s.shape = shape;
  s.world = world;
  s.params = gpt_param_count(shape);
  for (int u = 0; u < engine.num_units(); ++u) {
    const zeroshard::ShardInfo si = engine.shard_info(u);
    s.units.push_back({engine.unit_name(u), si.numel, si.padded_numel, si.shard_numel});
  }
  s.data_source = o.text_path.empty()
                      ? "generated corpus, " + std::to_string(text.size()) + " characters"
                      : o.text_path + ", " + std::to_string(text.size()) + " characters";
  s.tokens_per_step = int64_t(world) * o.batch * o.seq * o.config.gradient_accumulation_steps;
  int64_t first_step = 1;
  if (!o.resume.empty()) {
    // Master weights, moments, step count, loss scaler and hyperparameters; the data sampler
    // then draws past the batches of the steps already taken, so that with the same world
    // size the run goes on exactly as it would have without stopping.
    engine.load(o.resume);
    first_step = engine.step_count() + 1;
    if (first_step > o.steps)
      throw std::runtime_error("--resume " + o.resume + ": the checkpoint is after step " +
                               std::to_string(engine.step_count()) + ", and --steps is " +
                               std::to_string(o.steps) + ": nothing left to train");
    for (int64_t k = 0; k < engine.step_count() * o.config.gradient_accumulation_steps; ++k)
      data.next_train(o.batch);
    if (talk)
      std::printf("resumed from %s after step %lld\n", o.resume.c_str(),
                  (long long)engine.step_count());
  }
  s.val_before = validation_loss(engine, model, data, o.batch, *comm);
  if (talk) print_header(s);

  // Progress: losses are averaged over ranks once per printed line (one small all-reduce for
  // all the steps since the previous line), so logging costs no collective per step.
  const int log_every =
      o.log_every > 0 ? o.log_every : int(std::max<int64_t>(1, (o.steps + 29) / 30));
  std::vector<double> pending;
  std::vector<StepLog*> pending_logs;
  std::vector<StepLog> logs;
  logs.reserve(size_t(o.steps));
  const double t_start = now_s();
  double window_start = t_start;
  int64_t window_steps = 0;
  TrainSettings ts;
  ts.steps = o.steps;
  ts.warmup = o.warmup;
  ts.batch = o.batch;
  ts.peak_lr = o.config.optimizer.lr;
  ts.first_step = first_step;
  ts.on_step = [&](StepLog& log) {
    if (!o.save_root.empty() &&
        (log.step == o.steps || (o.save_every > 0 && log.step % o.save_every == 0))) {
      const std::filesystem::path tag = engine.save(o.save_root);
      if (talk && !o.quiet) std::printf("saved %s\n", tag.c_str());
    }
    logs.push_back(log);
    pending.push_back(log.local_loss);
    ++window_steps;
    if (log.step % log_every != 0 && log.step != o.steps) return;
    comm->all_reduce(pending.data(), int64_t(pending.size()), ReduceOp::sum, "training loss")
        ->wait();
    for (size_t i = 0; i < pending.size(); ++i)
      logs[logs.size() - pending.size() + i].loss = pending[i] / world;
    pending.clear();
    const double now = now_s();
    if (talk && !o.quiet)
      print_progress(s, logs.back(), now - window_start, window_steps, now - t_start);
    window_start = now;
    window_steps = 0;
  };
  train(engine, model, data, ts);
  s.train_wall_s = now_s() - t_start;
  s.steps = logs;
  s.val_after = validation_loss(engine, model, data, o.batch, *comm);
  if (o.sample_chars > 0) {
    const std::string prompt =
        o.text_path.empty() ? "the " : text.substr(0, std::min<size_t>(4, text.size()));
    s.sample = sample_text(engine, model, tok, prompt, o.sample_chars, o.seed);
  }

  // Every rank's ledger and timings, gathered to all (each rank fills its own row).
  const zeroshard::MemoryReport mine = engine.memory();
  MemCells bytes{}, peak{};
  for (size_t t = 0; t < bytes.size(); ++t)
    for (size_t k = 0; k < bytes[t].size(); ++k)
      bytes[t][k] = mine.bytes[t][k], peak[t][k] = mine.peak[t][k];
  std::vector<double> b = gather_rows(*comm, flatten(bytes), "ledger"),
                      p = gather_rows(*comm, flatten(peak), "ledger peaks");
  const size_t cells = size_t(zeroshard::kNumTiers * zeroshard::kNumMemKinds);
  for (int r = 0; r < world; ++r) {
    s.rank_bytes.push_back(unflatten(b.data() + size_t(r) * cells));
    s.rank_peak.push_back(unflatten(p.data() + size_t(r) * cells));
  }
  s.rank0 = mine;
  // The first step also pays for set-up (the validation pass since finalize(), the first
  // gathers without prefetch), so it is left out of the breakdown when there are more.
  RankTimes t;
  for (const StepLog& l : logs) {
    if (l.step == 1 && logs.size() > 1) continue;
    t.interval += l.result.interval_s, t.optimizer += l.result.optimizer_s,
        t.exposed += l.result.comm_exposed_s;
    t.busy += l.result.comm_busy_s, t.compute += l.compute_s, ++t.steps;
    t.comm_bytes += double(l.result.comm_bytes);
    t.inter_node_bytes += double(l.result.inter_node_bytes);
    t.newton_schulz += l.result.newton_schulz_s;
  }
  std::vector<double> tv =
      gather_rows(*comm,
                  {t.interval, t.optimizer, t.exposed, t.busy, t.compute, t.comm_bytes,
                   t.inter_node_bytes, double(t.steps), t.newton_schulz},
                  "timings");
  for (int r = 0; r < world; ++r) {
    const double* x = tv.data() + size_t(r) * 9;
    s.times.push_back({x[0], x[1], x[2], x[3], x[4], x[5], x[6], int64_t(x[7]), x[8]});
  }

  // Plain data parallel for the same model, measured: a stage-0 engine (everything whole, on the
  // device tier), finalized but never trained, and its ledger read.
  if (o.dp_reference) {
    zeroshard::Config dp = o.config;
    dp.stage = 0;
    dp.shard_group_size = 0;  // data parallel replicates everything
    dp.offload_optimizer.tier = zeroshard::Tier::device;
    dp.offload_param.tier = zeroshard::Tier::device;
    dp.device = zeroshard::Device::cpu;  // the same ledger, without taking the GPU's memory
    dp.speculative_step = zeroshard::SpeculativeStep::off;  // said once, by the run itself
    zeroshard::Engine ref(dp, comm);
    register_gpt(ref, shape, o.seed, /*with_init=*/false);
    s.dp0 = ref.memory();
    for (size_t tt = 0; tt < s.dp_bytes.size(); ++tt)
      for (size_t k = 0; k < s.dp_bytes[tt].size(); ++k) s.dp_bytes[tt][k] = s.dp0.bytes[tt][k];
  }

  if (talk) {
    print_final(s);
    if (!o.report_json.empty()) write_json(s, o.report_json);
  }
  return 0;
}

}  // namespace

int run_demo(const std::vector<std::string>& args) {
  const bool talk = zeroshard::launch_info().rank == 0;
  DemoOptions o;
  std::string error;
  switch (parse_demo_options(args, o, error)) {
    case ParseResult::help:
      if (talk) std::fputs(demo_help().c_str(), stdout);
      return 0;
    case ParseResult::error:
      if (talk)
        std::fprintf(stderr, "zeroshard demo: %s\nRun 'zeroshard demo --help' for the flags.\n",
                     error.c_str());
      return 2;
    case ParseResult::run:
      break;
  }
  try {
    return train_and_report(o);
  } catch (const zeroshard::Error& e) {
    // Configuration and argument errors are raised alike on every rank: one copy is enough.
    const bool same_everywhere = e.code() == zeroshard::ErrorCode::invalid_config ||
                                 e.code() == zeroshard::ErrorCode::invalid_argument ||
                                 e.code() == zeroshard::ErrorCode::model_mismatch;
    if (talk || !same_everywhere)
      std::fprintf(stderr, "zeroshard demo: %s error: %s\n", zeroshard::error_code_name(e.code()),
                   e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zeroshard demo: rank %d: %s\n", zeroshard::launch_info().rank, e.what());
  }
  return 1;
}

}  // namespace zsdemo
