#include "base/memory.h"

#include <malloc.h>

#include <cstdio>
#include <cstring>

namespace kvtier {

void TuneAllocatorForLargeBuffers() {
#if defined(__GLIBC__) && !defined(KVTIER_SANITIZED)
  mallopt(M_MMAP_MAX, 0);              // Large blocks come from the heap...
  mallopt(M_TRIM_THRESHOLD, 1 << 30);  // ...and freed ones stay there (up to 1 GiB).
  mallopt(M_TOP_PAD, 64 << 20);        // Grow the heap in 64 MiB steps.
  // One arena: a per-thread arena is unmapped whole once its blocks are
  // free, so gRPC's receive threads would fault every payload in afresh.
  // Measured with kvtier-bench store on 2 cores: GetSegments of 64 MiB
  // segments about 1.0 -> 1.8 GB/s. Small-allocation contention is the
  // price; it did not show at 8 streams.
  mallopt(M_ARENA_MAX, 1);
#endif
}

ProcessMemory ReadProcessMemory() {
  ProcessMemory m;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      unsigned long long kb = 0;
      if (std::sscanf(line, "VmRSS: %llu kB", &kb) == 1) m.resident_bytes = kb * 1024;
      if (std::sscanf(line, "VmHWM: %llu kB", &kb) == 1) m.peak_resident_bytes = kb * 1024;
    }
    std::fclose(f);
  }
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33)) && \
    !defined(KVTIER_SANITIZED)
  // Not under a sanitizer: its allocator replaces glibc's, whose arenas then
  // hold nothing, and glibc's malloc is still uninitialized when the first
  // mallinfo2() initializes it. That initialization is not thread-safe: two
  // threads doing it at once (EndRounds of concurrent sessions) both take the
  // main arena for one reference, and the second to exit aborts in
  // __malloc_arena_thread_freeres ("a->attached_threads > 0").
  const struct mallinfo2 mi = mallinfo2();
  // uordblks: in use from the arenas; hblkhd: in use from mmap()ed blocks.
  m.heap_in_use_bytes = mi.uordblks + mi.hblkhd;
  m.heap_free_bytes = mi.fordblks;
#endif
  return m;
}

}  // namespace kvtier
