// `zeroshard config FILE` and `zeroshard config --fields` (see config_cmd.hpp), from the public
// field table (zeroshard/config_fields.hpp) only.
#include "apps/cli/config_cmd.hpp"

#include <cstdio>
#include <sstream>
#include <string>
#include <type_traits>
#include <variant>

#include "zeroshard/config.hpp"
#include "zeroshard/config_fields.hpp"
#include "zeroshard/error.hpp"

namespace zscli {
namespace {

namespace zs = zeroshard;

constexpr const char* kHelp =
    "usage: zeroshard config FILE.json\n"
    "       zeroshard config --fields\n"
    "\n"
    "FILE.json: reads a configuration as Config::from_json_file() does (zeroshard's keys and\n"
    "DeepSpeed's), validates it, and prints every setting shared by the ranks (the fingerprint\n"
    "they compare at finalize()); an unknown key, a wrong type or a broken rule is reported by\n"
    "its path, exit code 1.\n"
    "--fields: one line per field of Config and its option structs, tab-separated: owner struct,\n"
    "C++/Python name (dotted), JSON path, type, default, shared by the ranks (yes/no), rules,\n"
    "alias. docs/configuration.md's reference is generated from it.\n";

template <class T>
const char* type_name() {
  if constexpr (std::is_same_v<T, bool>) return "bool";
  if constexpr (std::is_same_v<T, int>) return "int";
  if constexpr (std::is_same_v<T, int64_t>) return "int64";
  if constexpr (std::is_same_v<T, float>) return "float";
  if constexpr (std::is_same_v<T, double>) return "double";
  if constexpr (std::is_same_v<T, std::vector<std::string>>) return "list of paths";
  if constexpr (std::is_same_v<T, zs::DType>) return "f32 | bf16 | f16";
  if constexpr (std::is_same_v<T, zs::Device>) return "cpu | cuda";
  if constexpr (std::is_same_v<T, zs::Tier>) return "device | host | nvme";
  if constexpr (std::is_same_v<T, zs::OptimizerKind>) return "adam | adamw | sgd | lion | muon";
  if constexpr (std::is_same_v<T, zs::StateFormat>) return "f32 | bf16 | 8bit";
  if constexpr (std::is_same_v<T, zs::SpeculativeStep>) return "true | false | auto";
  return "?";
}

template <class T>
std::string value_text(const T& v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, bool>) {
    os << (v ? "true" : "false");
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    for (size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
    if (v.empty()) os << "(none)";
  } else if constexpr (std::is_same_v<T, zs::DType>) {
    os << zs::dtype_name(v);
  } else if constexpr (std::is_same_v<T, zs::Device>) {
    os << (v == zs::Device::cuda ? "cuda" : "cpu");
  } else if constexpr (std::is_same_v<T, zs::Tier>) {
    os << zs::tier_name(v);
  } else if constexpr (std::is_same_v<T, zs::OptimizerKind>) {
    os << zs::optimizer_name(v);
  } else if constexpr (std::is_same_v<T, zs::StateFormat>) {
    os << zs::state_format_name(v);
  } else if constexpr (std::is_same_v<T, zs::SpeculativeStep>) {
    os << (v == zs::SpeculativeStep::automatic ? "auto"
           : v == zs::SpeculativeStep::on      ? "true"
                                               : "false");
  } else {
    os << v;
  }
  return os.str();
}

template <class S>
constexpr const char* struct_name() {
  if constexpr (std::is_same_v<S, zs::Config>) return "Config";
  if constexpr (std::is_same_v<S, zs::OptimizerOptions>) return "OptimizerOptions";
  if constexpr (std::is_same_v<S, zs::OffloadOptions>) return "OffloadOptions";
  if constexpr (std::is_same_v<S, zs::LossScaleOptions>) return "LossScaleOptions";
  return "AioOptions";
}

template <class T>
constexpr bool is_struct =
    std::is_same_v<T, zs::OptimizerOptions> || std::is_same_v<T, zs::OffloadOptions> ||
    std::is_same_v<T, zs::LossScaleOptions> || std::is_same_v<T, zs::AioOptions>;

template <class P>
struct member_of;
template <class S, class T>
struct member_of<T S::*> {
  using type = T;
};

std::string join(const std::string& a, const char* b) {
  return a.empty() ? std::string(b) : a + "." + b;
}

// One line per leaf field of `obj` (an S), descending into the option structs.
template <class S>
void print_fields(const S& obj, const std::string& name, const std::string& json) {
  for (const zs::FieldInfo<S>& row : zs::config_fields<S>()) {
    const std::string n = join(name, row.name);
    const std::string j = row.json ? join(json, row.json) : std::string("(by hand)");
    std::visit(
        [&](auto member) {
          using M = typename member_of<decltype(member)>::type;
          if constexpr (is_struct<M>) {
            print_fields<M>(obj.*member, n, row.json ? join(json, row.json) : json);
          } else {
            std::string rules;
            for (const zs::FieldRule& r : row.rules)
              if (r.ok) rules += std::string(rules.empty() ? "" : "; ") + r.text;
            std::printf("%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", struct_name<S>(), n.c_str(), j.c_str(),
                        type_name<M>(), value_text(obj.*member).c_str(),
                        row.fingerprint ? "yes" : "no", rules.c_str(), row.alias ? row.alias : "");
          }
        },
        row.member);
  }
}

}  // namespace

int run_config(const std::vector<std::string>& args) {
  if (args.size() != 1 || args[0] == "--help") {
    std::fputs(kHelp, args.size() == 1 ? stdout : stderr);
    return args.size() == 1 ? 0 : 2;
  }
  if (args[0] == "--fields") {
    print_fields<zs::Config>(zs::Config{}, "", "");
    return 0;
  }
  try {
    const zs::Config cfg = zs::Config::from_json_file(args[0]);
    cfg.validate();
    std::fputs(cfg.fingerprint().c_str(), stdout);
    return 0;
  } catch (const zs::Error& e) {
    std::fprintf(stderr, "zeroshard config: %s\n", e.what());
    return 1;
  }
}

}  // namespace zscli
