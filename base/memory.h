// Process-wide allocator settings for programs that move large buffers.
#ifndef KVTIER_BASE_MEMORY_H_
#define KVTIER_BASE_MEMORY_H_

#include <cstdint>

namespace kvtier {

// Segment payloads are megabytes each and short-lived. By default glibc
// serves such blocks with fresh mmap()s and unmaps them on free, so every
// payload byte costs a page fault twice per request. This keeps freed large
// blocks in one heap for reuse instead. Call once, first thing in main(),
// before any thread starts.
void TuneAllocatorForLargeBuffers();

// The process's memory now. RSS and its peak come from /proc/self/status
// (VmRSS, VmHWM); the heap split from glibc's mallinfo2 (every arena).
// Fields the platform does not give stay 0 (the heap split under ASan,
// whose allocator is not glibc's). Cheap enough for each EndRound
// or scrape: one small file read and one walk of the allocator's bins.
struct ProcessMemory {
  uint64_t resident_bytes = 0;
  uint64_t peak_resident_bytes = 0;
  uint64_t heap_in_use_bytes = 0;
  uint64_t heap_free_bytes = 0;
};
ProcessMemory ReadProcessMemory();

}  // namespace kvtier

#endif  // KVTIER_BASE_MEMORY_H_
