// Payload files: large segment payloads live in files of their own beside
// RocksDB, one file per segment, referenced by the segment's index record in
// RocksDB. The index record is the commit point: a file is written (and
// fsync'd, with its directory, when writes are synchronous) before the record
// that names it, so a crash leaves at worst an unreferenced file, which
// recovery reuses or deletes. Files go through RocksDB's FileSystem interface, so tests
// can inject a failing disk under both.
//
// Spare files: creating a file and making its directory entry durable costs
// a journal commit of its own, which a 1 MiB put would wait for. A background
// thread keeps a few empty files ready, created in batches that share one
// subdirectory and one directory fsync; a writer takes one and only its data
// (and size) remain to sync.
//
// Recycled files: the file of a dropped segment is kept (up to a byte cap)
// and overwritten in place by a later put of at most its size: no inode to create, no blocks to
// allocate, no page cache to allocate and fill afresh, and fdatasync has only data to flush (about
// twice as fast as a new file for 1 MiB on ext4 here; buffered writes over a file's cached pages
// ran at 17-18 GB/s against 5.3-5.5 GB/s for new files on this project's VM). The file is reopened
// without truncation and written from its start like a new one (its writeback started per piece
// with `sync`), then cut to the payload's size. A file is reused only once the deletion of
// the record that named it is durable (with synchronous writes it is at once; otherwise the first
// reuse after a release syncs the WAL, once for every file released before it), and only when no
// read holds it (ReadPin), so a reader never sees another segment's bytes and a crash cannot bring
// back a record naming a reused file.
//
// Recovery keeps unreferenced files for reuse (empty: spares, others:
// recycled, each within its cap) and deletes the rest.
//
// Why not inside RocksDB: a value there is written twice (WAL, then blob
// file at flush), and Debian's portable RocksDB build checksums both passes
// in software. Small payloads still go inline (StoreOptions).
#ifndef KVTIER_CACHESTORE_PAYLOAD_FILES_H_
#define KVTIER_CACHESTORE_PAYLOAD_FILES_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace rocksdb {
class FileSystem;
class FSWritableFile;
}  // namespace rocksdb

namespace kvtier::cachestore {

// Thread-safe: distinct ids may be used concurrently; one id is written once.
class PayloadFiles {
 public:
  // Creates `dir` and its 256 fan-out subdirectories if missing. `fs` is not
  // owned. Keeps about `spare_files` empty files ready once Recover has run
  // (0: none; every writer creates its file). `sync`: spare files' directory
  // entries are made durable before use (the store's sync_writes). INTERNAL
  // on I/O errors.
  // `recycle_bytes`: the most bytes of dropped segments' files kept for
  // reuse (0: none). `sync_deletions` makes every deletion written so far
  // durable (the store's WAL sync); needed to reuse files whose release was
  // not durable, else those are deleted.
  static absl::StatusOr<std::unique_ptr<PayloadFiles>> Open(
      rocksdb::FileSystem* fs, std::string dir, uint32_t spare_files = 0, bool sync = true,
      uint64_t recycle_bytes = 0, std::function<absl::Status()> sync_deletions = nullptr);
  // Stops the spare thread and deletes the unused spares (best effort).
  ~PayloadFiles();

  // Once, before any writer: the ids the index names. Every other file
  // becomes a spare when empty (up to `spare_files`), else a recycled file
  // (up to `recycle_bytes`), else is deleted. Starts the spare thread.
  // Returns how many files it deleted.
  absl::StatusOr<int> Recover(const absl::flat_hash_set<uint64_t>& referenced);

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
    uint64_t id() const { return id_; }

   private:
    friend class PayloadFiles;
    Writer(PayloadFiles* files, uint64_t id, bool sync);
    PayloadFiles* const files_;
    const uint64_t id_;
    const bool sync_;
    std::unique_ptr<rocksdb::FSWritableFile> file_;
    uint64_t reused_size_ = 0;  // A recycled file's size before this write; 0 otherwise.
    uint64_t written_ = 0;
    bool finished_ = false;
    absl::Status status_;  // The first error, returned by every later call.
  };

  // A payload file for writing `size` bytes (Writer::id): the smallest
  // recycled file that holds them, else a spare, else one created now under
  // a fresh id. With `sync`, its directory entry is durable on return.
  // INTERNAL on I/O errors.
  absl::StatusOr<std::unique_ptr<Writer>> NewWriter(bool sync, uint64_t size);

