// The embedded multi-round chat workload (`make demo`'s default): per round,
// per token and per layer, the post-RoPE q/k/v an engine would send to
// kvtier-worker, generated on the fly from a seed (no file, no model).
//
// Its round structure is the one the Round Attention analysis of real chats
// reports, and every property is a named option:
//  - Each round r has a topic: one random direction T[r][h] per KV head
//    (norm sqrt(d)). Every key of the round is T[r][h] plus Gaussian noise
//    (`key_noise` per channel), at every layer. Values are a per-round mean
//    plus unit noise.
//  - Each question refers to a few earlier rounds: 1 to `max_refs` of them,
//    drawn without replacement; the previous round is among them with
//    probability `recent_ref_probability` (follow-ups are the common case),
//    the rest uniformly from older rounds. Reference weights are U(0.6, 1).
//    Answer tokens keep their question's references.
//  - From layer `topic_layer` up, every query points at the weighted sum of
//    the referenced rounds' topics and its own round's topic, scaled by
//    `topic_strength`: the round-attention distribution is the same at every
//    one of these layers. Below it, the query is a mix g * topical + (1 - g) *
//    a fresh random direction, g rising linearly from 0 at layer 0: lower
//    layers spread their attention over every round, as real ones do
//    (Round Attention's watershed).
// Query heads of one KV head share the direction, each with its own scale
// in [0.75, 1.25] x topic_strength.
#ifndef KVTIER_TRACES_SYNTHETIC_CHAT_H_
#define KVTIER_TRACES_SYNTHETIC_CHAT_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace kvtier::traces {

struct SyntheticChatOptions {
  // Shape: a 32-layer GQA model (a Llama-7B depth) with narrow attention so
  // that the demo runs on a laptop CPU.
  int layers = 32;
  int q_heads = 8;
  int kv_heads = 2;
  int head_dim = 128;
  int rounds = 24;
  int question_tokens = 16;
  int answer_tokens = 16;
  int topic_layer = 7;
  int max_refs = 3;
  double recent_ref_probability = 0.5;
  float topic_strength = 1.2f;
  float key_noise = 0.5f;
  uint64_t seed = 1;
};

absl::Status ValidateSyntheticChat(const SyntheticChatOptions& o);

class SyntheticChat {
 public:
  // The options must pass ValidateSyntheticChat.
  explicit SyntheticChat(const SyntheticChatOptions& o);

  const SyntheticChatOptions& options() const { return o_; }
  int tokens_per_round() const { return o_.question_tokens + o_.answer_tokens; }
  // The earlier rounds round r's question refers to, ascending (empty for
  // round 0), and their weights.
  const std::vector<int>& References(int round) const { return refs_[round]; }
  const std::vector<float>& ReferenceWeights(int round) const { return weights_[round]; }

  // Token `token` of round `round` (question tokens first) at `layer`:
  // q [q_heads, d], k and v [kv_heads, d].
  void Token(int round, int token, int layer, float* q, float* k, float* v) const;

 private:
  SyntheticChatOptions o_;
  std::vector<float> topics_;      // [rounds, kv_heads, d], norm sqrt(d).
  std::vector<float> means_;       // [rounds, kv_heads, d].
  std::vector<float> directions_;  // [rounds, kv_heads, d]: unit topical query.
  std::vector<float> head_scale_;  // [q_heads].
  std::vector<std::vector<int>> refs_;
  std::vector<std::vector<float>> weights_;
};

}  // namespace kvtier::traces

#endif  // KVTIER_TRACES_SYNTHETIC_CHAT_H_
