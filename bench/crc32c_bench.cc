// Google Benchmark: CRC-32C throughput (each hardware path, portable table)
// against memcpy of the same buffer, measured in the same run.
#include <cstring>
#include <random>
#include <string>

#include "benchmark/benchmark.h"
#include "kernels/crc32c.h"

namespace {

std::string RandomBuffer(size_t n) {
  std::string s(n, '\0');
  std::mt19937_64 rng(1);
  for (size_t i = 0; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    std::memcpy(&s[i], &v, 8);
  }
  return s;
}

void BM_Memcpy(benchmark::State& state) {
  std::string src = RandomBuffer(state.range(0)), dst(state.range(0), '\0');
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), src.size());
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

// Every path this CPU has (arg 1: 1 = sse4.2 crc32 x3, 2 = pclmulqdq folding,
// 3 = vpclmulqdq 512-bit folding, 4 = vpclmulqdq 256-bit folding); the one in
// use is marked.
void BM_Crc32c(benchmark::State& state) {
  const auto path = static_cast<kvtier::Crc32cPath>(state.range(1));
  if (!kvtier::Crc32cPathAvailable(path)) {
    state.SkipWithError("not on this CPU");
    return;
  }
  std::string src = RandomBuffer(state.range(0));
  for (auto _ : state) {
    benchmark::DoNotOptimize(kvtier::Crc32cExtendWith(path, 0, src.data(), src.size()));
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
  state.SetLabel(std::string(kvtier::Crc32cPathName(path)) +
                 (path == kvtier::Crc32cActivePath() ? " (in use)" : ""));
}

void BM_Crc32cPortable(benchmark::State& state) {
  std::string src = RandomBuffer(state.range(0));
  for (auto _ : state) {
    benchmark::DoNotOptimize(kvtier::Crc32cExtendPortable(0, src.data(), src.size()));
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

BENCHMARK(BM_Memcpy)->Arg(64 << 10)->Arg(1 << 20)->Arg(16 << 20);
BENCHMARK(BM_Crc32c)->ArgsProduct({{4 << 10, 64 << 10, 1 << 20, 16 << 20}, {1, 2, 3, 4}});
BENCHMARK(BM_Crc32cPortable)->Arg(1 << 20);

}  // namespace

BENCHMARK_MAIN();
