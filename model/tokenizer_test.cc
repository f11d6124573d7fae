#include "model/tokenizer.h"

#include <cstdio>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "tests/util/status_matchers.h"

namespace kvtier::model {
namespace {

using ::kvtier::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A small SentencePiece-style vocabulary: <unk>, <s>, </s>, a user-defined
// "\n\n", the 256 byte pieces (ids 4..259), then scored pieces.
struct Vocab {
  std::vector<std::string> pieces = {"<unk>", "<s>", "</s>", "\n\n"};
  std::vector<float> scores = {0, 0, 0, 0};
  std::vector<int32_t> types = {2, 3, 3, 4};
  Vocab() {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      pieces.push_back(name);
      scores.push_back(0);
      types.push_back(6);
    }
    for (auto [p, s] : std::vector<std::pair<std::string, float>>{{"\xE2\x96\x81", -1.0f},
                                                                  {"a", -2.0f},
                                                                  {"b", -2.0f},
                                                                  {"\xE2\x96\x81"
                                                                   "a",
                                                                   -1.5f},
                                                                  {"ab", -0.5f},
                                                                  {"\xE2\x96\x81"
                                                                   "ab",
                                                                   -0.1f}}) {
      pieces.push_back(p);
      scores.push_back(s);
      types.push_back(1);
    }
  }
  int id(const std::string& p) const {
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (pieces[i] == p) return static_cast<int>(i);
    }
    return -1;
  }
  std::string File(bool space_prefix) const {
    GgufWriter w;
    w.AddString("tokenizer.ggml.model", "llama");
    w.AddStrings("tokenizer.ggml.tokens", pieces);
    w.AddF32s("tokenizer.ggml.scores", scores);
    w.AddI32s("tokenizer.ggml.token_type", types);
    w.AddU32("tokenizer.ggml.bos_token_id", 1);
    w.AddU32("tokenizer.ggml.eos_token_id", 2);
    w.AddU32("tokenizer.ggml.unknown_token_id", 0);
    w.AddBool("tokenizer.ggml.add_space_prefix", space_prefix);
    return w.Serialize();
  }
};

std::unique_ptr<Tokenizer> Make(const std::string& bytes) {
  auto f = GgufFile::Parse({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, "v");
  EXPECT_TRUE(f.ok()) << f.status();
  auto t = Tokenizer::FromGguf(**f);
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

TEST(TokenizerTest, MergesByScoreLeftmostFirst) {
  Vocab v;
  const std::string file = v.File(false);
  auto t = Make(file);
  const int ab = v.id("ab"), sp_ab = v.id(
                                 "\xE2\x96\x81"
                                 "ab");
  // a b ▁ a b: "ab" (-0.5) merges at 0, then at 3; then "▁ab" (-0.1).
  EXPECT_THAT(t->Encode("ab ab", false), ElementsAre(ab, sp_ab));
  EXPECT_THAT(t->Encode("ab ab", true), ElementsAre(1, ab, sp_ab));
  EXPECT_EQ(t->Decode(t->Encode("ab ab", true)), "ab ab");
  // With add_space_prefix the text opens with a space piece.
  auto tp = Make(v.File(true));
  EXPECT_THAT(tp->Encode("ab", false), ElementsAre(sp_ab));
}

TEST(TokenizerTest, BytesUserDefinedAndControlPieces) {
  Vocab v;
  auto t = Make(v.File(false));
  // "é" has no piece: its two UTF-8 bytes.
  EXPECT_THAT(t->Encode("\xC3\xA9", false), ElementsAre(4 + 0xC3, 4 + 0xA9));
  EXPECT_EQ(t->Decode(t->Encode("\xC3\xA9", false)), "\xC3\xA9");
  // The user-defined "\n\n" is split out before the merges.
  EXPECT_THAT(t->Encode("ab\n\nab", false), ElementsAre(v.id("ab"), 3, v.id("ab")));
  // Control pieces written in the text are text, unless parsed as special.
  EXPECT_THAT(t->Encode("<s>", false), ElementsAre(4 + '<', 4 + 's', 4 + '>'));
  EXPECT_THAT(t->Encode("<s>ab", false, true), ElementsAre(1, v.id("ab")));
  EXPECT_EQ(t->Decode(1), "");
  EXPECT_EQ(t->Decode(1, true), "<s>");
  EXPECT_EQ(t->Find("ab"), v.id("ab"));
  EXPECT_EQ(t->Find("zz"), -1);
}

TEST(TokenizerTest, RefusesOtherModelsAndBadArrays) {
  GgufWriter w;
  w.AddString("tokenizer.ggml.model", "gpt2");
  w.AddStrings("tokenizer.ggml.tokens", {"a"});
  const std::string bytes = w.Serialize();
  auto f = GgufFile::Parse({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, "v");
  ASSERT_TRUE(f.ok());
  EXPECT_THAT(Tokenizer::FromGguf(**f),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gpt2 is not supported")));
  GgufWriter x;
  x.AddString("tokenizer.ggml.model", "llama");
  x.AddStrings("tokenizer.ggml.tokens", {"a", "b"});
  x.AddF32s("tokenizer.ggml.scores", {0});
  x.AddI32s("tokenizer.ggml.token_type", {1, 1});
  const std::string xb = x.Serialize();
  auto g = GgufFile::Parse({reinterpret_cast<const uint8_t*>(xb.data()), xb.size()}, "v");
  ASSERT_TRUE(g.ok());
  EXPECT_THAT(Tokenizer::FromGguf(**g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 pieces, 1 scores")));
}

}  // namespace
}  // namespace kvtier::model
