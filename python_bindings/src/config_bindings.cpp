// Config and its option structs. Three ways in, one validation:
//   Config(stage=2, dtype="bf16", optimizer={"lr": 3e-4}, offload_optimizer="cpu", ...)
//   Config.from_dict({...})  /  Config.from_json(text)  /  Config.from_json_file(path)
// The dict/JSON forms go through the C++ reader (zeroshard's own keys plus DeepSpeed's), so a
// bad key gets the same message in Python as in C++. Keyword arguments are the struct's field
// names; an unknown one, or a value of the wrong type, is a ConfigError that names it.
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <sstream>

#include "python_bindings/src/bindings.hpp"
#include "src/base/edit_distance.hpp"

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

// One settable field of a struct: its name and how a Python value is stored into it. The same
// table serves attribute assignment and keyword construction, so both accept the same values.
template <class T>
struct FieldSetter {
  const char* name;
  void (*set)(T&, nb::handle, const std::string& path);
};

template <class T>
void set_field(const std::vector<FieldSetter<T>>& table, const char* type, T& t,
               const std::string& key, nb::handle value) {
  for (const FieldSetter<T>& f : table) {
    if (key == f.name) {
      f.set(t, value, std::string(type) + "." + key);
      return;
    }
  }
  std::string msg = std::string("unknown keyword argument '") + key + "' for " + type;
  const FieldSetter<T>* best = nullptr;
  size_t best_d = std::max<size_t>(2, key.size() / 3) + 1;
  for (const FieldSetter<T>& f : table) {
    const size_t d = edit_distance(key, f.name);
    if (d < best_d) best = &f, best_d = d;
  }
  if (best) msg += std::string("; did you mean '") + best->name + "'?";
  msg += " (fields:";
  for (const FieldSetter<T>& f : table) msg += std::string(" ") + f.name;
  config_fail(msg + ")");
}

template <class T>
void apply_kwargs(const std::vector<FieldSetter<T>>& table, const char* type, T& t,
                  const nb::kwargs& kw) {
  for (auto [k, v] : kw) set_field(table, type, t, nb::cast<std::string>(k), v);
}

// A nested option struct may be given as the struct itself or as a dict of its fields.
template <class T>
T as_struct(const std::vector<FieldSetter<T>>& table, const char* type, nb::handle v,
            const std::string& path) {
  T out;
  if (nb::try_cast<T>(v, out, false)) return out;
  if (!PyDict_Check(v.ptr()))
    config_fail(path + " must be a " + type + " or a dict of its fields, got " + describe(v));
  for (auto [k, val] : nb::borrow<nb::dict>(v))
    set_field(table, type, out, nb::cast<std::string>(k), val);
  return out;
}

const std::vector<FieldSetter<OptimizerOptions>>& optimizer_fields() {
  using O = OptimizerOptions;
  static const std::vector<FieldSetter<O>> t = {
      {"kind", [](O& o, nb::handle v, const std::string&) { o.kind = parse_optimizer(v); }},
      {"lr", [](O& o, nb::handle v, const std::string& p) { o.lr = as_float(v, p); }},
      {"beta1", [](O& o, nb::handle v, const std::string& p) { o.beta1 = as_float(v, p); }},
      {"beta2", [](O& o, nb::handle v, const std::string& p) { o.beta2 = as_float(v, p); }},
      {"eps", [](O& o, nb::handle v, const std::string& p) { o.eps = as_float(v, p); }},
      {"weight_decay",
       [](O& o, nb::handle v, const std::string& p) { o.weight_decay = as_float(v, p); }},
      {"momentum", [](O& o, nb::handle v, const std::string& p) { o.momentum = as_float(v, p); }},
      {"nesterov", [](O& o, nb::handle v, const std::string& p) { o.nesterov = as_bool(v, p); }},
  };
  return t;
}

const std::vector<FieldSetter<OffloadOptions>>& offload_fields() {
  using O = OffloadOptions;
  static const std::vector<FieldSetter<O>> t = {
      {"tier", [](O& o, nb::handle v, const std::string&) { o.tier = parse_tier(v); }},
      // DeepSpeed's name for the same thing.
      {"device", [](O& o, nb::handle v, const std::string&) { o.tier = parse_tier(v); }},
      {"nvme_paths",
       [](O& o, nb::handle v, const std::string& p) { o.nvme_paths = as_paths(v, p); }},
      {"nvme_path",
       [](O& o, nb::handle v, const std::string& p) { o.nvme_paths = as_paths(v, p); }},
      {"buffer_count",
       [](O& o, nb::handle v, const std::string& p) { o.buffer_count = as_int32(v, p); }},
      {"pin_memory",
       [](O& o, nb::handle v, const std::string& p) { o.pin_memory = as_bool(v, p); }},
  };
  return t;
}

