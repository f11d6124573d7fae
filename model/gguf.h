// A reader for GGUF files (the model format of llama.cpp and ggml, version 2
// and 3): the header, the typed metadata, the tensor table and the aligned
// tensor data, mapped read-only. Layout: ../shared/design/ALGORITHMS.md and
// docs/models.md; the element types and their blocks are in model/quant.h.
//
// Everything in the file is checked before it is used: every length, count,
// offset and dimension is bounded by the file's size, tensors may not overlap
// or run past the end, and a tensor's byte size must match its type and
// shape. A file that fails any check is refused with INVALID_ARGUMENT naming
// the file, the item and what was wrong; nothing in it can make the reader
// read outside the bytes it was given.
//
// Thread safety: a GgufFile is immutable once opened; any number of threads
// may read it concurrently.
#ifndef KVTIER_MODEL_GGUF_H_
#define KVTIER_MODEL_GGUF_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/quant.h"

namespace kvtier::model {

// GGUF's metadata value types, numbered as in the file.
enum class GgufType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

// One metadata value. Integers of every width are held as int64 or uint64
// (with the file's type kept in `type`), floats as double; an array holds
// its elements (arrays of arrays are refused: no model uses them).
struct GgufValue {
  GgufType type = GgufType::kU8;
  GgufType element_type = GgufType::kU8;  // For arrays.
  std::variant<uint64_t, int64_t, double, bool, std::string> scalar;
  std::vector<std::string> strings;  // An array of strings.
  std::vector<double> numbers;       // An array of numbers (or bools, as 0/1).
};

struct GgufTensor {
  std::string name;
  GgmlType type = GgmlType::kF32;
  // ggml order: dims[0] is the row length (contiguous), dims[1] the number
  // of rows, and so on.
  std::vector<int64_t> dims;
  const uint8_t* data = nullptr;  // Inside the file's bytes.
  int64_t bytes = 0;

  int64_t elements() const;
  int64_t rows() const { return dims.empty() ? 0 : elements() / dims[0]; }
  int64_t row_length() const { return dims.empty() ? 0 : dims[0]; }
  int64_t row_bytes() const { return RowBytes(type, row_length()); }
  const uint8_t* row(int64_t r) const { return data + r * row_bytes(); }
};

class GgufFile {
 public:
  // Maps `path` read-only and parses it. NOT_FOUND when it cannot be opened;
  // INVALID_ARGUMENT when it is not a valid GGUF file (the message names the
  // path and the first problem found).
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses bytes the caller keeps alive for the GgufFile's lifetime; `name`
  // appears in error messages. The same checks as Open.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Parse(absl::Span<const uint8_t> bytes,
                                                         const std::string& name);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& name() const { return name_; }
  uint32_t version() const { return version_; }
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  uint64_t alignment() const { return alignment_; }

  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  // Null when there is no tensor of that name.
  const GgufTensor* tensor(const std::string& name) const;
  // The tensor, with NOT_FOUND naming it when absent and INVALID_ARGUMENT
  // when its shape is not `dims`.
  absl::StatusOr<const GgufTensor*> Tensor(const std::string& name,
                                           const std::vector<int64_t>& dims) const;

  // Typed metadata lookups. NOT_FOUND when the key is absent; INVALID_ARGUMENT
  // when it holds another kind of value or an integer out of the asked range.
  absl::StatusOr<int64_t> Int(const std::string& key) const;
  absl::StatusOr<double> Float(const std::string& key) const;
  absl::StatusOr<std::string> String(const std::string& key) const;
  absl::StatusOr<bool> Bool(const std::string& key) const;
  absl::StatusOr<const std::vector<std::string>*> Strings(const std::string& key) const;
  absl::StatusOr<const std::vector<double>*> Numbers(const std::string& key) const;
  bool Has(const std::string& key) const { return metadata_.count(key) != 0; }

  // FNV-1a (64-bit) over every tensor's name, type, shape and data, in the
  // file's order: the model's identity, independent of its metadata.
  // Computed once at open (it reads the whole file).
  uint64_t tensor_digest() const { return tensor_digest_; }

 private:
  GgufFile() = default;
  absl::Status ParseAll();

  std::string name_;
  absl::Span<const uint8_t> bytes_;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> by_name_;
  uint64_t tensor_digest_ = 0;
};

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_GGUF_H_
