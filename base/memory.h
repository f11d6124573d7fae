// Process-wide allocator settings for programs that move large buffers.
#ifndef KVTIER_BASE_MEMORY_H_
#define KVTIER_BASE_MEMORY_H_

namespace kvtier {

// Segment payloads are megabytes each and short-lived. By default glibc
// serves such blocks with fresh mmap()s and unmaps them on free, so every
// payload byte costs a page fault twice per request. This keeps freed large
// blocks in one heap for reuse instead. Call once, first thing in main(),
// before any thread starts.
void TuneAllocatorForLargeBuffers();

}  // namespace kvtier

#endif  // KVTIER_BASE_MEMORY_H_
