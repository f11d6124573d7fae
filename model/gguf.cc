#include "model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvtier::model {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF", little-endian.
constexpr int kMaxDims = 4;              // ggml's GGML_MAX_DIMS.
constexpr uint64_t kMaxAlignment = 1 << 20;

// A cursor over the file's bytes; every read is bounds-checked.
class Reader {
 public:
  Reader(absl::Span<const uint8_t> b, const std::string& name) : b_(b), name_(name) {}
  size_t pos() const { return pos_; }
  size_t left() const { return b_.size() - pos_; }

  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": not a valid GGUF file: ", what,
                                                   " (at byte ", pos_, " of ", b_.size(), ")"));
  }
  template <typename T>
  absl::StatusOr<T> Get(const char* what) {
    if (left() < sizeof(T)) return Error(absl::StrCat("truncated reading ", what));
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  absl::StatusOr<std::string> String(const char* what) {
    KVT_ASSIGN_OR_RETURN(uint64_t n, Get<uint64_t>(what));
    if (n > left()) {
      return Error(absl::StrCat(what, " claims ", n, " bytes; ", left(), " remain"));
    }
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  absl::Span<const uint8_t> b_;
  const std::string& name_;
  size_t pos_ = 0;
};

// Bytes a value of scalar type t occupies; 0 for strings and arrays.
int ScalarBytes(GgufType t) {
  switch (t) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kBool:
      return 1;
    case GgufType::kU16:
    case GgufType::kI16:
      return 2;
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kF32:
      return 4;
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kF64:
      return 8;
    case GgufType::kString:
    case GgufType::kArray:
      return 0;
  }
  return -1;
}

template <typename T>
absl::StatusOr<T> Read(Reader& r, const char* what) {
  return r.Get<T>(what);
}

// One scalar (not string, not array) of type t, as a double (for arrays) and
// into `out` (for single values).
absl::Status ReadScalar(Reader& r, GgufType t, GgufValue* out, double* as_number) {
  double num = 0;
  switch (t) {
    case GgufType::kU8: {
      KVT_ASSIGN_OR_RETURN(uint8_t v, Read<uint8_t>(r, "a u8"));
      if (out) out->scalar = static_cast<uint64_t>(v);
      num = v;
      break;
    }
    case GgufType::kI8: {
      KVT_ASSIGN_OR_RETURN(int8_t v, Read<int8_t>(r, "an i8"));
      if (out) out->scalar = static_cast<int64_t>(v);
      num = v;
      break;
    }
    case GgufType::kU16: {
      KVT_ASSIGN_OR_RETURN(uint16_t v, Read<uint16_t>(r, "a u16"));
      if (out) out->scalar = static_cast<uint64_t>(v);
      num = v;
      break;
    }
    case GgufType::kI16: {
      KVT_ASSIGN_OR_RETURN(int16_t v, Read<int16_t>(r, "an i16"));
      if (out) out->scalar = static_cast<int64_t>(v);
      num = v;
      break;
    }
    case GgufType::kU32: {
      KVT_ASSIGN_OR_RETURN(uint32_t v, Read<uint32_t>(r, "a u32"));
      if (out) out->scalar = static_cast<uint64_t>(v);
      num = v;
      break;
    }
    case GgufType::kI32: {
      KVT_ASSIGN_OR_RETURN(int32_t v, Read<int32_t>(r, "an i32"));
      if (out) out->scalar = static_cast<int64_t>(v);
      num = v;
      break;
    }
    case GgufType::kU64: {
      KVT_ASSIGN_OR_RETURN(uint64_t v, Read<uint64_t>(r, "a u64"));
      if (out) out->scalar = v;
      num = static_cast<double>(v);
      break;
    }
    case GgufType::kI64: {
      KVT_ASSIGN_OR_RETURN(int64_t v, Read<int64_t>(r, "an i64"));
      if (out) out->scalar = v;
      num = static_cast<double>(v);
      break;
    }
    case GgufType::kF32: {
      KVT_ASSIGN_OR_RETURN(float v, Read<float>(r, "an f32"));
      if (out) out->scalar = static_cast<double>(v);
      num = v;
      break;
    }
    case GgufType::kF64: {
      KVT_ASSIGN_OR_RETURN(double v, Read<double>(r, "an f64"));
      if (out) out->scalar = v;
      num = v;
      break;
    }
    case GgufType::kBool: {
      KVT_ASSIGN_OR_RETURN(uint8_t v, Read<uint8_t>(r, "a bool"));
      if (v > 1) return r.Error(absl::StrCat("bool value ", int{v}));
      if (out) out->scalar = v == 1;
      num = v;
      break;
    }
    default:
      return r.Error("not a scalar type");
  }
  if (as_number) *as_number = num;
  return absl::OkStatus();
}

