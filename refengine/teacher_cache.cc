#include "refengine/teacher_cache.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/crc32c.h"

namespace kvtier::refengine {
namespace {

// The file, in native byte order (it never leaves the machine):
//   "KVTTCH01"
//   u32 identity length, the identity's bytes
//   u32 answer_prefill, u32 vocab, u32 rounds, u64 floats of each round
//   per round: its floats, then u32 CRC-32C of them
//   f64 decode_ms_per_token, "KVTTEND1"
constexpr char kMagic[] = "KVTTCH01";
constexpr char kEnd[] = "KVTTEND1";
constexpr size_t kTrailer = sizeof(double) + 8;

uint64_t Fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

std::vector<uint64_t> FloatsOf(const std::vector<ScriptRound>& script, int vocab) {
  std::vector<uint64_t> out;
  out.reserve(script.size());
  for (const ScriptRound& r : script)
    out.push_back(r.assistant.size() * static_cast<uint64_t>(vocab));
  return out;
}

absl::Status Io(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

template <typename T>
bool Put(FILE* f, const T& x) {
  return fwrite(&x, sizeof(x), 1, f) == 1;
}
template <typename T>
bool Get(FILE* f, T* x) {
  return fread(x, sizeof(*x), 1, f) == 1;
}

}  // namespace

absl::StatusOr<std::string> FileIdentity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("stat ", path, ": ", std::strerror(errno)));
  }
  const int64_t mtime_ns =
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return absl::StrCat(path, " ", static_cast<int64_t>(st.st_size), " ", mtime_ns);
}

absl::StatusOr<TeacherCache> TeacherCache::Open(const std::string& dir, std::string identity) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("teacher cache ", dir, ": ", ec.message()));
  return TeacherCache(dir, std::move(identity));
}

std::string TeacherCache::PathOf(const std::vector<ScriptRound>& script,
                                 const ScriptOptions& options) const {
  uint64_t h = 0xcbf29ce484222325ULL;
  h = Fnv1a(h, identity_.data(), identity_.size());
  const uint32_t prefill = options.answer_prefill ? 1 : 0;
  h = Fnv1a(h, &prefill, sizeof(prefill));
  for (const ScriptRound& r : script) {
    for (const std::vector<int>* part : {&r.user, &r.assistant}) {
      const uint64_t n = part->size();
      h = Fnv1a(h, &n, sizeof(n));
      h = Fnv1a(h, part->data(), part->size() * sizeof(int));
    }
  }
  return absl::StrFormat("%s/%016x.teacher", dir_, h);
}

absl::StatusOr<std::optional<TeacherCache::Reader>> TeacherCache::Find(
    const std::vector<ScriptRound>& script, const ScriptOptions& options, int vocab) const {
  Reader r;
  r.path_ = PathOf(script, options);
  r.file_.reset(fopen(r.path_.c_str(), "rb"));
  if (r.file_ == nullptr) {
    if (errno == ENOENT) return std::nullopt;
    return Io("open", r.path_);
  }
  FILE* f = r.file_.get();
  auto damaged = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("teacher cache entry ", r.path_, ": ", why,
                                            " (remove the file to compute it again)"));
  };
  char magic[8];
  uint32_t id_len = 0;
  if (fread(magic, 1, 8, f) != 8 || std::memcmp(magic, kMagic, 8) != 0 || !Get(f, &id_len) ||
      id_len > (1u << 16)) {
    return damaged("not a teacher cache file");
  }
  std::string identity(id_len, '\0');
  uint32_t prefill = 0, file_vocab = 0, rounds = 0;
  if (fread(identity.data(), 1, id_len, f) != id_len || !Get(f, &prefill) || !Get(f, &file_vocab) ||
      !Get(f, &rounds)) {
    return damaged("truncated header");
  }
  if (identity != identity_) {
    return damaged(absl::StrCat("written for '", identity, "', not '", identity_, "'"));
  }
  const std::vector<uint64_t> want = FloatsOf(script, vocab);
  if (prefill != (options.answer_prefill ? 1u : 0u) || static_cast<int>(file_vocab) != vocab ||
      rounds != want.size()) {
    return damaged(absl::StrCat("holds ", rounds, " rounds over ", file_vocab, " words; asked for ",
                                want.size(), " over ", vocab));
  }
  r.floats_.resize(rounds);
  for (uint64_t& n : r.floats_) {
    if (!Get(f, &n)) return damaged("truncated header");
  }
  if (r.floats_ != want) return damaged("its rounds' lengths differ from the conversation's");
  // The trailer: the timing and the end mark (a committed file has both).
  const long body = ftell(f);
  char end[8];
  if (fseek(f, -static_cast<long>(kTrailer), SEEK_END) != 0 || !Get(f, &r.decode_ms_per_token_) ||
      fread(end, 1, 8, f) != 8 || std::memcmp(end, kEnd, 8) != 0 || fseek(f, body, SEEK_SET) != 0) {
    return damaged("no end mark");
  }
  return std::optional<Reader>(std::move(r));
}

