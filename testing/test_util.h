// Helpers shared by kvtier's tests and benchmarks: deterministic segment
// payloads and temporary directories.
#ifndef KVTIER_TESTING_TEST_UTIL_H_
#define KVTIER_TESTING_TEST_UTIL_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier::testing {

// A serialized SegmentPayload of one raw fp16 tensor whose serialized size is
// close to `target_bytes` (at least 64). The content is a function of `seed`;
// the tensor starts at `layer_begin` (the store checks it lies within the
// segment's layers).
std::string MakePayload(uint64_t target_bytes, uint64_t seed, uint32_t layer_begin = 0);

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on
// destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Writes `text` to `path` (created or truncated); aborts the test binary on
// failure, which only a broken temp dir can cause.
void WriteFile(const std::string& path, const std::string& text);

// Path of the shared test model (../shared/models/stories260K.bin beside the
// source tree, or $KVTIER_MODEL), or "" when it is not there.
std::string SharedModelPath();

// A file of the source tree (KVTIER_SOURCE_DIR, set by ctest), e.g.
// SourcePath("traces/stories260k_chats.jsonl").
std::string SourcePath(const std::string& relative);

// True when CI=true: a missing shared model is then a failure, not a skip.
bool InCi();

// A self-signed certificate for localhost (CN and subjectAltName
// DNS:localhost, valid a day) and its key, as PEM files in a directory.
struct SelfSignedCert {
  std::string cert, key;  // The files' paths.
  std::string pem;        // The certificate, for a client's root certificates.
};
// Made by the openssl CLI in `dir`. UNAVAILABLE when openssl is not
// installed (a test then skips: `make deps` installs it); INTERNAL when it
// fails.
absl::StatusOr<SelfSignedCert> MakeSelfSignedCert(const std::string& dir);

// A whole file's bytes; aborts the test binary when it cannot be read.
std::string ReadFileOrDie(const std::string& path);

// A certificate authority made by the openssl CLI in a directory, for
// mutual-TLS tests: it signs leaf certificates (EC P-256, valid a day)
// whose subjectAltName is what the caller gives.
class TestCa {
 public:
  // UNAVAILABLE when openssl is not installed; INTERNAL when it fails.
  static absl::StatusOr<TestCa> Make(const std::string& dir, const std::string& name);
  // A certificate for `name` with subjectAltName `san` ("DNS:localhost,
  // IP:127.0.0.1", "DNS:store-0"), signed by this CA.
  absl::StatusOr<SelfSignedCert> Issue(const std::string& name, const std::string& san) const;
  const std::string& pem() const { return ca_.pem; }
  const std::string& cert_path() const { return ca_.cert; }

 private:
  std::string dir_;
  SelfSignedCert ca_;
};

// The whole HTTP/1.0 response (status line, headers, body) to GET `path` on
// 127.0.0.1:`port`, or "" when nothing listens there.
std::string HttpGet(int port, const std::string& path);

// This binary run again (/proc/self/exe) as a child with `args`, its stdin
// and stdout on pipes: the CUDA IPC checks need a second process, since a
// handle opens only in another one. The child is forked and exec'd at once
// (nothing of this process's state, CUDA's included, is used in between).
class SelfChild {
 public:
  explicit SelfChild(const std::vector<std::string>& args);
  // Wait().
  ~SelfChild();
  SelfChild(const SelfChild&) = delete;
  SelfChild& operator=(const SelfChild&) = delete;
  bool started() const { return pid_ > 0 && out_ != nullptr; }
  // The child's stdout, line by line; null when it did not start.
  std::FILE* out() const { return out_; }
  // Writes `text` to its stdin; false when it is gone.
  bool Send(const std::string& text);
  // Closes its stdin, reads its stdout to the end (into *rest when given),
  // and waits: the exit status as waitpid gives it, or -1 when it did not
  // start. The first call waits; later ones give the same status.
  int Wait(std::string* rest = nullptr);

 private:
  int pid_ = -1;
  int in_ = -1;  // Its stdin.
  std::FILE* out_ = nullptr;
  bool waited_ = false;
  int status_ = -1;
};

}  // namespace kvtier::testing

// Sets `var` to the shared model's path, or skips the test (fails under
// CI=true) with a message saying where the model was looked for.
#define KVT_REQUIRE_SHARED_MODEL(var)                                             \
  std::string var = ::kvtier::testing::SharedModelPath();                         \
  if (var.empty()) {                                                              \
    if (::kvtier::testing::InCi()) {                                              \
      FAIL() << "CI=true but ../shared/models/stories260K.bin is missing";        \
    }                                                                             \
    GTEST_SKIP() << "needs ../shared/models/stories260K.bin beside the checkout " \
                    "(or KVTIER_MODEL=path); a user's clone has none";            \
  }

#endif  // KVTIER_TESTING_TEST_UTIL_H_
