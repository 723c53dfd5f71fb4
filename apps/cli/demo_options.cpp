#include "apps/cli/demo_options.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "zeroshard/error.hpp"

namespace zsdemo {
namespace {

using zeroshard::Config;
using zeroshard::DType;
using zeroshard::OptimizerKind;
using zeroshard::Tier;

// Every flag: name, value placeholder (empty for switches), help line. The parser and the help
// text both come from this table, so neither can forget a flag.
struct Flag {
  const char* name;
  const char* value;
  const char* help;
  const char* section;
};
constexpr Flag kFlags[] = {
    {"--stage", "0|1|2|3", "ZeRO stage (default 3; 0 is plain data parallel)", "ZeRO engine"},
    {"--device", "cpu|cuda",
     "where the model and engine run (default cpu; cuda: one GPU per rank over NCCL when there "
     "are enough, else ranks share GPUs through MPI)",
     "ZeRO engine"},
    {"--dtype", "f32|bf16|f16",
     "parameter and gradient type (default bf16; f16 uses dynamic loss scaling)", "ZeRO engine"},
    {"--optimizer", "adamw|adam|sgd|lion|muon",
     "optimizer (default adamw; muon: the matrices of the blocks by Muon, the embeddings, the "
     "head and the vectors by AdamW at lr 2e-3)",
     "ZeRO engine"},
    {"--optimizer-state", "f32|bf16|8bit",
     "storage of the optimizer moments (default f32; 8bit: blockwise 8-bit floats)", "ZeRO engine"},
    {"--master", "f32|bf16",
     "master weights (default f32; bf16: stochastic rounding, needs --dtype bf16 and the update "
     "on the CPU)",
     "ZeRO engine"},
    {"--offload-optimizer", "none|cpu|nvme",
     "tier of optimizer state and master weights (default none)", "ZeRO engine"},
    {"--offload-param", "none|cpu|nvme", "tier of parameter shards, stage 3 only (default none)",
     "ZeRO engine"},
    {"--shard-group", "N",
     "ranks per shard group: shard within groups of N consecutive ranks, replicate across them "
     "(hierarchical sharding, stages 1-3; default: one group of every rank)",
     "ZeRO engine"},
    {"--nvme-path", "DIR[,DIR..]", "directories for the nvme tier (both offload kinds)",
     "ZeRO engine"},
    {"--config", "FILE",
     "engine configuration in JSON (zeroshard or DeepSpeed keys); replaces the demo's defaults, "
     "flags override it",
     "ZeRO engine"},
    {"--lr", "X", "peak learning rate (default: 2e-3 adam/adamw, 3e-4 lion, 0.1 sgd)", "training"},
    {"--weight-decay", "X",
     "weight decay of weight matrices and embeddings (default 0.1; 0 for gains and biases)",
     "training"},
    {"--warmup", "N", "linear warm-up steps, then cosine decay to lr/10 (default steps/10)",
     "training"},
    {"--steps", "N", "optimizer steps (default 100)", "training"},
    {"--batch", "N",
     "sequences per rank per micro-step (default 8, or the config's "
     "train_micro_batch_size_per_gpu)",
     "training"},
    {"--accum", "N", "gradient accumulation micro-steps per optimizer step (default 1)",
     "training"},
    {"--clip", "X", "global gradient-norm clipping threshold, 0 = off (default 1.0)", "training"},
    {"--seed", "N", "seed of the corpus, the initial weights and the batches (default 1234)",
     "training"},
    {"--save", "DIR",
     "checkpoint root: a crash-safe tag step<N> after the last step (and every --save-every)",
     "checkpoints"},
    {"--save-every", "N", "also save every N steps (needs --save)", "checkpoints"},
    {"--resume", "PATH",
     "continue from a checkpoint (a tag, or a root's latest) to --steps; any world size and "
     "stage load it, and with the same ones the run continues bitwise",
     "checkpoints"},
    {"--layers", "N", "transformer blocks (default 4)", "model and data"},
    {"--dim", "N", "model width (default 256)", "model and data"},
    {"--heads", "N", "attention heads, must divide --dim (default 4)", "model and data"},
    {"--seq", "N", "context length in characters (default 64)", "model and data"},
    {"--text", "FILE", "train on this text file (characters) instead of the generated corpus",
     "model and data"},
    {"--corpus-chars", "N", "size of the generated corpus (default 2000000)", "model and data"},
    {"--log-every", "N", "print a progress line every N steps (default: about 30 lines per run)",
     "output"},
    {"--quiet", "", "no progress lines, only the summary", "output"},
    {"--no-dp-reference", "",
     "skip the plain data-parallel column of the memory table (it allocates a stage-0 engine, "
     "the whole model's state, in host memory: too much for capacity runs)",
     "output"},
    {"--report-json", "FILE",
     "write a machine-readable summary (losses, ledger per rank, timings) to FILE", "output"},
    {"--sample", "N",
     "characters to generate from the trained model at the end, 0 = none (default 160)", "output"},
    {"--blas-threads", "N", "OpenBLAS threads per rank (default: cores / ranks on this machine)",
     "output"},
    {"--help", "", "show this help", "output"},
};

const Flag* find_flag(const std::string& name) {
  for (const Flag& f : kFlags)
    if (name == f.name) return &f;
  return nullptr;
}

// Closest flag by edit distance, for "did you mean" on a typo.
std::string suggest(const std::string& name) {
  auto dist = [](const std::string& a, const std::string& b) {
    std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      cur[0] = i;
      for (size_t j = 1; j <= b.size(); ++j)
        cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
      std::swap(prev, cur);
    }
    return prev[b.size()];
  };
  const Flag* best = nullptr;
  size_t best_d = 4;  // farther than this is not a typo
  for (const Flag& f : kFlags) {
    size_t d = dist(name, f.name);
    if (d < best_d) best = &f, best_d = d;
  }
  return best ? std::string(" (did you mean ") + best->name + "?)" : "";
}

struct BadFlag {
  std::string msg;
};

int64_t to_int(const std::string& flag, const std::string& v, int64_t lo, int64_t hi) {
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || errno == ERANGE) throw BadFlag{flag + " " + v + ": not an integer"};
  if (x < lo || x > hi)
    throw BadFlag{flag + " " + v + ": must be in [" + std::to_string(lo) + ", " +
                  std::to_string(hi) + "]"};
  return x;
}

