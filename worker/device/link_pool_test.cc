// LinkPool: which communicator a sender takes, what a receiver promises and
// hands out, and what is destroyed (expired, past the caps, replaced).
#include "worker/device/link_pool.h"

#include <set>

#include "gtest/gtest.h"
#include "tests/util/status_matchers.h"

namespace kvtier::worker {
namespace {

using ::kvtier::testing::StatusIs;

// A link that only records its destruction (the pool never calls it).
class CountedLink : public DeviceLink {
 public:
  CountedLink(std::string name, std::set<std::string>* destroyed)
      : name_(std::move(name)), destroyed_(destroyed) {}
  ~CountedLink() override { destroyed_->insert(name_); }
  absl::Status Send(const DeviceLayer&, absl::Time) override {
    return absl::UnimplementedError("not sent through");
  }
  absl::StatusOr<std::unique_ptr<DeviceLayer>> Receive(DeviceRoundLayout, absl::Time) override {
    return absl::UnimplementedError("not received through");
  }

 private:
  std::string name_;
  std::set<std::string>* destroyed_;
};

class LinkPoolTest : public ::testing::Test {
 protected:
  LinkPool::Options Opts() {
    LinkPool::Options o;
    o.now = [this] { return now_; };
    return o;
  }
  std::unique_ptr<DeviceLink> Make(const std::string& name) {
    return std::make_unique<CountedLink>(name, &destroyed_);
  }
  absl::Time now_ = absl::FromUnixSeconds(1000);
  std::set<std::string> destroyed_;
};

TEST_F(LinkPoolTest, SenderTakesTheMostRecentIdleLinkOfThatPeer) {
  LinkPool pool(Opts());
  EXPECT_FALSE(pool.Take("b").has_value());
  pool.Put("b", "id1", Make("1"));
  now_ += absl::Seconds(1);
  pool.Put("c", "id2", Make("2"));
  now_ += absl::Seconds(1);
  pool.Put("b", "id3", Make("3"));
  EXPECT_EQ(pool.size(), 3u);
  std::optional<LinkPool::Link> first = pool.Take("b");
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->id, "id3");
  std::optional<LinkPool::Link> second = pool.Take("b");
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->id, "id1");
  EXPECT_FALSE(pool.Take("b").has_value());  // Taken links are out of the pool.
  EXPECT_EQ(pool.size(), 1u);
  EXPECT_TRUE(destroyed_.empty());
  second.reset();
  EXPECT_EQ(destroyed_, (std::set<std::string>{"1"}));  // Owned by the taker.
}

TEST_F(LinkPoolTest, ReceiverHandsOutOnlyWhatItPromisedToThatPeer) {
  LinkPool pool(Opts());
  pool.Put("sender-a", "id1", Make("1"));
  EXPECT_FALSE(pool.Promise("sender-b", "id1"));  // Another sender's.
  EXPECT_FALSE(pool.Promise("sender-a", "id9"));  // Not held.
  // Not promised yet: a header naming it finds nothing.
  EXPECT_THAT(pool.TakePromised("sender-a", "id1").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(pool.Promise("sender-a", "id1"));
  EXPECT_FALSE(pool.Promise("sender-a", "id1"));  // Once.
  EXPECT_EQ(pool.idle(), 0u);
  EXPECT_FALSE(pool.Take("sender-a").has_value());  // A promised link is not idle.
  EXPECT_THAT(pool.TakePromised("sender-b", "id1").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  absl::StatusOr<std::unique_ptr<DeviceLink>> l = pool.TakePromised("sender-a", "id1");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(pool.size(), 0u);
  pool.Put("sender-a", "id1", *std::move(l));  // After the transfer.
  EXPECT_EQ(pool.idle(), 1u);
  EXPECT_TRUE(destroyed_.empty());
}

TEST_F(LinkPoolTest, IdleAndPromisedLinksExpire) {
  LinkPool::Options o = Opts();
  o.idle_for = absl::Minutes(5);
  o.promised_for = absl::Seconds(60);
  LinkPool pool(o);
  pool.Put("a", "id1", Make("1"));
  pool.Put("a", "id2", Make("2"));
  ASSERT_TRUE(pool.Promise("a", "id2"));
  now_ += absl::Seconds(61);
  EXPECT_THAT(pool.TakePromised("a", "id2").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(destroyed_, (std::set<std::string>{"2"}));
  now_ += absl::Minutes(4);  // 5:01 since id1 was put back.
  EXPECT_FALSE(pool.Take("a").has_value());
  EXPECT_EQ(destroyed_, (std::set<std::string>{"1", "2"}));
  EXPECT_EQ(pool.size(), 0u);
}

TEST_F(LinkPoolTest, CapsKeepTheMostRecentlyUsed) {
  LinkPool::Options o = Opts();
  o.per_peer = 2;
  o.total = 3;
  LinkPool pool(o);
  for (int i = 0; i < 3; ++i) {
    pool.Put("a", "a" + std::to_string(i), Make("a" + std::to_string(i)));
    now_ += absl::Seconds(1);
  }
  EXPECT_EQ(destroyed_, (std::set<std::string>{"a0"}));  // Per peer.
  pool.Put("b", "b0", Make("b0"));
  now_ += absl::Seconds(1);
  ASSERT_TRUE(pool.Promise("b", "b0"));
  pool.Put("c", "c0", Make("c0"));
  // Four held, three allowed: the oldest idle one goes, never a promised one.
  EXPECT_EQ(destroyed_, (std::set<std::string>{"a0", "a1"}));
  EXPECT_EQ(pool.size(), 3u);
  EXPECT_TRUE(pool.TakePromised("b", "b0").ok());
  // The same id put back again replaces the entry it had.
  pool.Put("c", "c0", Make("c0-again"));
  EXPECT_EQ(destroyed_.count("c0"), 1u);
  EXPECT_EQ(pool.size(), 2u);
}

}  // namespace
}  // namespace kvtier::worker
