// A session image (worker::SessionImage) on the wire: TransferSession's
// header and tail, converted field by field at the service edge.
#ifndef KVTIER_SERVICES_WORKER_TRANSFER_PROTO_H_
#define KVTIER_SERVICES_WORKER_TRANSFER_PROTO_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtier/v1/worker.pb.h"
#include "worker/engine.h"

namespace kvtier {

v1::TransferHeader HeaderToProto(const std::string& session_id, const worker::SessionImage& im);
// The image's header part. INVALID_ARGUMENT for a shape, method, mode or
// codec out of range (the engine checks the rest when it imports).
absl::StatusOr<worker::SessionImage> HeaderFromProto(const v1::TransferHeader& h);

v1::TransferTail TailToProto(const worker::SessionImage& im);
void TailFromProto(const v1::TransferTail& t, worker::SessionImage* im);

v1::DeviceIdentity IdentityToProto(const worker::DeviceIdentity& id);
worker::DeviceIdentity IdentityFromProto(const v1::DeviceIdentity& p);

// One device round of a layer as the CUDA IPC path describes it, and back
// (INVALID_ARGUMENT for cut lists of different lengths).
v1::TransferDeviceRound DeviceRoundToProto(uint32_t round, size_t staged_bytes,
                                           std::string ipc_handle,
                                           const std::vector<worker::Unstaging>& tensors);
absl::StatusOr<std::vector<worker::Unstaging>> StagedTensorsFromProto(
    const v1::TransferDeviceRound& r);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_WORKER_TRANSFER_PROTO_H_