double to_real(const std::string& flag, const std::string& v, double lo, double hi) {
  errno = 0;
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || errno == ERANGE || !std::isfinite(x))
    throw BadFlag{flag + " " + v + ": not a number"};
  if (x < lo || x > hi) {
    std::ostringstream os;
    os << flag << " " << v << ": must be in [" << lo << ", " << hi << "]";
    throw BadFlag{os.str()};
  }
  return x;
}

template <class T>
T one_of(const std::string& flag, const std::string& v,
         const std::vector<std::pair<const char*, T>>& choices) {
  std::string names;
  for (const auto& [name, val] : choices) {
    if (v == name) return val;
    names += std::string(names.empty() ? "" : ", ") + name;
  }
  throw BadFlag{flag + " " + v + ": must be one of " + names};
}

Tier to_tier(const std::string& flag, const std::string& v) {
  return one_of<Tier>(flag, v, {{"none", Tier::device}, {"cpu", Tier::host}, {"nvme", Tier::nvme}});
}

float default_lr(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::lion:
      return 3e-4f;
    case OptimizerKind::sgd:
      return 0.1f;
    case OptimizerKind::muon:
      return 2e-2f;
    default:
      return 2e-3f;
  }
}

}  // namespace

std::string demo_help() {
  std::ostringstream os;
  os << "usage: zeroshard demo [flags]\n\n"
        "Trains a small GPT (character-level, a few million parameters) on N MPI ranks with the\n"
        "zeroshard engine: one engine unit per layer, the batch split over the ranks, gradients\n"
        "reduce-scattered during backward. Prints a line per step (loss, tokens/s), then the\n"
        "memory per rank by tier and kind next to plain data parallel, and where the step time\n"
        "went. Run it under MPI, e.g.\n\n"
        "  mpirun -np 4 build/apps/zeroshard demo --stage 3 --dtype bf16\n\n"
        "Precedence: the demo's defaults, replaced by --config FILE if given, then the flags.\n";
  const char* section = "";
  for (const Flag& f : kFlags) {
    if (std::string(section) != f.section) {
      section = f.section;
      os << "\n" << section << ":\n";
    }
    std::string lhs = std::string("  ") + f.name + (*f.value ? std::string(" ") + f.value : "");
    os << lhs;
    if (lhs.size() < 34)
      os << std::string(34 - lhs.size(), ' ');
    else
      os << "\n" << std::string(34, ' ');
    os << f.help << "\n";
  }
  os << "\nEnvironment: OMPI_* as for any Open MPI program; ZEROSHARD_CPU_THREADS sets the "
        "engine's\n"
        "optimizer threads per rank.\n";
  return os.str();
}

