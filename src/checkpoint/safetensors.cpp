// safetensors files (safetensors.hpp).
#include "src/checkpoint/safetensors.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "base/check.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "src/checkpoint/file_io.hpp"

namespace zeroshard::ckpt {

using nlohmann::json;

namespace {

constexpr int64_t kMaxHeader = int64_t(100) << 20;  // the format's own limit

// F32, BF16 and F16: what weights come in (read_f32()).
int64_t float_bytes(const std::string& d) {
  if (d == "F32") return 4;
  if (d == "BF16" || d == "F16") return 2;
  return 0;
}

}  // namespace

int64_t dtype_bytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "BF16" || d == "F16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL") return 1;
  return 0;
}

std::vector<std::string> tensor_names(const std::vector<UnitInfo>& units) {
  std::set<std::string> seen;
  bool unique = true;
  for (const UnitInfo& u : units)
    for (const ParamInfo& p : u.params) unique &= seen.insert(p.name).second;
  std::vector<std::string> names;
  for (const UnitInfo& u : units)
    for (const ParamInfo& p : u.params) names.push_back(unique ? p.name : u.name + "." + p.name);
  return names;
}

StWriter::StWriter(std::filesystem::path path, const std::vector<std::string>& names,
                   const std::vector<std::vector<int64_t>>& shapes,
                   const std::map<std::string, std::string>& metadata,
                   const std::vector<std::string>& dtypes)
    : path_(std::move(path)) {
  ZS_CHECK(dtypes.empty() || dtypes.size() == names.size());
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  int64_t offset = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string dtype = dtypes.empty() ? "F32" : dtypes[i];
    int64_t n = dtype_bytes(dtype);
    ZS_CHECK(n > 0);
    for (int64_t d : shapes[i]) n *= d;
    h[names[i]] = {{"dtype", dtype}, {"shape", shapes[i]}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = h.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  fd_.reset(::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd_) io_failure(path_, "creating", errno);
  uint64_t len = text.size();  // little-endian, as on every machine this builds for
  pwrite_all(fd_.get(), &len, 8, 0, path_);
  pwrite_all(fd_.get(), text.data(), text.size(), 8, path_);
  at_ = 8 + int64_t(text.size());
  end_ = at_ + offset;
}

void StWriter::append(const float* data, int64_t n) {
  append_bytes(data, n * 4);
}

void StWriter::append_bytes(const void* data, int64_t bytes) {
  pwrite_all(fd_.get(), data, size_t(bytes), at_, path_);
  at_ += bytes;
}

void StWriter::finish() {
  ZS_CHECK(at_ == end_);
  fsync_fd(fd_.get(), path_);
  fd_.reset();
}

StReader::StReader(std::filesystem::path path)
    : path_(std::move(path)), fd_(::open(path_.c_str(), O_RDONLY | O_CLOEXEC)) {
  const std::string file = path_.string();
  if (!fd_)
    ZS_THROW(invalid_argument, "safetensors: cannot open " << file << ": " << std::strerror(errno));
  const off_t size = ::lseek(fd_.get(), 0, SEEK_END);
  uint64_t len = 0;
  if (size < 8) ZS_THROW(corrupted, "safetensors: " << file << " is too short for a header");
  pread_all(fd_.get(), &len, 8, 0, path_, "header");
  if (len == 0 || len > uint64_t(kMaxHeader) || int64_t(len) > size - 8)
    ZS_THROW(corrupted, "safetensors: " << file << ": header length " << len << " is impossible");
  std::string text(size_t(len), '\0');
  pread_all(fd_.get(), text.data(), text.size(), 8, path_, "header");
  data_start_ = 8 + int64_t(len);
  const int64_t data_bytes = int64_t(size) - data_start_;
  json h;
  try {
    h = json::parse(text);
  } catch (const std::exception& e) {
    ZS_THROW(corrupted, "safetensors: " << file << ": the header is not JSON: " << e.what());
  }
  if (!h.is_object()) ZS_THROW(corrupted, "safetensors: " << file << ": the header is no object");
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (it.value().is_object())
        for (auto m = it.value().begin(); m != it.value().end(); ++m)
          if (m.value().is_string()) metadata_[m.key()] = m.value().get<std::string>();
      continue;
    }
    const json& v = it.value();
    auto bad = [&](const char* what) {
      ZS_THROW(corrupted, "safetensors: " << file << ": tensor '" << it.key() << "': " << what);
    };
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets") || !v["dtype"].is_string() || !v["shape"].is_array() ||
        !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      bad("needs dtype, shape and data_offsets [begin, end]");
    StTensor t;
    t.name = it.key();
    t.dtype = v["dtype"].get<std::string>();
    int64_t n = 1;
    for (const json& d : v["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t(1) << 48)) bad("bad shape");
      const int64_t dim = d.get<int64_t>();
      if (dim != 0 && n > (int64_t(1) << 48) / dim) bad("shape too large");
      n *= dim;
      t.shape.push_back(dim);
    }
    for (const json& o : v["data_offsets"])
      if (!o.is_number_unsigned() || o.get<uint64_t>() > uint64_t(data_bytes))
        bad("data_offsets outside the file");
    t.begin = v["data_offsets"][0].get<int64_t>();
    t.end = v["data_offsets"][1].get<int64_t>();
    const int64_t width = dtype_bytes(t.dtype);
    if (t.end < t.begin || (width && t.end - t.begin != n * width))
      bad("data_offsets do not match its shape and dtype");
    tensors_.push_back(std::move(t));
  }
  // Back to back from 0 to the end of the file, as the format requires.
  std::vector<const StTensor*> order;
  for (const StTensor& t : tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const StTensor* a, const StTensor* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t at = 0;
  for (const StTensor* t : order) {
    if (t->begin != at)
      ZS_THROW(corrupted, "safetensors: " << file << ": tensor '" << t->name
                                          << "' does not follow the one before it");
    at = t->end;
  }
  if (at != data_bytes)
    ZS_THROW(corrupted, "safetensors: " << file << ": the tensors cover " << at << " of "
                                        << data_bytes << " data bytes");
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

const StTensor* StReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void StReader::read_bytes(const StTensor& t, void* out) {
  pread_all(fd_.get(), out, size_t(t.end - t.begin), data_start_ + t.begin, path_, "data");
}

void StReader::read_f32(const StTensor& t, int64_t offset, int64_t n, float* out) {
  const int64_t width = float_bytes(t.dtype);
  ZS_CHECK(width > 0 && offset >= 0 && t.begin + (offset + n) * width <= t.end);
  const int64_t at = data_start_ + t.begin + offset * width;
  if (width == 4) {
    pread_all(fd_.get(), out, size_t(n) * 4, at, path_, "data");
    return;
  }
  std::vector<uint16_t> half(static_cast<size_t>(n));
  pread_all(fd_.get(), half.data(), half.size() * 2, at, path_, "data");
  for (int64_t i = 0; i < n; ++i)
    out[i] = t.dtype == "BF16" ? cpu::bf16_to_float(half[size_t(i)])
                               : cpu::f16_to_float(half[size_t(i)]);
}

}  // namespace zeroshard::ckpt