const std::vector<FieldSetter<LossScaleOptions>>& loss_scale_fields() {
  using O = LossScaleOptions;
  static const std::vector<FieldSetter<O>> t = {
      {"static_scale",
       [](O& o, nb::handle v, const std::string& p) { o.static_scale = as_float(v, p); }},
      {"initial_scale_power",
       [](O& o, nb::handle v, const std::string& p) { o.initial_scale_power = as_int32(v, p); }},
      {"window", [](O& o, nb::handle v, const std::string& p) { o.window = as_int32(v, p); }},
      {"hysteresis",
       [](O& o, nb::handle v, const std::string& p) { o.hysteresis = as_int32(v, p); }},
      {"min_scale", [](O& o, nb::handle v, const std::string& p) { o.min_scale = as_float(v, p); }},
  };
  return t;
}

const std::vector<FieldSetter<AioOptions>>& aio_fields() {
  using O = AioOptions;
  static const std::vector<FieldSetter<O>> t = {
      {"block_size", [](O& o, nb::handle v, const std::string& p) { o.block_size = as_int(v, p); }},
      {"queue_depth",
       [](O& o, nb::handle v, const std::string& p) { o.queue_depth = as_int32(v, p); }},
  };
  return t;
}

// An offload tier may also be given as just the device string: offload_optimizer="cpu".
OffloadOptions as_offload(nb::handle v, const std::string& path) {
  OffloadOptions o;
  if (PyUnicode_Check(v.ptr()) || v.is_none() || nb::isinstance<Tier>(v)) {
    o.tier = parse_tier(v);
    return o;
  }
  return as_struct(offload_fields(), "OffloadOptions", v, path);
}

const std::vector<FieldSetter<Config>>& config_fields() {
  using C = Config;
  static const std::vector<FieldSetter<C>> t = {
      {"stage", [](C& c, nb::handle v, const std::string& p) { c.stage = as_int32(v, p); }},
      // "cuda:N" (a torch.device's spelling) also sets device_index.
      {"device",
       [](C& c, nb::handle v, const std::string&) { c.device = parse_device(v, &c.device_index); }},
      {"device_index",
       [](C& c, nb::handle v, const std::string& p) { c.device_index = as_int32(v, p); }},
      {"dtype", [](C& c, nb::handle v, const std::string&) { c.dtype = parse_dtype(v); }},
      {"loss_scale",
       [](C& c, nb::handle v, const std::string& p) {
         c.loss_scale = as_struct(loss_scale_fields(), "LossScaleOptions", v, p);
       }},
      {"gradient_clipping",
       [](C& c, nb::handle v, const std::string& p) { c.gradient_clipping = as_double(v, p); }},
      {"gradient_accumulation_steps",
       [](C& c, nb::handle v, const std::string& p) {
         c.gradient_accumulation_steps = as_int32(v, p);
       }},
      {"optimizer",
       [](C& c, nb::handle v, const std::string& p) {
         c.optimizer = as_struct(optimizer_fields(), "OptimizerOptions", v, p);
       }},
      {"offload_optimizer",
       [](C& c, nb::handle v, const std::string& p) { c.offload_optimizer = as_offload(v, p); }},
      {"offload_param",
       [](C& c, nb::handle v, const std::string& p) { c.offload_param = as_offload(v, p); }},
      {"aio", [](C& c, nb::handle v,
                 const std::string& p) { c.aio = as_struct(aio_fields(), "AioOptions", v, p); }},
      {"shard_alignment",
       [](C& c, nb::handle v, const std::string& p) { c.shard_alignment = as_int(v, p); }},
      {"grad_buffers",
       [](C& c, nb::handle v, const std::string& p) { c.grad_buffers = as_int32(v, p); }},
      {"max_live_units",
       [](C& c, nb::handle v, const std::string& p) { c.max_live_units = as_int32(v, p); }},
      {"prefetch", [](C& c, nb::handle v, const std::string& p) { c.prefetch = as_bool(v, p); }},
      {"overlap_comm",
       [](C& c, nb::handle v, const std::string& p) { c.overlap_comm = as_bool(v, p); }},
      {"collective_timeout_s",
       [](C& c, nb::handle v, const std::string& p) { c.collective_timeout_s = as_double(v, p); }},
      {"reduce_bucket_size",
       [](C& c, nb::handle v, const std::string& p) { c.reduce_bucket_size = as_int(v, p); }},
      {"allgather_bucket_size",
       [](C& c, nb::handle v, const std::string& p) { c.allgather_bucket_size = as_int(v, p); }},
  };
  return t;
}

