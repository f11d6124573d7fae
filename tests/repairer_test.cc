// The controller's repairer against two real kvtier-store processes: a
// session's rounds copied from a survivor to a new replica byte for byte,
// in batches of whole rounds (one GetSegments and one PutSegments a batch),
// segments the target holds already left alone.
#include "services/controller/repairer.h"

#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/store_client.h"
#include "controller/controller.h"
#include "gtest/gtest.h"
#include "testing/store_process.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;

// The value of the metric line starting with `prefix` (labels included), or
// -1 when it is not there.
double Metric(const std::string& page, const std::string& prefix) {
  size_t at = page.find("\n" + prefix + " ");
  if (at == std::string::npos) return -1;
  at += prefix.size() + 2;
  return std::stod(page.substr(at, page.find('\n', at) - at));
}

class RepairerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) {
      stores_.push_back(std::make_unique<testing::StoreProcess>(
          absl::StrCat(dir_.path(), "/s", i), std::vector<std::string>{"--sync_writes=true"}));
      ASSERT_THAT(stores_.back()->Start(), IsOk());
      StoreClientOptions o;
      o.target = stores_.back()->target();
      auto c = StoreClient::Connect(o);
      ASSERT_THAT(c.status(), IsOk());
      clients_.push_back(std::move(*c));
    }
  }

  // `rounds` rounds of two segments of about `bytes` each on store `i`.
  void Fill(int i, const std::string& session, int rounds, uint64_t bytes, int first = 0) {
    for (int r = first; r < first + rounds; ++r) {
      std::vector<PutSegmentsItem> items(2);
      for (uint32_t s = 0; s < 2; ++s) {
        PutSegmentArgs& a = items[s].args;
        a.session_id = session;
        a.round = static_cast<uint32_t>(r);
        a.segment = s;
        a.layer_begin = 0;
        a.layer_end = 1;
        items[s].payload = payloads_.emplace_back(testing::MakePayload(bytes, 1000 * r + s));
      }
      auto put = clients_[i]->PutSegments(items);
      ASSERT_THAT(put.status(), IsOk());
      for (const auto& p : *put) ASSERT_THAT(p.status(), IsOk());
    }
  }

  // (round, segment) -> crc of what store `i` lists for `session`.
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> Listed(int i, const std::string& session) {
    std::map<std::pair<uint32_t, uint32_t>, uint32_t> out;
    auto l = clients_[i]->ListRounds(session);
    if (!l.ok()) return out;
    for (const v1::RoundInfo& r : l->rounds()) {
      for (const v1::SegmentInfo& s : r.segments()) {
        out[{s.ref().round(), s.ref().segment()}] = s.payload_crc32c();
      }
    }
    return out;
  }

  controller::RepairTask Task(const std::string& session) {
    controller::RepairTask t;
    t.tenant = "default";
    t.session = session;
    t.sources.push_back({{"s0", controller::NodeKind::kStore, stores_[0]->target()}});
    t.target = {{"s1", controller::NodeKind::kStore, stores_[1]->target()}};
    return t;
  }

  double TargetPutCalls() {
    return Metric(testing::HttpGet(stores_[1]->metrics_port(), "/metrics"),
                  "kvtier_store_requests_total{method=\"PutSegments\",outcome=\"ok\"}");
  }

  testing::TempDir dir_;
  std::vector<std::unique_ptr<testing::StoreProcess>> stores_;
  std::vector<std::unique_ptr<StoreClient>> clients_;
  std::deque<std::string> payloads_;  // The items' views point here: it never moves them.
};

TEST_F(RepairerTest, RoundsGoInBatchesAndArriveByteForByte) {
  // 200 rounds of two 4 KiB segments: 400 segments, two batches (256 a batch).
  Fill(0, "many", 200, 4096);
  // Three rounds of two 3 MiB segments, then one of two 512 KiB: rounds 0
  // and 1 alone (6 MiB each: two would pass the 8 MiB bound), round 2 with
  // round 3 (7 MiB).
  Fill(0, "large", 3, uint64_t{3} << 20);
  Fill(0, "large", 1, uint64_t{512} << 10, /*first=*/3);
  controller::Controller ctl;
  RepairOptions ro;
  ro.max_bytes_per_second = 0;
  auto repairer = Repairer::Start(&ctl, ro);
  ASSERT_THAT(repairer.status(), IsOk());
  const double before = std::max(0.0, TargetPutCalls());
  bool empty = true;
  ASSERT_THAT((*repairer)->Repair(Task("many"), &empty), IsOk());
  EXPECT_FALSE(empty);
  EXPECT_EQ(Listed(1, "many"), Listed(0, "many"));
  EXPECT_EQ(Listed(1, "many").size(), 400u);
  EXPECT_EQ(TargetPutCalls() - before, 2) << "400 segments in batches of at most 256";
  ASSERT_THAT((*repairer)->Repair(Task("large"), &empty), IsOk());
  EXPECT_EQ(Listed(1, "large"), Listed(0, "large"));
  EXPECT_EQ(TargetPutCalls() - before, 5) << "19 MiB in batches of at most 8 MiB";
  // The bytes too, not only the listed checksums.
  std::vector<v1::SegmentRef> refs;
  for (uint32_t r = 0; r < 4; ++r) {
    for (uint32_t s = 0; s < 2; ++s) {
      v1::SegmentRef ref;
      ref.set_round(r);
      ref.set_segment(s);
      refs.push_back(ref);
    }
  }
  auto a = clients_[0]->GetSegments("large", refs);
  auto b = clients_[1]->GetSegments("large", refs);
  ASSERT_THAT(a.status(), IsOk());
  ASSERT_THAT(b.status(), IsOk());
  for (size_t i = 0; i < refs.size(); ++i) EXPECT_TRUE((*a)[i].payload == (*b)[i].payload) << i;
  const RepairStats st = (*repairer)->stats();
  EXPECT_EQ(st.segments_copied, 408u);
  EXPECT_EQ(st.segments_present, 0u);
}

TEST_F(RepairerTest, SegmentsTheTargetHoldsAreLeftAlone) {
  Fill(0, "part", 10, 4096);
  Fill(1, "part", 4, 4096, /*first=*/3);  // Rounds 3-6 on the target already.
  const auto held = Listed(1, "part");
  controller::Controller ctl;
  RepairOptions ro;
  ro.max_bytes_per_second = 0;
  auto repairer = Repairer::Start(&ctl, ro);
  ASSERT_THAT(repairer.status(), IsOk());
  bool empty = true;
  ASSERT_THAT((*repairer)->Repair(Task("part"), &empty), IsOk());
  EXPECT_FALSE(empty);
  EXPECT_EQ(Listed(1, "part"), Listed(0, "part"));
  const RepairStats st = (*repairer)->stats();
  EXPECT_EQ(st.segments_copied, 12u);
  EXPECT_EQ(st.segments_present, 8u);
  for (const auto& [ref, crc] : held) EXPECT_EQ(Listed(1, "part").at(ref), crc);
  // A session no replica holds yet: done, with nothing copied, and said so.
  ASSERT_THAT((*repairer)->Repair(Task("never-stored"), &empty), IsOk());
  EXPECT_TRUE(empty);
  EXPECT_EQ((*repairer)->stats().segments_copied, 12u);
}

}  // namespace
}  // namespace kvtier
