// A fixed pool of threads that runs closures in FIFO order. gRPC callback
// handlers hand blocking work (RocksDB I/O, fsync) to it so that no callback
// thread ever blocks.
#ifndef KVTIER_BASE_EXECUTOR_H_
#define KVTIER_BASE_EXECUTOR_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvtier {

// Thread-safe. The destructor runs every task already scheduled, then joins.
class Executor {
 public:
  explicit Executor(int num_threads);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `task`. Tasks scheduled after destruction began are still run.
  void Schedule(std::function<void()> task);

 private:
  void WorkLoop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvtier

#endif  // KVTIER_BASE_EXECUTOR_H_
