// RocksDB checksums its WAL records, blob records and table blocks with
// CRC-32C through rocksdb::crc32c::Extend. Debian's librocksdb is built for
// the baseline x86-64 ISA, so that function runs its table-driven version
// (1.6 GB/s on the Zen 4 VM, where kvtier's own runs at 58-63 GB/s): every
// put of an inline payload paid for it in its WAL record, and every read of
// a spilled one in its blob record's check. kvtier links librocksdb.a with
// the linker's --wrap of that symbol, which sends RocksDB's calls to a
// wrapper in rocksdb_crc32c.cc: the same CRC-32C, computed by kvtier's
// Crc32cExtend (rocksdb_crc32c_test checks both ways against a process
// that runs stock RocksDB).
#ifndef KVTIER_CACHESTORE_ROCKSDB_CRC32C_H_
#define KVTIER_CACHESTORE_ROCKSDB_CRC32C_H_

namespace kvtier::cachestore {

// True once RocksDB has called kvtier's CRC-32C (after it wrote or read a
// record), that is, when the override is in effect.
bool RocksDbUsesKvtierCrc32c();

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_ROCKSDB_CRC32C_H_
