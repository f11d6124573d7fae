// Files a user hands to kvtier tools: the conversations file of a replay
// (refengine/replay.h, JSON Lines of token ids) and the InfiniGen skew
// file (kernels/speculation.h). Whatever parses must obey the format's
// rules and survive a round trip.
//
// Input: the first byte picks the parser, the rest is the file.
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "kernels/speculation.h"
#include "refengine/replay.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    auto cs = kvtier::refengine::ParseConversations(text, "fuzz.jsonl");
    if (!cs.ok()) return 0;
    for (const auto& c : *cs) {
      if (c.rounds.empty() || c.id.empty()) __builtin_trap();
      for (const auto& r : c.rounds) {
        if (r.user.empty() || r.assistant.empty()) __builtin_trap();
        for (const auto& [b, e] : r.score) {
          if (b < 0 || b >= e || e > static_cast<int>(r.assistant.size())) __builtin_trap();
        }
      }
    }
    auto again = kvtier::refengine::ParseConversations(kvtier::refengine::ToJsonl(*cs), "again");
    if (!again.ok() || again->size() != cs->size()) __builtin_trap();
    for (size_t i = 0; i < cs->size(); ++i) {
      if ((*again)[i].id != (*cs)[i].id || (*again)[i].tokens() != (*cs)[i].tokens()) {
        __builtin_trap();
      }
    }
  } else {
    auto m = kvtier::spec::ParseSkew(text);
    if (!m.ok()) return 0;
    if (m->heads.size() != static_cast<size_t>(m->layers)) __builtin_trap();
    for (const auto& layer : m->heads) {
      for (const auto& h : layer) {
        if (h.a.size() != static_cast<size_t>(m->head_dim) * m->head_dim) __builtin_trap();
        for (int32_t c : h.partial) {
          if (c < 0 || c >= m->head_dim) __builtin_trap();
        }
      }
    }
    if (kvtier::spec::SerializeSkew(*m) != text) __builtin_trap();
  }
  return 0;
}

namespace kvtier::fuzz {

std::vector<std::string> Seeds() {
  std::vector<std::string> seeds = {
      std::string("\0", 1) +
          R"({"id": "a", "rounds": [{"user": [1, 2, 3], "assistant": [4, 5], "score": [[0, 2]]}]})"
          "\n\n"
          R"({"rounds": [{"user": [7], "assistant": [8]}, {"user": [9], "assistant": [1, 2]}]})",
      std::string("\0", 1) + R"({"rounds": [{"user": [1.5], "assistant": "x"}]})",
  };
  kvtier::spec::SkewModel m;
  m.model = "seed";
  m.layers = 2;
  m.q_heads = 2;
  m.kv_heads = 1;
  m.head_dim = 4;
  m.partial_ratio = 0.5;
  m.calibration_tokens = 10;
  for (int l = 0; l < 2; ++l) {
    kvtier::spec::SkewHead h;
    h.a = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1};
    h.partial = {0, 2};
    m.heads.push_back({h});
  }
  seeds.push_back("\x01" + kvtier::spec::SerializeSkew(m));
  return seeds;
}

}  // namespace kvtier::fuzz