absl::StatusOr<std::vector<float>> TeacherCache::Reader::Round(int round) {
  if (round != next_ || round >= static_cast<int>(floats_.size())) {
    return absl::FailedPreconditionError(absl::StrCat("teacher cache entry ", path_, ": round ",
                                                      round, " asked after ", next_, " of ",
                                                      floats_.size()));
  }
  std::vector<float> out(floats_[round]);
  uint32_t crc = 0;
  if (fread(out.data(), sizeof(float), out.size(), file_.get()) != out.size() ||
      !Get(file_.get(), &crc)) {
    return absl::DataLossError(
        absl::StrCat("teacher cache entry ", path_, ": truncated in round ", round));
  }
  if (Crc32cExtend(0, out.data(), out.size() * sizeof(float)) != crc) {
    return absl::DataLossError(absl::StrCat("teacher cache entry ", path_, ": round ", round,
                                            " fails its CRC (remove the file)"));
  }
  ++next_;
  return out;
}

absl::StatusOr<TeacherCache::Writer> TeacherCache::Create(const std::vector<ScriptRound>& script,
                                                          const ScriptOptions& options,
                                                          int vocab) const {
  Writer w;
  w.path_ = PathOf(script, options);
  static std::atomic<uint64_t> writers{0};
  w.temp_ = absl::StrCat(w.path_, ".tmp-", ::getpid(), "-", writers++);
  w.floats_ = FloatsOf(script, vocab);
  w.file_.reset(fopen(w.temp_.c_str(), "wb"));
  if (w.file_ == nullptr) return Io("create", w.temp_);
  FILE* f = w.file_.get();
  const uint32_t id_len = static_cast<uint32_t>(identity_.size());
  const uint32_t prefill = options.answer_prefill ? 1 : 0;
  const uint32_t v = static_cast<uint32_t>(vocab);
  const uint32_t rounds = static_cast<uint32_t>(w.floats_.size());
  bool ok = fwrite(kMagic, 1, 8, f) == 8 && Put(f, id_len) &&
            fwrite(identity_.data(), 1, id_len, f) == id_len && Put(f, prefill) && Put(f, v) &&
            Put(f, rounds);
  for (uint64_t n : w.floats_) ok = ok && Put(f, n);
  if (!ok) return Io("write", w.temp_);
  return w;
}

TeacherCache::Writer::~Writer() {
  if (file_ != nullptr) {
    file_.reset();
    ::unlink(temp_.c_str());
  }
}

absl::Status TeacherCache::Writer::Append(int round, const std::vector<float>& logits) {
  if (round != next_ || round >= static_cast<int>(floats_.size()) ||
      logits.size() != floats_[round]) {
    return absl::InvalidArgumentError(absl::StrCat("teacher cache ", temp_, ": round ", round,
                                                   " of ", logits.size(), " logits after ", next_,
                                                   " rounds of ", floats_.size()));
  }
  const uint32_t crc = Crc32cExtend(0, logits.data(), logits.size() * sizeof(float));
  if (fwrite(logits.data(), sizeof(float), logits.size(), file_.get()) != logits.size() ||
      !Put(file_.get(), crc)) {
    return Io("write", temp_);
  }
  ++next_;
  return absl::OkStatus();
}

absl::Status TeacherCache::Writer::Commit(double decode_ms_per_token) {
  if (next_ != static_cast<int>(floats_.size())) {
    return absl::FailedPreconditionError(absl::StrCat("teacher cache ", temp_, ": commit after ",
                                                      next_, " of ", floats_.size(), " rounds"));
  }
  FILE* f = file_.get();
  if (!Put(f, decode_ms_per_token) || fwrite(kEnd, 1, 8, f) != 8 || fflush(f) != 0) {
    return Io("write", temp_);
  }
  if (fclose(file_.release()) != 0) {
    ::unlink(temp_.c_str());
    return Io("close", temp_);
  }
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    const absl::Status s = Io(absl::StrCat("rename to ", path_, " from"), temp_);
    ::unlink(temp_.c_str());
    return s;
  }
  return absl::OkStatus();
}

}  // namespace kvtier::refengine