ParseResult parse_demo_options(const std::vector<std::string>& args, DemoOptions& out,
                               std::string& error) {
  // First pass: collect flag → value, rejecting unknown flags and missing values.
  std::map<std::string, std::string> given;
  try {
    for (size_t i = 0; i < args.size(); ++i) {
      std::string name = args[i], value;
      const size_t eq = name.find('=');
      const bool inline_value = name.rfind("--", 0) == 0 && eq != std::string::npos;
      if (inline_value) value = name.substr(eq + 1), name = name.substr(0, eq);
      if (name == "--help" || name == "-h") return ParseResult::help;
      const Flag* f = find_flag(name);
      if (!f) {
        if (name.rfind("-", 0) != 0)
          throw BadFlag{"unexpected argument '" + name + "' (flags start with --)"};
        throw BadFlag{"unknown flag " + name + suggest(name)};
      }
      if (*f->value && !inline_value) {
        if (i + 1 >= args.size()) throw BadFlag{name + " needs a value (" + f->value + ")"};
        value = args[++i];
      } else if (!*f->value && inline_value) {
        throw BadFlag{name + " takes no value"};
      }
      if (given.count(name) && name != "--nvme-path") throw BadFlag{name + " given twice"};
      if (name == "--nvme-path" && given.count(name)) value = given[name] + "," + value;
      given[name] = value;
    }

    DemoOptions o;
    auto has = [&](const char* n) { return given.count(n) > 0; };
    auto val = [&](const char* n) { return given.at(n); };
    const int64_t kBig = int64_t(1) << 40;

    // The engine configuration: the demo's defaults or the file, then the flags.
    Config& c = o.config;
    if (has("--config")) {
      o.config_path = val("--config");
      c = Config::from_json_file(o.config_path);  // throws zeroshard::Error naming the bad key
      // The file's micro-batch is the default --batch, so one file configures both.
      if (c.train_micro_batch_size_per_gpu > 0) o.batch = c.train_micro_batch_size_per_gpu;
    } else {
      c.stage = 3;
      c.dtype = DType::bf16;
      c.gradient_clipping = 1.0;
      c.optimizer.kind = OptimizerKind::adamw;
      c.optimizer.lr = default_lr(c.optimizer.kind);
      c.optimizer.beta2 = 0.99f;  // small models and short runs: a shorter second-moment memory
      c.optimizer.weight_decay = 0.1f;
    }
    if (has("--stage")) c.stage = int(to_int("--stage", val("--stage"), 0, 3));
    if (has("--device"))
      c.device = one_of<zeroshard::Device>(
          "--device", val("--device"),
          {{"cpu", zeroshard::Device::cpu}, {"cuda", zeroshard::Device::cuda}});
    if (has("--dtype")) {
      c.dtype = one_of<DType>("--dtype", val("--dtype"),
                              {{"f32", DType::f32}, {"bf16", DType::bf16}, {"f16", DType::f16}});
      if (c.dtype != DType::f16)
        c.loss_scale = zeroshard::LossScaleOptions{};  // a file's f16 scaling
    }
    if (has("--optimizer")) {
      const OptimizerKind kind = one_of<OptimizerKind>("--optimizer", val("--optimizer"),
                                                       {{"adamw", OptimizerKind::adamw},
                                                        {"adam", OptimizerKind::adam},
                                                        {"sgd", OptimizerKind::sgd},
                                                        {"lion", OptimizerKind::lion},
                                                        {"muon", OptimizerKind::muon}});
      // Each optimizer has its own scale of learning rate, so a changed optimizer takes the
      // demo's rate for it (a file's rate was meant for the file's optimizer). SGD without
      // momentum barely trains in 100 steps: the demo's default adds it.
      const OptimizerKind before = c.optimizer.kind;
      c.optimizer.kind = kind;
      if (kind != OptimizerKind::sgd) {  // a file's SGD momentum was meant for SGD
        c.optimizer.momentum = 0.0f;
        c.optimizer.nesterov = false;
      }
      if (!has("--lr") && (kind != before || !has("--config"))) c.optimizer.lr = default_lr(kind);
      if (kind == OptimizerKind::sgd && !has("--config")) c.optimizer.momentum = 0.9f;
      if (kind == OptimizerKind::muon) {  // torch.optim.Muon's momentum, Nesterov and eps
        c.optimizer.momentum = 0.95f;
        c.optimizer.nesterov = true;
        c.optimizer.eps = 1e-7f;
      }
    }
    if (has("--optimizer-state"))
      c.optimizer_state =
          one_of<zeroshard::StateFormat>("--optimizer-state", val("--optimizer-state"),
                                         {{"f32", zeroshard::StateFormat::f32},
                                          {"bf16", zeroshard::StateFormat::bf16},
                                          {"8bit", zeroshard::StateFormat::q8}});
    if (has("--master"))
      c.bf16_master = one_of<bool>("--master", val("--master"), {{"f32", false}, {"bf16", true}});
    if (has("--shard-group"))
      c.shard_group_size = int(to_int("--shard-group", val("--shard-group"), 1, 1 << 20));
    if (has("--lr")) c.optimizer.lr = float(to_real("--lr", val("--lr"), 0, 10));
    if (has("--weight-decay"))
      c.optimizer.weight_decay = float(to_real("--weight-decay", val("--weight-decay"), 0, 10));
    if (has("--offload-optimizer"))
      c.offload_optimizer.tier = to_tier("--offload-optimizer", val("--offload-optimizer"));
    if (has("--offload-param"))
      c.offload_param.tier = to_tier("--offload-param", val("--offload-param"));
    if (has("--nvme-path")) {
      std::vector<std::string> paths;
      std::stringstream ss(val("--nvme-path"));
      for (std::string p; std::getline(ss, p, ',');)
        if (!p.empty()) paths.push_back(p);
      if (paths.empty()) throw BadFlag{"--nvme-path: no directory given"};
      c.offload_optimizer.nvme_paths = c.offload_param.nvme_paths = paths;
    }
    if (has("--accum"))
      c.gradient_accumulation_steps = int(to_int("--accum", val("--accum"), 1, 1024));
    if (has("--clip")) c.gradient_clipping = to_real("--clip", val("--clip"), 0, 1e9);

    if (has("--layers")) o.layers = to_int("--layers", val("--layers"), 1, 256);
    if (has("--dim")) o.dim = to_int("--dim", val("--dim"), 8, 16384);
    if (has("--heads")) o.heads = to_int("--heads", val("--heads"), 1, 256);
    if (has("--seq")) o.seq = to_int("--seq", val("--seq"), 2, 8192);
    if (has("--batch")) {
      o.batch = to_int("--batch", val("--batch"), 1, 1 << 20);
      // The engine checks a file's train_batch_size against the micro-batch that really runs.
      if (c.train_batch_size > 0 || c.train_micro_batch_size_per_gpu > 0)
        c.train_micro_batch_size_per_gpu = o.batch;
    }
    if (has("--steps")) o.steps = to_int("--steps", val("--steps"), 1, kBig);
    if (has("--save")) o.save_root = val("--save");
    if (has("--save-every")) {
      if (o.save_root.empty()) throw BadFlag{"--save-every needs --save DIR"};
      o.save_every = to_int("--save-every", val("--save-every"), 1, kBig);
    }
    if (has("--resume")) o.resume = val("--resume");
    if (has("--warmup")) o.warmup = to_int("--warmup", val("--warmup"), 0, kBig);
    if (has("--seed")) o.seed = uint64_t(to_int("--seed", val("--seed"), 0, kBig));
    if (has("--text")) o.text_path = val("--text");
    if (has("--corpus-chars"))
      o.corpus_chars = to_int("--corpus-chars", val("--corpus-chars"), 1000, int64_t(1) << 32);
    if (has("--log-every"))
      o.log_every = int(to_int("--log-every", val("--log-every"), 1, 1 << 30));
    if (has("--sample")) o.sample_chars = to_int("--sample", val("--sample"), 0, 100000);
    if (has("--blas-threads"))
      o.blas_threads = int(to_int("--blas-threads", val("--blas-threads"), 1, 1024));
    o.quiet = has("--quiet");
    o.dp_reference = !has("--no-dp-reference");
    if (has("--report-json")) {
      o.report_json = val("--report-json");
      // Checked now, not after a long run whose report would then be lost.
      std::ofstream probe(o.report_json, std::ios::app);
      if (!probe)
        throw BadFlag{"--report-json " + o.report_json + ": cannot write there (" +
                      std::strerror(errno) + ")"};
    }

    if (o.dim % o.heads != 0)
      throw BadFlag{"--dim " + std::to_string(o.dim) + " is not a multiple of --heads " +
                    std::to_string(o.heads)};
    if (o.batch < 1) throw BadFlag{"the batch (train_micro_batch_size_per_gpu) must be at least 1"};
    c.validate();  // the library's own range checks, with its key names
    out = std::move(o);
    return ParseResult::run;
  } catch (const BadFlag& e) {
    error = e.msg;
  } catch (const zeroshard::Error& e) {
    error = std::string("configuration: ") + e.what();
  }
  return ParseResult::error;
}

}  // namespace zsdemo
