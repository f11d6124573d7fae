#include "cachestore/payload_files.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "rocksdb/file_system.h"

namespace kvtier::cachestore {
namespace {

absl::Status FromIo(const rocksdb::IOStatus& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  if (s.IsNotFound() || s.IsPathNotFound()) {
    return absl::NotFoundError(absl::StrCat(what, ": ", s.ToString()));
  }
  return absl::InternalError(absl::StrCat(what, ": ", s.ToString()));
}

constexpr char kSuffix[] = ".seg";

}  // namespace

absl::StatusOr<std::unique_ptr<PayloadFiles>> PayloadFiles::Open(
    rocksdb::FileSystem* fs, std::string dir, uint32_t spare_files, bool sync,
    uint64_t recycle_bytes, std::function<absl::Status()> sync_deletions) {
  rocksdb::IOOptions io;
  if (auto s = FromIo(fs->CreateDirIfMissing(dir, io, nullptr), "create " + dir); !s.ok()) {
    return s;
  }
  std::unique_ptr<PayloadFiles> files(new PayloadFiles(fs, std::move(dir), spare_files, sync,
                                                       recycle_bytes, std::move(sync_deletions)));
  for (uint64_t i = 0; i < 256; ++i) {
    const std::string sub = files->SubDir(i);
    if (auto s = FromIo(fs->CreateDirIfMissing(sub, io, nullptr), "create " + sub); !s.ok()) {
      return s;
    }
  }
  return files;
}

PayloadFiles::~PayloadFiles() {
  std::deque<uint64_t> left;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (spare_thread_.joinable()) spare_thread_.join();
  {
    absl::MutexLock lock(&mu_);
    left.swap(spare_);
  }
  for (uint64_t id : left) (void)Remove(id);
}

absl::StatusOr<int> PayloadFiles::Recover(const absl::flat_hash_set<uint64_t>& referenced) {
  KVT_ASSIGN_OR_RETURN(std::vector<uint64_t> present, List());
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : present) next_seq_ = std::max(next_seq_, (id >> 8) + 1);
    for (uint64_t id : referenced) next_seq_ = std::max(next_seq_, (id >> 8) + 1);
  }
  int removed = 0;
  absl::flat_hash_set<uint64_t> adopted_dirs;  // Subdirectory numbers.
  for (uint64_t id : present) {
    if (referenced.contains(id)) continue;
    // A file nobody names can be reused: no record names it (the index scan
    // is complete, and so is every deletion before it).
    uint64_t size = 0;
    if (fs_->GetFileSize(Path(id), rocksdb::IOOptions(), &size, nullptr).ok()) {
      absl::MutexLock lock(&mu_);
      if (RecycleLocked(id, size, true)) {
        adopted_dirs.insert(id & 0xff);
        continue;
      }
    }
    KVT_RETURN_IF_ERROR(Remove(id));
    ++removed;
  }
  // A process killed between creating spares and syncing their directory
  // leaves entries that are not durable yet: a put would commit into them
  // without a directory sync of its own.
  if (sync_) {
    for (uint64_t sub : adopted_dirs) KVT_RETURN_IF_ERROR(SyncDir(sub));
  }
  if (spare_target_ > 0) spare_thread_ = std::thread([this] { SpareLoop(); });
  return removed;
}

bool PayloadFiles::RecycleLocked(uint64_t id, uint64_t size, bool durable) {
  if (size == 0) {
    if (spare_.size() >= spare_target_) return false;
    spare_.push_back(id);
    return true;
  }
  if (recycled_bytes_ + size > recycle_cap_) return false;
  if (!durable && sync_deletions_ == nullptr) return false;
  (durable ? recycled_ : pending_).emplace(size, id);
  recycled_bytes_ += size;
  return true;
}

bool PayloadFiles::ConfirmPending() {
  std::multimap<uint64_t, uint64_t> batch;
  {
    absl::MutexLock lock(&mu_);
    batch.swap(pending_);
  }
  if (batch.empty()) return false;
  // Every deletion written before these files were released becomes durable.
  absl::Status s = sync_deletions_();
  absl::MutexLock lock(&mu_);
  if (!s.ok()) {
    LogWarn("cannot sync deletions; released payload files wait", {{"error", s.ToString()}});
    pending_.merge(batch);
    return false;
  }
  recycled_.merge(batch);
  return true;
}

