// The architectures kvtier runs, read from a GGUF file's metadata: the one
// place that knows each architecture's keys and the defaults its reference
// implementations (llama.cpp, transformers) assume where the file is silent.
//
//   llama   every layer global; RoPE on adjacent pairs with base
//           {arch}.rope.freq_base (default 10,000); SiLU-gated FFN.
//   gemma3  every sixth layer global (layers 5, 11, 17, ...), the others
//           slide over {arch}.attention.sliding_window tokens (default 512);
//           global layers use {arch}.rope.freq_base (default 1,000,000),
//           sliding ones base 10,000; RoPE on half-split pairs; QK-norm,
//           post-attention and post-FFN norms, GeGLU (tanh GELU), embedding
//           scaled by sqrt(dim), output tied to the embedding; the norm
//           weights are stored with Gemma's "1 +" already added.
//
// A file whose metadata asks for something this code does not apply (RoPE
// scaling, a logit soft-cap, partial RoPE, value heads wider or narrower
// than key heads) is refused with INVALID_ARGUMENT naming the key.
#ifndef KVTIER_MODEL_ARCHITECTURE_H_
#define KVTIER_MODEL_ARCHITECTURE_H_

#include "absl/status/statusor.h"
#include "model/config.h"
#include "model/gguf.h"

namespace kvtier::model {

absl::StatusOr<ModelConfig> ConfigFromGguf(const GgufFile& f);

// Gemma 3's layer pattern: layer l is global when (l + 1) % 6 == 0.
constexpr int kGemma3GlobalEvery = 6;
constexpr float kGemma3LocalRopeBase = 10000.0f;
constexpr int kGemma3DefaultWindow = 512;

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_ARCHITECTURE_H_
