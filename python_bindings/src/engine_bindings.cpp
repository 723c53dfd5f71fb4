// Engine, Communicator, the memory report and the small result structs.
//
// Threading: every call that can block (collectives, waits for reductions, the optimizer step)
// or that computes releases the GIL, so other Python threads run meanwhile. The engine itself is
// driven by one thread at a time (engine.hpp), so each Engine carries a mutex that these calls
// take after dropping the GIL: two Python threads calling one engine are serialised, not racing.
// (Lock order is always GIL, then released, then the engine mutex; never the reverse.)
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <mutex>
#include <sstream>

#include "python_bindings/src/bindings.hpp"
#include "zeroshard/checkpoint.hpp"
#include "zeroshard/launch.hpp"
#include "zeroshard/planner.hpp"

namespace zeroshard::py {

namespace {

/// A checkpoint's module tensors from Python: (name, safetensors dtype, shape, bytes).
using PyModuleTensors =
    std::vector<std::tuple<std::string, std::string, std::vector<int64_t>, nb::bytes>>;
using PyAliases = std::vector<std::pair<std::string, std::string>>;

ModuleState to_module(const PyModuleTensors& tensors, const PyAliases& aliases) {
  ModuleState m;
  for (const auto& [name, dtype, shape, bytes] : tensors)
    m.tensors.push_back(
        {name, dtype, shape, std::vector<char>(bytes.c_str(), bytes.c_str() + bytes.size())});
  m.aliases = aliases;
  return m;
}

/// A parameter to register: Param plus the Python object holding its initial values.
struct PyParam {
  std::string name;
  std::vector<int64_t> shape;
  int group = 0;
  nb::object init;  // None or a CPU tensor / array of shape_numel(shape) elements (CPU on every
                    // device: finalize() reads it on the host)
};

struct PyEngine {
  PyEngine(Config c, std::shared_ptr<Communicator> cm)
      : comm(std::move(cm)), engine(std::move(c), comm) {}

