// kvtier-gpu-bench's shared pieces (gpu_bench.cc, gpu_batch.cc): the step's
// shape, its inputs encoded with the CPU codec and staged as kvtier-worker
// stages them, their float64 reference, and timing with CUDA events.
#ifndef KVTIER_BENCH_GPU_STEP_H_
#define KVTIER_BENCH_GPU_STEP_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kernels/codec.h"
#include "worker/device/layout.h"

namespace kvtier::bench::gpu {

constexpr int kQHeads = 32, kKvHeads = 8, kDim = 128;

#define GPU_CHECK(expr)                                                                  \
  do {                                                                                   \
    const cudaError_t e_ = (expr);                                                       \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "kvtier-gpu-bench: %s: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

struct Options {
  std::vector<int64_t> tokens = {4096, 32768, 131072};
  std::vector<std::string> codecs = {"fp16", "kivi4", "kivi2"};
  int reps = 20;
  std::string csv;
  bool cpu_check = false;
  bool general = true;        // Also time the general kernel (slow at 128K).
  bool flush = true;          // Write over 256 MiB before each timed launch.
  std::vector<int> prefetch;  // Prefetch distances to time the span kernel at.
  int batch_sessions = 0;     // --batch=SxT: only the batched-decode table.
  int64_t batch_tokens = 0;
};

// Median of `reps` timed calls of fn (after 3 warm-up calls), in ms.
template <typename Fn>
double MedianMs(int reps, Fn fn, const std::function<void()>& before = nullptr) {
  cudaEvent_t a, b;
  GPU_CHECK(cudaEventCreate(&a));
  GPU_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  GPU_CHECK(cudaDeviceSynchronize());
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    if (before) before();
    GPU_CHECK(cudaEventRecord(a));
    fn();
    GPU_CHECK(cudaEventRecord(b));
    GPU_CHECK(cudaEventSynchronize(b));
    float t = 0;
    GPU_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  GPU_CHECK(cudaEventDestroy(a));
  GPU_CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Writes over a buffer larger than the L2 cache before each timed launch, so
// that a step reads its K/V from device memory, as a decode step does after
// the other layers' steps (a 4K-token fp16 layer would otherwise sit in L2).
void FlushL2();

// One decode step's inputs: K and V encoded with the CPU codec and staged as
// kvtier-worker stages them, the codec's reconstruction of them (for the
// reference), the query and the open round's one row.
struct Step {
  int64_t tokens = 0;
  std::vector<uint8_t> staged;
  std::vector<std::pair<worker::StagedKv, worker::StagedKv>> heads;
  std::vector<EncodedBlock> tensors;  // K, V per KV head: what `views` point into.
  std::vector<std::pair<EncodedView, EncodedView>> views;
  std::vector<std::vector<float>> k_dec, v_dec;
  std::vector<float> q, open_k, open_v;  // Token-major, fp32.
};

[[noreturn]] void Die(const char* what, const absl::Status& st);

// The step's inputs for codec `setting` and `t` tokens; `salt` varies the
// values (the sessions of a batch differ).
Step Prepare(const std::string& setting, int64_t t, uint64_t salt = 0);

// Attention of the step in float64 over the reconstruction plus the open
// row: [q_heads, d].
std::vector<double> Reference(const Step& st);

// ||got - want|| / ||want||; infinite when `got` holds a non-finite value.
double RelError(const std::vector<float>& got, const std::vector<double>& want);

// The fewest bytes the kernel must move: the encoded K/V (the staged array,
// alignment padding aside), the open rows and the query once, the output once.
double FloorBytes(const Step& st);

// --batch: the batched-decode table and its targets (gpu_batch.cc); 1 when
// a result was wrong.
int RunBatch(const Options& o, double copy_gbps);

}  // namespace kvtier::bench::gpu

#endif  // KVTIER_BENCH_GPU_STEP_H_
