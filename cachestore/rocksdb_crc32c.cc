#include "cachestore/rocksdb_crc32c.h"

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kernels/crc32c.h"

namespace kvtier::cachestore {
namespace {

// Set once; read-mostly afterwards, so the hot path does not write a shared
// cache line on every call.
std::atomic<bool> rocksdb_called{false};

}  // namespace

bool RocksDbUsesKvtierCrc32c() { return rocksdb_called.load(std::memory_order_relaxed); }

}  // namespace kvtier::cachestore

// Linked with --wrap=_ZN7rocksdb6crc32c6ExtendEjPKcm (cachestore's
// CMakeLists.txt), so every call RocksDB's other objects make to
// rocksdb::crc32c::Extend(uint32_t, const char*, size_t) lands here. That
// function is declared in RocksDB's util/crc32c.h: "the crc32c of
// concat(A, data[0, n - 1]) where init_crc is the crc32c of some string A",
// which is exactly Crc32cExtend. (The name is the linker's convention for a
// wrapper of that mangled symbol.)
extern "C" uint32_t __wrap__ZN7rocksdb6crc32c6ExtendEjPKcm(uint32_t init_crc, const char* data,
                                                           size_t n) {
  if (!kvtier::cachestore::rocksdb_called.load(std::memory_order_relaxed)) {
    kvtier::cachestore::rocksdb_called.store(true, std::memory_order_relaxed);
  }
  return kvtier::Crc32cExtend(init_crc, data, n);
}