absl::StatusOr<GgufValue> ReadValue(Reader& r, uint32_t raw_type, const std::string& key) {
  GgufValue v;
  if (raw_type > static_cast<uint32_t>(GgufType::kF64)) {
    return r.Error(absl::StrCat("metadata ", key, " has unknown value type ", raw_type));
  }
  v.type = static_cast<GgufType>(raw_type);
  if (v.type == GgufType::kString) {
    KVT_ASSIGN_OR_RETURN(std::string s, r.String("a string value"));
    v.scalar = std::move(s);
    return v;
  }
  if (v.type != GgufType::kArray) {
    KVT_RETURN_IF_ERROR(ReadScalar(r, v.type, &v, nullptr));
    return v;
  }
  KVT_ASSIGN_OR_RETURN(uint32_t et, Read<uint32_t>(r, "an array's element type"));
  KVT_ASSIGN_OR_RETURN(uint64_t n, Read<uint64_t>(r, "an array's length"));
  if (et > static_cast<uint32_t>(GgufType::kF64) || et == static_cast<uint32_t>(GgufType::kArray)) {
    return r.Error(absl::StrCat("metadata ", key, " is an array of unsupported type ", et));
  }
  v.element_type = static_cast<GgufType>(et);
  // Every element takes at least one byte (a string at least eight): a
  // length the rest of the file cannot hold is refused before allocating.
  const uint64_t min_bytes = v.element_type == GgufType::kString ? 8 : ScalarBytes(v.element_type);
  if (n > r.left() / min_bytes) {
    return r.Error(absl::StrCat("metadata ", key, " claims ", n, " elements; the file is shorter"));
  }
  if (v.element_type == GgufType::kString) {
    v.strings.reserve(n);
    for (uint64_t i = 0; i < n; ++i) {
      KVT_ASSIGN_OR_RETURN(std::string s, r.String("an array's string"));
      v.strings.push_back(std::move(s));
    }
  } else {
    v.numbers.resize(n);
    for (uint64_t i = 0; i < n; ++i) {
      KVT_RETURN_IF_ERROR(ReadScalar(r, v.element_type, nullptr, &v.numbers[i]));
    }
  }
  return v;
}

// 64-bit FNV-1a, eight bytes (one little-endian word) at a time, then the
// tail byte by byte.
uint64_t Fnv(uint64_t h, const uint8_t* p, size_t n) {
  constexpr uint64_t kPrime = 0x100000001b3ull;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * kPrime;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * kPrime;
  return h;
}

}  // namespace

int64_t GgufTensor::elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_size_);
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot open model file ", path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  auto f = std::unique_ptr<GgufFile>(new GgufFile());
  f->name_ = path;
  if (st.st_size > 0) {
    void* m = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("mmap ", path, ": ", std::strerror(err)));
    }
    f->mapping_ = m;
    f->mapping_size_ = static_cast<size_t>(st.st_size);
    f->bytes_ = {static_cast<const uint8_t*>(m), f->mapping_size_};
  }
  ::close(fd);
  KVT_RETURN_IF_ERROR(f->ParseAll());
  return f;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Parse(absl::Span<const uint8_t> bytes,
                                                          const std::string& name) {
  auto f = std::unique_ptr<GgufFile>(new GgufFile());
  f->name_ = name;
  f->bytes_ = bytes;
  KVT_RETURN_IF_ERROR(f->ParseAll());
  return f;
}

