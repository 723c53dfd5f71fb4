// JsonField's typed reads and strict parsing (see json_value.hpp).

#include "src/config/json_value.hpp"

#include <cmath>
#include <limits>
#include <set>

#include "src/config/internal.hpp"

namespace zeroshard::config_detail {

void JsonField::bad(const std::string& rule) const {
  fail("\"" + path_ + "\" " + rule);
}

void JsonField::wrong_type(const std::string& expected) const {
  std::string got = j_.type_name();
  // Scalars are short enough to quote, and seeing "true" in quotes explains the error at once.
  if (j_.is_primitive() && !j_.is_null()) {
    std::string text = j_.dump();
    if (text.size() > 40) text = text.substr(0, 37) + "...";
    got += " " + text;
  }
  // Hugging Face's DeepSpeed integration fills in "auto" itself; a raw HF config lands here.
  if (is_auto()) {
    got +=
        " (\"auto\" is a placeholder the Hugging Face Trainer replaces before DeepSpeed reads"
        " the file; give a value)";
  }
  bad("must be " + expected + ", got " + got);
}

bool JsonField::boolean() const {
  if (!j_.is_boolean()) wrong_type("a boolean");
  return j_.get<bool>();
}

double JsonField::number() const {
  if (!j_.is_number()) wrong_type("a number");
  return j_.get<double>();
}

float JsonField::single() const {
  const double d = number();
  if (std::fabs(d) > std::numeric_limits<float>::max()) {
    bad("= " + show(d) + " does not fit in a 32-bit float");
  }
  // Not silently 0 either (an lr of 1e-50 would train nothing).
  if (d != 0 && std::fabs(d) < std::numeric_limits<float>::denorm_min()) {
    bad("= " + show(d) + " is below the smallest 32-bit float (it would be stored as 0)");
  }
  return static_cast<float>(d);
}

template <class T>
T JsonField::integer() const {
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
template int JsonField::integer<int>() const;
template int64_t JsonField::integer<int64_t>() const;

int64_t JsonField::count() const {
  const auto v = integer<int64_t>();
  if (v < 0) bad("= " + show(v) + " must be >= 0");
  return v;
}

std::string JsonField::string() const {
  if (!j_.is_string()) wrong_type("a string");
  return j_.get<std::string>();
}

void JsonField::object() const {
  if (!j_.is_object()) wrong_type("an object");
}

std::vector<std::string> JsonField::strings() const {
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

std::vector<float> JsonField::numbers(size_t n) const {
  const std::string expected = "an array of " + show(n) + " numbers";
  if (!j_.is_array() || j_.size() != n) wrong_type(expected);
  std::vector<float> out;
  for (size_t i = 0; i < n; ++i)
    out.push_back(JsonField(j_[i], path_ + "[" + show(i) + "]").single());
  return out;
}

json parse_strict(std::string_view text) {
  // JSON has no raw NUL: inside a string it must be written \u0000, and after the document it
  // would hide what follows it from a reader that stops there.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    fail("invalid JSON: a NUL byte at offset " + std::to_string(nul) +
         " (write \\u0000 inside a string; nothing may follow the document)");
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
    return json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/true,
                       /*ignore_comments=*/true);
  } catch (const json::exception& e) {
    // A syntax error, or a number no double holds (1e309): drop nlohmann's
    // "[json.exception.parse_error.101] " tag and keep its own text (line, column, token).
    std::string what = e.what();
    const size_t tag = what.find("] ");
    // The syntax note only where the syntax is what failed.
    const bool syntax = dynamic_cast<const json::parse_error*>(&e) != nullptr;
    fail("invalid JSON: " + (tag == std::string::npos ? what : what.substr(tag + 2)) +
         (syntax ? " (comments // and /* */ are allowed; hjson's # comments, unquoted keys and "
                   "trailing commas are not)"
                 : ""));
  }
}

}  // namespace zeroshard::config_detail
