// The field table (zeroshard/config_fields.hpp): every field it lists reads back from JSON,
// changing that field and nothing else; the fingerprint holds what ranks must agree on; and the
// one "did you mean" rule. The tests walk the table itself, so a field added to it is covered
// without a new test (a field the JSON reader maps by hand must be added to by_hand() below).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <charconv>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "zeroshard/config.hpp"
#include "zeroshard/config_fields.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

template <class P>
struct member_type;
template <class S, class T>
struct member_type<T S::*> {
  using type = T;
};
template <class T>
constexpr bool is_options =
    std::is_same_v<T, OptimizerOptions> || std::is_same_v<T, OffloadOptions> ||
    std::is_same_v<T, LossScaleOptions> || std::is_same_v<T, AioOptions>;

// Every leaf field of Config as a list of typed accessors.
using Ref = std::variant<bool*, int*, int64_t*, float*, double*, std::vector<std::string>*, DType*,
                         Device*, Tier*, OptimizerKind*, StateFormat*, SpeculativeStep*>;
struct Field {
  std::string name, json;
  bool by_hand, fingerprint;
  std::function<Ref(Config&)> ref;
};

template <class S>
void collect(std::vector<Field>& out, const std::function<S&(Config&)>& get,
             const std::string& name_prefix, const std::string& json_prefix) {
  auto join = [](const std::string& p, const char* k) { return p.empty() ? k : p + "." + k; };
  for (const FieldInfo<S>& row : config_fields<S>()) {
    const std::string name = join(name_prefix, row.name);
    const std::string json = row.json ? join(json_prefix, row.json) : "";
    std::visit(
        [&](auto member) {
          using M = typename member_type<decltype(member)>::type;
          if constexpr (is_options<M>) {
            collect<M>(
                out, [get, member](Config& c) -> M& { return get(c).*member; }, name, json);
          } else {
            out.push_back({name, json, row.json_by_hand, row.fingerprint,
                           [get, member](Config& c) -> Ref { return &(get(c).*member); }});
          }
        },
        row.member);
  }
}

const std::vector<Field>& fields() {
  static const std::vector<Field> f = [] {
    std::vector<Field> v;
    collect<Config>(
        v, [](Config& c) -> Config& { return c; }, "", "");
    return v;
  }();
  return f;
}

std::string shortest(double v) {
  char buf[64];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}
std::string shortest(float v) {
  char buf[64];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}

// Changes the field to a value other than its current one (the n-th candidate) and returns that
// value as JSON, or "" when there is no n-th candidate.
std::string change(Ref r, int n) {
  return std::visit(
      [n](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (n > 0) return "";
          *p = !*p;
          return *p ? "true" : "false";
        } else if constexpr (std::is_same_v<T, int> || std::is_same_v<T, int64_t>) {
          if (n > 1) return "";
          *p = n == 0 ? *p + 1 : *p * 2;
          return std::to_string(*p);
        } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
          if (n > 0) return "";
          *p = *p == 0 ? T(0.5) : *p / 2;
          return shortest(*p);
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          if (n > 0) return "";
          *p = {"/tmp/zs_a", "/tmp/zs_b"};
          return R"(["/tmp/zs_a", "/tmp/zs_b"])";
        } else if constexpr (std::is_same_v<T, Tier>) {
          if (n > 1) return "";
          *p = n == 0 ? Tier::host : Tier::nvme;
          return n == 0 ? R"("cpu")" : R"("nvme")";
        } else if constexpr (std::is_same_v<T, Device>) {
          if (n > 0) return "";
          *p = Device::cuda;
          return R"("cuda")";
        } else if constexpr (std::is_same_v<T, StateFormat>) {
          if (n > 1) return "";
          *p = n == 0 ? StateFormat::q8 : StateFormat::bf16;
          return n == 0 ? R"("8bit")" : R"("bf16")";
        } else if constexpr (std::is_same_v<T, SpeculativeStep>) {
          if (n > 1) return "";
          *p = n == 0 ? SpeculativeStep::on : SpeculativeStep::off;
          return n == 0 ? "true" : "false";
        } else {
          return "";  // DType, OptimizerKind: mapped by hand
        }
      },
      r);
}

