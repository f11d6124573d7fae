// K/V traces for measuring codecs and eviction on realistic data:
//  - captured from a llama2.c model (real attention, e.g. stories260K),
//  - synthetic-realistic (documented, tunable properties; see
//    SyntheticOptions), and
//  - imported from .npy / .safetensors dumps of any model
//    (scripts/export_kv_dump.py writes them from a Hugging Face model).
#ifndef KVTIER_TRACES_TRACE_H_
#define KVTIER_TRACES_TRACE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/forward.h"

namespace kvtier::traces {

struct KvTrace {
  std::string name;
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int64_t tokens = 0;       // Cached tokens.
  int64_t queries = 0;      // Decode queries per head; each attends over all cached tokens.
  std::vector<float> k, v;  // [layers, kv_heads, tokens, head_dim]
  std::vector<float> q;     // [layers, q_heads, queries, head_dim]; may be empty (imports).
  // Optional: every cached position's own query, [layers, q_heads, tokens,
  // head_dim] (model traces; synthetic ones with token_queries). Eviction
  // scoring reads it (SnapKV the last w rows, H2O all).
  std::vector<float> q_tokens;
  // Synthetic traces: the first token of each round, and the earlier rounds
  // the final question attends to.
  std::vector<int64_t> round_begin;
  std::vector<int> focus_rounds;
  // Model traces: the token ids (cached tokens, then the query tokens).
  std::vector<int> token_ids;

  const float* K(int layer, int head) const {
    return k.data() + Offset(layer, head, kv_heads, tokens);
  }
  const float* V(int layer, int head) const {
    return v.data() + Offset(layer, head, kv_heads, tokens);
  }
  const float* Q(int layer, int head) const {
    return q.data() + Offset(layer, head, q_heads, queries);
  }
  const float* QT(int layer, int head) const {
    return q_tokens.data() + Offset(layer, head, q_heads, tokens);
  }

 private:
  int64_t Offset(int layer, int head, int heads, int64_t n) const {
    return ((static_cast<int64_t>(layer) * heads + head) * n) * head_dim;
  }
};

// Runs `tokens` through the model with full-precision attention and keeps the
// first tokens.size() - n_queries positions' K/V and the last n_queries
// positions' queries (the next decode steps' real queries).
absl::StatusOr<KvTrace> CaptureModelTrace(const model::Model& m, const std::vector<int>& tokens,
                                          int n_queries, const std::string& name);

// The synthetic-realistic generator. Each property is one that published
// KV-cache analyses report, and each is tunable:
//  - outlier channels in K: `outlier_channels` fixed channels per head whose
//    keys sit near +-outlier_magnitude (KIVI, KVQuant);
//  - attention sinks: the first `sink_tokens` keys share a direction every
//    query leans towards (StreamingLLM);
//  - heads of very different concentration: each query head scales its query
//    by a factor spread log-uniformly over [min_concentration,
//    max_concentration], from near-uniform to near-one-hot heads (Ada-KV);
//  - multi-round structure: `rounds` rounds of `tokens_per_round` tokens, each
//    with its own topic direction in K and mean in V; the final question's
//    queries point at `focus_rounds` earlier rounds plus the last one (Round
//    Attention).
struct SyntheticOptions {
  int layers = 2;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int rounds = 8;
  int tokens_per_round = 256;
  int queries = 16;
  int outlier_channels = 4;
  float outlier_magnitude = 12.0f;
  int sink_tokens = 4;
  float sink_strength = 5.0f;
  float topic_strength = 2.5f;
  float min_concentration = 0.3f;
  float max_concentration = 6.0f;
  // Spread the concentrations over KV heads instead of query heads: the
  // query heads of one GQA group share one factor, so whole KV heads differ
  // (the Ada-KV premise at KV-head granularity).
  bool group_concentration = false;
  int focus_rounds = 2;
  // Also generate every token's own query (q_tokens): tokens of round r look
  // at round r's topic and the sinks; the final round's look where the
  // question's decode queries do.
  bool token_queries = false;
  uint64_t seed = 1;
};
absl::StatusOr<KvTrace> MakeSyntheticTrace(const SyntheticOptions& o);

// Loads a dump: a directory holding k.npy, v.npy and optionally q.npy, or a
// .safetensors file with tensors "k", "v" and optionally "q". K/V shapes are
// [layers, kv_heads, tokens, head_dim] (or without layers); Q is
// [layers, q_heads, queries, head_dim]. fp32, fp16, bf16 or fp64, C order.
absl::StatusOr<KvTrace> LoadTraceDump(const std::string& path);

// Writes a trace as a .safetensors file LoadTraceDump reads back.
absl::Status SaveSafetensors(const KvTrace& t, const std::string& path);

}  // namespace kvtier::traces

#endif  // KVTIER_TRACES_TRACE_H_
