// The store tests' fixture: a Store over a fresh directory with a fake
// clock (sync_writes off: the crash test covers fsync), reopened like a
// restarted process, optionally over a disk that fails on demand, and
// helpers to put and read whole segments.
#ifndef KVTIER_TESTS_UTIL_STORE_FIXTURE_H_
#define KVTIER_TESTS_UTIL_STORE_FIXTURE_H_

#include <memory>
#include <string>

#include "base/clock.h"
#include "cachestore/store.h"
#include "gtest/gtest.h"
#include "kernels/crc32c.h"
#include "rocksdb/env.h"
#include "testing/test_util.h"
#include "tests/util/failing_fs.h"

namespace kvtier::cachestore {

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.path = dir_.path() + "/db";
    options_.clock = &clock_;
    options_.sync_writes = false;  // Unit tests; the crash test covers fsync.
  }

  // Opens (or reopens, like a restarted process) the store, with fresh
  // in-memory quota accounting.
  void Open() {
    store_.reset();
    quota_manager_ = std::make_unique<QuotaManager>();
    auto s = Store::Open(options_, quota_manager_.get());
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(s).value();
  }

  // Puts a disk that fails on demand under the store Open() opens next.
  std::shared_ptr<testing::FailingFs> UseFailingDisk() {
    auto fs = std::make_shared<testing::FailingFs>();
    env_ = rocksdb::NewCompositeEnv(fs);
    options_.env = env_.get();
    return fs;
  }

  WriteSpec Spec(const std::string& session, uint32_t round, uint32_t seg,
                 const std::string& payload, const std::string& tenant = "t1") {
    WriteSpec w;
    w.tenant = tenant;
    w.session = session;
    w.id = {round, seg};
    w.layer_begin = seg == 0 ? 0 : 3;
    w.layer_end = seg == 0 ? 3 : 8;
    w.payload_bytes = payload.size();
    w.payload_crc32c = Crc32c(payload);
    return w;
  }

  absl::StatusOr<SegmentInfo> Put(const std::string& session, uint32_t round, uint32_t seg,
                                  const std::string& payload, const std::string& tenant = "t1") {
    auto t = store_->BeginWrite(Spec(session, round, seg, payload, tenant));
    if (!t.ok()) return t.status();
    return store_->CommitWrite(std::move(t).value(), payload);
  }

  std::string Get(const std::string& session, uint32_t round, uint32_t seg, Tier* from = nullptr,
                  const std::string& tenant = "t1") {
    auto r = store_->ReadSegment(tenant, session, {round, seg});
    if (!r.ok()) return "error: " + r.status().ToString();
    if (from != nullptr) *from = r->served_from;
    return *r->payload;
  }

  testing::TempDir dir_;
  FakeClock clock_;
  std::unique_ptr<QuotaManager> quota_manager_;
  std::unique_ptr<rocksdb::Env> env_;  // Outlives store_.
  StoreOptions options_;
  std::unique_ptr<Store> store_;
};

}  // namespace kvtier::cachestore

#endif  // KVTIER_TESTS_UTIL_STORE_FIXTURE_H_
