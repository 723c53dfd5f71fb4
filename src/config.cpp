// Config::validate() and the JSON reader (zeroshard's own keys plus DeepSpeed's).
//
// The reader is driven by one schema table (schema() below): every accepted key with the setter
// that stores it. A key that is not in the table is an error naming its full dotted path, so a
// typo in a DeepSpeed config fails loudly here instead of silently falling back to a default.
// Keys are applied in table order, not file order, so cross-key rules (optimizer "type" before
// its "params") do not depend on how the user ordered the file.

#include "zeroshard/config.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "src/base/edit_distance.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard {

const char* optimizer_name(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::adam:
      return "adam";
    case OptimizerKind::adamw:
      return "adamw";
    case OptimizerKind::sgd:
      return "sgd";
    case OptimizerKind::lion:
      return "lion";
  }
  return "unknown";
}

namespace {

using json = nlohmann::json;

constexpr const char* kPrefix = "config: ";

[[noreturn]] void fail(const std::string& what) {
  throw Error(ErrorCode::invalid_config, kPrefix + what);
}

// Shortest text that reads back as the same value, so a float field holding 0.9f prints "0.9"
// rather than "0.899999976" and messages quote what the user wrote.
template <class T>
std::string show(T v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else {
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    return std::string(buf, r.ptr);
  }
}

std::string join(const std::string& prefix, std::string_view key) {
  return prefix.empty() ? std::string(key) : prefix + "." + std::string(key);
}

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// DeepSpeed's spelling of a tier, which is what the user wrote in "device".
const char* device_name(Tier t) {
  switch (t) {
    case Tier::device:
      return "none";
    case Tier::host:
      return "cpu";
    case Tier::nvme:
      return "nvme";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// validate(): one require() per rule. Fields are named by their JSON path because that is what
// users edit; the conditions are written so that NaN fails them.

template <class T>
void require(bool ok, const std::string& field, T value, const std::string& rule) {
  if (!ok) fail(field + " = " + show(value) + " " + rule);
}

void validate_offload(const OffloadOptions& o, const std::string& key) {
  require(o.buffer_count >= 1, key + ".buffer_count", o.buffer_count, "must be >= 1");
  // The nvme tier stripes over these directories; without one there is nowhere to swap to.
  if (o.tier == Tier::nvme && o.nvme_paths.empty()) {
    fail(key + ".device = nvme requires " + key + ".nvme_path (one or more directories)");
  }
  for (size_t i = 0; i < o.nvme_paths.size(); ++i) {
    if (o.nvme_paths[i].empty()) fail(key + ".nvme_path[" + show(i) + "] is an empty path");
    // Each path holds one stripe file per tier; the same path twice would be the same file.
    for (size_t j = 0; j < i; ++j) {
      if (o.nvme_paths[j] == o.nvme_paths[i]) {
        fail(key + ".nvme_path[" + show(i) + "] = \"" + o.nvme_paths[i] + "\" repeats nvme_path[" +
             show(j) + "]");
      }
    }
  }
}

}  // namespace

void Config::validate() const {
  require(stage >= 0 && stage <= 3, "zero_optimization.stage", stage, "is out of range (0..3)");
  require(gradient_accumulation_steps >= 1, "gradient_accumulation_steps",
          gradient_accumulation_steps, "must be >= 1");
  require(gradient_clipping >= 0 && std::isfinite(gradient_clipping), "gradient_clipping",
          gradient_clipping, "must be finite and >= 0 (0 disables clipping)");
  require(reduce_bucket_size >= 1, "zero_optimization.reduce_bucket_size", reduce_bucket_size,
          "must be >= 1");
  require(allgather_bucket_size >= 1, "zero_optimization.allgather_bucket_size",
          allgather_bucket_size, "must be >= 1");

  // zeroshard's own knobs.
  require(shard_alignment >= 1, "zeroshard.shard_alignment", shard_alignment, "must be >= 1");
  require(grad_buffers >= 1, "zeroshard.grad_buffers", grad_buffers, "must be >= 1");
  require(max_live_units >= 2, "zeroshard.max_live_units", max_live_units,
          "must be >= 2 (the unit in use plus the one being prefetched)");
  require(collective_timeout_s > 0 && std::isfinite(collective_timeout_s),
          "zeroshard.collective_timeout_s", collective_timeout_s, "must be finite and > 0");

  // Loss scaling is checked whatever the dtype so that a bad value does not lie in wait for the
  // day the user switches fp16 on.
  const LossScaleOptions& ls = loss_scale;
  require(ls.static_scale >= 0 && std::isfinite(ls.static_scale), "fp16.loss_scale",
          ls.static_scale, "must be finite and >= 0 (0 = dynamic scaling)");
  require(ls.initial_scale_power >= 0 && ls.initial_scale_power <= 64, "fp16.initial_scale_power",
          ls.initial_scale_power, "is out of range (0..64)");
  require(ls.window >= 1, "fp16.loss_scale_window", ls.window, "must be >= 1");
  require(ls.hysteresis >= 1, "fp16.hysteresis", ls.hysteresis, "must be >= 1");
  require(ls.min_scale > 0 && std::isfinite(ls.min_scale), "fp16.min_loss_scale", ls.min_scale,
          "must be finite and > 0");
  // A floor above the starting point would make the first overflow raise the scale.
  if (ls.static_scale == 0) {
    require(std::ldexp(1.0, ls.initial_scale_power) >= ls.min_scale, "fp16.min_loss_scale",
            ls.min_scale,
            "is above the initial scale 2^" + show(ls.initial_scale_power) +
                " (fp16.initial_scale_power)");
  }

  const OptimizerOptions& o = optimizer;
  const bool sgd = o.kind == OptimizerKind::sgd;
  require(o.lr >= 0 && std::isfinite(o.lr), "optimizer.params.lr", o.lr, "must be finite and >= 0");
  require(o.beta1 >= 0 && o.beta1 < 1, "optimizer.params.betas[0]", o.beta1, "must be in [0, 1)");
  require(o.beta2 >= 0 && o.beta2 < 1, "optimizer.params.betas[1]", o.beta2, "must be in [0, 1)");
  require(o.eps > 0 && std::isfinite(o.eps), "optimizer.params.eps", o.eps,
          "must be finite and > 0");
  require(o.weight_decay >= 0 && std::isfinite(o.weight_decay), "optimizer.params.weight_decay",
          o.weight_decay, "must be finite and >= 0");
  require(o.momentum >= 0 && std::isfinite(o.momentum), "optimizer.params.momentum", o.momentum,
          "must be finite and >= 0");
  // Only SGD reads momentum; silently ignoring it elsewhere would hide a misconfiguration.
  require(o.momentum == 0 || sgd, "optimizer.params.momentum", o.momentum,
          std::string("applies only to sgd (optimizer is ") + optimizer_name(o.kind) + ")");
  if (o.nesterov && (!sgd || o.momentum <= 0)) {
    fail(std::string("optimizer.params.nesterov = true requires optimizer sgd with momentum > 0 "
                     "(optimizer is ") +
         optimizer_name(o.kind) + ", momentum = " + show(o.momentum) + ")");
  }

  validate_offload(offload_optimizer, "zero_optimization.offload_optimizer");
  validate_offload(offload_param, "zero_optimization.offload_param");
  // Parameters are sharded only in stage 3; below it every rank holds them whole on the device.
  if (offload_param.tier != Tier::device && stage != 3) {
    fail(std::string("zero_optimization.offload_param.device = ") +
         device_name(offload_param.tier) + " requires zero_optimization.stage = 3 (stage is " +
         show(stage) + "): parameters are sharded, and so offloadable, only in stage 3");
  }
  // Stage 0 keeps the whole optimizer state on every rank: swapping it would only be slower.
  if (offload_optimizer.tier == Tier::nvme && stage < 1) {
    fail(
        "zero_optimization.offload_optimizer.device = nvme requires zero_optimization.stage >= 1 "
        "(stage is 0: the optimizer state is not sharded)");
  }
  // The pipeline needs a slot to update in and one to read (or write) with.
  if (offload_optimizer.tier == Tier::nvme) {
    require(offload_optimizer.buffer_count >= 2, "zero_optimization.offload_optimizer.buffer_count",
            offload_optimizer.buffer_count, "must be >= 2 for device nvme");
  }
  if (offload_param.tier == Tier::nvme) {
    require(offload_param.buffer_count >= 2, "zero_optimization.offload_param.buffer_count",
            offload_param.buffer_count, "must be >= 2 for device nvme");
  }
  require(swap_read_ahead >= 0, "zeroshard.swap_read_ahead", swap_read_ahead,
          "must be >= 0 (0 = automatic)");
  if (offload_optimizer.tier == Tier::nvme && swap_read_ahead > 0) {
    require(swap_read_ahead < offload_optimizer.buffer_count, "zeroshard.swap_read_ahead",
            swap_read_ahead,
            "must be below zero_optimization.offload_optimizer.buffer_count (" +
                show(offload_optimizer.buffer_count) + ")");
  }
  require(device_index >= -1, "zeroshard.device_index", device_index,
          "must be >= 0, or -1 for the local rank's GPU");
  if (device == Device::cuda) {
    // What the GPU engine does not move yet: the nvme tier's swap pipeline works on host memory
    // only, and stage 3's parameter shard must be in GPU memory for the all-gather.
    if (offload_param.tier != Tier::device)
      fail(
          "zeroshard.device = cuda takes offload_param.device none: stage 3's parameter shards "
          "stay in GPU memory (parameter offload runs with zeroshard.device cpu)");
    if (offload_optimizer.tier == Tier::host && stage == 0)
      fail(
          "zero_optimization.offload_optimizer.device = cpu with zeroshard.device = cuda "
          "requires zero_optimization.stage >= 1 (stage 0 keeps whole gradients on the GPU)");
    // The GPU update moves 8 elements per 16-byte access: every shard must start aligned.
    require(shard_alignment % 8 == 0, "zeroshard.shard_alignment", shard_alignment,
            "must be a multiple of 8 with zeroshard.device = cuda (vector accesses)");
  }
  // O_DIRECT needs requests aligned to the logical block size; 4096 covers every NVMe format.
  require(aio.block_size > 0 && aio.block_size % 4096 == 0, "aio.block_size", aio.block_size,
          "must be a positive multiple of 4096 (O_DIRECT alignment)");
  require(aio.block_size <= (int64_t(1) << 30), "aio.block_size", aio.block_size,
          "must be at most 1 GiB (one io_uring request)");
  require(aio.queue_depth >= 1, "aio.queue_depth", aio.queue_depth, "must be >= 1");
  require(aio.queue_depth <= 4096, "aio.queue_depth", aio.queue_depth,
          "must be at most 4096 (io_uring ring entries)");
}

namespace {

// ---------------------------------------------------------------------------------------------
// from_json(): a JSON value with its dotted path, so every type error names the key.

class Field {
 public:
  Field(const json& j, std::string path) : j_(j), path_(std::move(path)) {}

  [[noreturn]] void bad(const std::string& rule) const { fail("\"" + path_ + "\" " + rule); }

  [[noreturn]] void wrong_type(const std::string& expected) const {
    std::string got = j_.type_name();
    // Scalars are short enough to quote, and seeing "true" in quotes explains the error at once.
    if (j_.is_primitive()) {
      std::string text = j_.dump();
      if (text.size() > 40) text = text.substr(0, 37) + "...";
      got += " " + text;
    }
    // Hugging Face's DeepSpeed integration fills in "auto" itself; a raw HF config lands here.
    if (j_.is_string() && j_.get_ref<const std::string&>() == "auto") {
      got +=
          " (\"auto\" is a placeholder the Hugging Face Trainer replaces before DeepSpeed reads"
          " the file; give a value)";
    }
    bad("must be " + expected + ", got " + got);
  }

  bool boolean() const {
    if (!j_.is_boolean()) wrong_type("a boolean");
    return j_.get<bool>();
  }

  double number() const {
    if (!j_.is_number()) wrong_type("a number");
    return j_.get<double>();
  }

  // Hyperparameters are stored as float; a value float cannot hold would become inf.
  float single() const {
    const double d = number();
    if (std::fabs(d) > std::numeric_limits<float>::max()) {
      bad("= " + show(d) + " does not fit in a 32-bit float");
    }
    return static_cast<float>(d);
  }

  template <class T>
  T integer() const {
    constexpr T lo = std::numeric_limits<T>::min();
    constexpr T hi = std::numeric_limits<T>::max();
    const std::string range = "is out of range for a " + show(sizeof(T) * 8) + "-bit integer";
    if (j_.is_number_unsigned()) {
      const uint64_t u = j_.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) bad("= " + j_.dump() + " " + range);
      return static_cast<T>(u);
    }
    if (j_.is_number_integer()) {
      const int64_t i = j_.get<int64_t>();
      if (i < lo || i > hi) bad("= " + j_.dump() + " " + range);
      return static_cast<T>(i);
    }
    if (j_.is_number_float()) {
      // DeepSpeed configs write sizes as 5e8, which JSON reads as a float: take it if integral.
      const double d = j_.get<double>();
      if (std::trunc(d) != d) bad("must be an integer, got " + show(d));
      // hi + 1.0 is a power of two, exact in double, so the bound is exact for 32 and 64 bits.
      if (!(d >= static_cast<double>(lo) && d < static_cast<double>(hi) + 1.0)) {
        bad("= " + show(d) + " " + range);
      }
      return static_cast<T>(d);
    }
    wrong_type("an integer");
  }

  // Counts that are accepted for compatibility and have no effect still must make sense.
  int64_t count() const {
    const auto v = integer<int64_t>();
    if (v < 0) bad("= " + show(v) + " must be >= 0");
    return v;
  }

  std::string string() const {
    if (!j_.is_string()) wrong_type("a string");
    return j_.get<std::string>();
  }

  // DeepSpeed's nvme_path is one directory; zeroshard stripes over several, so take both forms.
  std::vector<std::string> strings() const {
    const char* expected = "a string or an array of strings";
    if (j_.is_string()) return {j_.get<std::string>()};
    if (!j_.is_array()) wrong_type(expected);
    std::vector<std::string> out;
    for (const json& e : j_) {
      if (!e.is_string()) wrong_type(expected);
      out.push_back(e.get<std::string>());
    }
    return out;
  }

  std::vector<float> numbers(size_t n) const {
    const std::string expected = "an array of " + show(n) + " numbers";
    if (!j_.is_array() || j_.size() != n) wrong_type(expected);
    std::vector<float> out;
    for (size_t i = 0; i < n; ++i)
      out.push_back(Field(j_[i], path_ + "[" + show(i) + "]").single());
    return out;
  }

 private:
  const json& j_;
  std::string path_;
};

// What one from_json() call has seen beyond the Config itself: facts that are resolved only
// once the whole document is read.
struct Ctx {
  Config c;
  bool fp16 = false;
  bool bf16 = false;
  bool adam_type = false;  // optimizer.type was "Adam": adam_w_mode picks adam or adamw
};

using Setter = void (*)(const Field&, Ctx&);

// One key of the schema: a leaf with a setter, or a section with children.
struct Node {
  Node(std::string_view k, Setter s, bool req = false) : key(k), set(s), required(req) {}
  Node(std::string_view k, std::vector<Node> ch) : key(k), children(std::move(ch)) {}

  const Node* child(std::string_view k) const {
    for (const Node& n : children) {
      if (n.key == k) return &n;
    }
    return nullptr;
  }

  std::string_view key;
  Setter set = nullptr;
  std::vector<Node> children;
  bool required = false;
};

// Setters for keys DeepSpeed users bring that change nothing here: type-checked, then dropped.
void accept_bool(const Field& f, Ctx&) {
  f.boolean();
}
void accept_count(const Field& f, Ctx&) {
  f.count();
}

Tier parse_device(const Field& f) {
  const std::string s = f.string();
  if (s == "none") return Tier::device;
  if (s == "cpu") return Tier::host;
  if (s == "nvme") return Tier::nvme;
  f.bad("= \"" + s + "\" is not one of \"none\", \"cpu\", \"nvme\"");
}

Device compute_device(const Field& f) {
  const std::string s = f.string();
  if (s == "cpu") return Device::cpu;
  if (s == "cuda") return Device::cuda;
  f.bad("= \"" + s + "\" is not one of \"cpu\", \"cuda\"");
}

bool adam_family(OptimizerKind k) {
  return k == OptimizerKind::adam || k == OptimizerKind::adamw;
}

// Passing an SGD-only hyperparameter to Adam (or the reverse) is a TypeError in DeepSpeed/torch;
// here it is an error too rather than a silently ignored value.
void only_for(const Field& f, const Ctx& x, bool applies, const char* which) {
  if (!applies) {
    f.bad(std::string("applies only to ") + which + " (optimizer is " +
          optimizer_name(x.c.optimizer.kind) + ")");
  }
}

// offload_optimizer and offload_param share these keys; M picks which OffloadOptions they fill.
template <OffloadOptions Config::*M>
std::vector<Node> offload_keys(std::vector<Node> extra) {
  std::vector<Node> keys = {
      {"device", [](const Field& f, Ctx& x) { (x.c.*M).tier = parse_device(f); }},
      {"nvme_path", [](const Field& f, Ctx& x) { (x.c.*M).nvme_paths = f.strings(); }},
      {"buffer_count", [](const Field& f, Ctx& x) { (x.c.*M).buffer_count = f.integer<int>(); }},
      {"pin_memory", [](const Field& f, Ctx& x) { (x.c.*M).pin_memory = f.boolean(); }},
  };
  keys.insert(keys.end(), extra.begin(), extra.end());
  return keys;
}

// The schema. DeepSpeed defaults are in brackets; "no effect" keys are accepted so that real
// DeepSpeed files load, because the unit (not a bucket) is zeroshard's grain for all of them.
const Node& schema() {
  static const Node root(
      "",
      {
          {"zero_optimization",
           {
               {"stage", [](const Field& f, Ctx& x) { x.c.stage = f.integer<int>(); }},  // [0]
               // Elements per reduction / gather bucket [5e8]; stored, informational.
               {"reduce_bucket_size",
                [](const Field& f, Ctx& x) { x.c.reduce_bucket_size = f.integer<int64_t>(); }},
               {"allgather_bucket_size",
                [](const Field& f, Ctx& x) { x.c.allgather_bucket_size = f.integer<int64_t>(); }},
               {"overlap_comm", [](const Field& f, Ctx& x) { x.c.overlap_comm = f.boolean(); }},
               {"contiguous_gradients", accept_bool},  // [true] grads always land contiguous
               // [true] DeepSpeed's false means "all-reduce instead"; zeroshard has no such path.
               {"reduce_scatter",
                [](const Field& f, Ctx&) {
                  if (!f.boolean()) {
                    f.bad("= false is not supported: zeroshard always reduce-scatters gradients "
                          "in stages 1-3; remove the key or set it to true");
                  }
                }},
               // [true] Not in PEERS.md's key list, but in Hugging Face's stock ZeRO-2 file;
               // false (broadcast instead of all-gather) has no equivalent here.
               {"allgather_partitions",
                [](const Field& f, Ctx&) {
                  if (!f.boolean()) {
                    f.bad("= false is not supported: zeroshard always all-gathers parameters");
                  }
                }},
               {"sub_group_size", accept_count},                      // [1e9] unit is the grain
               {"stage3_prefetch_bucket_size", accept_count},         // [5e7] see zeroshard.prefetch
               {"stage3_param_persistence_threshold", accept_count},  // [1e5]
               {"stage3_max_live_parameters", accept_count},  // [1e9] see zeroshard.max_live_units
               {"stage3_max_reuse_distance", accept_count},   // [1e9]
               {"stage3_gather_16bit_weights_on_model_save", accept_bool},  // [false]
               {"offload_optimizer",
                offload_keys<&Config::offload_optimizer>({
                    // The nvme tier always overlaps read, update and write (DESIGN.md), and
                    // lays out its own swap files, so these three only need to be well-typed.
                    {"pipeline_read", accept_bool},
                    {"pipeline_write", accept_bool},
                    {"fast_init", accept_bool},
                    // [1.0] Fraction of the step run on the CPU (DeepSpeed "twin-flow").
                    {"ratio",
                     [](const Field& f, Ctx&) {
                       const double r = f.number();
                       if (r != 1.0) {
                         f.bad("= " + show(r) +
                               " is not supported: partial offload is not implemented; the "
                               "whole optimizer step runs on the tier that holds the state "
                               "(use 1.0 or remove the key)");
                       }
                     }},
                })},
               {"offload_param", offload_keys<&Config::offload_param>({
                                     {"buffer_size", accept_count},  // [1e8] sized by the unit
                                     {"max_in_cpu", accept_count},   // [1e9]
                                 })},
           }},
          // Enabling a precision sets Config::dtype once both sections are read (see from_json).
          {"fp16",
           {
               {"enabled", [](const Field& f, Ctx& x) { x.fp16 = f.boolean(); }},
               {"loss_scale",  // [0] 0 = dynamic, > 0 = fixed scale
                [](const Field& f, Ctx& x) { x.c.loss_scale.static_scale = f.single(); }},
               {"initial_scale_power",  // [16]
                [](const Field& f, Ctx& x) { x.c.loss_scale.initial_scale_power = f.integer<int>(); }},
               {"loss_scale_window",  // [1000]
                [](const Field& f, Ctx& x) { x.c.loss_scale.window = f.integer<int>(); }},
               {"hysteresis",  // [2]
                [](const Field& f, Ctx& x) { x.c.loss_scale.hysteresis = f.integer<int>(); }},
               {"min_loss_scale",  // [1]
                [](const Field& f, Ctx& x) { x.c.loss_scale.min_scale = f.single(); }},
               {"auto_cast", accept_bool},  // the trainer owns its autocast
           }},
          {"bf16", {{"enabled", [](const Field& f, Ctx& x) { x.bf16 = f.boolean(); }}}},
          {"gradient_clipping",
           [](const Field& f, Ctx& x) { x.c.gradient_clipping = f.number(); }},
          {"gradient_accumulation_steps",
           [](const Field& f, Ctx& x) { x.c.gradient_accumulation_steps = f.integer<int>(); }},
          // Batch sizes belong to the trainer's data loader; logging knobs to DeepSpeed's engine.
          {"train_micro_batch_size_per_gpu", accept_count},
          {"train_batch_size", accept_count},
          {"steps_per_print", accept_count},
          {"wall_clock_breakdown", accept_bool},
          {"optimizer",
           {
               // "type" comes before "params" in this table, so it is applied first whatever
               // the file's order. Names are case-insensitive as in DeepSpeed.
               {"type",
                [](const Field& f, Ctx& x) {
                  const std::string name = f.string();
                  const std::string t = lower(name);
                  OptimizerKind kind;
                  if (t == "adam" || t == "adamw") {
                    // DeepSpeed's "Adam" defaults to adam_w_mode = true, i.e. AdamW (decoupled
                    // weight decay); params.adam_w_mode = false selects classic Adam.
                    kind = OptimizerKind::adamw;
                  } else if (t == "sgd") {
                    kind = OptimizerKind::sgd;
                  } else if (t == "lion") {
                    kind = OptimizerKind::lion;
                  } else {
                    f.bad("= \"" + name +
                          "\" is not supported (supported: Adam, AdamW, SGD, Lion; "
                          "case-insensitive)");
                  }
                  // An "optimizer" block means what it means to DeepSpeed: what it leaves out
                  // takes the optimizer's own default (FusedAdam, FusedLion, torch SGD all
                  // default weight_decay to 0), not Config's AdamW-style 0.01.
                  x.c.optimizer = OptimizerOptions{};
                  x.c.optimizer.kind = kind;
                  x.c.optimizer.weight_decay = 0.0f;
                  x.adam_type = t == "adam";
                },
                /*required=*/true},
               {"params",
                {
                    {"lr", [](const Field& f, Ctx& x) { x.c.optimizer.lr = f.single(); }},
                    {"betas",
                     [](const Field& f, Ctx& x) {
                       only_for(f, x,
                                adam_family(x.c.optimizer.kind) ||
                                    x.c.optimizer.kind == OptimizerKind::lion,
                                "adam, adamw and lion");
                       const std::vector<float> b = f.numbers(2);
                       x.c.optimizer.beta1 = b[0];
                       x.c.optimizer.beta2 = b[1];
                     }},
                    {"eps",
                     [](const Field& f, Ctx& x) {
                       only_for(f, x, adam_family(x.c.optimizer.kind), "adam and adamw");
                       x.c.optimizer.eps = f.single();
                     }},
                    {"weight_decay",
                     [](const Field& f, Ctx& x) { x.c.optimizer.weight_decay = f.single(); }},
                    {"momentum",
                     [](const Field& f, Ctx& x) {
                       only_for(f, x, x.c.optimizer.kind == OptimizerKind::sgd, "sgd");
                       x.c.optimizer.momentum = f.single();
                     }},
                    {"nesterov",
                     [](const Field& f, Ctx& x) {
                       only_for(f, x, x.c.optimizer.kind == OptimizerKind::sgd, "sgd");
                       x.c.optimizer.nesterov = f.boolean();
                     }},
                    {"adam_w_mode",
                     [](const Field& f, Ctx& x) {
                       only_for(f, x, adam_family(x.c.optimizer.kind), "adam and adamw");
                       const bool w = f.boolean();
                       if (x.adam_type) {
                         x.c.optimizer.kind = w ? OptimizerKind::adamw : OptimizerKind::adam;
                       } else if (!w) {
                         // DeepSpeed silently forces AdamW here; a contradiction is worth a word.
                         f.bad("= false contradicts optimizer.type \"AdamW\"; use type \"Adam\" "
                               "for classic Adam (weight decay added to the gradient)");
                       }
                     }},
                    {"torch_adam",  // which Adam implementation DeepSpeed picks: moot here
                     [](const Field& f, Ctx& x) {
                       only_for(f, x, adam_family(x.c.optimizer.kind), "adam and adamw");
                       f.boolean();
                     }},
                }},
           }},
          {"aio",
           {
               {"block_size",  // [1 MiB] bytes per request
                [](const Field& f, Ctx& x) { x.c.aio.block_size = f.integer<int64_t>(); }},
               {"queue_depth",  // [8]
                [](const Field& f, Ctx& x) { x.c.aio.queue_depth = f.integer<int>(); }},
               // libaio threading knobs; io_uring needs none of them.
               {"intra_op_parallelism", accept_count},
               {"single_submit", accept_bool},
               {"overlap_events", accept_bool},
               {"thread_count", accept_count},
           }},
          {"zeroshard",
           {
               {"shard_alignment",
                [](const Field& f, Ctx& x) { x.c.shard_alignment = f.integer<int64_t>(); }},
               {"grad_buffers", [](const Field& f, Ctx& x) { x.c.grad_buffers = f.integer<int>(); }},
               {"max_live_units",
                [](const Field& f, Ctx& x) { x.c.max_live_units = f.integer<int>(); }},
               {"prefetch", [](const Field& f, Ctx& x) { x.c.prefetch = f.boolean(); }},
               {"collective_timeout_s",
                [](const Field& f, Ctx& x) { x.c.collective_timeout_s = f.number(); }},
               {"swap_read_ahead",
                [](const Field& f, Ctx& x) { x.c.swap_read_ahead = f.integer<int>(); }},
               {"device", [](const Field& f, Ctx& x) { x.c.device = compute_device(f); }},
               {"device_index",
                [](const Field& f, Ctx& x) { x.c.device_index = f.integer<int>(); }},
           }},
      });
  return root;
}

// DeepSpeed keys that users bring and zeroshard deliberately does not take, with the reason.
constexpr std::pair<std::string_view, std::string_view> kRejected[] = {
    {"scheduler",
     "zeroshard does not schedule the learning rate; drive it from the trainer (remove the key)"},
};

void collect_paths(const Node& n, const std::string& prefix, std::vector<std::string>& out) {
  for (const Node& c : n.children) {
    std::string path = join(prefix, c.key);  // a copy: out grows (and moves) while recursing
    out.push_back(path);
    collect_paths(c, path, out);
  }
}

[[noreturn]] void unknown_key(const std::string& path, const Node& section, std::string_view key) {
  std::string msg = "unknown key \"" + path + "\"";
  for (const auto& [rejected, why] : kRejected) {
    if (rejected == path) fail(msg + ": " + std::string(why));
  }
  // The same name elsewhere in the schema: most likely the key sits in the wrong section.
  static const std::vector<std::string> paths = [] {
    std::vector<std::string> v;
    collect_paths(schema(), "", v);
    return v;
  }();
  for (const std::string& p : paths) {
    const size_t dot = p.rfind('.');
    if (p.compare(dot == std::string::npos ? 0 : dot + 1, std::string::npos, key) == 0) {
      fail(msg + "; did you mean \"" + p + "\"?");
    }
  }
  // Otherwise the closest sibling, if it is close enough to be a typo.
  const Node* best = nullptr;
  size_t best_d = std::max<size_t>(2, key.size() / 3) + 1;
  for (const Node& c : section.children) {
    const size_t d = edit_distance(key, c.key);
    if (d < best_d && d < c.key.size()) best = &c, best_d = d;
  }
  if (best) {
    const std::string parent = path.substr(0, path.size() - key.size());
    msg += "; did you mean \"" + parent + std::string(best->key) + "\"?";
  }
  fail(msg);
}

void walk(const json& obj, const Node& section, const std::string& prefix, Ctx& x) {
  // Reject unknown keys before storing anything: the typo is the error the user needs to see.
  for (const auto& item : obj.items()) {
    if (!section.child(item.key())) unknown_key(join(prefix, item.key()), section, item.key());
  }
  for (const Node& n : section.children) {
    const std::string path = join(prefix, n.key);
    const auto it = obj.find(std::string(n.key));
    if (it == obj.end()) {
      if (n.required) fail("missing key \"" + path + "\"");
      continue;
    }
    if (n.set) {
      n.set(Field(*it, path), x);
      continue;
    }
    if (!it->is_object()) Field(*it, path).wrong_type("an object");
    walk(*it, n, path, x);
  }
}

// json::parse with DeepSpeed's extra strictness: a key repeated in one object is an error
// (Python's json keeps the last silently; DeepSpeed rejects it, and so do we).
json parse_strict(std::string_view text) {
  struct Frame {
    std::set<std::string> seen;
    std::string key;
    bool array;
  };
  std::vector<Frame> stack;
  auto where = [&stack] {
    std::string p;
    for (const Frame& f : stack) p += f.array ? "[]" : (p.empty() ? "" : ".") + f.key;
    return p;
  };
  const json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& v) {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        stack.push_back({{}, {}, ev == json::parse_event_t::array_start});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        stack.pop_back();
        break;
      case json::parse_event_t::key:
        stack.back().key = v.get<std::string>();
        if (!stack.back().seen.insert(stack.back().key).second) {
          fail("duplicate key \"" + where() + "\"");
        }
        break;
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), cb);
  } catch (const json::parse_error& e) {
    // Drop nlohmann's "[json.exception.parse_error.101] " tag; keep its line/column text.
    std::string what = e.what();
    const size_t tag = what.find("] ");
    fail("invalid JSON: " + (tag == std::string::npos ? what : what.substr(tag + 2)));
  }
}

}  // namespace

