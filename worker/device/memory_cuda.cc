// Device memory (CUDA builds): the block cache and the device-call timers.
#include <vector>

#include "worker/device/cuda.h"

namespace kvtier::worker {

std::atomic<uint64_t> device_call_count[kDeviceCalls];
std::atomic<uint64_t> device_call_ns[kDeviceCalls];

BlockCache& DeviceBlocks() {
  static BlockCache* cache = new BlockCache(
      kDefaultDeviceCacheBytes,
      [](size_t bytes) -> absl::StatusOr<void*> {
        void* p = nullptr;
        CallTimer timer(kAlloc);
        const cudaError_t e = cudaMalloc(&p, bytes);
        if (e != cudaSuccess) {
          cudaGetLastError();  // Not sticky: clear it.
          return CudaError(e, "cudaMalloc");
        }
        return p;
      },
      [](void* p, size_t) {
        CallTimer timer(kFree);
        cudaFree(p);
      });
  return *cache;
}

std::vector<DeviceCallTime> DeviceCallTimes() {
  std::vector<DeviceCallTime> out;
  for (int c = 0; c < kDeviceCalls; ++c) {
    out.push_back({kDeviceCallNames[c], device_call_count[c].load(std::memory_order_relaxed),
                   1e-9 * static_cast<double>(device_call_ns[c].load(std::memory_order_relaxed))});
  }
  return out;
}

void SetDeviceCacheBytes(size_t bytes) { DeviceBlocks().SetCap(bytes); }
BlockCache::Stats DeviceCacheState() { return DeviceBlocks().stats(); }

}  // namespace kvtier::worker
