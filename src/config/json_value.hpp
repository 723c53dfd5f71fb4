#pragma once
// The JSON reader's two tools: strict parsing (duplicate keys are errors) and a JSON value with
// its dotted path, whose typed reads fail with Error(invalid_config) naming the key and both
// types. Private to src/config/; nlohmann::json stays out of the public headers.

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace zeroshard::config_detail {

using json = nlohmann::json;

/// json::parse with DeepSpeed's extra strictness: a key repeated in one object is an error
/// (Python's json keeps the last silently; DeepSpeed rejects it, and so do we). Comments (// and
/// /* */) are allowed, as DeepSpeed's hjson reader allows them.
json parse_strict(std::string_view text);

/// One JSON value and its path ("zero_optimization.stage"). Holds a reference to the value:
/// the document must outlive it.
class JsonField {
 public:
  JsonField(const json& j, std::string path) : j_(j), path_(std::move(path)) {}

  const std::string& path() const { return path_; }
  /// The string "auto": DeepSpeed drops it where a key has a default, and so do the keys that
  /// have no effect here.
  bool is_auto() const { return j_.is_string() && j_.get_ref<const std::string&>() == "auto"; }

  /// Throws "config: \"<path>\" <rule>".
  [[noreturn]] void bad(const std::string& rule) const;
  /// Throws "\"<path>\" must be <expected>, got <type> <value>".
  [[noreturn]] void wrong_type(const std::string& expected) const;

  bool boolean() const;
  double number() const;
  /// A number that fits in a float (hyperparameters are stored as float; no silent inf).
  float single() const;
  /// An integer that fits in T (int or int64_t); an integral float (5e8) is taken.
  template <class T>
  T integer() const;
  /// A count that is accepted for compatibility and has no effect: still must be >= 0.
  int64_t count() const;
  std::string string() const;
  /// An object (its contents read by nobody here).
  void object() const;
  /// A string or an array of strings (DeepSpeed's nvme_path is one directory, ours several).
  std::vector<std::string> strings() const;
  /// An array of exactly n numbers, each fitting in a float.
  std::vector<float> numbers(size_t n) const;

 private:
  const json& j_;
  std::string path_;
};

}  // namespace zeroshard::config_detail
