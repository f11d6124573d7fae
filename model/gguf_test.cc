#include "model/gguf.h"

#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf_writer.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"

namespace kvtier::model {
namespace {

using ::kvtier::testing::StatusIs;
using ::testing::HasSubstr;

std::string F32Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

std::string SmallFile() {
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddU32("llama.block_count", 2);
  w.AddF32("llama.rope.freq_base", 10000.0f);
  w.AddBool("flag", true);
  w.AddStrings("tokenizer.ggml.tokens", {"<unk>", "a", "b"});
  w.AddF32s("tokenizer.ggml.scores", {0.0f, -1.5f, -2.5f});
  w.AddI32s("tokenizer.ggml.token_type", {2, 1, 1});
  w.AddTensor("t0", GgmlType::kF32, {4, 2}, F32Bytes({1, 2, 3, 4, 5, 6, 7, 8}));
  std::string q8(34, '\0');
  q8[0] = 0x00;
  q8[1] = 0x3c;  // fp16 1.0
  for (int i = 0; i < 32; ++i) q8[2 + i] = static_cast<char>(i - 16);
  w.AddTensor("t1", GgmlType::kQ8_0, {32}, q8);
  return w.Serialize();
}

absl::Span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

TEST(GgufTest, ReadsWhatTheWriterWrote) {
  const std::string bytes = SmallFile();
  KVT_ASSERT_OK_AND_ASSIGN(auto f, GgufFile::Parse(Bytes(bytes), "small"));
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->String("general.architecture").value(), "llama");
  EXPECT_EQ(f->Int("llama.block_count").value(), 2);
  EXPECT_EQ(f->Float("llama.rope.freq_base").value(), 10000.0);
  EXPECT_TRUE(f->Bool("flag").value());
  EXPECT_EQ(f->Strings("tokenizer.ggml.tokens").value()->at(2), "b");
  EXPECT_EQ(f->Numbers("tokenizer.ggml.scores").value()->at(1), -1.5);
  EXPECT_EQ(f->Numbers("tokenizer.ggml.token_type").value()->at(0), 2);
  EXPECT_THAT(f->Int("nope"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  EXPECT_THAT(f->Int("general.architecture"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not an integer")));
  KVT_ASSERT_OK_AND_ASSIGN(const GgufTensor* t0, f->Tensor("t0", {4, 2}));
  EXPECT_EQ(t0->rows(), 2);
  EXPECT_EQ((t0->data - reinterpret_cast<const uint8_t*>(bytes.data())) % 32, 0);
  std::vector<float> row(4);
  DequantizeRow(t0->type, t0->row(1), row.data(), 4);
  EXPECT_EQ(row, (std::vector<float>{5, 6, 7, 8}));
  EXPECT_THAT(f->Tensor("t0", {2, 4}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shape [4, 2]")));
  KVT_ASSERT_OK_AND_ASSIGN(const GgufTensor* t1, f->Tensor("t1", {32}));
  std::vector<float> q(32);
  DequantizeRow(t1->type, t1->data, q.data(), 32);
  EXPECT_EQ(q[0], -16.0f);
  EXPECT_EQ(q[31], 15.0f);
}

TEST(GgufTest, DigestFollowsTheTensorsNotTheMetadata) {
  const std::string a = SmallFile();
  KVT_ASSERT_OK_AND_ASSIGN(auto fa, GgufFile::Parse(Bytes(a), "a"));
  std::string b = a;
  KVT_ASSERT_OK_AND_ASSIGN(auto fb0, GgufFile::Parse(Bytes(b), "b"));
  EXPECT_EQ(fa->tensor_digest(), fb0->tensor_digest());
  const GgufTensor* t1 = fb0->tensor("t1");
  // Flip one bit of t1's last code byte.
  b[t1->data - reinterpret_cast<const uint8_t*>(b.data()) + 33] ^= 1;
  KVT_ASSERT_OK_AND_ASSIGN(auto fb, GgufFile::Parse(Bytes(b), "b"));
  EXPECT_NE(fa->tensor_digest(), fb->tensor_digest());
}

TEST(GgufTest, RefusesDamagedFilesWithAReason) {
  const std::string good = SmallFile();
  EXPECT_THAT(GgufFile::Parse(Bytes(good.substr(0, good.size() - 40)), "cut"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated?")));
  EXPECT_THAT(GgufFile::Parse(Bytes(good.substr(0, 30)), "short"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("short: not a valid GGUF")));
  std::string bad = good;
  bad[0] = 'X';
  EXPECT_THAT(GgufFile::Parse(Bytes(bad), "magic"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("wrong magic")));
  bad = good;
  bad[4] = 9;
  EXPECT_THAT(GgufFile::Parse(Bytes(bad), "v"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version 9")));
  // A huge tensor count cannot allocate: refused before reading entries.
  bad = good;
  const uint64_t huge = uint64_t{1} << 60;
  std::memcpy(&bad[8], &huge, 8);
  EXPECT_THAT(GgufFile::Parse(Bytes(bad), "count"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot fit")));
  // Cut anywhere before the last weight: never a crash, always an error.
  // (Only the last tensor's alignment padding may go.)
  KVT_ASSERT_OK_AND_ASSIGN(auto f, GgufFile::Parse(Bytes(good), "good"));
  const GgufTensor* last = f->tensor("t1");
  const size_t end = last->data + last->bytes - reinterpret_cast<const uint8_t*>(good.data());
  EXPECT_TRUE(GgufFile::Parse(Bytes(good.substr(0, end)), "unpadded").ok());
  for (size_t n = 0; n < end; ++n) {
    EXPECT_FALSE(GgufFile::Parse(Bytes(good.substr(0, n)), "cut").ok()) << n;
  }
}

TEST(GgufTest, RefusesUnsupportedTensorTypesByName) {
  GgufWriter w;
  w.AddTensor("blk.0.ffn_down.weight", static_cast<GgmlType>(16), {256}, std::string(66, '\0'));
  const std::string bytes = w.Serialize();
  EXPECT_THAT(GgufFile::Parse(Bytes(bytes), "iq"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blk.0.ffn_down.weight has type IQ2_XXS")));
}

TEST(GgufTest, OpensAFile) {
  kvtier::testing::TempDir dir;
  const std::string path = dir.path() + "/m.gguf";
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddTensor("x", GgmlType::kF32, {2}, F32Bytes({1, 2}));
  ASSERT_TRUE(w.Write(path).ok());
  KVT_ASSERT_OK_AND_ASSIGN(auto f, GgufFile::Open(path));
  EXPECT_EQ(f->tensors().size(), 1u);
  EXPECT_THAT(GgufFile::Open(dir.path() + "/none.gguf"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("none.gguf")));
}

}  // namespace
}  // namespace kvtier::model