  // Keeps file `id` from being recycled while it is read. Take it while the
  // index still names the file (under the index lock).
  class ReadPin {
   public:
    ReadPin() = default;
    ReadPin(ReadPin&& o) noexcept : files_(o.files_), id_(o.id_) { o.files_ = nullptr; }
    ReadPin& operator=(ReadPin&& o) noexcept;
    ~ReadPin();

   private:
    friend class PayloadFiles;
    ReadPin(PayloadFiles* files, uint64_t id) : files_(files), id_(id) {}
    PayloadFiles* files_ = nullptr;
    uint64_t id_ = 0;
  };
  ReadPin PinForRead(uint64_t id);

  // File `id` is no longer named by any record (`durable`: and that deletion
  // is durable): recycled (once no read holds it) or deleted.
  absl::Status Release(uint64_t id, bool durable = true);

  // Reads file `id`, expected to hold `size` bytes. NOT_FOUND if missing,
  // DATA_LOSS if shorter, INTERNAL on I/O errors.
  absl::StatusOr<std::string> Read(uint64_t id, uint64_t size) const;

  // Deletes file `id`; a missing file is not an error.
  absl::Status Remove(uint64_t id);

  // Ids of every payload file present, spares included.
  absl::StatusOr<std::vector<uint64_t>> List() const;

  // Spare files ready now, and writers that found none.
  size_t spares() const;
  // Waits until exactly `n` spare files are ready (the spare thread refills
  // on its own schedule): true, or false after `timeout`. For tests.
  bool WaitForSpares(size_t n, absl::Duration timeout) const;
  uint64_t spare_misses() const;
  // Recycled files held, their bytes, and writers that overwrote one.
  size_t recycled() const;
  uint64_t recycled_bytes() const;
  uint64_t recycle_hits() const;

 private:
  PayloadFiles(rocksdb::FileSystem* fs, std::string dir, uint32_t spare_files, bool sync,
               uint64_t recycle_bytes, std::function<absl::Status()> sync_deletions)
      : fs_(fs),
        dir_(std::move(dir)),
        spare_target_(spare_files),
        sync_(sync),
        recycle_cap_(recycle_bytes),
        sync_deletions_(std::move(sync_deletions)) {}
  std::string SubDir(uint64_t id) const;
  std::string Path(uint64_t id) const;
  // A fresh id whose file lands in subdirectory `sub`. Ids are
  // (sequence << 8) | sub, above every id present at Recover.
  uint64_t NewIdLocked(uint32_t sub) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CreateEmpty(uint64_t id);
  absl::Status SyncDir(uint64_t id);
  void SpareLoop();
  // Keeps `id` (`size` bytes on disk) for reuse if the cap allows.
  // `durable`: its record's deletion is durable; else it waits in pending_.
  bool RecycleLocked(uint64_t id, uint64_t size, bool durable) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes pending_ reusable (one WAL sync). False when nothing changed.
  bool ConfirmPending() ABSL_LOCKS_EXCLUDED(mu_);
  void Unpin(uint64_t id);

  rocksdb::FileSystem* const fs_;
  const std::string dir_;
  const uint32_t spare_target_;
  const bool sync_;
  const uint64_t recycle_cap_;
  const std::function<absl::Status()> sync_deletions_;

  mutable absl::Mutex mu_;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  uint32_t next_sub_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<uint64_t> spare_ ABSL_GUARDED_BY(mu_);
  uint64_t spare_misses_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::multimap<uint64_t, uint64_t> recycled_ ABSL_GUARDED_BY(mu_);  // Size on disk -> id.
  std::multimap<uint64_t, uint64_t> pending_ ABSL_GUARDED_BY(mu_);   // Deletion not yet durable.
  uint64_t recycled_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t recycle_hits_ ABSL_GUARDED_BY(mu_) = 0;
  // Files being read, and those released while read (recycled at the last unpin).
  absl::flat_hash_map<uint64_t, int> readers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, bool> released_while_read_ ABSL_GUARDED_BY(mu_);  // -> durable
  std::thread spare_thread_;
};

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_PAYLOAD_FILES_H_
