// A RocksDB client without kvtier's CRC-32C override (it links librocksdb
// alone), for rocksdb_crc32c_test: `write DIR` fills a database the way the
// store configures one (blob files for values of 4 KiB and more, part
// flushed to tables, the rest left in the WAL); `verify DIR` opens one with
// every checksum checked and reads the same keys back. Exit status 0 when
// all went well.
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "cachestore/rocksdb_stock_data.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"

using kvtier::cachestore::stock_data::Key;
using kvtier::cachestore::stock_data::kKeys;
using kvtier::cachestore::stock_data::StoreLikeOptions;
using kvtier::cachestore::stock_data::Value;

int main(int argc, char** argv) {
  if (argc != 3 || (std::strcmp(argv[1], "write") != 0 && std::strcmp(argv[1], "verify") != 0)) {
    std::fprintf(stderr, "usage: %s write|verify DIR\n", argv[0]);
    return 2;
  }
  const bool write = std::strcmp(argv[1], "write") == 0;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(StoreLikeOptions(), argv[2], &raw);
  if (!s.ok()) {
    std::fprintf(stderr, "open: %s\n", s.ToString().c_str());
    return 1;
  }
  std::unique_ptr<rocksdb::DB> db(raw);
  if (write) {
    for (int i = 0; i < kKeys; ++i) {
      if (i == kKeys / 2 && !(s = db->Flush(rocksdb::FlushOptions())).ok()) break;
      if (!(s = db->Put(rocksdb::WriteOptions(), Key(i), Value(i))).ok()) break;
    }
  } else {
    rocksdb::ReadOptions ro;
    ro.verify_checksums = true;
    for (int i = 0; i < kKeys && s.ok(); ++i) {
      std::string v;
      s = db->Get(ro, Key(i), &v);
      if (s.ok() && v != Value(i)) s = rocksdb::Status::Corruption("value of " + Key(i));
    }
  }
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[1], s.ToString().c_str());
    return 1;
  }
  return 0;
}
