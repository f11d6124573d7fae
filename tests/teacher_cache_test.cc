// refengine/teacher_cache.h: entries round-trip bit for bit, are found only
// by the same identity, script and options, are never partial, and a damaged
// or mismatched file is an error that names it.
#include "refengine/teacher_cache.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"

namespace kvtier {
namespace {

using ::kvtier::testing::StatusIs;
using refengine::ScriptOptions;
using refengine::ScriptRound;
using refengine::TeacherCache;
using ::testing::HasSubstr;

constexpr int kVocab = 7;

std::vector<ScriptRound> Script() { return {{{1, 2, 3}, {4, 5}}, {{6}, {7, 8, 9}}}; }

std::vector<float> Logits(int round, size_t positions) {
  std::vector<float> out(positions * kVocab);
  for (size_t i = 0; i < out.size(); ++i) out[i] = 0.25f * static_cast<float>(i) - round + 1e-7f;
  return out;
}

// Writes the whole entry for Script().
void WriteEntry(const TeacherCache& cache, const ScriptOptions& o, double ms) {
  KVT_ASSERT_OK_AND_ASSIGN(TeacherCache::Writer w, cache.Create(Script(), o, kVocab));
  KVT_ASSERT_OK(w.Append(0, Logits(0, 2)));
  KVT_ASSERT_OK(w.Append(1, Logits(1, 3)));
  KVT_ASSERT_OK(w.Commit(ms));
}

TEST(TeacherCacheTest, RoundTripsEveryRoundBitForBit) {
  testing::TempDir dir;
  KVT_ASSERT_OK_AND_ASSIGN(TeacherCache cache,
                           TeacherCache::Open(dir.path() + "/teachers", "model 1 2"));
  KVT_ASSERT_OK_AND_ASSIGN(auto none, cache.Find(Script(), {}, kVocab));
  EXPECT_FALSE(none.has_value());
  WriteEntry(cache, {}, 3.5);
  KVT_ASSERT_OK_AND_ASSIGN(auto found, cache.Find(Script(), {}, kVocab));
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->decode_ms_per_token(), 3.5);
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> r0, found->Round(0));
  EXPECT_EQ(r0, Logits(0, 2));
  EXPECT_THAT(found->Round(0).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> r1, found->Round(1));
  EXPECT_EQ(r1, Logits(1, 3));
  // Only the entry is left in the directory: no temporary file.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path() + "/teachers")) {
    EXPECT_EQ(e.path().extension(), ".teacher");
    ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST(TeacherCacheTest, FoundOnlyByTheSameIdentityScriptAndOptions) {
  testing::TempDir dir;
  KVT_ASSERT_OK_AND_ASSIGN(TeacherCache cache, TeacherCache::Open(dir.path(), "model 1 2"));
  WriteEntry(cache, {}, 1);
  KVT_ASSERT_OK_AND_ASSIGN(TeacherCache other, TeacherCache::Open(dir.path(), "model 1 3"));
  KVT_ASSERT_OK_AND_ASSIGN(auto a, other.Find(Script(), {}, kVocab));
  EXPECT_FALSE(a.has_value());
  KVT_ASSERT_OK_AND_ASSIGN(auto b, cache.Find(Script(), {.answer_prefill = true}, kVocab));
  EXPECT_FALSE(b.has_value());
  std::vector<ScriptRound> s = Script();
  s[1].user[0] = 5;
  KVT_ASSERT_OK_AND_ASSIGN(auto c, cache.Find(s, {}, kVocab));
  EXPECT_FALSE(c.has_value());
  // The same tokens split differently between question and answer.
  s = Script();
  s[0].user.push_back(s[0].assistant[0]);
  s[0].assistant.erase(s[0].assistant.begin());
  KVT_ASSERT_OK_AND_ASSIGN(auto d, cache.Find(s, {}, kVocab));
  EXPECT_FALSE(d.has_value());
  // The same script over another vocabulary is the same file, refused.
  EXPECT_THAT(cache.Find(Script(), {}, kVocab + 1).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("asked for 2 over 8")));
}

TEST(TeacherCacheTest, AnUncommittedWriterLeavesNothing) {
  testing::TempDir dir;
  KVT_ASSERT_OK_AND_ASSIGN(TeacherCache cache, TeacherCache::Open(dir.path(), "id"));
  {
    KVT_ASSERT_OK_AND_ASSIGN(TeacherCache::Writer w, cache.Create(Script(), {}, kVocab));
    KVT_ASSERT_OK(w.Append(0, Logits(0, 2)));
    EXPECT_THAT(w.Commit(1), StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(w.Append(1, Logits(1, 2)), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(w.Append(2, Logits(1, 3)), StatusIs(absl::StatusCode::kInvalidArgument));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  KVT_ASSERT_OK_AND_ASSIGN(auto none, cache.Find(Script(), {}, kVocab));
  EXPECT_FALSE(none.has_value());
}

TEST(TeacherCacheTest, DamagedFilesAreErrorsThatNameThem) {
  testing::TempDir dir;
  KVT_ASSERT_OK_AND_ASSIGN(TeacherCache cache, TeacherCache::Open(dir.path(), "id"));
  WriteEntry(cache, {}, 1);
  const std::string path = cache.PathOf(Script(), {});
  const auto size = std::filesystem::file_size(path);
  std::string bytes(size, '\0');
  {
    std::ifstream in(path, std::ios::binary);
    in.read(bytes.data(), static_cast<std::streamsize>(size));
  }
  auto rewrite = [&](const std::string& b) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(b.data(), static_cast<std::streamsize>(b.size()));
  };
  // A flipped bit in the second round's logits: its CRC fails.
  std::string flipped = bytes;
  flipped[size - 16 - 4 - 4] ^= 0x10;
  rewrite(flipped);
  KVT_ASSERT_OK_AND_ASSIGN(auto f, cache.Find(Script(), {}, kVocab));
  ASSERT_TRUE(f.has_value());
  KVT_EXPECT_OK(f->Round(0).status());
  EXPECT_THAT(f->Round(1).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path + ": round 1 fails its CRC")));
  // Without its end mark.
  rewrite(bytes.substr(0, size - 1));
  EXPECT_THAT(cache.Find(Script(), {}, kVocab).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("no end mark")));
  // Another file under the entry's name.
  rewrite("not logits");
  EXPECT_THAT(cache.Find(Script(), {}, kVocab).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not a teacher cache file")));
}

TEST(TeacherCacheTest, OpenNamesADirectoryItCannotMake) {
  testing::TempDir dir;
  testing::WriteFile(dir.path() + "/file", "x");
  EXPECT_THAT(TeacherCache::Open(dir.path() + "/file/sub", "id").status(),
              StatusIs(absl::StatusCode::kInternal, HasSubstr(dir.path() + "/file/sub")));
}

}  // namespace
}  // namespace kvtier
