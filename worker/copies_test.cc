// Counts what EndRound allocates on its way from the open round to the store:
// with each tensor encoded straight into its segment buffer, the bytes it
// allocates are the stored bytes plus small bookkeeping, not a second copy of
// the round (the test fails if an intermediate EncodedTensor, or any other
// full copy of the encoded round, comes back). And counts the conversions on
// the way in: K/V sent in the model's dtype reach the open round unconverted.
#include <atomic>
#include <cstdlib>
#include <new>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/half.h"
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

// K/V rows in the model's dtype are copied into the open round: no value is
// converted, and the outputs are those of the same values sent as fp32 (each
// of whose K/V values is converted once). bf16 rows into an fp16 model are
// widened and narrowed: two conversions a value.
TEST(StepConversionsTest, KvInTheModelsDtypeAreNotConverted) {
  const ModelShape shape{3, 4, 2, 64, DType::kFp16};
  const int64_t tokens = 20;
  const int64_t kv_values = 2 * tokens * shape.kv_heads * shape.head_dim * shape.layers;
  SizeOnlyStore store;
  EngineOptions options;
  options.placement = EngineOptions::Placement::kHost;
  Engine engine(&store, options);
  SessionPolicy policy;
  policy.codec = SessionPolicy::RawFp32Codec();
  policy.codec.dtype = DType::kFp16;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const int d = shape.head_dim;
  std::vector<float> q(tokens * shape.q_heads * d), k(tokens * shape.kv_heads * d), v(k.size());
  for (std::vector<float>* x : {&q, &k, &v}) {
    for (float& e : *x) e = HalfToFloat(FloatToHalf(nd(rng)));  // Exact in fp16.
  }
  auto halves = [](const std::vector<float>& x, bool bf16) {
    std::vector<uint16_t> h(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = bf16 ? FloatToBf16(x[i]) : FloatToHalf(x[i]);
    return h;
  };
  const std::vector<uint16_t> k16 = halves(k, false), v16 = halves(v, false);
  const std::vector<uint16_t> kb = halves(k, true), vb = halves(v, true);
  std::vector<std::vector<float>> outs;
  std::vector<uint64_t> converted;
  for (int variant = 0; variant < 3; ++variant) {
    const std::string id = "s" + std::to_string(variant);
    ASSERT_THAT(engine.OpenSession(id, shape, policy), IsOk());
    std::vector<float> out(q.size());
    for (int l = 0; l < shape.layers; ++l) {
      const Rows kr = variant == 0   ? Rows(k.data())
                      : variant == 1 ? Rows(DType::kFp16, k16.data())
                                     : Rows(DType::kBf16, kb.data());
      const Rows vr = variant == 0   ? Rows(v.data())
                      : variant == 1 ? Rows(DType::kFp16, v16.data())
                                     : Rows(DType::kBf16, vb.data());
      ASSERT_THAT(engine.PrefillLayer(id, l, tokens, 0, q.data(), kr, vr, out.data()).status(),
                  IsOk());
    }
    outs.push_back(out);
    auto stats = engine.Stats(id);
    ASSERT_THAT(stats.status(), IsOk());
    converted.push_back(stats->converted_kv_values);
  }
  EXPECT_EQ(converted[0], static_cast<uint64_t>(kv_values));      // fp32: narrowed once.
  EXPECT_EQ(converted[1], 0u);                                    // fp16: copied.
  EXPECT_EQ(converted[2], static_cast<uint64_t>(2 * kv_values));  // bf16: widened, narrowed.
  EXPECT_EQ(outs[1], outs[0]);
}

INSTANTIATE_TEST_SUITE_P(Codecs, EndRoundCopiesTest,
                         ::testing::Values(Case{"raw", ""}, Case{"fp32", ""}, Case{"kivi4", ""},
                                           Case{"kivi8:R=128", ""}),
                         [](const auto& info) { return std::to_string(info.index); });

}  // namespace
}  // namespace kvtier::worker
