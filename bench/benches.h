// The kvtier-bench subcommands and the baselines they share.
#ifndef KVTIER_BENCH_BENCHES_H_
#define KVTIER_BENCH_BENCHES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvtier::bench {

int StoreBench(int argc, char** argv);        // store_bench.cc
int StoreScaleBench(int argc, char** argv);   // store_scale_bench.cc
int TransferBench(int argc, char** argv);     // transfer_bench.cc
int PoolBench(int argc, char** argv);         // pool_bench.cc
int SpeculationBench(int argc, char** argv);  // speculation_bench.cc

// Forks the process that TcpLoopbackGbps sends to (once; later calls do
// nothing). Call it before starting threads or allocating much: the child
// is a copy of the caller at that point, and lives until the caller exits.
void StartTcpSink();

// Sends `bytes_per_stream` over each of `streams` loopback TCP connections
// to the sink process, which discards them; returns GB/s (1e9 bytes/s).
// Starts the sink first if it is not running.
double TcpLoopbackGbps(int streams, uint64_t bytes_per_stream);

// The middle value (the upper one of an even count); 0 when empty.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The value of `arg` when it is `flag` followed by it ("--rounds=" and
// "--rounds=8" give "8"), else null.
inline const char* FlagValue(const std::string& arg, const char* flag) {
  const size_t n = std::strlen(flag);
  return arg.compare(0, n, flag) == 0 ? arg.c_str() + n : nullptr;
}

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_BENCHES_H_
