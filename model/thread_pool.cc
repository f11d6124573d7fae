#include "model/thread_pool.h"

namespace kvtier::model {

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    start_.SignalAll();
  }
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::Take(const std::function<void(int)>& fn, int n) {
  for (int i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(int)>* fn;
    int n;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && generation_ == seen) start_.Wait(&mu_);
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      n = n_;
    }
    Take(*fn, n);
    absl::MutexLock lock(&mu_);
    if (--busy_ == 0) done_.Signal();
  }
}

void ThreadPool::ParallelFor(int n, const std::function<void(int)>& fn) {
  if (workers_.empty() || n <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  absl::MutexLock run(&run_mu_);
  {
    absl::MutexLock lock(&mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    busy_ = static_cast<int>(workers_.size());
    ++generation_;
    start_.SignalAll();
  }
  Take(fn, n);
  absl::MutexLock lock(&mu_);
  while (busy_ > 0) done_.Wait(&mu_);
  fn_ = nullptr;
}

}  // namespace kvtier::model
