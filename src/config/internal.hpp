#pragma once
// What the three parts of Config share (fields.cpp: the table and the fingerprint; json.cpp:
// the reader; validate.cpp: the rules): the error prefix, value formatting and a walk over every
// field of the table with its two names.

#include <charconv>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "zeroshard/config.hpp"
#include "zeroshard/config_fields.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard::config_detail {

inline constexpr const char* kPrefix = "config: ";

/// Throws Error(invalid_config, "config: " + what).
[[noreturn]] void fail(const std::string& what);

/// Why Config::speculative_step is not taken ("" when it is), for the engine (whose rank 0 says
/// so at finalize()) and the planner alike. `muon`: a parameter group is Muon; `gpu`: backward
/// runs on a device beside the CPU (a GPU, or the asynchronous CPU device playing one).
std::string speculation_off(const Config& c, bool muon, bool gpu);
/// Whether rank 0 says at finalize() whether the speculative step is taken, and why: where it
/// was asked for (on), or left to the engine (automatic) on a GPU engine with the state
/// offloaded, where the choice matters.
bool speculation_said(const Config& c, bool gpu);

/// "a.b" from "a" and "b"; just "b" when the prefix is empty.
inline std::string join(const std::string& prefix, std::string_view key) {
  return prefix.empty() ? std::string(key) : prefix + "." + std::string(key);
}

/// Shortest text that reads back as the same value, so a float field holding 0.9f prints "0.9"
/// rather than "0.899999976" and messages quote what the user wrote.
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

/// A field's value as the fingerprint prints it: numbers as show(), enums by name, paths joined
/// by ','.
std::string show_value(bool v);
std::string show_value(int v);
std::string show_value(int64_t v);
std::string show_value(float v);
std::string show_value(double v);
std::string show_value(const std::vector<std::string>& v);
std::string show_value(DType v);
std::string show_value(Device v);
std::string show_value(Tier v);
std::string show_value(OptimizerKind v);
std::string show_value(StateFormat v);
std::string show_value(SpeculativeStep v);

/// DeepSpeed's spelling of a tier ("none", "cpu", "nvme"), which is what the user wrote.
const char* deepspeed_tier_name(Tier t);

/// T of a pointer to member `T S::*`.
template <class P>
struct member_type;
template <class S, class T>
struct member_type<T S::*> {
  using type = T;
};
template <class P>
using member_type_t = typename member_type<P>::type;

/// True for the option structs that are rows of Config with tables of their own.
template <class T>
inline constexpr bool is_option_struct =
    std::is_same_v<T, OptimizerOptions> || std::is_same_v<T, OffloadOptions> ||
    std::is_same_v<T, LossScaleOptions> || std::is_same_v<T, AioOptions>;

/// Calls f(row, value, name, json) for every leaf field of `obj` (an S or a const S), descending
/// into nested option structs, in table order. `value` is a reference to the member; `name` is
/// its dotted C++ path ("optimizer.lr"); `json` its dotted JSON path ("optimizer.params.lr"),
/// empty when the row has no JSON key.
template <class S, class Obj, class F>
void for_each_field(Obj& obj, const std::string& name_prefix, const std::string& json_prefix,
                    F&& f) {
  for (const FieldInfo<S>& row : config_fields<S>()) {
    const std::string name = join(name_prefix, row.name);
    const std::string json_path = row.json ? join(json_prefix, row.json) : std::string();
    std::visit(
        [&](auto member) {
          using M = member_type_t<decltype(member)>;
          if constexpr (is_option_struct<M>) {
            for_each_field<M>(obj.*member, name, json_path, f);
          } else {
            f(row, obj.*member, name, json_path);
          }
        },
        row.member);
  }
}

}  // namespace zeroshard::config_detail
