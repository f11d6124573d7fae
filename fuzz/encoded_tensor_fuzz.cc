// EncodedTensor and SegmentPayload parsing (kernels/encoded_tensor.h,
// kernels/codec.h): what the store checks on every PutSegment and the worker
// on every recalled segment, then decoding what passed.
#include <string>
#include <vector>

#include "encoded/encode.h"
#include "encoded/encoded_tensor.h"
#include "fuzz/fuzz_target.h"
#include "kernels/codec.h"
#include "kernels/crc32c.h"
#include "testing/test_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  (void)kvtier::ValidatePayloadBytes(bytes);
  for (bool crc : {true, false}) {
    absl::StatusOr<std::vector<kvtier::TensorParts>> parts = kvtier::SplitPayload(bytes, crc);
    if (!parts.ok()) continue;
    for (const kvtier::TensorParts& t : *parts) {
      absl::StatusOr<kvtier::EncodedView> v = kvtier::ParseEncoded(t);
      if (!v.ok()) continue;
      // Decode a bounded slice of what validated: the first rows of the
      // first slab.
      const int64_t rows = std::min<int64_t>(v->tokens, 64);
      if (v->head_dim <= 0 || v->head_dim > 4096 || rows <= 0) continue;
      std::vector<float> out(static_cast<size_t>(rows * v->head_dim));
      kvtier::DecodeRows(*v, 0, 0, rows, out.data(), kvtier::KernelLevel::kReference);
    }
  }
  // The transfer's checksum outside the buffers' data: it parses whatever
  // SplitPayload does, and over the whole payload it equals the framing's
  // and each tensor's, chained.
  absl::StatusOr<uint32_t> outside = kvtier::Crc32cOutsidePayloadBufferData(0, bytes);
  uint32_t in_pass = 0;
  if (absl::StatusOr<std::vector<kvtier::TensorParts>> parts =
          kvtier::SplitPayload(bytes, false, &in_pass);
      parts.ok()) {
    if (!outside.ok()) __builtin_trap();        // It parses what SplitPayload does.
    if (in_pass != *outside) __builtin_trap();  // The same value in the same pass.
    uint32_t crc = 0;
    size_t at = 0;
    for (const kvtier::TensorParts& t : *parts) {
      const size_t begin = static_cast<size_t>(t.bytes.data() - bytes.data());
      crc = kvtier::Crc32cExtend(crc, bytes.data() + at, begin - at);
      absl::StatusOr<uint32_t> c = kvtier::Crc32cOutsideBufferData(crc, t.bytes);
      if (!c.ok()) __builtin_trap();
      crc = *c;
      at = begin + t.bytes.size();
    }
    crc = kvtier::Crc32cExtend(crc, bytes.data() + at, bytes.size() - at);
    if (crc != *outside) __builtin_trap();
  }
  // The full parser must agree with the in-place one on validity.
  absl::StatusOr<kvtier::v1::SegmentPayload> full = kvtier::ParseAndValidatePayload(bytes);
  absl::StatusOr<std::vector<kvtier::TensorParts>> split = kvtier::SplitPayload(bytes, true);
  if (full.ok() && split.ok() && full->tensors_size() != static_cast<int>(split->size())) {
    __builtin_trap();
  }
  return 0;
}

namespace kvtier::fuzz {

std::vector<std::string> Seeds() {
  std::vector<std::string> seeds = {testing::MakePayload(200, 1), testing::MakePayload(64, 2, 3)};
  // One segment per codec, as the worker writes them.
  std::vector<float> x(2 * 16 * 8);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 23) / 7.0f - 1.5f;
  for (const char* codec : {"raw", "fp16", "kivi4", "kivi2", "kcvt4", "gear4", "gearl4"}) {
    absl::StatusOr<CodecConfig> c = ParseCodecSetting(codec);
    if (!c.ok()) continue;
    const int64_t shape[3] = {2, 16, 8};
    v1::SegmentPayload p;
    for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
      absl::StatusOr<v1::EncodedTensor> t = Encode(*c, role, shape, x.data());
      if (t.ok()) *p.add_tensors() = *std::move(t);
    }
    seeds.push_back(p.SerializeAsString());
  }
  return seeds;
}

}  // namespace kvtier::fuzz
