#pragma once
/// \file config_fields.hpp
/// The table of Config's fields: one row per field of Config and of each option struct it holds.
///
/// A field is declared once, in the struct (config.hpp) and in its row here (the rows are in
/// src/config/fields.cpp). The row drives everything else that knows the field by name:
/// - the JSON reader (Config::from_json) reads it from `json`, relative to its struct's section;
/// - Config::validate() applies its `rules` and names it by its JSON path;
/// - the Python bindings make it a property and a keyword argument named `name` (and `alias`);
/// - Config::fingerprint() includes it when `fingerprint` is set.
/// What a row cannot say (DeepSpeed keys that map to no field, rules across fields) is code in
/// src/config/json.cpp and src/config/validate.cpp.
///
/// The tables are immutable and built once, on first use; reading them is thread-safe.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "zeroshard/config.hpp"
#include "zeroshard/export.hpp"
#include "zeroshard/types.hpp"

namespace zeroshard {

/// A pointer to one member of S. The alternative it holds is the field's C++ type; the last four
/// are the option structs nested in Config, whose fields are rows of their own tables.
template <class S>
using FieldMember =
    std::variant<bool S::*, int S::*, int64_t S::*, float S::*, double S::*,
                 std::vector<std::string> S::*, DType S::*, Device S::*, Tier S::*,
                 OptimizerKind S::*, StateFormat S::*, SpeculativeStep S::*, OptimizerOptions S::*,
                 OffloadOptions S::*, LossScaleOptions S::*, AioOptions S::*>;

/// One check validate() applies to a numeric field on its own: `ok(value)` must hold (written so
/// that NaN fails it), else Error(invalid_config) "config: <json path> = <value> <text>".
/// Integer fields are passed converted to double (exact below 2^53).
struct FieldRule {
  bool (*ok)(double value) = nullptr;  ///< nullptr: no rule
  const char* text = nullptr;          ///< e.g. "must be >= 1"
};

/// One row: a field of S.
template <class S>
struct FieldInfo {
  /// The C++ member's name, which is also the Python attribute and keyword argument.
  const char* name;
  FieldMember<S> member;
  /// The key in S's JSON section, e.g. "loss_scale_window" in "fp16"; for a nested struct, the
  /// section's path relative to S's ("zero_optimization.offload_optimizer"). Validation
  /// messages name the field by the joined path. nullptr: no JSON key (set by hand, see below).
  const char* json = nullptr;
  /// The JSON reader does not read `json` as a plain key: src/config/json.cpp maps the field
  /// by hand (dtype from fp16/bf16.enabled, optimizer.type, the betas pair).
  bool json_by_hand = false;
  /// Part of Config::fingerprint(), i.e. every rank must agree on it. Settings that change the
  /// sequence of collectives or the numbers are; per-rank local settings (paths, I/O sizes,
  /// timeouts, which GPU) are not. The row says why where it is false.
  bool fingerprint = true;
  /// validate()'s checks of this field alone, applied in order (an empty rule ends the list).
  FieldRule rules[2] = {};
  /// Another keyword the Python bindings accept for this field (DeepSpeed's name), or nullptr.
  const char* alias = nullptr;
};

/// The table of S, in S's declaration order. S is Config, OptimizerOptions, OffloadOptions,
/// LossScaleOptions or AioOptions; the span refers to static storage, valid for the program.
template <class S>
std::span<const FieldInfo<S>> config_fields();
template <>
ZS_API std::span<const FieldInfo<Config>> config_fields<Config>();
template <>
ZS_API std::span<const FieldInfo<OptimizerOptions>> config_fields<OptimizerOptions>();
template <>
ZS_API std::span<const FieldInfo<OffloadOptions>> config_fields<OffloadOptions>();
template <>
ZS_API std::span<const FieldInfo<LossScaleOptions>> config_fields<LossScaleOptions>();
template <>
ZS_API std::span<const FieldInfo<AioOptions>> config_fields<AioOptions>();

/// The candidate closest to `key` by case-insensitive edit distance, if it is close enough to be
/// a typo of it (distance at most max(2, key.size() / 3) and below the candidate's length;
/// the first of equally close ones); an empty view otherwise. The returned view refers to the
/// candidate's storage. This is the one "did you mean" rule of the JSON reader and of Python's
/// keyword arguments.
ZS_API std::string_view closest_name(std::string_view key,
                                     const std::vector<std::string_view>& candidates);

}  // namespace zeroshard