absl::Status GgufFile::ParseAll() {
  Reader r(bytes_, name_);
  KVT_ASSIGN_OR_RETURN(uint32_t magic, r.Get<uint32_t>("the magic"));
  if (magic != kMagic) return r.Error("wrong magic (expected \"GGUF\")");
  KVT_ASSIGN_OR_RETURN(version_, r.Get<uint32_t>("the version"));
  if (version_ != 2 && version_ != 3) {
    return r.Error(absl::StrCat("version ", version_, " (this reader knows 2 and 3)"));
  }
  KVT_ASSIGN_OR_RETURN(uint64_t n_tensors, r.Get<uint64_t>("the tensor count"));
  KVT_ASSIGN_OR_RETURN(uint64_t n_kv, r.Get<uint64_t>("the metadata count"));
  // A metadata entry takes at least 13 bytes, a tensor entry at least 28.
  if (n_kv > r.left() / 13 || n_tensors > r.left() / 28) {
    return r.Error(
        absl::StrCat(n_kv, " metadata entries and ", n_tensors, " tensors cannot fit in the file"));
  }
  for (uint64_t i = 0; i < n_kv; ++i) {
    KVT_ASSIGN_OR_RETURN(std::string key, r.String("a metadata key"));
    KVT_ASSIGN_OR_RETURN(uint32_t type, r.Get<uint32_t>("a metadata type"));
    KVT_ASSIGN_OR_RETURN(GgufValue v, ReadValue(r, type, key));
    if (!metadata_.emplace(key, std::move(v)).second) {
      return r.Error(absl::StrCat("metadata key ", key, " appears twice"));
    }
  }
  if (Has("general.alignment")) {
    KVT_ASSIGN_OR_RETURN(int64_t a, Int("general.alignment"));
    if (a <= 0 || static_cast<uint64_t>(a) > kMaxAlignment || (a & (a - 1)) != 0) {
      return r.Error(
          absl::StrCat("general.alignment ", a, " is not a power of two up to ", kMaxAlignment));
    }
    alignment_ = static_cast<uint64_t>(a);
  }
  std::vector<uint64_t> offsets;
  tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    KVT_ASSIGN_OR_RETURN(t.name, r.String("a tensor name"));
    KVT_ASSIGN_OR_RETURN(uint32_t n_dims, r.Get<uint32_t>("a tensor's dimension count"));
    if (n_dims < 1 || n_dims > kMaxDims) {
      return r.Error(absl::StrCat("tensor ", t.name, " has ", n_dims, " dimensions"));
    }
    // Every tensor lies in the file, so no dimension nor product of
    // dimensions exceeds the file's size in weights (8 per byte at most).
    const uint64_t limit = static_cast<uint64_t>(bytes_.size()) * 8 + 8;
    uint64_t elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      KVT_ASSIGN_OR_RETURN(uint64_t dim, r.Get<uint64_t>("a tensor dimension"));
      if (dim == 0 || dim > limit || elements > limit / dim) {
        return r.Error(
            absl::StrCat("tensor ", t.name, " has dimension ", dim, ", too large for the file"));
      }
      elements *= dim;
      t.dims.push_back(static_cast<int64_t>(dim));
    }
    KVT_ASSIGN_OR_RETURN(uint32_t type, r.Get<uint32_t>("a tensor type"));
    if (!GgmlTypeSupported(type)) {
      return absl::InvalidArgumentError(absl::StrCat(name_, ": tensor ", t.name, " has type ",
                                                     GgmlTypeName(type), " (", type,
                                                     "), which kvtier cannot read"));
    }
    t.type = static_cast<GgmlType>(type);
    if (t.dims[0] % BlockWeights(t.type) != 0) {
      return r.Error(absl::StrCat("tensor ", t.name, " has rows of ", t.dims[0], " weights, not a ",
                                  "multiple of ", GgmlTypeName(type), "'s block of ",
                                  BlockWeights(t.type)));
    }
    t.bytes = RowBytes(t.type, t.dims[0]) * (static_cast<int64_t>(elements) / t.dims[0]);
    KVT_ASSIGN_OR_RETURN(uint64_t offset, r.Get<uint64_t>("a tensor offset"));
    if (offset % alignment_ != 0) {
      return r.Error(absl::StrCat("tensor ", t.name, " at offset ", offset,
                                  ", not a multiple of the alignment ", alignment_));
    }
    if (by_name_.count(t.name) != 0) {
      return r.Error(absl::StrCat("tensor ", t.name, " appears twice"));
    }
    by_name_[t.name] = tensors_.size();
    offsets.push_back(offset);
    tensors_.push_back(std::move(t));
  }
  const uint64_t data_start = (r.pos() + alignment_ - 1) / alignment_ * alignment_;
  const uint64_t data_bytes = data_start <= bytes_.size() ? bytes_.size() - data_start : 0;
  std::vector<size_t> order(tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
  uint64_t end = 0;
  for (size_t i : order) {
    GgufTensor& t = tensors_[i];
    const uint64_t bytes = static_cast<uint64_t>(t.bytes);
    if (offsets[i] > data_bytes || bytes > data_bytes - offsets[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          name_, ": tensor ", t.name, " (", bytes, " bytes at data offset ", offsets[i],
          ") runs past the end of the file (", data_bytes, " bytes of tensor data): truncated?"));
    }
    if (offsets[i] < end) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": tensor ", t.name, " overlaps the tensor before it"));
    }
    end = offsets[i] + bytes;
    t.data = bytes_.data() + data_start + offsets[i];
  }
  uint64_t h = 0xcbf29ce484222325ull;
  for (const GgufTensor& t : tensors_) {
    h = Fnv(h, reinterpret_cast<const uint8_t*>(t.name.data()), t.name.size());
    const uint32_t type = static_cast<uint32_t>(t.type);
    h = Fnv(h, reinterpret_cast<const uint8_t*>(&type), 4);
    for (int64_t d : t.dims) h = Fnv(h, reinterpret_cast<const uint8_t*>(&d), 8);
    h = Fnv(h, t.data, static_cast<size_t>(t.bytes));
  }
  tensor_digest_ = h;
  return absl::OkStatus();
}

