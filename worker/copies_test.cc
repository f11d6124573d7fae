// Counts what EndRound allocates on its way from the open round to the store:
// with each tensor encoded straight into its segment buffer, the bytes it
// allocates are the stored bytes plus small bookkeeping, not a second copy of
// the round (the test fails if an intermediate EncodedTensor, or any other
// full copy of the encoded round, comes back).
#include <atomic>
#include <cstdlib>
#include <new>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/status_matchers.h"
#include "worker/engine.h"
#include "worker/segment_store.h"

namespace {

// Bytes allocated with operator new on a thread while it counts.
thread_local bool counting = false;
thread_local uint64_t counted_bytes = 0;

void* Allocate(std::size_t n) {
  if (counting) counted_bytes += n;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}

}  // namespace

// ASan brings its own operator new; the test skips itself there.
#if !defined(__SANITIZE_ADDRESS__)
void* operator new(std::size_t n) { return Allocate(n); }
void* operator new[](std::size_t n) { return Allocate(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#endif

namespace kvtier::worker {
namespace {

using ::kvtier::testing::IsOk;

// A store that keeps nothing: Put records the payload's size and copies no
// byte, so every byte counted during EndRound is the worker's own.
class SizeOnlyStore : public SegmentStore {
 public:
  absl::Status Put(const std::string&, const Segment&, uint32_t, uint32_t, std::string_view payload,
                   const CallOptions&) override {
    put_bytes += payload.size();
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> Get(const std::string&, const std::vector<Segment>&,
                                               const CallOptions&) override {
    return absl::NotFoundError("keeps nothing");
  }
  absl::Status Delete(const std::string&, const CallOptions&) override { return absl::OkStatus(); }
  absl::Status DropRound(const std::string&, uint32_t, const CallOptions&) override {
    return absl::OkStatus();
  }
  absl::Status DropSegments(const std::string&, const std::vector<Segment>&,
                            const CallOptions&) override {
    return absl::OkStatus();
  }
  absl::Status RecordRecalls(const std::string&, const std::vector<uint32_t>&,
                             const CallOptions&) override {
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<StoredRound>> List(const std::string&, const CallOptions&) override {
    return absl::NotFoundError("keeps nothing");
  }
  uint64_t put_bytes = 0;
};

// Without eviction: SnapKV's scores and GEAR's factorization allocate
// working memory of the round's order of size that is not a copy of it.
struct Case {
  const char* codec;
  const char* eviction;  // "" for none.
};

class EndRoundCopiesTest : public ::testing::TestWithParam<Case> {};

TEST_P(EndRoundCopiesTest, AllocatesTheStoredBytesOnce) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "ASan replaces operator new; the count runs in the default build";
#endif
  // One big head per layer, so that a second copy of the round would be
  // megabytes while bookkeeping stays kilobytes.
  const ModelShape shape{8, 4, 2, 128, DType::kFp16};
  const int64_t tokens = 1024;
  SizeOnlyStore store;
  EngineOptions options;
  options.placement = EngineOptions::Placement::kHost;
  Engine engine(&store, options);
  SessionPolicy policy;
  auto codec = ParseCodecSetting(GetParam().codec);
  ASSERT_THAT(codec.status(), IsOk());
  policy.codec = *codec;
  if (*GetParam().eviction != '\0') {
    auto ev = evict::ParsePolicy(GetParam().eviction);
    ASSERT_THAT(ev.status(), IsOk());
    policy.eviction = *ev;
  }
  ASSERT_THAT(engine.OpenSession("s", shape, policy), IsOk());
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const int d = shape.head_dim;
  std::vector<float> q(tokens * shape.q_heads * d), k(tokens * shape.kv_heads * d),
      v(tokens * shape.kv_heads * d), out(q.size());
  for (int l = 0; l < shape.layers; ++l) {
    for (float& x : q) x = nd(rng);
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    auto r = engine.PrefillLayer("s", l, tokens, 16, q.data(), k.data(), v.data(), out.data());
    ASSERT_THAT(r.status(), IsOk());
  }
  counted_bytes = 0;
  counting = true;
  auto report = engine.EndRound("s");
  counting = false;
  ASSERT_THAT(report.status(), IsOk());
  ASSERT_EQ(report->stored_bytes, store.put_bytes);
  const double ratio = static_cast<double>(counted_bytes) / static_cast<double>(store.put_bytes);
  std::printf("%s %s: stored %llu bytes, EndRound allocated %llu (%.3fx)\n", GetParam().codec,
              GetParam().eviction, static_cast<unsigned long long>(store.put_bytes),
              static_cast<unsigned long long>(counted_bytes), ratio);
  // The segment buffers themselves (1x), plus per-tensor encoders, eviction's
  // keep lists and scores and one head's gather scratch; a second copy of the
  // encoded round would push this past 2x.
  EXPECT_LT(ratio, 1.5);
}

INSTANTIATE_TEST_SUITE_P(Codecs, EndRoundCopiesTest,
                         ::testing::Values(Case{"raw", ""}, Case{"fp32", ""}, Case{"kivi4", ""},
                                           Case{"kivi8:R=128", ""}),
                         [](const auto& info) { return std::to_string(info.index); });

}  // namespace
}  // namespace kvtier::worker
