// worker/device/attention.h in a build without CUDA: there is no device path,
// and every entry point says so. The engine then keeps working sets in host
// memory (EngineOptions::placement kAuto), or refuses kDevice sessions.
#include "worker/device/attention.h"

namespace kvtier::worker {
namespace {

absl::Status NotBuilt() {
  return absl::FailedPreconditionError(
      "this kvtier was built without CUDA (KVTIER_CUDA=OFF or no nvcc): no device working set");
}

}  // namespace

bool DeviceBuiltIn() { return false; }
std::vector<DeviceCallTime> DeviceCallTimes() { return {}; }
void SetDeviceCacheBytes(size_t) {}
BlockCache::Stats DeviceCacheState() { return {}; }
bool DeviceUsable() { return false; }
absl::Status DeviceStatus() { return NotBuilt(); }
absl::Status DeviceSupportsCodec(const CodecConfig&) { return NotBuilt(); }

absl::StatusOr<std::unique_ptr<DeviceLayer>> UploadLayer(
    const std::vector<std::pair<EncodedView, EncodedView>>&, int,
    const std::vector<std::string_view>&) {
  return NotBuilt();
}

absl::StatusOr<DeviceIdentity> LocalDeviceIdentity() { return NotBuilt(); }
absl::Status WarmDevice(bool) { return NotBuilt(); }
absl::Status ProbeIpcPeer(const DeviceIdentity&) { return NotBuilt(); }
absl::StatusOr<std::unique_ptr<IpcPack>> NewIpcPack(uint64_t) { return NotBuilt(); }

namespace {

class NoIpcSource : public IpcSource {
 public:
  absl::StatusOr<std::unique_ptr<DeviceLayer>> CopyLayer(std::string_view, uint64_t,
                                                         DeviceRoundLayout) override {
    return NotBuilt();
  }
  int opened() const override { return 0; }
};

}  // namespace

std::unique_ptr<IpcSource> NewIpcSource(bool) { return std::make_unique<NoIpcSource>(); }

bool NcclBuiltIn() { return false; }
int DeviceCount() { return 0; }
absl::Status UseDevice(int) { return NotBuilt(); }
absl::StatusOr<std::string> NewLinkId() { return NotBuilt(); }
absl::StatusOr<std::unique_ptr<DeviceLink>> JoinLink(std::string_view, int, absl::Time) {
  return NotBuilt();
}

absl::StatusOr<std::unique_ptr<DeviceSession>> NewDeviceSession(int, int, int, int) {
  return NotBuilt();
}

absl::StatusOr<std::unique_ptr<DeviceSpeculator>> NewDeviceSpeculator(int, int, int, int, int) {
  return NotBuilt();
}

}  // namespace kvtier::worker
