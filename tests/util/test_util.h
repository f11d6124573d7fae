// Helpers shared by kvtier's tests and benchmarks: deterministic segment
// payloads and temporary directories.
#ifndef KVTIER_TESTS_UTIL_TEST_UTIL_H_
#define KVTIER_TESTS_UTIL_TEST_UTIL_H_

#include <cstdint>
#include <string>

namespace kvtier::testing {

// A serialized SegmentPayload of one raw fp16 tensor whose serialized size is
// close to `target_bytes` (at least 64). The content is a function of `seed`.
std::string MakePayload(uint64_t target_bytes, uint64_t seed);

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

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_TEST_UTIL_H_