Config Config::from_json(std::string_view text) {
  const json doc = parse_strict(text);
  if (!doc.is_object()) {
    fail(std::string("the top level must be a JSON object, got ") + doc.type_name());
  }
  Ctx x;
  walk(doc, schema(), "", x);
  if (x.fp16 && x.bf16) {
    fail("fp16.enabled and bf16.enabled are both true; enable one of them");
  }
  x.c.dtype = x.fp16 ? DType::f16 : x.bf16 ? DType::bf16 : DType::f32;
  x.c.validate();
  return x.c;
}

Config Config::from_json_file(const std::filesystem::path& path) {
  // path's operator<< quotes it (and escapes quotes inside); it also sidesteps a GCC 12 -O3
  // false -Wrestrict on '"' + string + '"'.
  std::ostringstream quoted;
  quoted << path;
  const std::string name = quoted.str();
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail("cannot read " + name + ": is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int e = errno;
    fail("cannot open " + name + ": " + (e ? std::strerror(e) : "open failed"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("cannot read " + name + ": read failed");
  try {
    return from_json(text.str());
  } catch (const Error& err) {
    // "config: <path>: <what from_json said>", so the user knows which file to open.
    std::string what = err.what();
    if (what.rfind(kPrefix, 0) == 0) what.erase(0, std::strlen(kPrefix));
    throw Error(err.code(), kPrefix + path.string() + ": " + what);
  }
}

}  // namespace zeroshard