PayloadFiles::ReadPin PayloadFiles::PinForRead(uint64_t id) {
  absl::MutexLock lock(&mu_);
  ++readers_[id];
  return ReadPin(this, id);
}

PayloadFiles::ReadPin& PayloadFiles::ReadPin::operator=(ReadPin&& o) noexcept {
  if (this != &o) {
    if (files_ != nullptr) files_->Unpin(id_);
    files_ = o.files_;
    id_ = o.id_;
    o.files_ = nullptr;
  }
  return *this;
}

PayloadFiles::ReadPin::~ReadPin() {
  if (files_ != nullptr) files_->Unpin(id_);
}

void PayloadFiles::Unpin(uint64_t id) {
  bool durable = true;
  {
    absl::MutexLock lock(&mu_);
    auto it = readers_.find(id);
    if (it == readers_.end() || --it->second > 0) return;
    readers_.erase(it);
    auto released = released_while_read_.find(id);
    if (released == released_while_read_.end()) return;
    durable = released->second;
    released_while_read_.erase(released);
  }
  if (absl::Status s = Release(id, durable); !s.ok()) {
    LogWarn("cannot release a payload file", {{"error", s.ToString()}});
  }
}

absl::Status PayloadFiles::Release(uint64_t id, bool durable) {
  uint64_t size = 0;
  const bool sized = fs_->GetFileSize(Path(id), rocksdb::IOOptions(), &size, nullptr).ok();
  {
    absl::MutexLock lock(&mu_);
    if (readers_.contains(id)) {
      released_while_read_[id] = durable;
      return absl::OkStatus();
    }
    // Only non-empty files: an empty one may be a spare's directory entry
    // that was never synced (a writer that failed before writing).
    if (sized && size > 0 && RecycleLocked(id, size, durable)) return absl::OkStatus();
  }
  return Remove(id);
}

size_t PayloadFiles::recycled() const {
  absl::MutexLock lock(&mu_);
  return recycled_.size() + pending_.size();
}

uint64_t PayloadFiles::recycled_bytes() const {
  absl::MutexLock lock(&mu_);
  return recycled_bytes_;
}

uint64_t PayloadFiles::recycle_hits() const {
  absl::MutexLock lock(&mu_);
  return recycle_hits_;
}

uint64_t PayloadFiles::NewIdLocked(uint32_t sub) { return (next_seq_++ << 8) | (sub & 0xff); }

absl::Status PayloadFiles::CreateEmpty(uint64_t id) {
  const std::string path = Path(id);
  rocksdb::IOOptions io;
  std::unique_ptr<rocksdb::FSWritableFile> file;
  KVT_RETURN_IF_ERROR(
      FromIo(fs_->NewWritableFile(path, rocksdb::FileOptions(), &file, nullptr), "create " + path));
  return FromIo(file->Close(io, nullptr), "close " + path);
}

absl::Status PayloadFiles::SyncDir(uint64_t id) {
  rocksdb::IOOptions io;
  std::unique_ptr<rocksdb::FSDirectory> d;
  KVT_RETURN_IF_ERROR(FromIo(fs_->NewDirectory(SubDir(id), io, &d, nullptr), "open dir"));
  return FromIo(d->Fsync(io, nullptr), "sync dir");
}

