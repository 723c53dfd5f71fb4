// Config and its option structs. Three ways in, one validation:
//   Config(stage=2, dtype="bf16", optimizer={"lr": 3e-4}, offload_optimizer="cpu", ...)
//   Config.from_dict({...})  /  Config.from_json(text)  /  Config.from_json_file(path)
// The dict/JSON forms go through the C++ reader (zeroshard's own keys plus DeepSpeed's), so a
// bad key gets the same message in Python as in C++. Keyword arguments are the struct's field
// names; an unknown one, or a value of the wrong type, is a ConfigError that names it.
// Properties and keyword arguments are made from the field table (zeroshard/config_fields.hpp):
// a new Config field needs no code here unless it has a new C++ type.
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string_view>
#include <type_traits>
#include <variant>

#include "python_bindings/src/bindings.hpp"

namespace zeroshard::py {

namespace {

[[noreturn]] void config_fail(const std::string& msg) {
  throw Error(ErrorCode::invalid_config, "config: " + msg);
}

std::string describe(nb::handle v) {
  std::string r = nb::repr(v).c_str();
  if (r.size() > 40) r = r.substr(0, 37) + "...";
  return std::string(nb::type_name(v.type()).c_str()) + " " + r;
}

// "<dotted path> = <value>" of the first float in `v` that is not finite ("" if none): JSON has
// no NaN or infinity, and json.dumps would write tokens that no JSON reader takes.
std::string non_finite_at(nb::handle v, const std::string& path) {
  if (PyFloat_Check(v.ptr()))
    return std::isfinite(PyFloat_AsDouble(v.ptr())) ? ""
                                                    : "\"" + path + "\" = " + nb::repr(v).c_str();
  std::string at;
  if (PyDict_Check(v.ptr())) {
    for (auto [k, x] : nb::borrow<nb::dict>(v)) {
      const std::string key = nb::str(k).c_str();
      if (!(at = non_finite_at(x, path.empty() ? key : path + "." + key)).empty()) return at;
    }
  } else if (PyList_Check(v.ptr()) || PyTuple_Check(v.ptr())) {
    size_t i = 0;
    for (nb::handle x : v)
      if (!(at = non_finite_at(x, path + "[" + std::to_string(i++) + "]")).empty()) return at;
  }
  return at;
}

// Strict scalar conversions: Python's bool is an int, but True for a count is a mistake.
int64_t as_int(nb::handle v, const std::string& path) {
  if (PyBool_Check(v.ptr()) || !PyLong_Check(v.ptr()))
    config_fail(path + " must be an integer, got " + describe(v));
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (overflow)
    config_fail(path + " = " + nb::repr(v).c_str() + " is out of range for a 64-bit integer");
  return x;
}
int as_int32(nb::handle v, const std::string& path) {
  const int64_t x = as_int(v, path);
  if (x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max())
    config_fail(path + " = " + std::to_string(x) + " is out of range for a 32-bit integer");
  return int(x);
}
double as_double(nb::handle v, const std::string& path) {
  if (PyBool_Check(v.ptr()) || !(PyLong_Check(v.ptr()) || PyFloat_Check(v.ptr())))
    config_fail(path + " must be a number, got " + describe(v));
  return nb::cast<double>(v);
}
float as_float(nb::handle v, const std::string& path) {
  const double d = as_double(v, path);
  if (std::fabs(d) > std::numeric_limits<float>::max())
    config_fail(path + " = " + nb::repr(v).c_str() + " does not fit in a 32-bit float");
  return float(d);
}
bool as_bool(nb::handle v, const std::string& path) {
  if (!PyBool_Check(v.ptr())) config_fail(path + " must be a boolean, got " + describe(v));
  return v.ptr() == Py_True;
}
std::vector<std::string> as_paths(nb::handle v, const std::string& path) {
  if (PyUnicode_Check(v.ptr())) return {nb::cast<std::string>(v)};
  std::vector<std::string> out;
  try {
    for (nb::handle e : v) out.push_back(nb::cast<std::string>(nb::str(e)));
  } catch (const nb::python_error&) {
    config_fail(path + " must be a path or a list of paths, got " + describe(v));
  }
  return out;
}

template <class S>
constexpr const char* struct_name() {
  if constexpr (std::is_same_v<S, Config>) return "Config";
  if constexpr (std::is_same_v<S, OptimizerOptions>) return "OptimizerOptions";
  if constexpr (std::is_same_v<S, OffloadOptions>) return "OffloadOptions";
  if constexpr (std::is_same_v<S, LossScaleOptions>) return "LossScaleOptions";
  if constexpr (std::is_same_v<S, AioOptions>) return "AioOptions";
}

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

template <class T>
T as_options(nb::handle v, const std::string& path);

// Stores a Python value into `field`, a member of `s`, by the field's C++ type. The same code
// serves attribute assignment and keyword construction, so both accept the same values.
template <class S, class T>
void store(S& s, T& field, nb::handle v, const std::string& path) {
  if constexpr (std::is_same_v<T, bool>) {
    field = as_bool(v, path);
  } else if constexpr (std::is_same_v<T, int>) {
    field = as_int32(v, path);
  } else if constexpr (std::is_same_v<T, int64_t>) {
    field = as_int(v, path);
  } else if constexpr (std::is_same_v<T, float>) {
    field = as_float(v, path);
  } else if constexpr (std::is_same_v<T, double>) {
    field = as_double(v, path);
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    field = as_paths(v, path);
  } else if constexpr (std::is_same_v<T, DType>) {
    field = parse_dtype(v);
  } else if constexpr (std::is_same_v<T, Tier>) {
    field = parse_tier(v);
  } else if constexpr (std::is_same_v<T, OptimizerKind>) {
    field = parse_optimizer(v);
  } else if constexpr (std::is_same_v<T, StateFormat>) {
    field = parse_state_format(v);
  } else if constexpr (std::is_same_v<T, SpeculativeStep>) {
    field = parse_speculative_step(v);
  } else if constexpr (std::is_same_v<T, Device>) {
    // "cuda:N" (a torch.device's spelling) also sets Config::device_index.
    if constexpr (std::is_same_v<S, Config>) {
      field = parse_device(v, &s.device_index);
    } else {
      field = parse_device(v, nullptr);
    }
  } else {
    static_assert(is_options<T>, "a Config field type without a Python conversion");
    field = as_options<T>(v, path);
  }
}

// The row of S named `key` (its name or its alias), or null.
template <class S>
const FieldInfo<S>* find_field(std::string_view key) {
  for (const FieldInfo<S>& row : config_fields<S>()) {
    if (key == row.name || (row.alias && key == row.alias)) return &row;
  }
  return nullptr;
}

template <class S>
void set_field(S& s, const FieldInfo<S>& row, nb::handle v, const std::string& key) {
  std::visit(
      [&](auto member) { store(s, s.*member, v, std::string(struct_name<S>()) + "." + key); },
      row.member);
}

template <class S>
void set_field(S& s, const std::string& key, nb::handle value) {
  if (const FieldInfo<S>* row = find_field<S>(key)) return set_field(s, *row, value, key);
  std::vector<std::string_view> names;
  for (const FieldInfo<S>& row : config_fields<S>()) {
    names.push_back(row.name);
    if (row.alias) names.push_back(row.alias);
  }
  std::string msg = "unknown keyword argument '" + key + "' for " + struct_name<S>();
  const std::string_view best = closest_name(key, names);
  if (!best.empty()) msg += "; did you mean '" + std::string(best) + "'?";
  msg += " (fields:";
  for (std::string_view n : names) msg += " " + std::string(n);
  config_fail(msg + ")");
}

template <class S>
void apply_kwargs(S& s, const nb::kwargs& kw) {
  for (auto [k, v] : kw) set_field(s, nb::cast<std::string>(k), v);
}

// A nested option struct may be given as the struct itself or as a dict of its fields; an
// offload tier also as just the device string: offload_optimizer="cpu".
template <class T>
T as_options(nb::handle v, const std::string& path) {
  T out;
  if (nb::try_cast<T>(v, out, false)) return out;
  if constexpr (std::is_same_v<T, OffloadOptions>) {
    if (PyUnicode_Check(v.ptr()) || v.is_none() || nb::isinstance<Tier>(v)) {
      out.tier = parse_tier(v);
      return out;
    }
  }
  if (!PyDict_Check(v.ptr()))
    config_fail(path + " must be a " + struct_name<T>() + " or a dict of its fields, got " +
                describe(v));
  for (auto [k, val] : nb::borrow<nb::dict>(v)) set_field(out, nb::cast<std::string>(k), val);
  return out;
}

// Binds every row of S's table (and its alias) as a read/write property. A plain field's getter
// returns its value; a nested option struct's returns a reference into S, so that
// cfg.optimizer.lr = 0.1 changes cfg (its setter still takes dicts and objects).
template <class S, class Cls>
void bind_fields(Cls& cls) {
  for (const FieldInfo<S>& row : config_fields<S>()) {
    for (const char* name : {row.name, row.alias}) {
      if (!name) continue;
      const std::string key = name;
      std::visit(
          [&](auto member) {
            using M = typename member_type<decltype(member)>::type;
            auto set = [member, key](S& s, nb::handle v) {
              store(s, s.*member, v, std::string(struct_name<S>()) + "." + key);
            };
            if constexpr (is_options<M>) {
              cls.def_prop_rw(
                  name, [member](S& s) -> M& { return s.*member; }, set,
                  nb::rv_policy::reference_internal);
            } else {
              cls.def_prop_rw(
                  name, [member](const S& s) { return s.*member; }, set);
            }
          },
          row.member);
    }
  }
  cls.def_static(
      "fields",
      [] {
        std::vector<std::string> names;
        for (const FieldInfo<S>& row : config_fields<S>()) names.push_back(row.name);
        return names;
      },
      "The keyword arguments the constructor takes (the C++ struct's field names).");
}

// Option structs: keyword construction sets fields and validates nothing (Config does).
template <class S>
nb::class_<S> bind_options(nb::module_& m, const char* doc) {
  auto cls = nb::class_<S>(m, struct_name<S>(), doc);
  bind_fields<S>(cls);
  cls.def("__init__", [](S* self, const nb::kwargs& kw) {
    new (self) S();
    apply_kwargs(*self, kw);
  });
  return cls;
}

std::string f2s(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

void bind_enums(nb::module_& m) {
  nb::enum_<DType>(m, "DType", "Element type of parameters and gradients.")
      .value("f32", DType::f32)
      .value("bf16", DType::bf16)
      .value("f16", DType::f16);
  nb::enum_<Device>(m, "Device",
                    "The compute device (Config.device): parameters, gradients and the device "
                    "tier live in its memory. cuda needs a build with ZEROSHARD_WITH_CUDA=ON.")
      .value("cpu", Device::cpu)
      .value("cuda", Device::cuda);
  nb::enum_<Tier>(m, "Tier", "Where a shard lives: device memory, pinned host memory, NVMe files.")
      .value("device", Tier::device)
      .value("host", Tier::host)
      .value("nvme", Tier::nvme);
  nb::enum_<OptimizerKind>(m, "OptimizerKind")
      .value("adam", OptimizerKind::adam)
      .value("adamw", OptimizerKind::adamw)
      .value("sgd", OptimizerKind::sgd)
      .value("lion", OptimizerKind::lion)
      .value("muon", OptimizerKind::muon);
  nb::enum_<StateFormat>(m, "StateFormat",
                         "Storage of the optimizer moments (Config.optimizer_state): f32, bf16, "
                         "or q8 (blockwise 8-bit, \"8bit\").")
      .value("f32", StateFormat::f32)
      .value("bf16", StateFormat::bf16)
      .value("q8", StateFormat::q8);
  nb::enum_<SpeculativeStep>(m, "SpeculativeStep",
                             "Config.speculative_step: off, on, or automatic (\"auto\", the "
                             "default: on for a GPU engine with the optimizer state on nvme). "
                             "True and False are on and off.")
      .value("off", SpeculativeStep::off)
      .value("on", SpeculativeStep::on)
      .value("automatic", SpeculativeStep::automatic);
}

}  // namespace

Config coerce_config(nb::handle h) {
  Config c;
  if (nb::try_cast<Config>(h, c, false)) return c;
  if (PyDict_Check(h.ptr())) return nb::cast<Config>(nb::type<Config>().attr("from_dict")(h));
  if (PyUnicode_Check(h.ptr()) || nb::hasattr(h, "__fspath__"))
    return Config::from_json_file(
        nb::cast<std::string>(nb::module_::import_("os").attr("fspath")(h)));
  config_fail("expected a Config, a dict of zeroshard/DeepSpeed keys or a JSON file path, got " +
              describe(h));
}

OptimizerOptions coerce_optimizer(nb::handle h) {
  return as_options<OptimizerOptions>(h, "optimizer");
}

void bind_config(nb::module_& m) {
  bind_enums(m);
  m.def("dtype_size", &dtype_size, "Bytes per element of a DType.");

  auto opt = bind_options<OptimizerOptions>(
      m,
      "Hyperparameters of one parameter group (see include/zeroshard/config.hpp for each "
      "optimizer's use of them). OptimizerOptions(kind='adamw', lr=1e-3, ...).");
  opt.def("__repr__", [](const OptimizerOptions& o) {
    return std::string("OptimizerOptions(kind='") + optimizer_name(o.kind) + "', lr=" + f2s(o.lr) +
           ", beta1=" + f2s(o.beta1) + ", beta2=" + f2s(o.beta2) + ", eps=" + f2s(o.eps) +
           ", weight_decay=" + f2s(o.weight_decay) + ", momentum=" + f2s(o.momentum) +
           ", nesterov=" + (o.nesterov ? "True" : "False") + ")";
  });
  auto off = bind_options<OffloadOptions>(
      m, "Where one kind of state lives: OffloadOptions(tier='cpu') or DeepSpeed's device='cpu'.");
  off.def("__repr__", [](const OffloadOptions& o) {
    return std::string("OffloadOptions(tier='") + tier_name(o.tier) +
           "', nvme_paths=" + std::to_string(o.nvme_paths.size()) +
           " path(s), buffer_count=" + std::to_string(o.buffer_count) + ")";
  });
  bind_options<LossScaleOptions>(m, "Dynamic loss scaling for f16.");
  bind_options<AioOptions>(m, "io_uring swapper settings.");

  auto cfg = nb::class_<Config>(
      m, "Config",
      "Engine configuration. Config(**fields) with the C++ struct's field names (nested options "
      "as dicts or option objects), or Config.from_dict / from_json / from_json_file with "
      "zeroshard's or DeepSpeed's JSON keys. Keyword construction validates at once.");
  bind_fields<Config>(cfg);
  // Keyword construction validates at once; a Config built up by attribute assignment is
  // validated by validate() or when an Engine is made from it.
  cfg.def("__init__", [](Config* self, const nb::kwargs& kw) {
    new (self) Config();
    apply_kwargs(*self, kw);
    self->validate();
  });

  cfg.def("validate", &Config::validate,
          "Raises ConfigError naming the first field with a bad value.")
      .def_static(
          "from_json", [](const std::string& text) { return Config::from_json(text); },
          nb::arg("text"),
          "Parses zeroshard's or DeepSpeed's JSON keys (ConfigError names a bad key's path).")
      .def_static(
          "from_json_file",
          [](const std::filesystem::path& p) { return Config::from_json_file(p); }, nb::arg("path"))
      .def_static(
          "from_dict",
          [](nb::handle d) {
            if (!PyDict_Check(d.ptr())) config_fail("from_dict() takes a dict, got " + describe(d));
            if (const std::string at = non_finite_at(d, ""); !at.empty())
              config_fail(at + " is not a finite number");
            std::string text;
            try {
              text = nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(d));
            } catch (const nb::python_error& e) {
              config_fail(std::string("the dict is not JSON-serializable: ") + e.what());
            }
            return Config::from_json(text);
          },
          nb::arg("d"), "The same keys as from_json(), given as a Python dict.")
      .def("copy", [](const Config& c) { return c; })
      .def("__copy__", [](const Config& c) { return c; })
      .def("__deepcopy__", [](const Config& c, nb::handle) { return c; })
      .def("__repr__", [](const Config& c) {
        std::ostringstream s;
        s << "Config(stage=" << c.stage << ", dtype='" << dtype_name(c.dtype) << "', optimizer='"
          << optimizer_name(c.optimizer.kind) << "', lr=" << c.optimizer.lr
          << ", offload_optimizer='" << tier_name(c.offload_optimizer.tier) << "', offload_param='"
          << tier_name(c.offload_param.tier) << "', gradient_clipping=" << c.gradient_clipping
          << ", gradient_accumulation_steps=" << c.gradient_accumulation_steps;
        // The CPU, the default, is left out (as it always was).
        if (c.device == Device::cuda) s << ", device='cuda', device_index=" << c.device_index;
        s << ")";
        return s.str();
      });
}

}  // namespace zeroshard::py
