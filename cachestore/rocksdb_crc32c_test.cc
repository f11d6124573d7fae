// kvtier's CRC-32C in place of RocksDB's (rocksdb_crc32c.h) must compute the
// same checksums: a database written by stock RocksDB (a helper process
// that links librocksdb alone) is read here with every checksum checked,
// and one written here is read by the helper.
#include "cachestore/rocksdb_crc32c.h"

#include <sys/wait.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "testing/test_util.h"

namespace kvtier::cachestore {
namespace {

constexpr int kKeys = 64;  // As rocksdb_stock_tool.cc.

std::string Key(int i) { return "key-" + std::to_string(i); }

std::string Value(int i) {
  const size_t n = 100 + (static_cast<size_t>(i) * 2053) % (64 << 10);
  std::string v(n, '\0');
  uint32_t x = 2166136261u ^ static_cast<uint32_t>(i);
  for (char& c : v) {
    x = x * 16777619u + 1;
    c = static_cast<char>(x >> 24);
  }
  return v;
}

rocksdb::Options StoreLikeOptions() {
  rocksdb::Options o;
  o.create_if_missing = true;
  o.paranoid_checks = true;
  o.enable_blob_files = true;
  o.min_blob_size = 4096;
  return o;
}

int RunTool(const std::string& mode, const std::string& dir) {
  const std::string cmd = std::string(KVTIER_ROCKSDB_STOCK_TOOL) + " " + mode + " " + dir;
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST(RocksDbCrc32c, ReadsWhatStockRocksDbWrote) {
  testing::TempDir tmp;
  const std::string dir = tmp.path() + "/stock";
  ASSERT_EQ(RunTool("write", dir), 0);
  rocksdb::DB* raw = nullptr;
  ASSERT_TRUE(rocksdb::DB::Open(StoreLikeOptions(), dir, &raw).ok());  // Replays the WAL.
  std::unique_ptr<rocksdb::DB> db(raw);
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  for (int i = 0; i < kKeys; ++i) {
    std::string v;
    rocksdb::Status s = db->Get(ro, Key(i), &v);
    ASSERT_TRUE(s.ok()) << Key(i) << ": " << s.ToString();
    ASSERT_EQ(v, Value(i)) << Key(i);
  }
  EXPECT_TRUE(db->VerifyChecksum().ok());
  EXPECT_TRUE(RocksDbUsesKvtierCrc32c()) << "RocksDB did not call kvtier's CRC-32C";
}

TEST(RocksDbCrc32c, StockRocksDbReadsWhatWeWrote) {
  testing::TempDir tmp;
  const std::string dir = tmp.path() + "/ours";
  {
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(StoreLikeOptions(), dir, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    for (int i = 0; i < kKeys; ++i) {
      if (i == kKeys / 2) {
        ASSERT_TRUE(db->Flush(rocksdb::FlushOptions()).ok());
      }
      ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), Key(i), Value(i)).ok());
    }
  }  // The second half stays in the WAL.
  EXPECT_EQ(RunTool("verify", dir), 0);
  EXPECT_TRUE(RocksDbUsesKvtierCrc32c());
}

}  // namespace
}  // namespace kvtier::cachestore
