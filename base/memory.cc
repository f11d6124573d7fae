#include "base/memory.h"

#include <malloc.h>

namespace kvtier {

void TuneAllocatorForLargeBuffers() {
#if defined(__GLIBC__) && !defined(KVTIER_SANITIZED)
  mallopt(M_MMAP_MAX, 0);              // Large blocks come from the heap...
  mallopt(M_TRIM_THRESHOLD, 1 << 30);  // ...and freed ones stay there (up to 1 GiB).
  mallopt(M_TOP_PAD, 64 << 20);        // Grow the heap in 64 MiB steps.
#endif
}

}  // namespace kvtier
