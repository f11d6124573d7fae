// A RocksDB file system whose writes start failing on demand: the "failing
// disk" that store tests inject below the Store (StoreOptions::env, through
// rocksdb::NewCompositeEnv) instead of mocking RocksDB. Thread-safe.
#ifndef KVTIER_TESTS_UTIL_FAILING_FS_H_
#define KVTIER_TESTS_UTIL_FAILING_FS_H_

#include <atomic>
#include <memory>
#include <string>

#include "rocksdb/file_system.h"

namespace kvtier::testing {

class FailingFs : public rocksdb::FileSystemWrapper {
 public:
  FailingFs() : FileSystemWrapper(rocksdb::FileSystem::Default()) {}
  const char* Name() const override { return "FailingFs"; }
  std::atomic<bool> fail{false};
  std::atomic<int> wal_syncs{0};  // Sync or Fsync calls on RocksDB's WAL files.

  rocksdb::IOStatus ReuseWritableFile(const std::string& f, const std::string& old,
                                      const rocksdb::FileOptions& o,
                                      std::unique_ptr<rocksdb::FSWritableFile>* r,
                                      rocksdb::IODebugContext* dbg) override {
    std::unique_ptr<rocksdb::FSWritableFile> file;
    rocksdb::IOStatus s = target()->ReuseWritableFile(f, old, o, &file, dbg);
    if (s.ok()) *r = std::make_unique<File>(std::move(file), &fail, WalCounter(f));
    return s;
  }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* dbg) override {
    std::unique_ptr<rocksdb::FSWritableFile> file;
    rocksdb::IOStatus s = target()->NewWritableFile(f, o, &file, dbg);
    if (s.ok()) *r = std::make_unique<File>(std::move(file), &fail, WalCounter(f));
    return s;
  }

 private:
  std::atomic<int>* WalCounter(const std::string& f) {
    return f.size() > 4 && f.compare(f.size() - 4, 4, ".log") == 0 ? &wal_syncs : nullptr;
  }

  class File : public rocksdb::FSWritableFileOwnerWrapper {
   public:
    File(std::unique_ptr<rocksdb::FSWritableFile> f, std::atomic<bool>* fail,
         std::atomic<int>* syncs)
        : FSWritableFileOwnerWrapper(std::move(f)), fail_(fail), syncs_(syncs) {}
    rocksdb::IOStatus Append(const rocksdb::Slice& d, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* dbg) override {
      if (fail_->load()) return rocksdb::IOStatus::IOError("injected disk failure");
      return FSWritableFileOwnerWrapper::Append(d, o, dbg);
    }
    rocksdb::IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
      if (fail_->load()) return rocksdb::IOStatus::IOError("injected disk failure");
      if (syncs_ != nullptr) syncs_->fetch_add(1);
      return FSWritableFileOwnerWrapper::Sync(o, dbg);
    }
    rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
      if (fail_->load()) return rocksdb::IOStatus::IOError("injected disk failure");
      if (syncs_ != nullptr) syncs_->fetch_add(1);
      return FSWritableFileOwnerWrapper::Fsync(o, dbg);
    }

   private:
    std::atomic<bool>* fail_;
    std::atomic<int>* syncs_;
  };
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_FAILING_FS_H_