const GgufTensor* GgufFile::tensor(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<const GgufTensor*> GgufFile::Tensor(const std::string& name,
                                                   const std::vector<int64_t>& dims) const {
  const GgufTensor* t = tensor(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat(name_, ": no tensor ", name));
  if (t->dims != dims) {
    auto shape = [](const std::vector<int64_t>& d) {
      std::string s = "[";
      for (size_t i = 0; i < d.size(); ++i) absl::StrAppend(&s, i ? ", " : "", d[i]);
      return s + "]";
    };
    return absl::InvalidArgumentError(absl::StrCat(name_, ": tensor ", name, " has shape ",
                                                   shape(t->dims), "; the model needs ",
                                                   shape(dims)));
  }
  return t;
}

namespace {

absl::StatusOr<const GgufValue*> Find(const GgufFile& f, const std::string& key) {
  auto it = f.metadata().find(key);
  if (it == f.metadata().end()) {
    return absl::NotFoundError(absl::StrCat(f.name(), ": no metadata ", key));
  }
  return &it->second;
}

absl::Status WrongKind(const GgufFile& f, const std::string& key, const char* want) {
  return absl::InvalidArgumentError(absl::StrCat(f.name(), ": metadata ", key, " is not ", want));
}

}  // namespace

absl::StatusOr<int64_t> GgufFile::Int(const std::string& key) const {
  KVT_ASSIGN_OR_RETURN(const GgufValue* v, Find(*this, key));
  if (const auto* u = std::get_if<uint64_t>(&v->scalar)) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return WrongKind(*this, key, "an integer in range");
    }
    return static_cast<int64_t>(*u);
  }
  if (const auto* i = std::get_if<int64_t>(&v->scalar)) return *i;
  return WrongKind(*this, key, "an integer");
}

absl::StatusOr<double> GgufFile::Float(const std::string& key) const {
  KVT_ASSIGN_OR_RETURN(const GgufValue* v, Find(*this, key));
  if (v->type != GgufType::kF32 && v->type != GgufType::kF64) {
    return WrongKind(*this, key, "a float");
  }
  return std::get<double>(v->scalar);
}

absl::StatusOr<std::string> GgufFile::String(const std::string& key) const {
  KVT_ASSIGN_OR_RETURN(const GgufValue* v, Find(*this, key));
  if (v->type != GgufType::kString) return WrongKind(*this, key, "a string");
  return std::get<std::string>(v->scalar);
}

absl::StatusOr<bool> GgufFile::Bool(const std::string& key) const {
  KVT_ASSIGN_OR_RETURN(const GgufValue* v, Find(*this, key));
  if (v->type != GgufType::kBool) return WrongKind(*this, key, "a bool");
  return std::get<bool>(v->scalar);
}

absl::StatusOr<const std::vector<std::string>*> GgufFile::Strings(const std::string& key) const {
  KVT_ASSIGN_OR_RETURN(const GgufValue* v, Find(*this, key));
  if (v->type != GgufType::kArray || v->element_type != GgufType::kString) {
    return WrongKind(*this, key, "an array of strings");
  }
  return &v->strings;
}

absl::StatusOr<const std::vector<double>*> GgufFile::Numbers(const std::string& key) const {
  KVT_ASSIGN_OR_RETURN(const GgufValue* v, Find(*this, key));
  if (v->type != GgufType::kArray || v->element_type == GgufType::kString) {
    return WrongKind(*this, key, "an array of numbers");
  }
  return &v->numbers;
}

}  // namespace kvtier::model
