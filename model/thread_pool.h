// Worker threads that run the pieces of one parallel loop together with the
// calling thread: the forward pass splits its matrix products by rows over
// them (Forward's `pool`). One loop runs at a time; a second caller waits
// for the first to finish. Thread-safe.
#ifndef KVTIER_MODEL_THREAD_POOL_H_
#define KVTIER_MODEL_THREAD_POOL_H_

#include <atomic>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvtier::model {

class ThreadPool {
 public:
  // `threads` in all, the caller included: threads - 1 workers start now.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Calls fn(i) once for every i in [0, n), spread over the threads, and
  // returns when every call has returned.
  void ParallelFor(int n, const std::function<void(int)>& fn) ABSL_LOCKS_EXCLUDED(run_mu_, mu_);

 private:
  void WorkerLoop();
  void Take(const std::function<void(int)>& fn, int n);

  absl::Mutex run_mu_;  // Held for a whole loop: one at a time.
  absl::Mutex mu_;
  const std::function<void(int)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  int n_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_ ABSL_GUARDED_BY(mu_) = 0;  // Workers still in the current loop.
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::CondVar start_;  // A loop began (generation_ moved) or stop_.
  absl::CondVar done_;   // busy_ reached 0.
  std::atomic<int> next_{0};
  std::vector<std::thread> workers_;
};

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_THREAD_POOL_H_
