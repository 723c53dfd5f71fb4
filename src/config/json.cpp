// Config::from_json(): zeroshard's own keys plus DeepSpeed's.
//
// The reader walks one schema tree: every accepted key with the setter that stores it. The tree
// is built once from two sources: the field table (fields.cpp), which gives every field's key
// and a setter chosen by the field's type, and the layout below, which gives DeepSpeed's
// sections in the order they are read and the keys that are not one field (accepted for
// compatibility, or mapped by hand). A key that is not in the tree is an error naming its full
// dotted path, so a typo in a DeepSpeed config fails loudly here instead of silently falling
// back to a default. Keys are applied in tree order, not file order, so cross-key rules
// (optimizer "type" before its "params") do not depend on how the user ordered the file.

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "src/config/internal.hpp"
#include "src/config/json_value.hpp"

namespace zeroshard {
namespace {

using config_detail::fail;
using config_detail::join;
using config_detail::json;
using config_detail::JsonField;
using config_detail::kPrefix;
using config_detail::show;

// What one from_json() call has seen beyond the Config itself: facts that are resolved only
// once the whole document is read.
struct Ctx {
  Config c;
  bool fp16 = false;
  bool bf16 = false;
  bool adam_type = false;     // optimizer.type was "Adam": adam_w_mode picks adam or adamw
  bool torch_adam = false;    // optimizer.params.torch_adam: torch's own defaults apply
  bool weight_decay = false;  // optimizer.params.weight_decay was given
};

using Setter = std::function<void(const JsonField&, Ctx&)>;
using Guard = void (*)(const JsonField&, const Ctx&);

// One key of the schema: a leaf with a setter, or a section with children. In the layout, a
// child made by Node::fields() marks where the table's fields of that section go.
struct Node {
  Node(std::string_view k, Setter s, bool req = false) : key(k), set(std::move(s)), required(req) {}
  Node(std::string_view k, std::vector<Node> ch) : key(k) {
    for (Node& c : ch) {
      if (c.fields_marker) {
        fields_at = children.size();
      } else {
        children.push_back(std::move(c));
      }
    }
  }
  static Node fields() {
    Node n("", Setter{});
    n.fields_marker = true;
    return n;
  }

  const Node* child(std::string_view k) const {
    for (const Node& n : children) {
      if (n.key == k) return &n;
    }
    return nullptr;
  }
  Node* child(std::string_view k) {
    return const_cast<Node*>(static_cast<const Node&>(*this).child(k));
  }

  // Adds a child where the layout put this section's fields (the end if it did not say).
  Node& add(Node n) {
    if (fields_at >= children.size()) {
      children.push_back(std::move(n));
      fields_at = children.size();
      return children.back();
    }
    auto it = children.insert(children.begin() + std::ptrdiff_t(fields_at++), std::move(n));
    return *it;
  }

  // The section at a dotted path below this one, created (empty) where missing.
  Node& section(std::string_view path) {
    Node* s = this;
    while (!path.empty()) {
      const size_t dot = path.find('.');
      const std::string_view k = path.substr(0, dot);
      Node* c = s->child(k);
      s = c ? c : &s->add(Node(k, std::vector<Node>{}));
      path = dot == std::string_view::npos ? std::string_view() : path.substr(dot + 1);
    }
    return *s;
  }

