// The tensor bridge. Tensors cross in both directions by DLPack (or the buffer protocol on the
// way in) and are never copied here: a tensor C++ cannot use as it is (on a device the call does
// not read, strided, of another dtype) is rejected with an error that says what to do, because a
// silent copy would turn the caller's in-place writes into writes to a temporary, and hide a
// hot-path cost. Engine views keep their device: a GPU engine's views leave as CUDA arrays.
#include <cctype>
#include <cstring>
#include <sstream>

#include "python_bindings/src/bindings.hpp"

namespace zeroshard::py {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw Error(ErrorCode::invalid_argument, msg);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool same(nb::dlpack::dtype a, nb::dlpack::dtype b) {
  return a == b;
}

std::string shape_text(size_t ndim, const int64_t* shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < ndim; ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

// A fixed-size std::vector<float> handed to Python: the capsule frees it with the array.
void delete_floats(void* p) noexcept {
  delete static_cast<std::vector<float>*>(p);
}

}  // namespace

nb::dlpack::dtype to_dlpack(DType t) {
  switch (t) {
    case DType::f32:
      return nb::dtype<float>();
    case DType::f16:
      return {uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::bf16:
      return {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
  }
  throw Error(ErrorCode::internal, "to_dlpack(): unknown dtype");
}

std::string dlpack_dtype_name(nb::dlpack::dtype t) {
  const char* base = "unknown";
  switch (nb::dlpack::dtype_code(t.code)) {
    case nb::dlpack::dtype_code::Int:
      base = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      base = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      base = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      base = "bfloat";
      break;
    case nb::dlpack::dtype_code::Complex:
      base = "complex";
      break;
    case nb::dlpack::dtype_code::Bool:
      return "bool";
    default:
      break;
  }
  std::string s = base + std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

Imported import_tensor(nb::handle obj, const TensorRequest& req, bool writable) {
  Imported out;
  // No implicit conversion (convert = false): nanobind would otherwise make a contiguous or
  // retyped copy, which is exactly what the contract forbids.
  const bool ok = writable ? nb::try_cast<Array>(obj, out.array, false)
                           : nb::try_cast<ArrayRO>(obj, out.array_ro, false);
  if (!ok) {
    std::string type = nb::type_name(obj.type()).c_str();
    std::string hint;
    // torch refuses to export a tensor that requires grad; say so rather than "wrong type".
    if (nb::hasattr(obj, "requires_grad") && nb::hasattr(obj, "detach") &&
        nb::cast<bool>(obj.attr("requires_grad")))
      hint = " (it requires grad: pass tensor.detach(), which shares its memory)";
    else if (writable)
      hint = " (it must also be writable)";
    fail(req.what + ": expected a CPU tensor or array supporting DLPack or the buffer protocol" +
         (req.allow_cuda ? " (or a CUDA tensor)" : "") + ", got " + type + hint);
  }
  const size_t ndim = writable ? out.array.ndim() : out.array_ro.ndim();
  const int device = writable ? out.array.device_type() : out.array_ro.device_type();
  const int device_id = writable ? out.array.device_id() : out.array_ro.device_id();
  const nb::dlpack::dtype dt = writable ? out.array.dtype() : out.array_ro.dtype();
  const int64_t* shape = writable ? out.array.shape_ptr() : out.array_ro.shape_ptr();
  const int64_t* strides = writable ? out.array.stride_ptr() : out.array_ro.stride_ptr();
  void* data = writable ? static_cast<void*>(out.array.data())
                        : const_cast<void*>(static_cast<const void*>(out.array_ro.data()));

  Device zdev = Device::cpu;
  if (device == nb::device::cuda::value && req.allow_cuda) {
    zdev = Device::cuda;
  } else if (device != nb::device::cpu::value) {
    // No copy to the host here: the caller moves the tensor (tensor.cpu()) if that is meant.
    const std::string where =
        device == nb::device::cuda::value ? " (cuda:" + std::to_string(device_id) + ")" : "";
    fail(req.what + ": the tensor is on DLPack device type " + std::to_string(device) + where +
         "; zeroshard's Python bindings take CPU tensors" +
         (req.allow_cuda ? " or CUDA tensors" : " here (pass tensor.cpu() if a copy is meant)"));
  }

  int64_t numel = 1;
  for (size_t i = 0; i < ndim; ++i) numel *= shape[i];

  // C-contiguous: strides (in elements) are the running product of the trailing extents;
  // extents of 1 may carry any stride, and a tensor of at most one element is always fine.
  if (numel > 1) {
    int64_t expect = 1;
    for (size_t i = ndim; i-- > 0;) {
      if (shape[i] != 1 && strides[i] != expect)
        fail(req.what + ": the tensor is not contiguous (shape " + shape_text(ndim, shape) +
             ", strides " + shape_text(ndim, strides) +
             "); zeroshard never copies silently: pass tensor.contiguous()");
      expect *= shape[i];
    }
  }

  DType zdt = DType::f32;
  if (req.has_dtype && !same(dt, to_dlpack(req.dtype)))
    fail(req.what + ": dtype " + dlpack_dtype_name(dt) + " does not match the expected " +
         dlpack_dtype_name(to_dlpack(req.dtype)) + " (" + dtype_name(req.dtype) +
         "); zeroshard never converts silently: pass tensor.to(the expected dtype)");
  if (!req.any_dtype) {
    if (same(dt, to_dlpack(DType::f32)))
      zdt = DType::f32;
    else if (same(dt, to_dlpack(DType::bf16)))
      zdt = DType::bf16;
    else if (same(dt, to_dlpack(DType::f16)))
      zdt = DType::f16;
    else
      fail(req.what + ": dtype " + dlpack_dtype_name(dt) +
           " is not supported (float32, bfloat16 or float16)");
  }
  if (req.numel >= 0 && numel != req.numel)
    fail(req.what + ": the tensor has " + std::to_string(numel) + " elements (shape " +
         shape_text(ndim, shape) + "), expected " + std::to_string(req.numel));

  out.view = TensorView{data, numel, zdt, zdev, zdev == Device::cuda ? device_id : 0};
  out.nbytes = numel * int64_t((dt.bits * dt.lanes + 7) / 8);
  return out;
}

nb::object export_view(const TensorView& v, const std::vector<int64_t>& shape, nb::handle owner) {
  if (shape_numel(shape) != v.numel)
    throw Error(ErrorCode::internal, "export_view(): shape " + shape_string(shape) + " has " +
                                         std::to_string(shape_numel(shape)) + " elements, view " +
                                         std::to_string(v.numel));
  std::vector<size_t> ext(shape.begin(), shape.end());
  // The view's own device: exporting GPU memory as a CPU array would let the consumer read
  // device pointers as host memory. DLPack's stream handshake needs nothing from this side: the
  // engine's work is ordered on its stream, which the trainer shares (Engine.set_stream()).
  const bool cuda = v.device == Device::cuda;
  // Zero-element views may carry a null pointer; DLPack consumers accept that.
  Array a(v.data, ext.size(), ext.data(), owner, nullptr, to_dlpack(v.dtype),
          cuda ? nb::device::cuda::value : nb::device::cpu::value, cuda ? v.device_index : 0, 'C');
  return nb::cast(a, nb::rv_policy::reference);
}

nb::object export_owned(std::vector<float>&& values) {
  auto* heap = new std::vector<float>(std::move(values));
  nb::capsule owner(heap, delete_floats);
  const size_t n = heap->size();
  Array a(heap->data(), 1, &n, owner, nullptr, nb::dtype<float>(), nb::device::cpu::value, 0, 'C');
  return nb::cast(a, nb::rv_policy::reference);
}

// ---- enums from strings -------------------------------------------------------------------------

namespace {

// torch.float32 and numpy.dtype('float32') print as "torch.float32" / "float32".
std::string spelled(nb::handle h) {
  std::string s = lower(nb::str(h).c_str());
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  return s;
}

[[noreturn]] void bad_value(const char* what, nb::handle h, const char* choices) {
  throw Error(ErrorCode::invalid_config, std::string("config: ") + what + " = " +
                                             nb::repr(h).c_str() + " is not one of " + choices);
}

}  // namespace

DType parse_dtype(nb::handle h) {
  DType d;
  if (nb::try_cast<DType>(h, d, false)) return d;
  const std::string s = spelled(h);
  if (s == "f32" || s == "fp32" || s == "float32" || s == "float") return DType::f32;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "f16" || s == "fp16" || s == "float16" || s == "half") return DType::f16;
  bad_value("dtype", h,
            "\"f32\", \"bf16\", \"f16\" (or torch.float32, torch.bfloat16, torch.float16)");
}

Tier parse_tier(nb::handle h) {
  Tier t;
  if (nb::try_cast<Tier>(h, t, false)) return t;
  if (h.is_none()) return Tier::device;
  const std::string s = spelled(h);
  // DeepSpeed spells the tiers by device: "none" (stay on the device), "cpu", "nvme".
  if (s == "device" || s == "none") return Tier::device;
  if (s == "host" || s == "cpu") return Tier::host;
  if (s == "nvme") return Tier::nvme;
  bad_value("offload device", h,
            "\"none\", \"cpu\", \"nvme\" (or Tier.device, Tier.host, Tier.nvme)");
}

Device parse_device(nb::handle h, int* index) {
  Device d;
  if (nb::try_cast<Device>(h, d, false)) return d;
  // torch.device("cuda", 1) prints as "cuda:1", torch.device("cuda") as "cuda".
  const std::string s = spelled(h);
  if (s == "cpu") return Device::cpu;
  if (s == "cuda") return Device::cuda;
  if (index && s.rfind("cuda:", 0) == 0 && s.size() > 5 && s.size() <= 9 &&
      s.find_first_not_of("0123456789", 5) == std::string::npos) {
    *index = std::stoi(s.substr(5));
    return Device::cuda;
  }
  bad_value("device", h, "\"cpu\", \"cuda\", \"cuda:N\" (or Device.cpu, Device.cuda)");
}

OptimizerKind parse_optimizer(nb::handle h) {
  OptimizerKind k;
  if (nb::try_cast<OptimizerKind>(h, k, false)) return k;
  const std::string s = spelled(h);
  if (s == "adam") return OptimizerKind::adam;
  if (s == "adamw") return OptimizerKind::adamw;
  if (s == "sgd") return OptimizerKind::sgd;
  if (s == "lion") return OptimizerKind::lion;
  if (s == "muon") return OptimizerKind::muon;
  bad_value("optimizer", h, "\"adam\", \"adamw\", \"sgd\", \"lion\", \"muon\"");
}

SpeculativeStep parse_speculative_step(nb::handle h) {
  SpeculativeStep s;
  if (nb::try_cast<SpeculativeStep>(h, s, false)) return s;
  if (nb::isinstance<nb::bool_>(h))
    return nb::cast<bool>(h) ? SpeculativeStep::on : SpeculativeStep::off;
  if (spelled(h) == "auto") return SpeculativeStep::automatic;
  bad_value("speculative_step", h, "True, False, \"auto\" (or SpeculativeStep.*)");
}

StateFormat parse_state_format(nb::handle h) {
  StateFormat f;
  if (nb::try_cast<StateFormat>(h, f, false)) return f;
  const std::string s = spelled(h);
  for (StateFormat v : {StateFormat::f32, StateFormat::bf16, StateFormat::q8})
    if (s == state_format_name(v)) return v;
  bad_value("optimizer_state", h, "\"f32\", \"bf16\", \"8bit\" (or StateFormat.*)");
}

}  // namespace zeroshard::py
