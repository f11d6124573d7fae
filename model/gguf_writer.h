// Writes GGUF files (version 3): metadata and tensors in the order added,
// tensor data aligned to general.alignment (32). Used to convert
// stories260K's llama2.c checkpoint and by the reader's tests and fuzz seeds.
//
// Not thread-safe; one writer builds one file.
#ifndef KVTIER_MODEL_GGUF_WRITER_H_
#define KVTIER_MODEL_GGUF_WRITER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/quant.h"

namespace kvtier::model {

class GgufWriter {
 public:
  void AddU32(const std::string& key, uint32_t v);
  void AddI32(const std::string& key, int32_t v);
  void AddF32(const std::string& key, float v);
  void AddBool(const std::string& key, bool v);
  void AddString(const std::string& key, const std::string& v);
  void AddStrings(const std::string& key, const std::vector<std::string>& v);
  void AddF32s(const std::string& key, const std::vector<float>& v);
  void AddI32s(const std::string& key, const std::vector<int32_t>& v);
  // `data` holds the tensor's bytes in its type's layout (RowBytes of
  // dims[0] per row); dims in ggml order (dims[0] the row length).
  void AddTensor(const std::string& name, GgmlType type, const std::vector<int64_t>& dims,
                 std::string data);

  // The whole file.
  std::string Serialize() const;
  // Writes the file atomically (a temporary beside it, then rename).
  absl::Status Write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> dims;
    std::string data;
  };
  uint64_t n_kv_ = 0;
  std::string kv_;  // Serialized metadata entries.
  std::vector<Tensor> tensors_;
};

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_GGUF_WRITER_H_