  std::string key;
  Setter set;
  Guard pre = nullptr;  // runs before `set` (a key that applies only to some optimizers)
  std::vector<Node> children;
  bool required = false;
  bool fields_marker = false;
  size_t fields_at = size_t(-1);
};

// ---- setters by type, for the table's fields ---------------------------------------------------

Tier parse_tier(const JsonField& f) {
  const std::string s = f.string();
  if (s == "none") return Tier::device;
  if (s == "cpu") return Tier::host;
  if (s == "nvme") return Tier::nvme;
  f.bad("= \"" + s + "\" is not one of \"none\", \"cpu\", \"nvme\"");
}

Device parse_device(const JsonField& f) {
  const std::string s = f.string();
  if (s == "cpu") return Device::cpu;
  if (s == "cuda") return Device::cuda;
  f.bad("= \"" + s + "\" is not one of \"cpu\", \"cuda\"");
}

StateFormat parse_state_format(const JsonField& f) {
  const std::string s = f.string();
  for (StateFormat v : {StateFormat::f32, StateFormat::bf16, StateFormat::q8})
    if (s == state_format_name(v)) return v;
  f.bad("= \"" + s + "\" is not one of \"f32\", \"bf16\", \"8bit\"");
}

// true, false or "auto".
SpeculativeStep parse_speculative_step(const JsonField& f) {
  if (f.is_auto()) return SpeculativeStep::automatic;
  return f.boolean() ? SpeculativeStep::on : SpeculativeStep::off;
}

template <class T>
void read(const JsonField& f, T& out) {
  if constexpr (std::is_same_v<T, bool>) {
    out = f.boolean();
  } else if constexpr (std::is_same_v<T, int> || std::is_same_v<T, int64_t>) {
    out = f.integer<T>();
  } else if constexpr (std::is_same_v<T, float>) {
    out = f.single();
  } else if constexpr (std::is_same_v<T, double>) {
    out = f.number();
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    out = f.strings();
  } else if constexpr (std::is_same_v<T, Tier>) {
    out = parse_tier(f);
  } else if constexpr (std::is_same_v<T, Device>) {
    out = parse_device(f);
  } else if constexpr (std::is_same_v<T, StateFormat>) {
    out = parse_state_format(f);
  } else if constexpr (std::is_same_v<T, SpeculativeStep>) {
    out = parse_speculative_step(f);
  } else {
    // DType and OptimizerKind have no one key: their rows must say json_by_hand.
    throw Error(ErrorCode::internal, "config: no JSON reader for the type of " + f.path());
  }
}

// Adds the rows of S's table below `section`; `get` finds the S inside the Config being read.
template <class S>
void add_table(Node& section, const std::function<S&(Config&)>& get) {
  for (const FieldInfo<S>& row : config_fields<S>()) {
    if (!row.json || row.json_by_hand) continue;
    std::visit(
        [&](auto member) {
          using M = config_detail::member_type_t<decltype(member)>;
          if constexpr (config_detail::is_option_struct<M>) {
            add_table<M>(section.section(row.json),
                         [get, member](Config& c) -> M& { return get(c).*member; });
          } else {
            const std::string_view path = row.json;
            const size_t dot = path.rfind('.');
            Node& parent =
                dot == std::string_view::npos ? section : section.section(path.substr(0, dot));
            const std::string_view key = path.substr(dot == std::string_view::npos ? 0 : dot + 1);
            if (parent.child(key)) {
              throw Error(ErrorCode::internal,
                          std::string("config: JSON key \"") + row.json + "\" is declared twice");
            }
            parent.add(Node(
                key, [get, member](const JsonField& f, Ctx& x) { read(f, get(x.c).*member); }));
          }
        },
        row.member);
  }
}

// ---- the layout: DeepSpeed's sections and its keys that are not one field ----------------------

// Setters for keys DeepSpeed users bring that change nothing here: type-checked, then dropped
// ("auto" too, which DeepSpeed itself drops for them).
void accept_bool(const JsonField& f, Ctx&) {
  if (!f.is_auto()) f.boolean();
}
void accept_count(const JsonField& f, Ctx&) {
  if (!f.is_auto()) f.count();
}
void accept_number(const JsonField& f, Ctx&) {
  if (!f.is_auto()) f.number();
}
// A section that configures a part of DeepSpeed other than its optimizer (logging, profiling,
// activation checkpointing): it must be an object; what is in it is not zeroshard's.
void accept_section(const JsonField& f, Ctx&) {
  f.object();
}

bool adam_family(OptimizerKind k) {
  return k == OptimizerKind::adam || k == OptimizerKind::adamw;
}

// Passing an SGD-only hyperparameter to Adam (or the reverse) is a TypeError in DeepSpeed/torch;
// here it is an error too rather than a silently ignored value.
void only_for(const JsonField& f, const Ctx& x, bool applies, const char* which) {
  if (!applies) {
    f.bad(std::string("applies only to ") + which + " (optimizer is " +
          optimizer_name(x.c.optimizer.kind) + ")");
  }
}
void adam_only(const JsonField& f, const Ctx& x) {
  only_for(f, x, adam_family(x.c.optimizer.kind), "adam and adamw");
}
void momentum_only(const JsonField& f, const Ctx& x) {
  only_for(f, x,
           x.c.optimizer.kind == OptimizerKind::sgd || x.c.optimizer.kind == OptimizerKind::muon,
           "sgd and muon");
}
void adam_or_muon(const JsonField& f, const Ctx& x) {
  only_for(f, x, adam_family(x.c.optimizer.kind) || x.c.optimizer.kind == OptimizerKind::muon,
           "adam, adamw and muon");
}
void muon_only(const JsonField& f, const Ctx& x) {
  only_for(f, x, x.c.optimizer.kind == OptimizerKind::muon, "muon");
}

// optimizer.type: DeepSpeed's names, case-insensitive.
void set_optimizer_type(const JsonField& f, Ctx& x) {
  const std::string name = f.string();
  std::string t = name;
  for (char& ch : t) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  OptimizerKind kind;
  if (t == "adam" || t == "adamw") {
    // DeepSpeed's "Adam" defaults to adam_w_mode = true, i.e. AdamW (decoupled weight decay);
    // params.adam_w_mode = false selects classic Adam.
    kind = OptimizerKind::adamw;
  } else if (t == "sgd") {
    kind = OptimizerKind::sgd;
  } else if (t == "lion") {
    kind = OptimizerKind::lion;
  } else if (t == "muon") {
    kind = OptimizerKind::muon;
  } else {
    f.bad("= \"" + name +
          "\" is not supported (supported: Adam, AdamW, SGD, Lion, Muon; case-insensitive)");
  }
  // An "optimizer" block means what it means to DeepSpeed: what it leaves out takes the
  // optimizer's own default (FusedAdam, FusedLion, torch SGD all default weight_decay to 0), not
  // Config's AdamW-style 0.01.
  x.c.optimizer = OptimizerOptions{};
  x.c.optimizer.kind = kind;
  x.c.optimizer.weight_decay = 0.0f;
  if (kind == OptimizerKind::muon) {  // torch.optim.Muon's defaults (weight decay: DeepSpeed's 0)
    x.c.optimizer.momentum = 0.95f;
    x.c.optimizer.nesterov = true;
    x.c.optimizer.eps = 1e-7f;
  }
  x.adam_type = t == "adam";
}

void set_adam_w_mode(const JsonField& f, Ctx& x) {
  adam_only(f, x);
  const bool w = f.boolean();
  if (x.adam_type) {
    x.c.optimizer.kind = w ? OptimizerKind::adamw : OptimizerKind::adam;
  } else if (!w) {
    // DeepSpeed silently forces AdamW here; a contradiction is worth a word.
    f.bad(
        "= false contradicts optimizer.type \"AdamW\"; use type \"Adam\" for classic Adam "
        "(weight decay added to the gradient)");
  }
}

// zero_optimization: DeepSpeed's ZeRO knobs; most of them have no bucket to size here.
Node zero_optimization_layout() {
  return Node(
      "zero_optimization",
      {
          Node::fields(),  // stage, overlap_comm, reduce/allgather_bucket_size
          {"contiguous_gradients", accept_bool},  // [true] grads always land contiguous
          // [true] DeepSpeed's false means "all-reduce instead"; zeroshard has no such path.
          {"reduce_scatter",
           [](const JsonField& f, Ctx&) {
             if (!f.boolean()) {
               f.bad(
                   "= false is not supported: zeroshard always reduce-scatters gradients "
                   "in stages 1-3; remove the key or set it to true");
             }
           }},
          // [true] Not in PEERS.md's key list, but in Hugging Face's stock ZeRO-2 file;
          // false (broadcast instead of all-gather) has no equivalent here.
          {"allgather_partitions",
           [](const JsonField& f, Ctx&) {
             if (!f.boolean()) {
               f.bad("= false is not supported: zeroshard always all-gathers parameters");
             }
           }},
          // [-1] MiCS: shards within groups of this many ranks, replicated across them.
          {"mics_shard_size",
           [](const JsonField& f, Ctx& x) {
             const double v = f.number();
             if (v != -1 && !(v >= 1 && v == std::floor(v)))
               f.bad("= " + show(v) + " must be -1 (off) or a whole number of ranks >= 1");
             x.c.shard_group_size = v == -1 ? 0 : int(v);
           }},
          {"sub_group_size", accept_count},                      // [1e9] unit is the grain
          {"stage3_prefetch_bucket_size", accept_count},         // [5e7] see zeroshard.prefetch
          {"stage3_param_persistence_threshold", accept_count},  // [1e5]
          {"stage3_max_live_parameters", accept_count},  // [1e9] see zeroshard.max_live_units
          {"stage3_max_reuse_distance", accept_count},   // [1e9]
          {"stage3_gather_16bit_weights_on_model_save", accept_bool},  // [false]
          {"round_robin_gradients", accept_bool},  // [false] a CPU-offload copy order
          // [true] A parameter that gets no gradient in a backward is tolerated (its gradient
          // counts as zero); false asks for an error instead, which zeroshard does not raise.
          {"ignore_unused_parameters",
           [](const JsonField& f, Ctx&) {
             if (!f.boolean())
               f.bad(
                   "= false is not taken: zeroshard always tolerates a parameter that gets no "
                   "gradient in a backward (DeepSpeed's default); remove the key or set it true");
           }},
          {"offload_optimizer",
           {
               Node::fields(),  // device, nvme_path, buffer_count, pin_memory
               // The nvme tier always overlaps read, update and write (docs/DESIGN.md), and lays
               // out its own swap files, so these three only need to be well-typed.
               {"pipeline_read", accept_bool},
               {"pipeline_write", accept_bool},
               {"fast_init", accept_bool},
               // DeepSpeed's speculation-then-validation: zeroshard's speculative_step.
               {"super_offload", [](const JsonField& f,
                                    Ctx& x) { x.c.speculative_step = parse_speculative_step(f); }},
               // [1.0] Share of the CPU's cores for SuperOffload's optimizer: the arena's
               // threads are the engine's (ZEROSHARD_CPU_THREADS).
               {"cpuadam_cores_perc",
                [](const JsonField& f, Ctx&) {
                  const double v = f.number();
                  if (!(v > 0 && v <= 1)) f.bad("= " + show(v) + " must be in (0, 1]");
                }},
               // [1.0] Fraction of the step run on the CPU (DeepSpeed "twin-flow").
               {"ratio",
                [](const JsonField& f, Ctx&) {
                  const double r = f.number();
                  if (r != 1.0) {
                    f.bad("= " + show(r) +
                          " is not supported: partial offload is not implemented; the whole "
                          "optimizer step runs on the tier that holds the state (use 1.0 or "
                          "remove the key)");
                  }
                }},
           }},
          {"offload_param",
           {
               Node::fields(),
               {"buffer_size", accept_count},  // [1e8] sized by the unit
               {"max_in_cpu", accept_count},   // [1e9]
           }},
      });
}

// optimizer: DeepSpeed's type names and its params, some of which apply to one family only.
Node optimizer_layout() {
  return Node("optimizer",
              {
                  // "type" comes before "params", so it is applied first whatever the file's order.
                  {"type", set_optimizer_type, /*required=*/true},
                  {"params",
                   {
                       Node::fields(),  // lr, eps, weight_decay, momentum, nesterov
                       {"betas",
                        [](const JsonField& f, Ctx& x) {
                          only_for(f, x,
                                   adam_family(x.c.optimizer.kind) ||
                                       x.c.optimizer.kind == OptimizerKind::lion,
                                   "adam, adamw and lion");
                          const std::vector<float> b = f.numbers(2);
                          x.c.optimizer.beta1 = b[0];
                          x.c.optimizer.beta2 = b[1];
                        }},
                       {"adam_w_mode", set_adam_w_mode},
                       // Which Adam DeepSpeed builds: torch.optim's, with torch's defaults
                       // (AdamW's weight decay 0.01), or its own fused one (0).
                       {"torch_adam",
                        [](const JsonField& f, Ctx& x) {
                          adam_only(f, x);
                          x.torch_adam = f.boolean();
                        }},
                       // [true] Adam without bias correction is not implemented.
                       {"bias_correction",
                        [](const JsonField& f, Ctx& x) {
                          adam_only(f, x);
                          if (!f.boolean())
                            f.bad(
                                "= false is not supported: zeroshard's Adam always corrects "
                                "the moments' bias; remove the key or set it true");
                        }},
                   }},
              });
}

// bf16 (or its older name bfloat16): enabling it sets Config::dtype once every section is read.
Node bf16_layout(std::string_view name) {
  return Node(
      name,
      {
          {"enabled", [](const JsonField& f, Ctx& x) { x.bf16 = x.bf16 || f.boolean(); }},
          // zeroshard checks every step's gradients for inf/NaN and skips such a step on every
          // rank; the flag rides on the norm's all-reduce, so it costs nothing.
          {"check_grad_overflow",
           [](const JsonField& f, Ctx&) {
             if (!f.boolean())
               f.bad(
                   "= false is not taken: zeroshard always skips a step whose gradients hold "
                   "inf or NaN, at no cost (the check rides on the gradient norm's all-reduce); "
                   "remove the key or set it true");
           }},
          // Each micro-step's reduced gradient is folded into its f32 accumulator as soon as its
          // reduction lands, which is what DeepSpeed's flag asks for: either value is accepted,
          // and the engine does that.
          {"immediate_grad_update", accept_bool},
      });
}

// The layout. DeepSpeed defaults are in brackets; "no effect" keys are accepted so that real
// DeepSpeed files load, because the unit (not a bucket) is zeroshard's grain for all of them.
Node layout() {
  return Node(
      "", {
              zero_optimization_layout(),
              // Enabling a precision sets Config::dtype once both sections are read (from_json).
              {"fp16",
               {
                   {"enabled", [](const JsonField& f, Ctx& x) { x.fp16 = f.boolean(); }},
                   Node::fields(),  // loss_scale, initial_scale_power, ... min_loss_scale
                   {"auto_cast", accept_bool},  // the trainer owns its autocast
               }},
              bf16_layout("bf16"),
              bf16_layout("bfloat16"),  // DeepSpeed's older name for the same section
              Node::fields(),           // gradient_clipping, gradient_accumulation_steps
              // Logging knobs of DeepSpeed's engine.
              {"steps_per_print", accept_count},
              {"wall_clock_breakdown", accept_bool},
              {"memory_breakdown", accept_bool},
              {"dump_state", accept_bool},
              // Sections for other parts of DeepSpeed: its monitors, profilers and activation
              // checkpointing (the trainer's torch.utils.checkpoint does that here).
              {"tensorboard", accept_section},
              {"wandb", accept_section},
              {"csv_monitor", accept_section},
              {"comet", accept_section},
              {"flops_profiler", accept_section},
              {"comms_logger", accept_section},
              {"activation_checkpointing", accept_section},
              // Whether DeepSpeed allows a client optimizer under ZeRO, or forces its CPU Adam: the
              // optimizer here is always zeroshard's own.
              {"zero_allow_untested_optimizer", accept_bool},
              {"zero_force_ds_cpu_optimizer", accept_bool},
              // Dividing the gradients by the world size before or after the sum: the engine takes
              // the mean over ranks and micro-steps either way.
              {"prescale_gradients", accept_bool},
              {"gradient_predivide_factor", accept_number},
              optimizer_layout(),

              {"aio",
               {
                   // The table's block_size [1 MiB] and queue_depth [8], then libaio threading
                   // knobs: io_uring needs none of them.
                   Node::fields(),
                   {"intra_op_parallelism", accept_count},
                   {"single_submit", accept_bool},
                   {"overlap_events", accept_bool},
                   {"thread_count", accept_count},
               }},
              {"zeroshard", {Node::fields()}},
          });
}

// Table fields that apply to some optimizers only.
// A batch size written in the file is a size: 0 is not "not given" there (leave it out).
void batch_size(const JsonField& f, const Ctx&) {
  if (f.count() < 1) f.bad("= 0 must be >= 1 (leave the key out when not given)");
}

constexpr std::pair<std::string_view, Guard> kGuards[] = {
    {"train_batch_size", batch_size},
    {"train_micro_batch_size_per_gpu", batch_size},
    {"optimizer.params.eps", adam_or_muon},
    {"optimizer.params.momentum", momentum_only},
    {"optimizer.params.nesterov", momentum_only},
    {"optimizer.params.ns_steps", muon_only},
    {"optimizer.params.ns_bf16", muon_only},
    {"optimizer.params.match_rms_adamw", muon_only},
};

const Node& schema() {
  static const Node root = [] {
    Node r = layout();
    add_table<Config>(r, [](Config& c) -> Config& { return c; });
    for (const auto& [path, guard] : kGuards) {
      const size_t dot = path.rfind('.');
      Node* leaf = dot == std::string_view::npos
                       ? r.child(path)
                       : r.section(path.substr(0, dot)).child(path.substr(dot + 1));
      if (!leaf || !leaf->set) {
        throw Error(ErrorCode::internal, "config: guarded key " + std::string(path) + " is gone");
      }
      leaf->pre = guard;
    }
    return r;
  }();
  return root;
}

// ---- walking a document ------------------------------------------------------------------------

// DeepSpeed keys that users bring and zeroshard deliberately does not take, with the reason.
constexpr std::pair<std::string_view, std::string_view> kRejected[] = {
    {"scheduler",
     "zeroshard does not schedule the learning rate; drive it from the trainer (remove the key)"},
    {"zero_optimization.cpu_offload",
     "DeepSpeed's deprecated name; write \"offload_optimizer\": {\"device\": \"cpu\"} instead"},
    {"optimizer.params.max_grad_norm", "clipping is the top-level \"gradient_clipping\" key"},
    {"communication_data_type",
     "zeroshard reduces gradients in the parameters' dtype, summing in f32 on the CPU; remove the "
     "key"},
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
  std::vector<std::string_view> siblings;
  for (const Node& c : section.children) siblings.push_back(c.key);
  const std::string_view best = closest_name(key, siblings);
  if (!best.empty()) {
    const std::string parent = path.substr(0, path.size() - key.size());
    msg += "; did you mean \"" + parent + std::string(best) + "\"?";
  }
  fail(msg);
}

// Values DeepSpeed drops for the default: null for the keys it declares Optional (config
// generators write them), and "auto" for the table's keys that have no effect here.
bool dropped(std::string_view path, const json& v) {
  if (v.is_null()) {
    for (std::string_view k : {"zero_optimization.offload_optimizer.nvme_path",
                               "zero_optimization.offload_param.nvme_path", "train_batch_size",
                               "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"})
      if (path == k) return true;
  } else if (JsonField(v, std::string(path)).is_auto()) {
    for (std::string_view k :
         {"zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size"})
      if (path == k) return true;
  }
  return false;
}

void walk(const json& obj, const Node& section, const std::string& prefix, Ctx& x) {
  // Reject unknown keys before storing anything: the typo is the error the user needs to see.
  for (const auto& item : obj.items()) {
    if (!section.child(item.key())) unknown_key(join(prefix, item.key()), section, item.key());
  }
  for (const Node& n : section.children) {
    const std::string path = join(prefix, n.key);
    const auto it = obj.find(n.key);
    if (it == obj.end()) {
      if (n.required) fail("missing key \"" + path + "\"");
      continue;
    }
    if (dropped(path, *it)) continue;
    if (n.set) {
      const JsonField f(*it, path);
      if (n.pre) n.pre(f, x);
      n.set(f, x);
      continue;
    }
    if (!it->is_object()) JsonField(*it, path).wrong_type("an object");
    walk(*it, n, path, x);
  }
}

}  // namespace

Config Config::from_json(std::string_view text) {
  const json doc = config_detail::parse_strict(text);
  if (!doc.is_object()) {
    fail(std::string("the top level must be a JSON object, got ") + doc.type_name());
  }
  Ctx x;
  walk(doc, schema(), "", x);
  const json* params = nullptr;  // optimizer.params, where walk() found an object
  if (const auto o = doc.find("optimizer"); o != doc.end() && o->contains("params"))
    params = &(*o)["params"];
  x.weight_decay = params && params->contains("weight_decay");
  if (x.fp16 && x.bf16) {
    fail("fp16.enabled and bf16.enabled are both true; enable one of them");
  }
  x.c.dtype = x.fp16 ? DType::f16 : x.bf16 ? DType::bf16 : DType::f32;
  // A disabled fp16 section's loss scale is DeepSpeed's to ignore, and ours: applied to bf16 or
  // f32 gradients it would divide them by a scale the loss was never multiplied by.
  if (!x.fp16) x.c.loss_scale = LossScaleOptions{};
  // torch.optim.AdamW's default weight decay, where DeepSpeed builds it (torch_adam).
  if (x.torch_adam && !x.weight_decay && x.c.optimizer.kind == OptimizerKind::adamw)
    x.c.optimizer.weight_decay = 0.01f;
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
