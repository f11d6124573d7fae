#include "base/memory.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

// A worker's first EndRounds read the process's memory on several threads at
// once. In a fresh process (a fork, so that no earlier read initialized
// anything) many threads make their first read together and then exit; every
// child must exit 0. Under ASan, glibc's malloc initialized by that first
// read from two threads at once aborted the second of them to exit: in 105 to
// 119 of 200 such children (3 runs). Here 50 children of 8 threads; each
// thread also checks that the read found the resident set. The test process
// itself must not read its memory before it forks (hence one test in this
// binary).
TEST(ProcessMemoryTest, FirstReadsFromManyThreadsAtOnceThenThreadsExit) {
  constexpr int kChildren = 50;
  constexpr int kThreads = 8;
  int failed = 0;
  int first_status = 0;
  for (int c = 0; c < kChildren; ++c) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0) << "fork";
    if (pid == 0) {
      std::atomic<bool> go{false};
      std::vector<std::thread> threads;
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&go] {
          while (!go.load(std::memory_order_acquire)) {
          }
          if (ReadProcessMemory().resident_bytes == 0) _exit(3);
        });
      }
      go.store(true, std::memory_order_release);
      for (std::thread& t : threads) t.join();
      _exit(0);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      if (failed++ == 0) first_status = status;
    }
  }
  EXPECT_EQ(failed, 0) << "children that did not exit 0, of " << kChildren << "; the first: "
                       << (WIFSIGNALED(first_status) ? "signal " : "exit status ")
                       << (WIFSIGNALED(first_status) ? WTERMSIG(first_status)
                                                     : WEXITSTATUS(first_status));
}

}  // namespace
}  // namespace kvtier
