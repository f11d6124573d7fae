#include "cachestore/payload_files.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

absl::StatusOr<std::unique_ptr<PayloadFiles>> PayloadFiles::Open(rocksdb::FileSystem* fs,
                                                                 std::string dir) {
  rocksdb::IOOptions io;
  if (auto s = FromIo(fs->CreateDirIfMissing(dir, io, nullptr), "create " + dir); !s.ok()) {
    return s;
  }
  std::unique_ptr<PayloadFiles> files(new PayloadFiles(fs, std::move(dir)));
  for (uint64_t i = 0; i < 256; ++i) {
    const std::string sub = files->SubDir(i);
    if (auto s = FromIo(fs->CreateDirIfMissing(sub, io, nullptr), "create " + sub); !s.ok()) {
      return s;
    }
  }
  return files;
}

std::string PayloadFiles::SubDir(uint64_t id) const {
  return absl::StrFormat("%s/%02x", dir_, id & 0xff);
}

std::string PayloadFiles::Path(uint64_t id) const {
  return absl::StrFormat("%s/%016x%s", SubDir(id), id, kSuffix);
}

absl::StatusOr<std::unique_ptr<PayloadFiles::Writer>> PayloadFiles::NewWriter(uint64_t id,
                                                                              bool sync) {
  const std::string path = Path(id);
  rocksdb::IOOptions io;
  std::unique_ptr<Writer> w(new Writer(this, id, sync));
  absl::Status s = FromIo(fs_->NewWritableFile(path, rocksdb::FileOptions(), &w->file_, nullptr),
                          "create " + path);
  if (s.ok() && sync) {
    // The new directory entry must be durable before the index names it;
    // syncing it now overlaps that with the payload's arrival.
    std::unique_ptr<rocksdb::FSDirectory> d;
    s = FromIo(fs_->NewDirectory(SubDir(id), io, &d, nullptr), "open dir");
    if (s.ok()) s = FromIo(d->Fsync(io, nullptr), "sync dir");
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
    status_ = FromIo(file_->Append(rocksdb::Slice(bytes.data() + at, n), io, nullptr),
                     absl::StrCat("write payload file ", id_));
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
  if (sync_) status_ = FromIo(file_->Sync(io, nullptr), absl::StrCat("sync payload file ", id_));
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