  std::shared_ptr<Communicator> comm;
  Engine engine;
  std::mutex mu;
  // Registration as the trainer gave it: views go back out with each parameter's own shape.
  std::vector<std::vector<std::string>> names;
  std::vector<std::vector<std::vector<int64_t>>> shapes;
  // Initial values are read during finalize(); their imports keep the producers' memory alive
  // until then.
  std::vector<Imported> init_keep;
};

// Runs `f` without the GIL and with the engine's mutex held.
template <class F>
auto locked(PyEngine& e, F&& f) {
  nb::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lock(e.mu);
  return f();
}

void check_unit(const PyEngine& e, UnitId u, const char* call) {
  if (u < 0 || size_t(u) >= e.shapes.size())
    throw Error(ErrorCode::invalid_argument, std::string(call) + "(): no unit with id " +
                                                 std::to_string(u) + " (" +
                                                 std::to_string(e.shapes.size()) + " registered)");
}

// A float32 tensor or array's values, copied (write_shard(), write_full()).
std::vector<float> f32_values(nb::handle values, const char* what) {
  TensorRequest req{what};
  req.has_dtype = true;
  req.dtype = DType::f32;
  Imported t = import_tensor(values, req, false);
  const float* p = static_cast<const float*>(t.view.data);
  return std::vector<float>(p, p + t.view.numel);
}

// Engine views, one per parameter, as arrays that keep the Engine object alive.
nb::list export_views(PyEngine& e, UnitId u, const std::vector<TensorView>& views) {
  nb::object owner = nb::find(&e);
  nb::list out;
  for (size_t i = 0; i < views.size(); ++i)
    out.append(export_view(views[i], e.shapes[size_t(u)][i], owner));
  return out;
}

ReduceOp parse_op(const std::string& s) {
  if (s == "sum") return ReduceOp::sum;
  if (s == "max") return ReduceOp::max;
  if (s == "min") return ReduceOp::min;
  throw Error(ErrorCode::invalid_argument,
              "all_reduce(): op '" + s + "' is not one of 'sum', 'max', 'min'");
}

std::string step_repr(const StepResult& r) {
  std::ostringstream s;
  s << "StepResult(step=" << r.step << ", skipped=" << (r.skipped ? "True" : "False")
    << ", grad_norm=" << r.grad_norm << ", clip_factor=" << r.clip_factor
    << ", loss_scale=" << r.loss_scale << ", optimizer_s=" << r.optimizer_s
    << ", comm_busy_s=" << r.comm_busy_s << ", comm_exposed_s=" << r.comm_exposed_s
    << ", interval_s=" << r.interval_s << ")";
  return s.str();
}

}  // namespace

namespace {

void bind_communicator(nb::module_& m) {
  // ---- communicator ---------------------------------------------------------------------------
  nb::class_<Communicator>(
      m, "Communicator",
      "Collectives over a fixed group of ranks (make_mpi_communicator / make_self_communicator). "
      "Every rank must call the same collectives in the same order; a collective that outlasts "
      "the timeout raises CollectiveTimeoutError instead of hanging. Thread-safe.")
      .def("rank", &Communicator::rank)
      .def("size", &Communicator::size)
      .def("set_timeout", &Communicator::set_timeout, nb::arg("seconds"))
      .def("barrier", &Communicator::barrier, nb::arg("what") = "barrier",
           nb::call_guard<nb::gil_scoped_release>())
      .def(
          "all_reduce",
          [](Communicator& c, nb::handle buf, const std::string& op, const std::string& what) {
            Imported t = import_tensor(buf, {"all_reduce(): buffer", /*any_dtype=*/true}, true);
            if (t.array.dtype() != nb::dtype<double>())
              throw Error(ErrorCode::invalid_argument,
                          "all_reduce(): buffer has dtype " + dlpack_dtype_name(t.array.dtype()) +
                              ", expected float64 (the reduction runs in double)");
            const ReduceOp rop = parse_op(op);
            nb::gil_scoped_release nogil;
            c.all_reduce(static_cast<double*>(t.view.data), t.view.numel, rop, what)->wait();
          },
          nb::arg("buffer"), nb::arg("op") = "sum", nb::arg("what") = "all_reduce",
          "In-place element-wise reduction of a contiguous float64 CPU tensor over the ranks.")
      .def(
          "broadcast",
          [](Communicator& c, nb::handle buf, int root, const std::string& what) {
            Imported t = import_tensor(buf, {"broadcast(): buffer", /*any_dtype=*/true}, true);
            nb::gil_scoped_release nogil;
            c.broadcast(t.view.data, t.nbytes, root, what)->wait();
          },
          nb::arg("buffer"), nb::arg("root") = 0, nb::arg("what") = "broadcast",
          "In place: every rank's contiguous CPU tensor (any dtype) receives root's bytes.")
      .def(
          "all_gather",
          [](Communicator& c, nb::handle send, nb::handle recv, const std::string& what) {
            Imported s = import_tensor(send, {"all_gather(): send"}, false);
            TensorRequest rr{"all_gather(): recv"};
            rr.has_dtype = true;
            rr.dtype = s.view.dtype;
            rr.numel = s.view.numel * c.size();
            Imported r = import_tensor(recv, rr, true);
            nb::gil_scoped_release nogil;
            c.all_gather(s.view.data, r.view.data, s.view.numel, s.view.dtype, what)->wait();
          },
          nb::arg("send"), nb::arg("recv"), nb::arg("what") = "all_gather",
          "recv (size() x send elements, same dtype: float32/bfloat16/float16) = every rank's "
          "send, in rank order.");
  m.def("make_mpi_communicator", &make_mpi_communicator, nb::call_guard<nb::gil_scoped_release>(),
        "A communicator over MPI_COMM_WORLD (initialises MPI with MPI_THREAD_MULTIPLE if needed; "
        "finalises it when the last one is destroyed). Launch with mpirun.");
  m.def("finalize_mpi", &finalize_mpi, nb::call_guard<nb::gil_scoped_release>(),
        "Finalises MPI now if zeroshard initialised it: communicators still alive finish their "
        "started collectives and close (later ones fail). Called at interpreter exit, so that a "
        "script that leaves an optimizer alive still ends its MPI job cleanly.");
  m.def("make_self_communicator", &make_self_communicator,
        "A communicator of one rank, without MPI.");
  m.def("abort_mpi_job", &abort_mpi_job, nb::arg("code") = 1,
        "Ends every rank of the MPI job now (MPI_Abort), if MPI is initialised and the world has "
        "more than one rank; returns otherwise. For a rank that fails on its own, which would "
        "otherwise wait in MPI_Finalize while its peers wait for it in a collective.");
  m.def(
      "make_store_communicator",
      [](std::function<void(const std::string&, const std::string&)> set,
         std::function<std::optional<std::string>(const std::string&)> try_get,
         std::function<void(const std::string&)> erase, int rank, int size,
         const std::string& prefix) {
        return make_store_communicator(
            KeyValueStore{std::move(set), std::move(try_get), std::move(erase)}, rank, size,
            prefix);
      },
      nb::arg("set"), nb::arg("try_get"), nb::arg("erase").none(), nb::arg("rank"), nb::arg("size"),
      nb::arg("prefix") = "zeroshard",
      "A communicator whose collectives go through a key-value store every rank reaches: "
      "set(key, value: str), try_get(key) -> str or None without blocking, erase(key) or None. "
      "For set-up without an MPI launcher (NCCL under torchrun), not for training data.");
  m.def(
      "make_nccl_communicator",
      [](int device, std::shared_ptr<Communicator> bootstrap) {
        return bootstrap ? make_nccl_communicator(device, std::move(bootstrap))
                         : make_nccl_communicator(device);
      },
      nb::arg("device"), nb::arg("bootstrap").none() = nb::none(),
      nb::call_guard<nb::gil_scoped_release>(),
      "A communicator over NCCL for tensors on CUDA device `device`, bootstrapped through "
      "`bootstrap` (a Communicator whose rank and size become NCCL's) or, when None, MPI. "
      "Collective: every rank calls it.");
  nb::class_<LaunchInfo>(m, "LaunchInfo", "How this process was started (launch_info()).")
      .def_ro("launcher", &LaunchInfo::launcher)
      .def_ro("rank", &LaunchInfo::rank)
      .def_ro("world_size", &LaunchInfo::world_size)
      .def_ro("local_rank", &LaunchInfo::local_rank)
      .def_ro("local_size", &LaunchInfo::local_size)
      .def_ro("mpi_world", &LaunchInfo::mpi_world);
  m.def("launch_info", &launch_info,
        "The launcher's view of this process (mpirun, srun, torchrun or none), read from its "
        "environment without starting anything.");
}

void bind_results(nb::module_& m) {
  // ---- small result structs -------------------------------------------------------------------
  nb::class_<StepResult>(m, "StepResult", "What Engine.step() did.")
      .def_ro("skipped", &StepResult::skipped)
      .def_ro("grad_norm", &StepResult::grad_norm)
      .def_ro("clip_factor", &StepResult::clip_factor)
      .def_ro("loss_scale", &StepResult::loss_scale)
      .def_ro("step", &StepResult::step)
      .def_ro("optimizer_s", &StepResult::optimizer_s)
      .def_ro("newton_schulz_s", &StepResult::newton_schulz_s)
      .def_ro("speculation_kept", &StepResult::speculation_kept)
      .def_ro("speculation_dropped", &StepResult::speculation_dropped)
      .def_ro("comm_busy_s", &StepResult::comm_busy_s)
      .def_ro("comm_exposed_s", &StepResult::comm_exposed_s)
      .def_ro("interval_s", &StepResult::interval_s)
      .def_ro("comm_bytes", &StepResult::comm_bytes)
      .def_ro("inter_node_bytes", &StepResult::inter_node_bytes)
      .def("comm_hidden_fraction", &StepResult::comm_hidden_fraction)
      .def("__repr__", &step_repr);

  nb::class_<LossScalerState>(m, "LossScalerState",
                              "The dynamic loss scaler's whole state, for checkpoints.")
      .def(nb::init<>())
      .def_rw("scale", &LossScalerState::scale)
      .def_rw("hysteresis_left", &LossScalerState::hysteresis_left)
      .def_rw("iteration", &LossScalerState::iteration)
      .def_rw("last_overflow", &LossScalerState::last_overflow);

  nb::class_<ShardGroup>(m, "ShardGroup",
                         "This rank's place in the sharding (Config.shard_group_size): shard "
                         "`rank` of the `size` ranks of group `index` of `count`.")
      .def_ro("rank", &ShardGroup::rank)
      .def_ro("size", &ShardGroup::size)
      .def_ro("index", &ShardGroup::index)
      .def_ro("count", &ShardGroup::count);

  nb::class_<ShardInfo>(m, "ShardInfo", "Shard geometry of one unit on this rank, in elements.")
      .def_ro("numel", &ShardInfo::numel)
      .def_ro("padded_numel", &ShardInfo::padded_numel)
      .def_ro("shard_offset", &ShardInfo::shard_offset)
      .def_ro("shard_numel", &ShardInfo::shard_numel)
      .def("__repr__", [](const ShardInfo& s) {
        return "ShardInfo(numel=" + std::to_string(s.numel) +
               ", padded_numel=" + std::to_string(s.padded_numel) +
               ", shard_offset=" + std::to_string(s.shard_offset) +
               ", shard_numel=" + std::to_string(s.shard_numel) + ")";
      });

  nb::enum_<StateKind>(m, "StateKind", "Which state read_shard()/write_shard() address.")
      .value("param", StateKind::param)
      .value("master", StateKind::master)
      .value("state0", StateKind::state0)
      .value("state1", StateKind::state1);
}

void bind_memory_report(nb::module_& m) {
  // ---- memory report --------------------------------------------------------------------------
  nb::enum_<MemKind>(m, "MemKind")
      .value("param", MemKind::param)
      .value("grad", MemKind::grad)
      .value("master", MemKind::master)
      .value("optim_state", MemKind::optim_state)
      .value("buffer", MemKind::buffer);
  nb::class_<NamedBuffer>(m, "NamedBuffer")
      .def_ro("name", &NamedBuffer::name)
      .def_ro("tier", &NamedBuffer::tier)
      .def_ro("bytes", &NamedBuffer::bytes)
      .def_ro("peak", &NamedBuffer::peak);
  nb::class_<MemoryReport>(m, "MemoryReport",
                           "The ledger: bytes held on this rank by tier x kind, with peaks.")
      .def("at", &MemoryReport::at, nb::arg("tier"), nb::arg("kind"), "Bytes held now in one cell.")
      .def(
          "total",
          [](const MemoryReport& r, nb::handle tier) {
            return tier.is_none() ? r.total() : r.total(parse_tier(tier));
          },
          nb::arg("tier") = nb::none(), "Bytes held now, on one tier or on all.")
      .def("model_state_bytes", &MemoryReport::model_state_bytes)
      .def_ro("buffers", &MemoryReport::buffers)
      .def(
          "as_dict",
          [](const MemoryReport& r) {
            // {"device": {"param": {"bytes": n, "peak": n}, ...}, "host": ..., "nvme": ...}
            nb::dict out;
            for (int t = 0; t < kNumTiers; ++t) {
              nb::dict row;
              for (int k = 0; k < kNumMemKinds; ++k) {
                nb::dict cell;
                cell["bytes"] = r.bytes[size_t(t)][size_t(k)];
                cell["peak"] = r.peak[size_t(t)][size_t(k)];
                row[mem_kind_name(MemKind(k))] = cell;
              }
              out[tier_name(Tier(t))] = row;
            }
            return out;
          },
          "Every cell as {tier: {kind: {'bytes': n, 'peak': n}}}.")
      .def("to_string", &MemoryReport::to_string)
      .def("__str__", &MemoryReport::to_string);
}

// Construction, parameter groups, units and finalize().
void def_registration(nb::class_<PyEngine>& cls) {
  cls.def(
      "__init__",
      [](PyEngine* self, nb::handle config, std::shared_ptr<Communicator> comm) {
        if (!comm) throw Error(ErrorCode::invalid_argument, "Engine(): the communicator is None");
        Config c = coerce_config(config);
        // device cuda: the C++ constructor says if this build has no CUDA (ConfigError) or
        // no GPU can be used (CudaError); views then leave as CUDA arrays (export_view).
        new (self) PyEngine(std::move(c), std::move(comm));
      },
      nb::arg("config"), nb::arg("comm"),
      "config: a Config, a dict of zeroshard/DeepSpeed keys, or a JSON file path.");
  cls.def(
      "add_group",
      [](PyEngine& e, nb::handle options) {
        OptimizerOptions o = coerce_optimizer(options);
        return locked(e, [&] { return e.engine.add_group(o); });
      },
      nb::arg("options"),
      "Adds a parameter group (OptimizerOptions or a dict); returns its index.");
  cls.def(
      "add_unit",
      [](PyEngine& e, const std::string& name, const std::vector<PyParam*>& params) {
        std::vector<Param> ps;
        std::vector<Imported> keep;
        for (const PyParam* p : params) {
          if (!p)
            throw Error(ErrorCode::invalid_argument,
                        "add_unit('" + name + "'): a parameter is None");
          Param q{p->name, p->shape, p->group, {}};
          if (p->init.is_valid() && !p->init.is_none()) {
            TensorRequest req{"add_unit('" + name + "'): initial values of '" + p->name + "'"};
            req.numel = shape_numel(p->shape);
            keep.push_back(import_tensor(p->init, req, false));
            q.init = keep.back().view;
          }
          ps.push_back(std::move(q));
        }
        const UnitId id = locked(e, [&] { return e.engine.add_unit(name, std::move(ps)); });
        std::vector<std::string> names;
        std::vector<std::vector<int64_t>> shapes;
        for (const PyParam* p : params) names.push_back(p->name), shapes.push_back(p->shape);
        e.names.push_back(std::move(names));
        e.shapes.push_back(std::move(shapes));
        for (Imported& k : keep) e.init_keep.push_back(std::move(k));
        return id;
      },
      nb::arg("name"), nb::arg("params"), "Registers a unit (a list of Param); returns its id.");
  cls.def(
      "finalize",
      [](PyEngine& e) {
        locked(e, [&] { e.engine.finalize(); });
        e.init_keep.clear();  // read: the producers' tensors may go now
      },
      "Plans the layout, checks all ranks registered the same model, allocates, copies the "
      "initial values in. Collective.");
}

// Parameters and gradients, the step.
void def_training(nb::class_<PyEngine>& cls) {
  cls.def(
      "params",
      [](PyEngine& e, UnitId u) {
        check_unit(e, u, "params");
        auto v = locked(e, [&] { return e.engine.params(u); });
        return export_views(e, u, v);
      },
      nb::arg("unit"), "Stages 0-2: the unit's parameters, updated in place by step().");
  cls.def(
      "gather",
      [](PyEngine& e, UnitId u) {
        check_unit(e, u, "gather");
        auto v = locked(e, [&] { return e.engine.gather(u); });
        return export_views(e, u, v);
      },
      nb::arg("unit"),
      "Stage 3: all-gathers the unit; the views are valid until release(). Collective.");
  cls.def(
      "release", [](PyEngine& e, UnitId u) { locked(e, [&] { e.engine.release(u); }); },
      nb::arg("unit"));
  cls.def(
      "grads",
      [](PyEngine& e, UnitId u) {
        check_unit(e, u, "grads");
        auto v = locked(e, [&] { return e.engine.grads(u); });
        return export_views(e, u, v);
      },
      nb::arg("unit"),
      "Zeroed gradient views to write this micro-step's gradients; valid until grads_ready().");
  cls.def(
      "grads_ready",
      [](PyEngine& e, UnitId u, nb::handle grads) {
        if (grads.is_none()) {
          locked(e, [&] { e.engine.grads_ready(u); });
          return;
        }
        // The copying form: validate every tensor here (clear errors, no conversion), then
        // one GIL-free call copies them in and starts the reduction.
        check_unit(e, u, "grads_ready");
        const auto& names = e.names[size_t(u)];
        const auto& shapes = e.shapes[size_t(u)];
        const size_t n = nb::len(grads);
        if (n != names.size())
          throw Error(ErrorCode::invalid_argument, "grads_ready(): unit '" + e.engine.unit_name(u) +
                                                       "' has " + std::to_string(names.size()) +
                                                       " parameters, got " + std::to_string(n) +
                                                       " gradients");
        std::vector<Imported> keep;
        std::vector<TensorView> views;
        size_t i = 0;
        for (nb::handle g : grads) {
          if (g.is_none()) {  // no gradient for this parameter in this micro-step
            views.push_back(TensorView{});
            ++i;
            continue;
          }
          TensorRequest req{"grads_ready(): gradient of '" + names[i] + "' (unit '" +
                            e.engine.unit_name(u) + "')"};
          req.has_dtype = true;
          req.dtype = e.engine.config().dtype;
          // A GPU engine copies from device memory too; the C++ call checks that it is its
          // own GPU (a copy from another one would need peer access).
          req.allow_cuda = e.engine.config().device == Device::cuda;
          req.numel = shape_numel(shapes[i]);
          keep.push_back(import_tensor(g, req, false));
          views.push_back(keep.back().view);
          ++i;
        }
        locked(e, [&] { e.engine.grads_ready(u, views); });
      },
      nb::arg("unit"), nb::arg("grads") = nb::none(),
      "Marks the unit's gradients of this micro-step complete and starts their reduction. "
      "With grads (one contiguous tensor per parameter, of Config.dtype, on the CPU or, for "
      "device cuda, on the engine's GPU), copies them in first; they may be reused on return "
      "(CUDA ones by work queued on the engine's stream after this call). None for a parameter "
      "that got no gradient: one that got none in any micro-step on any rank is left as it is "
      "by the step (no decay, moments kept). Collective.");
  cls.def(
      "step", [](PyEngine& e) { return locked(e, [&] { return e.engine.step(); }); },
      "Finishes reductions; updates every shard (or skips on overflow). Collective.");
  cls.def(
      "clip_grad_norm",
      [](PyEngine& e, double max_norm) {
        return locked(e, [&] { return e.engine.clip_grad_norm(max_norm); });
      },
      nb::arg("max_norm") = 0.0,
      "Closes this step's gradients and returns their global L2 norm (inf on overflow); the "
      "coming step() clips at max_norm (0: only Config.gradient_clipping). Collective.");
  cls.def("zero_grad", [](PyEngine& e) { locked(e, [&] { e.engine.zero_grad(); }); });
}

// Hyperparameters, identity, the model as registered, streams.
void def_accessors(nb::class_<PyEngine>& cls) {
  cls.def(
      "set_lr", [](PyEngine& e, int g, float lr) { locked(e, [&] { e.engine.set_lr(g, lr); }); },
      nb::arg("group"), nb::arg("lr"));
  cls.def(
      "lr", [](PyEngine& e, int g) { return locked(e, [&] { return e.engine.lr(g); }); },
      nb::arg("group") = 0);
  cls.def(
      "set_options",
      [](PyEngine& e, int g, nb::handle options) {
        OptimizerOptions o = coerce_optimizer(options);
        locked(e, [&] { e.engine.set_options(g, o); });
      },
      nb::arg("group"), nb::arg("options"),
      "Replaces a group's hyperparameters (OptimizerOptions or a dict) from the next step on.");
  cls.def(
      "options", [](PyEngine& e, int g) { return locked(e, [&] { return e.engine.options(g); }); },
      nb::arg("group") = 0, "A group's hyperparameters, as an OptimizerOptions copy.");
  cls.def("loss_scale",
          [](PyEngine& e) { return locked(e, [&] { return e.engine.loss_scale(); }); });
  cls.def("loss_scaler_state",
          [](PyEngine& e) { return locked(e, [&] { return e.engine.loss_scaler_state(); }); });
  cls.def(
      "set_loss_scaler_state",
      [](PyEngine& e, const LossScalerState& st) {
        locked(e, [&] { e.engine.set_loss_scaler_state(st); });
      },
      nb::arg("state"));
  cls.def("step_count",
          [](PyEngine& e) { return locked(e, [&] { return e.engine.step_count(); }); });
  cls.def("rank", [](PyEngine& e) { return e.engine.rank(); });
  cls.def("world_size", [](PyEngine& e) { return e.engine.world_size(); });
  cls.def("num_units", [](PyEngine& e) { return int(e.shapes.size()); });
  cls.def(
      "unit_name",
      [](PyEngine& e, UnitId u) { return locked(e, [&] { return e.engine.unit_name(u); }); },
      nb::arg("unit"));
  cls.def(
      "param_names",
      [](PyEngine& e, UnitId u) {
        check_unit(e, u, "param_names");
        return e.names[size_t(u)];
      },
      nb::arg("unit"));
  cls.def(
      "param_shapes",
      [](PyEngine& e, UnitId u) {
        check_unit(e, u, "param_shapes");
        return e.shapes[size_t(u)];
      },
      nb::arg("unit"));
  cls.def(
      "shard_info",
      [](PyEngine& e, UnitId u) { return locked(e, [&] { return e.engine.shard_info(u); }); },
      nb::arg("unit"));
  cls.def("shard_group", [](PyEngine& e) { return e.engine.shard_group(); });
  cls.def(
      "config", [](PyEngine& e) { return e.engine.config(); }, "A copy of the engine's Config.");
  cls.def(
      "stream",
      [](PyEngine& e) {
        return reinterpret_cast<uintptr_t>(locked(e, [&] { return e.engine.stream(); }));
      },
      "Config.device cuda: the cudaStream_t the engine's work runs on, as an int (what "
      "torch.cuda.ExternalStream takes); 0 on the CPU.");
  cls.def(
      "set_stream",
      [](PyEngine& e, uintptr_t stream) {
        locked(e, [&] { e.engine.set_stream(reinterpret_cast<void*>(stream)); });
      },
      nb::arg("stream"),
      "Config.device cuda: run the engine's work on this cudaStream_t (an int, e.g. "
      "torch.cuda.current_stream().cuda_stream) from now on; waits for the work already "
      "issued. 0 returns to the engine's own stream, so torch's default stream, whose "
      "cuda_stream is 0, is passed as 1 (cudaStreamLegacy, as DLPack spells it). Raises "
      "InvalidArgumentError on the CPU unless 0.");
}

// State access, checkpoints and memory.
void def_state(nb::class_<PyEngine>& cls) {
  cls.def(
      "read_shard",
      [](PyEngine& e, UnitId u, StateKind k) {
        auto v = locked(e, [&] { return e.engine.read_shard(u, k); });
        return export_owned(std::move(v));
      },
      nb::arg("unit"), nb::arg("kind"), "This rank's shard of one state, as a new float32 array.");
  cls.def(
      "write_shard",
      [](PyEngine& e, UnitId u, StateKind k, nb::handle values) {
        std::vector<float> v = f32_values(values, "write_shard(): values");
        locked(e, [&] { e.engine.write_shard(u, k, v); });
      },
      nb::arg("unit"), nb::arg("kind"), nb::arg("values"),
      "Overwrites this rank's shard of master/state0/state1 (float32, shard_numel elements).");
  cls.def(
      "commit_shards", [](PyEngine& e) { locked(e, [&] { e.engine.commit_shards(); }); },
      "Collective: rebuilds the parameters from the shards written with write_shard().");
  cls.def(
      "read_full",
      [](PyEngine& e, UnitId u, int param, StateKind k) {
        auto v = locked(e, [&] { return e.engine.read_full(u, param, k); });
        return export_owned(std::move(v));
      },
      nb::arg("unit"), nb::arg("param"), nb::arg("kind"),
      "Collective: parameter `param` of the unit whole, of one state, as a new float32 array "
      "(flat).");
  cls.def(
      "read_full_grad",
      [](PyEngine& e, UnitId u, int param) {
        auto v = locked(e, [&] { return e.engine.read_full_grad(u, param); });
        return export_owned(std::move(v));
      },
      nb::arg("unit"), nb::arg("param"),
      "Collective: parameter `param`'s reduced gradient whole (mean over ranks and micro-steps, "
      "unscaled, before clipping), as a new float32 array (flat). After the step's last "
      "micro-step, before step(); closes the micro-steps as clip_grad_norm() does.");
  cls.def(
      "write_full",
      [](PyEngine& e, UnitId u, int param, StateKind k, nb::handle values) {
        std::vector<float> v = f32_values(values, "write_full(): values");
        locked(e, [&] { e.engine.write_full(u, param, k, v); });
      },
      nb::arg("unit"), nb::arg("param"), nb::arg("kind"), nb::arg("values"),
      "Collective: overwrites parameter `param`'s master/state0/state1 whole (float32, the same "
      "on every rank) and rebuilds the parameters.");
  cls.def(
      "set_step_count",
      [](PyEngine& e, int64_t n) { locked(e, [&] { e.engine.set_step_count(n); }); },
      nb::arg("steps"));
  cls.def(
      "set_loss_scale",
      [](PyEngine& e, float s) { locked(e, [&] { e.engine.set_loss_scale(s); }); },
      nb::arg("scale"));
  cls.def(
      "has_state", [](PyEngine& e, StateKind k) { return e.engine.has_state(k); }, nb::arg("kind"),
      "Whether the optimizer keeps this state (read_shard() of an absent one raises).");
  cls.def(
      "save",
      [](PyEngine& e, const std::filesystem::path& root, const std::string& tag,
         const PyModuleTensors& module_tensors, const PyAliases& aliases) {
        const ModuleState module = to_module(module_tensors, aliases);
        return locked(e, [&] { return e.engine.save(root, tag, module); });
      },
      nb::arg("root"), nb::arg("tag") = "", nb::arg("module_tensors") = PyModuleTensors{},
      nb::arg("aliases") = PyAliases{},
      "Collective: writes the checkpoint root/<tag> (default tag 'step<N>'), crash-safe and "
      "checksummed, and points root/latest at it; any world size and stage can load it. A tag "
      "that exists is refused. module_tensors [(name, dtype, shape, bytes)] (frozen parameters, "
      "buffers; safetensors dtypes) and aliases [(name, trained parameter's name)]: rank 0's go "
      "into the checkpoint beside the state (read_module_state()). Returns its path.");
  cls.def(
      "save_async",
      [](PyEngine& e, const std::filesystem::path& root, const std::string& tag,
         const PyModuleTensors& module_tensors, const PyAliases& aliases) {
        const ModuleState module = to_module(module_tensors, aliases);
        locked(e, [&] { e.engine.save_async(root, tag, module); });
      },
      nb::arg("root"), nb::arg("tag") = "", nb::arg("module_tensors") = PyModuleTensors{},
      nb::arg("aliases") = PyAliases{},
      "Collective: save() from a snapshot taken now, written while training goes on; "
      "finish_save() publishes it.");
  cls.def(
      "finish_save", [](PyEngine& e) { return locked(e, [&] { return e.engine.finish_save(); }); },
      "Collective: completes the pending save_async(); returns its path (empty if none).");
  cls.def(
      "load",
      [](PyEngine& e, const std::filesystem::path& path, bool optimizer_states,
         bool hyperparameters) {
        LoadOptions o;
        o.optimizer_states = optimizer_states;
        o.hyperparameters = hyperparameters;
        locked(e, [&] { e.engine.load(path, o); });
      },
      nb::arg("path"), nb::arg("optimizer_states") = true, nb::arg("hyperparameters") = true,
      "Collective: loads a checkpoint (a tag directory, or a root's latest tag) written at any "
      "world size or stage, in one pass: a load refused by the manifest or a file's header "
      "changes nothing; a damaged block leaves the engine refusing step(), gather() and save() "
      "until a load succeeds. "
      "optimizer_states=False: the master weights only (moments, step and loss scaler kept); "
      "hyperparameters=False: the groups' hyperparameters kept.");
  cls.def("num_groups", [](PyEngine& e) { return e.engine.num_groups(); });
  cls.def(
      "load_safetensors",
      [](PyEngine& e, const std::filesystem::path& file) {
        locked(e, [&] { e.engine.load_safetensors(file); });
      },
      nb::arg("file"),
      "Collective: pretrained weights from a safetensors file become the master weights.");
  cls.def(
      "memory", [](PyEngine& e) { return locked(e, [&] { return e.engine.memory(); }); },
      "The ledger's MemoryReport.");
  cls.def("communicator", [](PyEngine& e) { return e.comm; });
}

void bind_engine_class(nb::module_& m) {
  // ---- engine ---------------------------------------------------------------------------------
  nb::class_<PyParam>(m, "Param",
                      "One parameter of a unit: Param(name, shape=None, group=0, init=None). init "
                      "is an optional contiguous CPU tensor of float32/bfloat16/float16 with the "
                      "parameter's element count (shape defaults to init's shape); it is read "
                      "during finalize() without copying before then.")
      .def(
          "__init__",
          [](PyParam* self, std::string name, nb::handle shape, int group, nb::handle init) {
            new (self) PyParam();
            self->name = std::move(name);
            self->group = group;
            self->init = nb::borrow(init);
            if (!shape.is_none()) {
              for (nb::handle d : shape) self->shape.push_back(nb::cast<int64_t>(d));
            } else if (!init.is_none() && nb::hasattr(init, "shape")) {
              for (nb::handle d : init.attr("shape")) self->shape.push_back(nb::cast<int64_t>(d));
            } else {
              throw Error(ErrorCode::invalid_argument,
                          "Param('" + self->name + "'): give a shape or an init tensor");
            }
          },
          nb::arg("name"), nb::arg("shape") = nb::none(), nb::arg("group") = 0,
          nb::arg("init") = nb::none())
      .def_ro("name", &PyParam::name)
      .def_ro("shape", &PyParam::shape)
      .def_ro("group", &PyParam::group);

  nb::class_<PyEngine> engine(
      m, "Engine",
      "One model's units, shards, optimizer and communication on this rank (see "
      "include/zeroshard/engine.hpp for the contract of each call). Views it returns (params, "
      "gather, grads) are DLPack/buffer-protocol arrays over engine memory, valid as the C++ "
      "contract says; torch.from_dlpack() / numpy.from_dlpack() wrap them without copying. With "
      "Config.device cuda they are CUDA arrays (torch.from_dlpack() gives CUDA tensors over the "
      "engine's GPU memory) and the engine's work runs on its stream (stream(), set_stream()).");
  def_registration(engine);
  def_training(engine);
  def_accessors(engine);
  def_state(engine);
}

}  // namespace

// Checkpoints read without an engine (zeroshard/checkpoint.hpp).
void bind_checkpoint_tools(nb::module_& m) {
  m.def("describe_checkpoint", &describe_checkpoint, nb::arg("path"),
        nb::call_guard<nb::gil_scoped_release>(),
        "The manifest of a checkpoint (a tag, or a root's latest) as a table.");
  m.def(
      "verify_checkpoint",
      [](const std::filesystem::path& p) {
        nb::gil_scoped_release nogil;
        return verify_checkpoint(p);
      },
      nb::arg("path"), "Verifies every checksum; returns the data bytes verified.");
  m.def(
      "export_checkpoint",
      [](const std::filesystem::path& p, const std::filesystem::path& out,
         int64_t max_shard_bytes) {
        nb::gil_scoped_release nogil;
        export_checkpoint(p, out, {}, max_shard_bytes);
      },
      nb::arg("path"), nb::arg("out_dir"), nb::arg("max_shard_bytes") = kExportShardBytes,
      "Writes the model as Hugging Face loads it (model.safetensors: f32 weights under every "
      "name, the module's tensors; above max_shard_bytes, 0: never, shards with "
      "model.safetensors.index.json) and out_dir/optimizer.safetensors.");
  m.def(
      "read_module_state",
      [](const std::filesystem::path& p) {
        ModuleState s;
        {
          nb::gil_scoped_release nogil;
          s = read_module_state(p);
        }
        PyModuleTensors t;
        for (const ModuleTensor& x : s.tensors)
          t.emplace_back(x.name, x.dtype, x.shape, nb::bytes(x.bytes.data(), x.bytes.size()));
        return std::make_pair(t, s.aliases);
      },
      nb::arg("path"),
      "What the checkpoint carries of the model besides the engine's state: "
      "([(name, dtype, shape, bytes)], [(alias, parameter)]), checked; empty lists where none.");
}

using PyUnits = std::vector<std::pair<std::string, std::vector<PyParam*>>>;

std::vector<PlanUnit> plan_units(const PyUnits& units) {
  std::vector<PlanUnit> us;
  for (const auto& [name, params] : units) {
    PlanUnit u{name, {}};
    for (const PyParam* p : params) {
      if (!p)
        throw Error(ErrorCode::invalid_argument,
                    "plan_memory(): unit '" + name + "' has a parameter None");
      u.params.push_back(Param{p->name, p->shape, p->group, {}});
    }
    us.push_back(std::move(u));
  }
  return us;
}

void bind_plan(nb::module_& m) {
  m.def(
      "plan_choices",
      [](const Config& cfg, const PyUnits& units, int world,
         const std::vector<OptimizerOptions>& groups, const std::string& calibration,
         double compute_s, double memory_gbs, double disk_gbs, double bus_gbs, double pcie_gbs,
         double gpu_update_gps, double ns_gflops) {
        const std::vector<PlanUnit> us = plan_units(units);
        std::vector<PlanChoice> cs;
        MachineRates rates;
        {
          nb::gil_scoped_release nogil;
          cs = plan_choices(cfg, us, world, groups);
          if (!calibration.empty()) rates = read_calibration(calibration, cfg);
        }
        // As `zeroshard plan` takes them: typed rates over the file's.
        const bool timed = !calibration.empty() || memory_gbs > 0 || disk_gbs > 0 || bus_gbs > 0 ||
                           pcie_gbs > 0 || gpu_update_gps > 0 || ns_gflops > 0;
        rates.compute_s = compute_s;
        set_typed_rates(rates, cfg, world,
                        {memory_gbs, disk_gbs, bus_gbs, pcie_gbs, gpu_update_gps, ns_gflops});
        nb::list out;
        for (const PlanChoice& c : cs) {
          nb::dict d;
          d["stage"] = c.stage;
          d["optimizer"] = tier_name(c.optimizer);
          d["params"] = tier_name(c.params);
          for (int t = 0; t < kNumTiers; ++t) d[tier_name(Tier(t))] = c.tier_bytes[t];
          d["model_states"] = c.model_states;
          d["step"] = nb::none();
          d["step_note"] = nb::none();
          if (timed) {
            StepPrediction p;
            try {
              p = predict_step(c.config, us, world, rates, groups);
            } catch (const Error& e) {  // not modelled, or a rate the file lacks
              d["step_note"] = std::string(e.what());
              out.append(d);
              continue;
            }
            nb::dict st;
            st["total_s"] = p.total_s;
            st["compute_s"] = p.compute_s;
            st["comm_s"] = p.comm_s;
            st["optimizer_s"] = p.optimizer_s;
            st["newton_schulz_s"] = p.newton_schulz_s;
            st["nvme_s"] = p.nvme_s;
            st["pcie_s"] = p.pcie_s;
            st["rollback_s"] = p.rollback_s;
            d["step"] = st;
          }
          out.append(d);
        }
        return out;
      },
      nb::arg("config"), nb::arg("units"), nb::arg("world"),
      nb::arg("groups") = std::vector<OptimizerOptions>{}, nb::arg("calibration") = "",
      nb::arg("compute_s") = 0.0, nb::arg("memory_gbs") = 0.0, nb::arg("disk_gbs") = 0.0,
      nb::arg("bus_gbs") = 0.0, nb::arg("pcie_gbs") = 0.0, nb::arg("gpu_update_gps") = 0.0,
      nb::arg("ns_gflops") = 0.0,
      "plan_memory() for every stage and offload choice, with config's other settings: a list "
      "of dicts (stage, optimizer, params, bytes on device/host/nvme and model_states, of the "
      "rank that holds the most). With `calibration` (a file `zeroshard calibrate` wrote), each "
      "dict's `step` is predict_step()'s split of the engine's step in seconds (total_s, "
      "compute_s as given, comm_s, optimizer_s with Muon's newton_schulz_s in it, pcie_s, "
      "nvme_s, and rollback_s: with speculative_step, the update of a step that keeps no "
      "speculation, optimizer_s being what backward left of it); where it cannot be predicted "
      "(a rate not given) `step` is None and `step_note` says why. Typed rates stand in for "
      "the file's or override them (set_typed_rates()): memory_gbs, disk_gbs, bus_gbs, a GPU "
      "engine's pcie_gbs and gpu_update_gps, and Muon's ns_gflops (its Newton-Schulz "
      "iteration, GFLOP/s at every size).");
  m.def(
      "plan_memory",
      [](const Config& cfg, const PyUnits& units, int world, int rank,
         const std::vector<OptimizerOptions>& groups) {
        const std::vector<PlanUnit> us = plan_units(units);
        nb::gil_scoped_release nogil;
        return plan_memory(cfg, us, world, rank, groups);
      },
      nb::arg("config"), nb::arg("units"), nb::arg("world"), nb::arg("rank") = 0,
      nb::arg("groups") = std::vector<OptimizerOptions>{},
      "The MemoryReport rank `rank` of an engine with `config` on `world` ranks would have after "
      "finalize(), computed by the engine's own setup with nothing allocated (equal to that "
      "engine's memory()). units: a list of (name, [Param, ...]) as Engine.add_unit takes them "
      "(initial values are ignored); groups: the parameter groups after the first. CPU engines "
      "only.");
}

void bind_engine(nb::module_& m) {
  m.def("version", &version, "The library's version, e.g. '0.1.0'.");
  bind_plan(m);
  bind_checkpoint_tools(m);
  bind_communicator(m);
  bind_results(m);
  bind_memory_report(m);
  bind_engine_class(m);
}

}  // namespace zeroshard::py
