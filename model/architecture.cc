#include "model/architecture.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvtier::model {
namespace {

absl::StatusOr<int> IntIn(const GgufFile& f, const std::string& key, int lo, int hi) {
  KVT_ASSIGN_OR_RETURN(int64_t v, f.Int(key));
  if (v < lo || v > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(), ": ", key, " = ", v, " is outside [", lo, ", ", hi, "]"));
  }
  return static_cast<int>(v);
}

absl::StatusOr<int> IntOr(const GgufFile& f, const std::string& key, int lo, int hi, int dflt) {
  if (!f.Has(key)) return dflt;
  return IntIn(f, key, lo, hi);
}

absl::StatusOr<double> FloatOr(const GgufFile& f, const std::string& key, double dflt) {
  if (!f.Has(key)) return dflt;
  return f.Float(key);
}

absl::Status Unsupported(const GgufFile& f, const std::string& key, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat(f.name(), ": ", key, " ", why, "; kvtier does not apply it"));
}

}  // namespace

const char* ArchName(Arch a) { return a == Arch::kGemma3 ? "gemma3" : "llama"; }

absl::StatusOr<ModelConfig> ConfigFromGguf(const GgufFile& f) {
  KVT_ASSIGN_OR_RETURN(std::string arch, f.String("general.architecture"));
  ModelConfig c;
  if (arch == "llama") {
    c.arch = Arch::kLlama;
  } else if (arch == "gemma3") {
    c.arch = Arch::kGemma3;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        f.name(), ": architecture ", arch, " is not supported (kvtier runs llama and gemma3)"));
  }
  const std::string p = arch + ".";
  KVT_ASSIGN_OR_RETURN(c.n_layers, IntIn(f, p + "block_count", 1, 1024));
  KVT_ASSIGN_OR_RETURN(c.dim, IntIn(f, p + "embedding_length", 2, 1 << 16));
  KVT_ASSIGN_OR_RETURN(c.hidden_dim, IntIn(f, p + "feed_forward_length", 1, 1 << 18));
  KVT_ASSIGN_OR_RETURN(c.n_heads, IntIn(f, p + "attention.head_count", 1, 1024));
  KVT_ASSIGN_OR_RETURN(c.n_kv_heads,
                       IntOr(f, p + "attention.head_count_kv", 1, c.n_heads, c.n_heads));
  if (c.n_heads % c.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(f.name(), ": ", c.n_heads,
                                                   " query heads are not a multiple of ",
                                                   c.n_kv_heads, " key/value heads"));
  }
  KVT_ASSIGN_OR_RETURN(c.key_length,
                       IntOr(f, p + "attention.key_length", 2, 4096, c.dim / c.n_heads));
  KVT_ASSIGN_OR_RETURN(int value_length,
                       IntOr(f, p + "attention.value_length", 2, 4096, c.key_length));
  if (value_length != c.key_length) {
    return Unsupported(
        f, p + "attention.value_length",
        absl::StrCat("(", value_length, ") differs from the key length ", c.key_length));
  }
  if (c.key_length % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(f.name(), ": odd key length ", c.key_length));
  }
  KVT_ASSIGN_OR_RETURN(c.seq_len, IntIn(f, p + "context_length", 1, 1 << 24));
  KVT_ASSIGN_OR_RETURN(double eps, FloatOr(f, p + "attention.layer_norm_rms_epsilon", 1e-5));
  if (!(eps > 0 && eps < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        f.name(), ": ", p, "attention.layer_norm_rms_epsilon = ", eps, " is outside (0, 1)"));
  }
  c.rms_eps = static_cast<float>(eps);
  KVT_ASSIGN_OR_RETURN(double base,
                       FloatOr(f, p + "rope.freq_base", c.arch == Arch::kGemma3 ? 1e6 : 1e4));
  if (!(base > 1 && base < 1e30)) {
    return Unsupported(f, p + "rope.freq_base", absl::StrCat("= ", base));
  }
  c.rope_theta = static_cast<float>(base);
  KVT_ASSIGN_OR_RETURN(int rope_dims, IntOr(f, p + "rope.dimension_count", 1, 4096, c.key_length));
  if (rope_dims != c.key_length) {
    return Unsupported(
        f, p + "rope.dimension_count",
        absl::StrCat("= ", rope_dims, " (partial RoPE over a key length of ", c.key_length, ")"));
  }
  // RoPE scaling: a factor other than 1 changes the positions' angles.
  if (f.Has(p + "rope.scaling.factor")) {
    KVT_ASSIGN_OR_RETURN(double factor, f.Float(p + "rope.scaling.factor"));
    if (factor != 1.0) {
      return Unsupported(f, p + "rope.scaling.factor",
                         absl::StrCat("= ", factor, " asks for RoPE scaling"));
    }
  }
  if (f.Has(p + "rope.scaling.type")) {
    KVT_ASSIGN_OR_RETURN(std::string type, f.String(p + "rope.scaling.type"));
    if (type != "none" && type != "linear") {
      return Unsupported(f, p + "rope.scaling.type", absl::StrCat("= ", type));
    }
  }
  for (const char* k : {"final_logit_softcapping", "attn_logit_softcapping"}) {
    if (f.Has(p + k)) return Unsupported(f, p + k, "asks for a logit soft-cap");
  }
  c.shared_classifier = f.tensor("output.weight") == nullptr;
  const GgufTensor* embed = f.tensor("token_embd.weight");
  if (embed == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(f.name(), ": no tensor token_embd.weight"));
  }
  if (embed->dims.size() != 2 || embed->dims[0] != c.dim || embed->dims[1] > (1 << 22)) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(), ": token_embd.weight is not [", c.dim, ", vocabulary]"));
  }
  c.vocab_size = static_cast<int>(embed->dims[1]);
  if (c.arch == Arch::kGemma3) {
    KVT_ASSIGN_OR_RETURN(
        int window, IntOr(f, p + "attention.sliding_window", 1, 1 << 24, kGemma3DefaultWindow));
    KVT_ASSIGN_OR_RETURN(
        int every, IntOr(f, p + "attention.sliding_window_pattern", 1, 1024, kGemma3GlobalEvery));
    c.window.resize(c.n_layers);
    c.layer_rope_theta.resize(c.n_layers);
    for (int l = 0; l < c.n_layers; ++l) {
      const bool global = (l + 1) % every == 0;
      c.window[l] = global ? 0 : window;
      c.layer_rope_theta[l] = global ? c.rope_theta : kGemma3LocalRopeBase;
    }
  }
  c.digest = f.tensor_digest();
  return c;
}

}  // namespace kvtier::model