// Binds every table entry as a read/write property (the getter returns the plain value) and a
// keyword constructor. Nested structs are rebound below with reference getters.
// `nested` names fields bound separately (with reference getters); `with_init` = false leaves the
// constructor to the caller.
template <class T, class Cls, class Get>
void bind_fields(Cls& cls, const std::vector<FieldSetter<T>>& table, const char* type, Get get,
                 bool with_init = true, std::vector<std::string> nested = {}) {
  for (const FieldSetter<T>& f : table) {
    if (std::find(nested.begin(), nested.end(), f.name) != nested.end()) continue;
    auto setter = f.set;
    const std::string path = std::string(type) + "." + f.name;
    const std::string name = f.name;
    cls.def_prop_rw(
        f.name, [get, name](const T& t) { return get(t, name); },
        [setter, path](T& t, nb::handle v) { setter(t, v, path); });
  }
  if (!with_init) return;
  cls.def("__init__", [&table, type](T* self, const nb::kwargs& kw) {
    new (self) T();
    apply_kwargs(table, type, *self, kw);
  });
}

std::string f2s(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
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
  return as_struct(optimizer_fields(), "OptimizerOptions", h, "optimizer");
}

void bind_config(nb::module_& m) {
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
      .value("lion", OptimizerKind::lion);
  m.def("dtype_size", &dtype_size, "Bytes per element of a DType.");

  auto opt = nb::class_<OptimizerOptions>(
      m, "OptimizerOptions",
      "Hyperparameters of one parameter group (see include/zeroshard/config.hpp for each "
      "optimizer's use of them). OptimizerOptions(kind='adamw', lr=1e-3, ...).");
  bind_fields(opt, optimizer_fields(), "OptimizerOptions",
              [](const OptimizerOptions& o, const std::string& n) -> nb::object {
                if (n == "kind") return nb::cast(o.kind);
                if (n == "lr") return nb::cast(o.lr);
                if (n == "beta1") return nb::cast(o.beta1);
                if (n == "beta2") return nb::cast(o.beta2);
                if (n == "eps") return nb::cast(o.eps);
                if (n == "weight_decay") return nb::cast(o.weight_decay);
                if (n == "momentum") return nb::cast(o.momentum);
                return nb::cast(o.nesterov);
              });
  opt.def("__repr__", [](const OptimizerOptions& o) {
    return std::string("OptimizerOptions(kind='") + optimizer_name(o.kind) + "', lr=" + f2s(o.lr) +
           ", beta1=" + f2s(o.beta1) + ", beta2=" + f2s(o.beta2) + ", eps=" + f2s(o.eps) +
           ", weight_decay=" + f2s(o.weight_decay) + ", momentum=" + f2s(o.momentum) +
           ", nesterov=" + (o.nesterov ? "True" : "False") + ")";
  });

  auto off = nb::class_<OffloadOptions>(
      m, "OffloadOptions",
      "Where one kind of state lives: OffloadOptions(tier='cpu') or DeepSpeed's device='cpu'.");
  bind_fields(off, offload_fields(), "OffloadOptions",
              [](const OffloadOptions& o, const std::string& n) -> nb::object {
                if (n == "tier" || n == "device") return nb::cast(o.tier);
                if (n == "nvme_paths" || n == "nvme_path") return nb::cast(o.nvme_paths);
                if (n == "buffer_count") return nb::cast(o.buffer_count);
                return nb::cast(o.pin_memory);
              });
  off.def("__repr__", [](const OffloadOptions& o) {
    return std::string("OffloadOptions(tier='") + tier_name(o.tier) +
           "', nvme_paths=" + std::to_string(o.nvme_paths.size()) +
           " path(s), buffer_count=" + std::to_string(o.buffer_count) + ")";
  });

  auto ls = nb::class_<LossScaleOptions>(m, "LossScaleOptions", "Dynamic loss scaling for f16.");
  bind_fields(ls, loss_scale_fields(), "LossScaleOptions",
              [](const LossScaleOptions& o, const std::string& n) -> nb::object {
                if (n == "static_scale") return nb::cast(o.static_scale);
                if (n == "initial_scale_power") return nb::cast(o.initial_scale_power);
                if (n == "window") return nb::cast(o.window);
                if (n == "hysteresis") return nb::cast(o.hysteresis);
                return nb::cast(o.min_scale);
              });

  auto aio = nb::class_<AioOptions>(m, "AioOptions", "io_uring swapper settings.");
  bind_fields(aio, aio_fields(), "AioOptions",
              [](const AioOptions& o, const std::string& n) -> nb::object {
                if (n == "block_size") return nb::cast(o.block_size);
                return nb::cast(o.queue_depth);
              });

  auto cfg = nb::class_<Config>(
      m, "Config",
      "Engine configuration. Config(**fields) with the C++ struct's field names (nested options "
      "as dicts or option objects), or Config.from_dict / from_json / from_json_file with "
      "zeroshard's or DeepSpeed's JSON keys. Keyword construction validates at once.");
  bind_fields(cfg, config_fields(), "Config",
              [](const Config& c, const std::string& n) -> nb::object {
                if (n == "stage") return nb::cast(c.stage);
                if (n == "device") return nb::cast(c.device);
                if (n == "device_index") return nb::cast(c.device_index);
                if (n == "dtype") return nb::cast(c.dtype);
                if (n == "gradient_clipping") return nb::cast(c.gradient_clipping);
                if (n == "gradient_accumulation_steps")
                  return nb::cast(c.gradient_accumulation_steps);
                if (n == "shard_alignment") return nb::cast(c.shard_alignment);
                if (n == "grad_buffers") return nb::cast(c.grad_buffers);
                if (n == "max_live_units") return nb::cast(c.max_live_units);
                if (n == "prefetch") return nb::cast(c.prefetch);
                if (n == "overlap_comm") return nb::cast(c.overlap_comm);
                if (n == "collective_timeout_s") return nb::cast(c.collective_timeout_s);
                if (n == "reduce_bucket_size") return nb::cast(c.reduce_bucket_size);
                return nb::cast(c.allgather_bucket_size);
              },
              /*with_init=*/false,
              {"optimizer", "offload_optimizer", "offload_param", "loss_scale", "aio"});
  // Keyword construction validates at once; a Config built up by attribute assignment is
  // validated by validate() or when an Engine is made from it.
  cfg.def("__init__", [](Config* self, const nb::kwargs& kw) {
    new (self) Config();
    apply_kwargs(config_fields(), "Config", *self, kw);
    self->validate();
  });
  // Nested option structs: the getter returns a reference into the Config, so that
  // cfg.optimizer.lr = 0.1 changes cfg (the setters above still take dicts and objects).
#define ZS_NESTED(field, T, conv)                                           \
  cfg.def_prop_rw(                                                          \
      #field, [](Config& c) -> T& { return c.field; },                      \
      [](Config& c, nb::handle v) { c.field = conv(v, "Config." #field); }, \
      nb::rv_policy::reference_internal)
  ZS_NESTED(optimizer, OptimizerOptions, ([](nb::handle x, const std::string& p) {
              return as_struct(optimizer_fields(), "OptimizerOptions", x, p);
            }));
  ZS_NESTED(offload_optimizer, OffloadOptions, as_offload);
  ZS_NESTED(offload_param, OffloadOptions, as_offload);
  ZS_NESTED(loss_scale, LossScaleOptions, ([](nb::handle x, const std::string& p) {
              return as_struct(loss_scale_fields(), "LossScaleOptions", x, p);
            }));
  ZS_NESTED(aio, AioOptions, ([](nb::handle x, const std::string& p) {
              return as_struct(aio_fields(), "AioOptions", x, p);
            }));
#undef ZS_NESTED

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
            std::string text;
            try {
              text = nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(d));
            } catch (const nb::python_error& e) {
              config_fail(std::string("the dict is not JSON-serializable: ") + e.what());
            }
            return Config::from_json(text);
          },
          nb::arg("d"), "The same keys as from_json(), given as a Python dict.")
      .def_static(
          "fields",
          [] {
            std::vector<std::string> names;
            for (const auto& f : config_fields()) names.push_back(f.name);
            return names;
          },
          "The keyword arguments Config() takes (the C++ struct's field names).")
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
