// kvtier's CRC-32C in place of RocksDB's (rocksdb_crc32c.h) must compute the
// same checksums: a database written by stock RocksDB (a helper process
// that links librocksdb alone) is read here with every checksum checked,
// and one written here is read by the helper.
#include "cachestore/rocksdb_crc32c.h"

#include <sys/wait.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "cachestore/rocksdb_stock_data.h"
#include "gtest/gtest.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "testing/test_util.h"

namespace kvtier::cachestore {
namespace {

using stock_data::Key;
using stock_data::kKeys;
using stock_data::StoreLikeOptions;
using stock_data::Value;

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
