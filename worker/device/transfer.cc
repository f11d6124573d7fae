#include "worker/device/transfer.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "encoded/encode.h"
#include "encoded/encoded_tensor.h"
#include "kernels/codec.h"
#include "worker/session.h"

namespace kvtier::worker {

std::string BootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return std::string(absl::StripAsciiWhitespace(id));
}

absl::Status IpcPeerCheck(const DeviceIdentity& local, const DeviceIdentity& peer) {
  if (peer.boot_id.empty() || peer.gpu_uuid.empty() || peer.pid == 0 || peer.probe_handle.empty() ||
      peer.probe_nonce.empty()) {
    return absl::FailedPreconditionError("the sender sent no complete device identity");
  }
  if (local.boot_id.empty() || local.gpu_uuid.empty()) {
    return absl::FailedPreconditionError("this worker cannot tell its node's boot id or its GPU");
  }
  if (peer.boot_id != local.boot_id) {
    return absl::FailedPreconditionError("the sender runs on another node (or another boot)");
  }
  if (peer.gpu_uuid != local.gpu_uuid) {
    return absl::FailedPreconditionError("the sender's session is on another GPU of this node");
  }
  if (peer.pid == local.pid) {
    return absl::FailedPreconditionError(
        "the sender is this process (CUDA IPC handles open in another process only)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ChooseDevicePath(const DeviceIdentity& local,
                                             const DeviceIdentity& peer) {
  if (peer.gpu_uuid.empty() || peer.gpu_uuid == local.gpu_uuid) {
    absl::Status same = IpcPeerCheck(local, peer);
    if (!same.ok()) return same;
    return std::string("cuda_ipc");
  }
  if (!local.nccl) {
    return absl::FailedPreconditionError(
        "the sender's session is on another GPU, and this worker was built without NCCL");
  }
  if (!peer.nccl) {
    return absl::FailedPreconditionError(
        "the sender's session is on another GPU, and the sender was built without NCCL");
  }
  return std::string("nccl");
}

std::string ProcessKey(const DeviceIdentity& id) {
  return absl::StrCat(id.boot_id, "/", absl::BytesToHexString(id.gpu_uuid), "/", id.pid);
}

std::string DevicePeerFailures::Key(const DeviceIdentity& peer, const std::string& path) {
  return absl::StrCat(ProcessKey(peer), "/", path);
}

void DevicePeerFailures::Record(const DeviceIdentity& peer, const std::string& path,
                                const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (failed_.size() >= 1024) failed_.clear();
  failed_[Key(peer, path)] = absl::FailedPreconditionError(
      absl::StrCat("the ", path, " path failed with this sender before (", why.message(), ")"));
}

absl::Status DevicePeerFailures::Check(const DeviceIdentity& peer, const std::string& path) const {
  absl::MutexLock lock(&mu_);
  auto it = failed_.find(Key(peer, path));
  return it == failed_.end() ? absl::OkStatus() : it->second;
}

namespace {

absl::Status Refuse(size_t t, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("device round tensor ", t, ": ", why));
}

}  // namespace

absl::StatusOr<DeviceRoundLayout> CheckDeviceRound(std::vector<Unstaging> tensors,
                                                   size_t staged_bytes, int kv_heads,
                                                   int head_dim) {
  if (tensors.size() != static_cast<size_t>(2) * kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("a device round of ", tensors.size(),
                                                   " tensors; the model has ", kv_heads,
                                                   " KV heads, K and V each"));
  }
  // The regions of all tensors lie apart in one staged array: their sizes
  // add up to at most its size, which bounds the skeleton below.
  size_t total = 0, regions = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const Unstaging& u = tensors[t];
    size_t at = 0;
    for (const Unstaging::Cut& c : u.cuts) {
      if (c.at < at || c.at > u.rest.size()) return Refuse(t, "its cuts are out of order");
      if (c.size > staged_bytes - regions) {
        return Refuse(t, absl::StrCat("its regions exceed the ", staged_bytes, " staged bytes"));
      }
      regions += c.size;
      at = c.at;
    }
    std::string framing;
    AppendPayloadFraming(u.bytes(), &framing);
    total += framing.size() + u.bytes();
  }
  // The tensors again, as one SegmentPayload, zeros where the regions go
  // (calloc: pages of a large skeleton are never touched).
  std::unique_ptr<char, decltype(&std::free)> skeleton(
      static_cast<char*>(std::calloc(total == 0 ? 1 : total, 1)), &std::free);
  if (skeleton == nullptr) return absl::ResourceExhaustedError("no memory to check a device round");
  char* p = skeleton.get();
  for (const Unstaging& u : tensors) {
    std::string framing;
    AppendPayloadFraming(u.bytes(), &framing);
    std::memcpy(p, framing.data(), framing.size());
    p += framing.size();
    size_t from = 0;
    for (const Unstaging::Cut& c : u.cuts) {
      std::memcpy(p, u.rest.data() + from, c.at - from);
      p += c.at - from + c.size;
      from = c.at;
    }
    std::memcpy(p, u.rest.data() + from, u.rest.size() - from);
    p += u.rest.size() - from;
  }
  absl::StatusOr<std::vector<TensorParts>> parts =
      SplitPayload(std::string_view(skeleton.get(), total), /*verify_crc=*/false);
  if (!parts.ok() || parts->size() != tensors.size()) {
    return absl::InvalidArgumentError(absl::StrCat("a device round's tensors do not parse: ",
                                                   parts.ok()
                                                       ? absl::StrCat(parts->size(), " tensors")
                                                       : std::string(parts.status().message())));
  }
  DeviceRoundLayout out;
  size_t end = 0;
  for (int h = 0; h < kv_heads; ++h) {
    std::pair<StagedKv, StagedKv> head;
    int64_t len = -1;
    for (int j = 0; j < 2; ++j) {
      const size_t t = static_cast<size_t>(2 * h + j);
      absl::StatusOr<EncodedView> v = ParseEncoded((*parts)[t]);
      if (!v.ok()) return Refuse(t, std::string(v.status().message()));
      if (v->slabs != 1 || v->head_dim != head_dim || (len >= 0 && v->tokens != len)) {
        return Refuse(t, "its shape does not match the session's model");
      }
      len = v->tokens;
      absl::StatusOr<StagedKv> staged = LayOutView(*v, head_dim, &end);
      if (!staged.ok()) return Refuse(t, std::string(staged.status().message()));
      absl::StatusOr<Unstaging> mine = PlanUnstaging((*parts)[t].bytes, *staged);
      if (!mine.ok()) return Refuse(t, std::string(mine.status().message()));
      const std::vector<Unstaging::Cut>& theirs = tensors[t].cuts;
      bool same = mine->cuts.size() == theirs.size();
      for (size_t i = 0; same && i < theirs.size(); ++i) {
        same = mine->cuts[i].at == theirs[i].at && mine->cuts[i].offset == theirs[i].offset &&
               mine->cuts[i].size == theirs[i].size;
      }
      if (!same) return Refuse(t, "its regions are not where its metadata puts them");
      staged->regions.clear();  // They point into the skeleton.
      (j == 0 ? head.first : head.second) = *std::move(staged);
    }
    out.heads.push_back(std::move(head));
    out.lens.push_back(len);
  }
  if (end != staged_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a device round's tensors lay out in ", end,
                                                   " staged bytes; the sender says ",
                                                   staged_bytes));
  }
  for (const Unstaging& u : tensors) out.bytes += static_cast<int64_t>(u.bytes());
  out.staged_bytes = staged_bytes;
  out.unstaging = std::move(tensors);
  return out;
}

}  // namespace kvtier::worker
