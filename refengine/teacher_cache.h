// The full cache's logits of replayed conversations, kept in a directory so
// that replays of the same conversations under several policies (the
// fidelity suite, bench/gemma_suite.py) run the full cache once per
// conversation instead of once per policy. The logits are the exact fp32
// values the full cache produced; a replay scored from them gives the same
// figures as one that ran the full cache beside the tier.
//
// One file per entry, named by a 64-bit FNV-1a hash of what the logits
// depend on: `identity` (the caller's: the model file and the binary that
// computes them), the script's tokens and ScriptOptions. The file repeats
// the identity and the script's shape, and each round carries a CRC-32C: a
// file that does not match what is asked for is an error, never a silent
// miss. Entries are written to a temporary file and renamed when complete,
// so a crash leaves no partial entry. Nothing is evicted: the directory
// holds positions x vocabulary x 4 bytes per conversation (Gemma 3's
// 262,144-word vocabulary: 1 MiB a position); its owner removes it.
//
// Thread safety: a TeacherCache is immutable and may be shared; Reader and
// Writer are each used by one thread at a time. Concurrent writers of the
// same entry are safe (the last rename wins; both files hold the same
// logits).
#ifndef KVTIER_REFENGINE_TEACHER_CACHE_H_
#define KVTIER_REFENGINE_TEACHER_CACHE_H_

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "refengine/conversation.h"

namespace kvtier::refengine {

class TeacherCache {
 public:
  // Reads one entry's rounds in order.
  class Reader {
   public:
    // Round `round`'s logits ([assistant tokens, vocab]); rounds are read
    // in order from 0. DATA_LOSS when the round's CRC does not match,
    // FAILED_PRECONDITION when asked out of order.
    absl::StatusOr<std::vector<float>> Round(int round);
    // The full cache's time per answer token when the entry was written
    // (Transcript::decode_ms_per_token).
    double decode_ms_per_token() const { return decode_ms_per_token_; }

   private:
    friend class TeacherCache;
    std::string path_;
    std::unique_ptr<FILE, int (*)(FILE*)> file_{nullptr, &fclose};
    std::vector<uint64_t> floats_;  // Per round.
    int next_ = 0;
    double decode_ms_per_token_ = 0;
  };

  // Writes one entry's rounds in order; the entry exists once Commit
  // returns OK. Destroying an uncommitted Writer removes its temporary file.
  class Writer {
   public:
    ~Writer();
    Writer(Writer&&) = default;
    // Round `round`'s logits, rounds in order from 0, each of the size the
    // script gives (INVALID_ARGUMENT otherwise).
    absl::Status Append(int round, const std::vector<float>& logits);
    // After every round: records the time per answer token and renames the
    // file into place.
    absl::Status Commit(double decode_ms_per_token);

   private:
    friend class TeacherCache;
    Writer() = default;
    std::string path_, temp_;
    std::unique_ptr<FILE, int (*)(FILE*)> file_{nullptr, &fclose};
    std::vector<uint64_t> floats_;
    int next_ = 0;
  };

  // `dir` is created when missing (INTERNAL naming it when it cannot be).
  // `identity` names everything besides the script that the logits depend
  // on (FileIdentity of the model file and of the running binary).
  static absl::StatusOr<TeacherCache> Open(const std::string& dir, std::string identity);

  // The entry for `script` replayed with `options` over a `vocab`-word
  // model: std::nullopt when there is none; DATA_LOSS naming the file when
  // there is one that does not hold what is asked for (a different
  // identity or shape under the same hash) or is damaged.
  absl::StatusOr<std::optional<Reader>> Find(const std::vector<ScriptRound>& script,
                                             const ScriptOptions& options, int vocab) const;
  // A new entry for the same arguments.
  absl::StatusOr<Writer> Create(const std::vector<ScriptRound>& script,
                                const ScriptOptions& options, int vocab) const;

  // The file an entry lives in (for messages and tests).
  std::string PathOf(const std::vector<ScriptRound>& script, const ScriptOptions& options) const;

 private:
  TeacherCache(std::string dir, std::string identity)
      : dir_(std::move(dir)), identity_(std::move(identity)) {}
  std::string dir_, identity_;
};

// "PATH SIZE MTIME_NS" of a file, following links (NOT_FOUND when it cannot
// be read): what TeacherCache's identity is made of.
absl::StatusOr<std::string> FileIdentity(const std::string& path);

}  // namespace kvtier::refengine

#endif  // KVTIER_REFENGINE_TEACHER_CACHE_H_
