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
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codec.h"
#include "kernels/cuda/cuda_kernels.h"

namespace kvtier::worker {

// One stretch of bytes StageView copied: `size` bytes from `src` to
// `offset` in the staged array.
struct StagedRegion {
  const uint8_t* src = nullptr;
  size_t offset = 0, size = 0;
};

struct StagedKv {
  cuda::SegKv kv;  // Pointer fields unset until PlaceStaged.
  size_t raw = 0, codes = 0, scales = 0, zeros = 0, residual = 0;  // Offsets.
  std::vector<StagedRegion> regions;                               // In staging order.
};

// Appends the view's buffers to `host`. The view must be one slab of
// `head_dim`; raw, KIVI and KCVT only (UNIMPLEMENTED for GEAR's parts).
absl::StatusOr<StagedKv> StageView(const EncodedView& v, int head_dim, std::vector<uint8_t>* host);

// The same layout with nothing copied: `*staged_end` is the staged array's
// size before the view and after it (a receiver of device rounds lays their
// tensors out itself to check what it was sent).
absl::StatusOr<StagedKv> LayOutView(const EncodedView& v, int head_dim, size_t* staged_end);

// The descriptor once the staged array lives at `base`.
cuda::SegKv PlaceStaged(const StagedKv& s, const uint8_t* base);

// How a staged tensor's serialized bytes are made again from the staged
// array alone (a hand-off of a device working set reads its layers back):
// the tensor's bytes that StageView did not copy (its metadata and framing,
// a few dozen bytes), kept on the host, and where each staged region goes
// among them.
struct Unstaging {
  struct Cut {
    size_t at = 0;                // Position in `rest` before which the region goes.
    size_t offset = 0, size = 0;  // The region in the staged array.
  };
  std::string rest;
  std::vector<Cut> cuts;  // By position.
  size_t bytes() const;   // The serialized tensor's size.
};

// `tensor` is the serialized tensor whose parsed view `staged` was staged
// from: every staged region must lie inside it, without overlap (INTERNAL
// otherwise).
absl::StatusOr<Unstaging> PlanUnstaging(std::string_view tensor, const StagedKv& staged);

// Appends the serialized tensor to *out, its regions read from the staged
// array at `base` (`size` bytes; INTERNAL when a region lies outside it).
absl::Status Unstage(const Unstaging& u, const uint8_t* base, size_t size, std::string* out);

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_DEVICE_LAYOUT_H_