bool same(Ref a, Ref b) {
  return std::visit(
      [&](auto* pa) {
        using P = decltype(pa);
        return *pa == *std::get<P>(b);
      },
      a);
}

// A JSON document from dotted paths and literal values.
std::string document(const std::vector<std::pair<std::string, std::string>>& kv) {
  struct Obj {
    std::map<std::string, Obj> sub;
    std::string literal;
  };
  Obj root;
  for (const auto& [path, literal] : kv) {
    Obj* o = &root;
    size_t start = 0;
    while (true) {
      const size_t dot = path.find('.', start);
      o = &o->sub[path.substr(start, dot - start)];
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    o->literal = literal;
  }
  std::function<std::string(const Obj&)> dump = [&](const Obj& o) {
    if (o.sub.empty() && &o != &root) return o.literal;
    std::string s = "{";
    for (const auto& [k, v] : o.sub) s += (s.size() > 1 ? ", \"" : "\"") + k + "\": " + dump(v);
    return s + "}";
  };
  return dump(root);
}

// Every field differs from the default only where the test changed it.
void expect_same_config(Config& got, Config& want, const std::string& what) {
  for (const Field& f : fields()) {
    EXPECT_TRUE(same(f.ref(got), f.ref(want))) << f.name << " differs after " << what;
  }
}

// Round trip: for every field with a plain JSON key, a document that sets it (on top of a base
// the field's rules need) gives the Config with that field changed and nothing else.
TEST(ConfigFields, EveryJsonFieldReadsBackAndChangesOnlyItself) {
  using Doc = std::vector<std::pair<std::string, std::string>>;
  int covered = 0;
  for (const Field& f : fields()) {
    if (f.json.empty() || f.by_hand) continue;
    // Optimizer hyperparameters need the optimizer's type; offload_param needs stage 3;
    // bf16_master needs bf16 parameters; the loss scale is read only with fp16 enabled.
    const std::vector<Doc> bases =
        f.json.rfind("optimizer.", 0) == 0
            ? std::vector<Doc>{{{"optimizer.type", R"("AdamW")"}},
                               {{"optimizer.type", R"("SGD")"},
                                {"optimizer.params.momentum", "0.5"}},
                               {{"optimizer.type", R"("Muon")"}}}
        : f.json.rfind("fp16.", 0) == 0
            ? std::vector<Doc>{{{"fp16.enabled", "true"}}}
            : std::vector<Doc>{{}, {{"zero_optimization.stage", "3"}}, {{"bf16.enabled", "true"}}};
    bool done = false;
    for (const Doc& base : bases) {
      for (int n = 0; !done; ++n) {
        Config want = Config::from_json(document(base));
        const std::string literal = change(f.ref(want), n);
        if (literal.empty()) break;
        try {
          want.validate();
        } catch (const Error&) {
          continue;  // this value breaks a rule here: try the next value or base
        }
        Doc doc = base;
        doc.emplace_back(f.json, literal);
        const std::string text = document(doc);
        SCOPED_TRACE(f.name + " from " + text);
        Config got;
        try {
          got = Config::from_json(text);
        } catch (const Error&) {
          break;  // a key of another optimizer (Muon's under AdamW): try the next base
        }
        expect_same_config(got, want, text);
        done = true;
      }
      if (done) break;
    }
    EXPECT_TRUE(done) << f.name << ": no value of it passed validate(); teach change() one";
    covered += done;
  }
  EXPECT_GE(covered, 30);
}

// The fields the JSON reader maps by hand, each with a document that sets it.
TEST(ConfigFields, FieldsMappedByHandReadBack) {
  const std::map<std::string, std::pair<std::string, std::function<void(Config&)>>> by_hand = {
      {"dtype", {R"({"bf16": {"enabled": true}})", [](Config& c) { c.dtype = DType::bf16; }}},
      {"optimizer.kind",
       {R"({"optimizer": {"type": "Lion"}})",
        [](Config& c) {
          c.optimizer.kind = OptimizerKind::lion;
          c.optimizer.weight_decay = 0;  // an optimizer block takes DeepSpeed's default
        }}},
      {"optimizer.beta1",
       {R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.5, 0.999]}}})",
        [](Config& c) {
          c.optimizer.beta1 = 0.5f;
          c.optimizer.weight_decay = 0;
        }}},
      {"optimizer.beta2",
       {R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.5]}}})",
        [](Config& c) {
          c.optimizer.beta2 = 0.5f;
          c.optimizer.weight_decay = 0;
        }}},
  };
  for (const Field& f : fields()) {
    if (!f.by_hand) continue;
    const auto it = by_hand.find(f.name);
    ASSERT_NE(it, by_hand.end()) << f.name << " is read by hand: add it to this test";
    Config got = Config::from_json(it->second.first);
    Config want;
    it->second.second(want);
    Config defaults;
    ASSERT_FALSE(same(f.ref(got), f.ref(defaults))) << f.name;
    expect_same_config(got, want, it->second.first);
  }
}

