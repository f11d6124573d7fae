// How one encoded K or V tensor of a past round is laid out for the device
// working set: its buffers staged into one host byte array (each at a 256-byte
// boundary), then described by a kvtier::cuda::SegKv whose pointers point
// into wherever that array is copied (GPU memory, or the array itself in
// tests). Plain C++, built with or without CUDA, so the layout is tested on
// every machine (worker/device_layout_test.cc).
#ifndef KVTIER_WORKER_DEVICE_LAYOUT_H_
#define KVTIER_WORKER_DEVICE_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codec.h"
#include "kernels/cuda/cuda_kernels.h"

namespace kvtier::worker {

struct StagedKv {
  cuda::SegKv kv;  // Pointer fields unset until PlaceStaged.
  size_t raw = 0, codes = 0, scales = 0, zeros = 0, residual = 0;  // Offsets.
};

// Appends the view's buffers to `host`. The view must be one slab of
// `head_dim`; raw, KIVI and KCVT only (UNIMPLEMENTED for GEAR's parts).
absl::StatusOr<StagedKv> StageView(const EncodedView& v, int head_dim, std::vector<uint8_t>* host);

// The descriptor once the staged array lives at `base`.
cuda::SegKv PlaceStaged(const StagedKv& s, const uint8_t* base);

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_DEVICE_LAYOUT_H_
