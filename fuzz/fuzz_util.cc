#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "fuzz/fuzz_target.h"
#include "google/protobuf/stubs/logging.h"

namespace kvtier::fuzz {
namespace {

// Malformed input is the point here: protobuf's parse-error log lines are
// noise.
const bool kQuietProtobuf = [] {
  google::protobuf::SetLogHandler(nullptr);
  return true;
}();

}  // namespace

__attribute__((weak)) void TearDown() {}

std::vector<std::string> SplitParts(const uint8_t* data, size_t size, size_t max_parts) {
  std::vector<std::string> parts;
  size_t at = 0;
  while (at < size && parts.size() < max_parts) {
    if (size - at < 2) break;
    size_t len = data[at] | (size_t{data[at + 1]} << 8);
    at += 2;
    len = std::min(len, size - at);
    parts.emplace_back(reinterpret_cast<const char*>(data + at), len);
    at += len;
  }
  return parts;
}

std::string JoinParts(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& p : parts) {
    const size_t len = std::min<size_t>(p.size(), 0xffff);
    out.push_back(static_cast<char>(len & 0xff));
    out.push_back(static_cast<char>(len >> 8));
    out.append(p, 0, len);
  }
  return out;
}

}  // namespace kvtier::fuzz

// With KVTIER_FUZZ_WRITE_SEEDS=DIR, a libFuzzer binary writes its seeds
// into DIR (the corpus `make fuzz` starts from) and exits.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("KVTIER_FUZZ_WRITE_SEEDS");
  if (dir == nullptr) return 0;
  std::filesystem::create_directories(dir);
  int i = 0;
  for (const std::string& s : kvtier::fuzz::Seeds()) {
    std::ofstream(std::string(dir) + "/seed-" + std::to_string(i++), std::ios::binary) << s;
  }
  std::printf("wrote %d seeds to %s\n", i, dir);
  std::exit(0);
}
