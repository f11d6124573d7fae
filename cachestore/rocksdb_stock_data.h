// What rocksdb_crc32c_test and its helper (rocksdb_stock_tool) write and
// read back: the same keys and values on both sides, in a database set up
// as the store sets up its own (blob files for values of 4 KiB and more).
// Header-only, so the helper links librocksdb alone.
#ifndef KVTIER_CACHESTORE_ROCKSDB_STOCK_DATA_H_
#define KVTIER_CACHESTORE_ROCKSDB_STOCK_DATA_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "rocksdb/options.h"

namespace kvtier::cachestore::stock_data {

inline constexpr int kKeys = 64;

inline std::string Key(int i) { return "key-" + std::to_string(i); }

// Deterministic values from 100 B to 64 KiB.
inline std::string Value(int i) {
  const size_t n = 100 + (static_cast<size_t>(i) * 2053) % (64 << 10);
  std::string v(n, '\0');
  uint32_t x = 2166136261u ^ static_cast<uint32_t>(i);
  for (char& c : v) {
    x = x * 16777619u + 1;
    c = static_cast<char>(x >> 24);
  }
  return v;
}

inline rocksdb::Options StoreLikeOptions() {
  rocksdb::Options o;
  o.create_if_missing = true;
  o.paranoid_checks = true;
  o.enable_blob_files = true;
  o.min_blob_size = 4096;
  return o;
}

}  // namespace kvtier::cachestore::stock_data

#endif  // KVTIER_CACHESTORE_ROCKSDB_STOCK_DATA_H_
