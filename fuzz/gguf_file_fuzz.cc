// GGUF files (model/gguf.h): what `--model` hands the engine and the tools.
// Parses the bytes; for every tensor that passes, dequantizes its first row
// both ways (model/quant.h) and traps if they disagree; reads the
// architecture (model/architecture.h) and the vocabulary, and tokenizes a
// text with it (every id inside the vocabulary, or a trap).
#include <cmath>
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "model/architecture.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<std::unique_ptr<kvtier::model::GgufFile>> f =
      kvtier::model::GgufFile::Parse({data, size}, "fuzz");
  if (!f.ok()) return 0;
  for (const kvtier::model::GgufTensor& t : (*f)->tensors()) {
    const int64_t n = std::min<int64_t>(t.row_length(), 1 << 12);
    const int64_t bw = kvtier::model::BlockWeights(t.type);
    const int64_t m = n / bw * bw;
    if (m == 0) continue;
    std::vector<float> got(m);
    std::vector<double> want(m);
    kvtier::model::DequantizeRow(t.type, t.data, got.data(), m);
    kvtier::model::DequantizeRowReference(t.type, t.data, want.data(), m);
    for (int64_t i = 0; i < m; ++i) {
      if (std::isfinite(want[i]) && std::abs(want[i]) < 1e30 &&
          std::abs(got[i] - want[i]) > 1e-5 * (1 + std::abs(want[i])) * 64) {
        __builtin_trap();
      }
    }
  }
  (void)kvtier::model::ConfigFromGguf(**f);
  auto tok = kvtier::model::Tokenizer::FromGguf(**f);
  if (tok.ok()) {
    for (bool special : {false, true}) {
      for (int id :
           (*tok)->Encode("User: h\xC3\xA9llo\n\n <s> w\xF0\x9F\x8E\x89rld", true, special)) {
        if (id < 0 || id >= (*tok)->size()) __builtin_trap();
        (void)(*tok)->Decode(id, special);
      }
    }
  }
  return 0;
}

namespace kvtier::fuzz {

std::vector<std::string> Seeds() {
  using kvtier::model::GgmlType;
  kvtier::model::GgufWriter w;
  w.AddString("general.architecture", "gemma3");
  w.AddU32("gemma3.block_count", 1);
  w.AddF32("gemma3.rope.freq_base", 1e6f);
  w.AddString("tokenizer.ggml.model", "llama");
  w.AddStrings("tokenizer.ggml.tokens", {"<pad>", "<eos>", "<bos>", "<unk>", "a", "\n\n",
                                         "\xE2\x96\x81"
                                         "a"});
  w.AddF32s("tokenizer.ggml.scores", {0, 0, 0, 0, -1, 0, -0.5f});
  w.AddI32s("tokenizer.ggml.token_type", {3, 3, 3, 2, 1, 4, 1});
  w.AddU32("tokenizer.ggml.unknown_token_id", 3);
  w.AddU32("tokenizer.ggml.bos_token_id", 2);
  std::vector<std::string> seeds;
  const GgmlType types[] = {GgmlType::kF32,  GgmlType::kQ8_0, GgmlType::kQ4_K,
                            GgmlType::kQ6_K, GgmlType::kQ5_0, GgmlType::kBF16};
  for (GgmlType t : types) {
    kvtier::model::GgufWriter one = w;
    const int64_t n = 256;
    std::string bytes(static_cast<size_t>(kvtier::model::RowBytes(t, n) * 2), '\x11');
    one.AddTensor("blk.0.attn_q.weight", t, {n, 2}, bytes);
    seeds.push_back(one.Serialize());
  }
  return seeds;
}

}  // namespace kvtier::fuzz
