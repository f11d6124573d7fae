// Payload files: large segment payloads live in files of their own beside
// RocksDB, one file per segment, referenced by the segment's index record in
// RocksDB. The index record is the commit point: a file is written (and
// fsync'd, with its directory, when writes are synchronous) before the record
// that names it, so a crash leaves at worst an unreferenced file, which
// recovery deletes. Files go through RocksDB's FileSystem interface, so tests
// can inject a failing disk under both.
//
// Why not inside RocksDB: a value there is written twice (WAL, then blob
// file at flush), and Debian's portable RocksDB build checksums both passes
// in software. Small payloads still go inline (StoreOptions).
#ifndef KVTIER_CACHESTORE_PAYLOAD_FILES_H_
#define KVTIER_CACHESTORE_PAYLOAD_FILES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace rocksdb {
class FileSystem;
class FSWritableFile;
}  // namespace rocksdb

namespace kvtier::cachestore {

// Thread-safe: distinct ids may be used concurrently; one id is written once.
class PayloadFiles {
 public:
  // Creates `dir` and its 256 fan-out subdirectories if missing. `fs` is not
  // owned. INTERNAL on I/O errors.
  static absl::StatusOr<std::unique_ptr<PayloadFiles>> Open(rocksdb::FileSystem* fs,
                                                            std::string dir);

  // A payload file being written as its bytes arrive. With `sync`, each
  // append starts the writeback of what it wrote (sync_file_range), so the
  // disk works while the rest arrives and Finish waits only for the tail;
  // the directory entry is made durable when the file is created, also
  // ahead of Finish. Destroyed unfinished, it removes the file.
  // Not thread-safe: one caller at a time.
  class Writer {
   public:
    Writer(const Writer&) = delete;
    Writer& operator=(const Writer&) = delete;
    ~Writer();
    // INTERNAL on I/O errors; after one, every call fails with it.
    absl::Status Append(std::string_view bytes);
    // Flushes (fdatasync with `sync`) and closes. The file is complete and,
    // with `sync`, durable on success. INTERNAL on I/O errors.
    absl::Status Finish();
    uint64_t written() const { return written_; }

   private:
    friend class PayloadFiles;
    Writer(PayloadFiles* files, uint64_t id, bool sync);
    PayloadFiles* const files_;
    const uint64_t id_;
    const bool sync_;
    std::unique_ptr<rocksdb::FSWritableFile> file_;
    uint64_t written_ = 0;
    bool finished_ = false;
    absl::Status status_;  // The first error, returned by every later call.
  };

  // Creates file `id` (which must not exist) for writing. With `sync`, its
  // directory entry is durable on return. INTERNAL on I/O errors.
  absl::StatusOr<std::unique_ptr<Writer>> NewWriter(uint64_t id, bool sync);

  // Reads file `id`, expected to hold `size` bytes. NOT_FOUND if missing,
  // DATA_LOSS if shorter, INTERNAL on I/O errors.
  absl::StatusOr<std::string> Read(uint64_t id, uint64_t size) const;

  // Deletes file `id`; a missing file is not an error.
  absl::Status Remove(uint64_t id);

  // Ids of every payload file present (recovery's orphan scan).
  absl::StatusOr<std::vector<uint64_t>> List() const;

 private:
  PayloadFiles(rocksdb::FileSystem* fs, std::string dir) : fs_(fs), dir_(std::move(dir)) {}
  std::string SubDir(uint64_t id) const;
  std::string Path(uint64_t id) const;

  rocksdb::FileSystem* const fs_;
  const std::string dir_;
};

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_PAYLOAD_FILES_H_
