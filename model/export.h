// A Model written back as a GGUF file (float32 tensors, ggml's names): how
// stories260K's llama2.c checkpoint becomes traces/stories260k.gguf, so that
// both of the project's models load through one path, and how tests build
// small models of another architecture from it. The vocabulary is not
// written: the files it makes run on token ids.
#ifndef KVTIER_MODEL_EXPORT_H_
#define KVTIER_MODEL_EXPORT_H_

#include <string>

#include "absl/status/status.h"
#include "model/model.h"

namespace kvtier::model {

struct ExportOptions {
  // "llama" writes the model as it is. "gemma3" writes a gemma3-shaped
  // model from the same weights (the norms it lacks set to 1): a different
  // model, with sliding windows, for tests of the tier's shape.
  std::string arch = "llama";
  std::string name;             // general.name; default: the file's stem.
  int gemma3_window = 0;        // gemma3.attention.sliding_window (0: default).
  int gemma3_global_every = 0;  // gemma3.attention.sliding_window_pattern (0: default).
};

// Writes `m` to `path` (atomically). INVALID_ARGUMENT for an unknown arch.
absl::Status ExportGguf(const Model& m, const ExportOptions& o, const std::string& path);

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_EXPORT_H_
