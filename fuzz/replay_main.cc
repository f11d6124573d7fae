// The driver of a fuzz target outside libFuzzer: runs every seed, every
// file given on the command line (a corpus or a crash input), then random
// mutations of them (flips, inserts, deletes, truncations, splices) until
// KVTIER_FUZZ_SECONDS (default 3) have passed. Deterministic per
// KVTIER_FUZZ_RNG_SEED (default 1). A crash or a sanitizer report fails the
// run; the last input is then in $KVTIER_FUZZ_LAST (default
// ./fuzz-last-input) for replay.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "fuzz/fuzz_target.h"

namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void Remember(const std::string& input) {
  const char* p = std::getenv("KVTIER_FUZZ_LAST");
  std::ofstream(p != nullptr ? p : "fuzz-last-input", std::ios::binary | std::ios::trunc) << input;
}

void Run(const std::string& input) {
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
}

std::string Mutate(const std::vector<std::string>& pool, std::mt19937_64& rng) {
  std::string s = pool[rng() % pool.size()];
  const int edits = 1 + static_cast<int>(rng() % 8);
  for (int e = 0; e < edits; ++e) {
    const size_t at = s.empty() ? 0 : rng() % s.size();
    switch (rng() % 6) {
      case 0:  // Flip bits.
        if (!s.empty()) s[at] = static_cast<char>(s[at] ^ (1u << (rng() % 8)));
        break;
      case 1:  // A random byte.
        if (!s.empty()) s[at] = static_cast<char>(rng());
        break;
      case 2:  // Insert bytes (sometimes an interesting one).
        s.insert(at, std::string(1 + rng() % 4, static_cast<char>(rng() % 2 ? 0xff : rng())));
        break;
      case 3:  // Delete a run.
        if (!s.empty()) s.erase(at, 1 + rng() % std::min<size_t>(16, s.size() - at));
        break;
      case 4:  // Truncate.
        s.resize(at);
        break;
      case 5: {  // Splice in a piece of another input.
        const std::string& o = pool[rng() % pool.size()];
        if (!o.empty()) {
          const size_t from = rng() % o.size();
          s.insert(at, o.substr(from, 1 + rng() % (o.size() - from)));
        }
        break;
      }
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> pool = kvtier::fuzz::Seeds();
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path p(argv[i]);
    if (std::filesystem::is_directory(p)) {
      for (const auto& e : std::filesystem::directory_iterator(p))
        pool.push_back(ReadFile(e.path()));
    } else {
      pool.push_back(ReadFile(p));
    }
  }
  if (pool.empty()) pool.emplace_back();
  for (const std::string& s : pool) {
    Remember(s);
    Run(s);
  }
  const char* secs = std::getenv("KVTIER_FUZZ_SECONDS");
  const char* seed = std::getenv("KVTIER_FUZZ_RNG_SEED");
  const double budget = secs != nullptr ? std::atof(secs) : 3.0;
  std::mt19937_64 rng(seed != nullptr ? std::strtoull(seed, nullptr, 10) : 1);
  const auto start = std::chrono::steady_clock::now();
  long runs = 0;
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < budget) {
    const std::string input = Mutate(pool, rng);
    Remember(input);
    Run(input);
    ++runs;
  }
  kvtier::fuzz::TearDown();
  std::printf("%s: %zu seeds and inputs, %ld mutations in %.1f s, no crash\n", argv[0], pool.size(),
              runs, budget);
  return 0;
}
