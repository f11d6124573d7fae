// What every kvtier fuzz target defines, besides libFuzzer's
// LLVMFuzzerTestOneInput: the seed inputs, built with the same helpers the
// tests use, so a run starts from well-formed messages and mutates outward.
//
// A target builds two ways (fuzz/CMakeLists.txt):
//   - with clang and -DKVTIER_FUZZ=ON, as a libFuzzer binary (`make fuzz`);
//   - in every other build, linked with replay_main.cc: it runs the seeds,
//     any corpus files given, and seeded random mutations of them for a few
//     seconds, which is the short run in the default test suite.
#ifndef KVTIER_FUZZ_FUZZ_TARGET_H_
#define KVTIER_FUZZ_FUZZ_TARGET_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace kvtier::fuzz {

std::vector<std::string> Seeds();

// Called once after the last input, before the process exits: a target that
// keeps process-wide state (a server, its threads and temporary directory)
// stops and removes it here, so that nothing of it runs while the static
// destructors do. replay_main.cc calls it before main returns; under
// libFuzzer a target registers it with std::atexit when it builds that
// state. Calling it twice is harmless. Default (weak): nothing.
void TearDown();

// A little-endian length-prefixed split of the input, for targets that take
// several messages: each part is a 2-byte length and that many bytes (the
// last part takes what is left when the length runs past the end).
std::vector<std::string> SplitParts(const uint8_t* data, size_t size, size_t max_parts);
// The inverse, for building seeds.
std::string JoinParts(const std::vector<std::string>& parts);

}  // namespace kvtier::fuzz

#endif  // KVTIER_FUZZ_FUZZ_TARGET_H_
