// zeroshard._core: the extension module. Its Python face is the `zeroshard` package
// (python_bindings/zeroshard/), which re-exports these names and adds zeroshard.torch.
#include "python_bindings/src/bindings.hpp"

namespace zeroshard::py {

namespace {

// One Python exception class per ErrorCode, all deriving from zeroshard.Error (a RuntimeError).
// Caller mistakes (invalid_argument, invalid_config) are also ValueErrors, as Python code
// expects of a bad argument. The OSError family is left out on purpose: its instance layout
// cannot be combined with RuntimeError's.
struct ErrorClass {
  ErrorCode code;
  const char* name;
  bool value_error;
  const char* doc;
};
constexpr ErrorClass kErrorClasses[] = {
    {ErrorCode::invalid_argument, "InvalidArgumentError", true,
     "A caller passed something the contract forbids (sizes, dtypes, layout, call order)."},
    {ErrorCode::invalid_config, "ConfigError", true,
     "A configuration key is unknown, has the wrong type or a bad value."},
    {ErrorCode::model_mismatch, "ModelMismatchError", false,
     "Ranks registered different models; raised on every rank."},
    {ErrorCode::timeout, "CollectiveTimeoutError", false, "A collective did not complete in time."},
    {ErrorCode::comm_failure, "CommunicationError", false,
     "The communication backend failed (or is unusable after a timeout)."},
    {ErrorCode::io_error, "StorageError", false, "A file or device operation failed."},
    {ErrorCode::corrupted, "CorruptedDataError", false,
     "Data read back failed its checksum or has the wrong size."},
    {ErrorCode::no_space, "NoSpaceError", false, "A tier ran out of room."},
    {ErrorCode::cuda_error, "CudaError", false, "A CUDA runtime or NCCL call failed."},
    {ErrorCode::overflow, "GradientOverflowError", false,
     "Gradients overflowed with the loss scale already at its minimum (every later step would "
     "be skipped)."},
    {ErrorCode::internal, "InternalError", false, "An invariant inside zeroshard broke (a bug)."},
};
constexpr size_t kNumCodes = sizeof(kErrorClasses) / sizeof(kErrorClasses[0]);

// Owned by the module object (added as attributes), so these borrowed pointers stay valid.
PyObject* g_base = nullptr;
PyObject* g_classes[kNumCodes] = {};

PyObject* class_for(ErrorCode c) {
  for (size_t i = 0; i < kNumCodes; ++i)
    if (kErrorClasses[i].code == c) return g_classes[i];
  return g_base;
}

}  // namespace

void bind_errors(nb::module_& m) {
  g_base = PyErr_NewExceptionWithDoc(
      "zeroshard.Error",
      "Base of every exception zeroshard raises; the message is the C++ zeroshard::Error's "
      "what(), and .code names its ErrorCode.",
      PyExc_RuntimeError, nullptr);
  if (!g_base) throw nb::python_error();
  m.attr("Error") = nb::handle(g_base);
  nb::setattr(g_base, "code", nb::none());

  for (size_t i = 0; i < kNumCodes; ++i) {
    const ErrorClass& e = kErrorClasses[i];
    const std::string qual = std::string("zeroshard.") + e.name;
    nb::object bases =
        e.value_error ? nb::object(nb::make_tuple(nb::handle(g_base), nb::handle(PyExc_ValueError)))
                      : nb::borrow(g_base);
    PyObject* cls = PyErr_NewExceptionWithDoc(qual.c_str(), e.doc, bases.ptr(), nullptr);
    if (!cls) throw nb::python_error();
    nb::setattr(cls, "code", nb::str(error_code_name(e.code)));
    g_classes[i] = cls;
    m.attr(e.name) = nb::handle(cls);
  }

  // The one place where C++ errors become Python exceptions: same message, class by code.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(class_for(e.code()), e.what());
    }
  });
}

}  // namespace zeroshard::py

NB_MODULE(_core, m) {
  namespace py = zeroshard::py;
  m.doc() = "zeroshard's C++ engine (ZeRO sharding and offload); use it through `zeroshard`.";
  // Tensors handed to PyTorch keep the engine alive through their DLPack deleters; an interpreter
  // that exits with a model still referenced is not a leak worth a warning per object.
  nanobind::set_leak_warnings(false);
  m.attr("__version__") = zeroshard::version();
  py::bind_errors(m);
  py::bind_config(m);
  py::bind_engine(m);
  py::bind_kernels(m);
}