void PayloadFiles::SpareLoop() {
  absl::MutexLock lock(&mu_);
  auto low_or_stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || spare_.size() <= spare_target_ / 2;
  };
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
  while (true) {
    mu_.Await(absl::Condition(&low_or_stopping));
    if (stopping_) return;
    // One batch in one subdirectory: one directory fsync for all of it.
    const uint32_t sub = next_sub_++ & 0xff;
    std::vector<uint64_t> batch;
    while (spare_.size() + batch.size() < spare_target_) batch.push_back(NewIdLocked(sub));
    mu_.Unlock();
    absl::Status s;
    size_t made = 0;
    for (; made < batch.size() && s.ok(); ++made) s = CreateEmpty(batch[made]);
    if (s.ok() && sync_) s = SyncDir(batch.front());
    if (!s.ok()) {
      for (size_t i = 0; i < made; ++i) (void)Remove(batch[i]);
      LogWarn("cannot create spare payload files; writers create their own",
              {{"error", s.ToString()}});
    }
    mu_.Lock();
    if (s.ok()) {
      spare_.insert(spare_.end(), batch.begin(), batch.end());
    } else {
      // Retry later, without spinning on a failing disk.
      mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Seconds(1));
    }
  }
}

size_t PayloadFiles::spares() const {
  absl::MutexLock lock(&mu_);
  return spare_.size();
}

bool PayloadFiles::WaitForSpares(size_t n, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto ready = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return spare_.size() == n; };
  return mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
}

uint64_t PayloadFiles::spare_misses() const {
  absl::MutexLock lock(&mu_);
  return spare_misses_;
}

std::string PayloadFiles::SubDir(uint64_t id) const {
  return absl::StrFormat("%s/%02x", dir_, id & 0xff);
}

std::string PayloadFiles::Path(uint64_t id) const {
  return absl::StrFormat("%s/%016x%s", SubDir(id), id, kSuffix);
}

absl::StatusOr<std::unique_ptr<PayloadFiles::Writer>> PayloadFiles::NewWriter(bool sync,
                                                                              uint64_t size) {
  uint64_t id = 0;
  bool spare = false;
  bool recycled = false;
  uint64_t reused_size = 0;
  bool confirm = false;
  {
    absl::MutexLock lock(&mu_);
    confirm = recycled_.lower_bound(std::max<uint64_t>(size, 1)) == recycled_.end() &&
              pending_.lower_bound(std::max<uint64_t>(size, 1)) != pending_.end();
  }
  if (confirm) ConfirmPending();
  {
    absl::MutexLock lock(&mu_);
    // The smallest recycled file that holds `size` bytes.
    auto fit = recycled_.lower_bound(std::max<uint64_t>(size, 1));
    if (fit != recycled_.end()) {
      id = fit->second;
      reused_size = fit->first;
      recycled_bytes_ -= fit->first;
      recycled_.erase(fit);
      recycled = true;
      ++recycle_hits_;
    } else if (!spare_.empty() && (sync_ || !sync)) {
      id = spare_.front();
      spare_.pop_front();
      spare = true;
    } else {
      id = NewIdLocked(next_sub_++);
      if (spare_target_ > 0) ++spare_misses_;
    }
  }
  const std::string path = Path(id);
  std::unique_ptr<Writer> w(new Writer(this, id, sync));
  // A spare exists already (empty): opening it truncates nothing and adds no
  // directory entry. A recycled file is reopened without truncation (the
  // same name: no rename) and written from its start, over its cached
  // pages and allocated blocks; Finish cuts what lies past the payload.
  w->reused_size_ = reused_size;
  absl::Status s =
      recycled
          ? FromIo(fs_->ReuseWritableFile(path, path, rocksdb::FileOptions(), &w->file_, nullptr),
                   "reopen " + path)
          : FromIo(fs_->NewWritableFile(path, rocksdb::FileOptions(), &w->file_, nullptr),
                   "create " + path);
  if (s.ok() && sync && !spare && !recycled) {
    // The new directory entry must be durable before the index names it;
    // syncing it now overlaps that with the payload's arrival.
    s = SyncDir(id);
  }
  if (!s.ok()) return s;  // ~Writer removes the file.
  return w;
}

PayloadFiles::Writer::Writer(PayloadFiles* files, uint64_t id, bool sync)
    : files_(files), id_(id), sync_(sync) {}

PayloadFiles::Writer::~Writer() {
  if (finished_) return;
  rocksdb::IOOptions io;
  if (file_ != nullptr) (void)file_->Close(io, nullptr);
  (void)files_->Remove(id_);  // Best effort; recovery sweeps orphans too.
}