TEST(ConfigFields, NamesAreUniqueAndJsonPathsTooAndTablesFollowTheStructs) {
  std::map<std::string, int> names, paths;
  for (const Field& f : fields()) {
    EXPECT_EQ(++names[f.name], 1) << f.name;
    if (!f.json.empty()) {
      EXPECT_EQ(++paths[f.json], 1) << f.json;
    }
  }
  // One row per member: a member without a row is one that no reader, rule or binding knows
  // of. Adding a field to config.hpp and its row to fields.cpp raises this count.
  EXPECT_EQ(fields().size(), 52u) << "a Config member without a row in src/config/fields.cpp?";
}

TEST(ConfigFields, FingerprintHasOneLinePerSharedSettingAndNamesIt) {
  const Config d;
  const std::string fp = d.fingerprint();
  for (const char* line :
       {"config stage=0\n", "config dtype=f32\n", "config prefetch=true\n",
        "config max_live_units=3\n", "config overlap_comm=true\n", "config grad_buffers=2\n",
        "config device=cpu\n", "config optimizer.kind=adamw\n", "config optimizer.lr=0.001\n",
        "config offload_optimizer.tier=device\n", "config shard_alignment=128\n",
        "config gradient_clipping=0\n", "config loss_scale.window=1000\n"}) {
    EXPECT_THAT(fp, HasSubstr(line));
  }
  // Per-rank local settings stay out: each rank may have its own disks, GPU and patience.
  for (const char* local : {"nvme_paths", "device_index", "collective_timeout_s", "aio.",
                            "buffer_count", "pin_memory", "swap_read_ahead", "bucket_size"}) {
    EXPECT_THAT(fp, Not(HasSubstr(local)));
  }
  // Every fingerprinted field shows up in it, and a change to it changes its line only.
  int lines = 0;
  for (const Field& f : fields()) {
    Config c;
    if (change(f.ref(c), 0).empty()) {
      std::visit(
          [](auto* p) {
            if constexpr (std::is_same_v<decltype(p), DType*>) *p = DType::bf16;
            if constexpr (std::is_same_v<decltype(p), OptimizerKind*>) *p = OptimizerKind::sgd;
          },
          f.ref(c));
    }
    const std::string fc = c.fingerprint();
    if (!f.fingerprint) {
      EXPECT_EQ(fc, fp) << f.name << " is not fingerprinted";
      continue;
    }
    ++lines;
    EXPECT_NE(fc, fp) << f.name;
    EXPECT_THAT(fc, HasSubstr("config " + f.name + "=")) << f.name;
  }
  EXPECT_EQ(std::count(fp.begin(), fp.end(), '\n'), lines);
}

TEST(ConfigFields, ClosestNameIsTheOneDidYouMeanRule) {
  const std::vector<std::string_view> names = {"stage", "prefetch", "lr", "max_live_units"};
  EXPECT_EQ(closest_name("stag", names), "stage");
  EXPECT_EQ(closest_name("PREFETCH", names), "prefetch");  // case-insensitive
  EXPECT_EQ(closest_name("max_live_unit", names), "max_live_units");
  EXPECT_EQ(closest_name("x", names), "");  // replacing all of "lr" is no typo of it
  EXPECT_EQ(closest_name("completely_else", names), "");
}

}  // namespace
}  // namespace zeroshard