absl::Status PayloadFiles::Writer::Append(std::string_view bytes) {
  if (!status_.ok()) return status_;
  rocksdb::IOOptions io;
  // In pieces, each one's writeback started at once.
  constexpr size_t kPiece = size_t{2} << 20;
  for (size_t at = 0; at < bytes.size() && status_.ok(); at += kPiece) {
    const size_t n = std::min(kPiece, bytes.size() - at);
    const rocksdb::Slice piece(bytes.data() + at, n);
    status_ = FromIo(file_->Append(piece, io, nullptr), absl::StrCat("write payload file ", id_));
    if (status_.ok() && sync_) {
      status_ = FromIo(file_->RangeSync(written_, n, io, nullptr),
                       absl::StrCat("write back payload file ", id_));
    }
    if (status_.ok()) written_ += n;
  }
  return status_;
}

absl::Status PayloadFiles::Writer::Finish() {
  if (!status_.ok()) return status_;
  rocksdb::IOOptions io;
  if (written_ < reused_size_) {
    // A recycled file longer than this payload: its tail goes (the disk
    // budget counts payload bytes), and the file's size is the payload's,
    // made durable by the sync below.
    status_ =
        FromIo(file_->Truncate(written_, io, nullptr), absl::StrCat("cut payload file ", id_));
  }
  if (status_.ok() && sync_) {
    status_ = FromIo(file_->Sync(io, nullptr), absl::StrCat("sync payload file ", id_));
  }
  if (status_.ok()) {
    status_ = FromIo(file_->Close(io, nullptr), absl::StrCat("close payload file ", id_));
  }
  if (!status_.ok()) return status_;
  file_.reset();
  finished_ = true;
  return absl::OkStatus();
}

absl::StatusOr<std::string> PayloadFiles::Read(uint64_t id, uint64_t size) const {
  const std::string path = Path(id);
  std::unique_ptr<rocksdb::FSRandomAccessFile> file;
  rocksdb::IOOptions io;
  if (auto s = FromIo(fs_->NewRandomAccessFile(path, rocksdb::FileOptions(), &file, nullptr),
                      "open " + path);
      !s.ok()) {
    return s;
  }
  std::string out(size, '\0');
  uint64_t done = 0;
  while (done < size) {
    rocksdb::Slice got;
    const size_t want = static_cast<size_t>(std::min<uint64_t>(size - done, 64 << 20));
    if (auto s =
            FromIo(file->Read(done, want, io, &got, out.data() + done, nullptr), "read " + path);
        !s.ok()) {
      return s;
    }
    if (got.size() == 0) break;
    if (got.data() != out.data() + done) std::memcpy(out.data() + done, got.data(), got.size());
    done += got.size();
  }
  if (done != size) {
    return absl::DataLossError(absl::StrCat(path, " holds ", done, " bytes, expected ", size));
  }
  return out;
}

absl::Status PayloadFiles::Remove(uint64_t id) {
  rocksdb::IOStatus s = fs_->DeleteFile(Path(id), rocksdb::IOOptions(), nullptr);
  if (s.IsNotFound() || s.IsPathNotFound()) return absl::OkStatus();
  return FromIo(s, "delete payload file");
}

absl::StatusOr<std::vector<uint64_t>> PayloadFiles::List() const {
  std::vector<uint64_t> ids;
  for (uint64_t i = 0; i < 256; ++i) {
    std::vector<std::string> names;
    if (auto s = FromIo(fs_->GetChildren(SubDir(i), rocksdb::IOOptions(), &names, nullptr),
                        "list " + SubDir(i));
        !s.ok()) {
      return s;
    }
    for (const std::string& n : names) {
      uint64_t id;
      if (n.size() == 16 + sizeof(kSuffix) - 1 && n.substr(16) == kSuffix &&
          absl::SimpleHexAtoi(n.substr(0, 16), &id)) {
        ids.push_back(id);
      }
    }
  }
  return ids;
}

}  // namespace kvtier::cachestore
