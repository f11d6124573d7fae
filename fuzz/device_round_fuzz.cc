// A device round as a sender describes it in TransferSession
// (TransferLayer.device_rounds), checked as the receiver checks it before it
// opens a CUDA IPC handle: StagedTensorsFromProto, then
// worker::CheckDeviceRound. A tenant that reaches TransferSession can send
// any of this. What passes must lie inside the staged array: each tensor,
// made again from a staged array of that size, parses, and their sizes add
// up to what the layout says.
//
// Input: parts (fuzz_target.h): a TransferDeviceRound, then one byte for
// the model (bit 0: kv_heads 1 or 2; bit 1: head_dim 8 or 64).
#include <cstdlib>
#include <string>
#include <vector>

#include "encoded/encode.h"
#include "encoded/encoded_tensor.h"
#include "fuzz/fuzz_target.h"
#include "kernels/codec.h"
#include "kvtier/v1/worker.pb.h"
#include "services/worker/transfer_proto.h"
#include "worker/device/layout.h"
#include "worker/device/transfer.h"
#include "worker/session.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> parts = kvtier::fuzz::SplitParts(data, size, 2);
  if (parts.size() < 2 || parts[1].empty()) return 0;
  kvtier::v1::TransferDeviceRound round;
  if (!round.ParseFromString(parts[0])) return 0;
  const int kv_heads = (parts[1][0] & 1) != 0 ? 2 : 1;
  const int head_dim = (parts[1][0] & 2) != 0 ? 64 : 8;
  auto tensors = kvtier::StagedTensorsFromProto(round);
  if (!tensors.ok()) return 0;
  auto layout = kvtier::worker::CheckDeviceRound(*std::move(tensors), round.staged_bytes(),
                                                 kv_heads, head_dim);
  if (!layout.ok()) return 0;
  if (layout->staged_bytes > (size_t{16} << 20)) return 0;  // Passed; too large to rebuild here.
  const std::string staged(layout->staged_bytes, '\0');
  std::vector<std::string> made(layout->unstaging.size());
  int64_t bytes = 0;
  for (size_t i = 0; i < made.size(); ++i) {
    if (!kvtier::worker::Unstage(layout->unstaging[i],
                                 reinterpret_cast<const uint8_t*>(staged.data()), staged.size(),
                                 &made[i])
             .ok()) {
      std::abort();  // A checked layout reads outside its staged array.
    }
    bytes += static_cast<int64_t>(made[i].size());
  }
  if (bytes != layout->bytes) std::abort();
  const std::string payload =
      kvtier::worker::SerializePayload(std::vector<std::string_view>(made.begin(), made.end()));
  auto split = kvtier::SplitPayload(payload, /*verify_crc=*/false);
  if (!split.ok()) std::abort();
  for (const kvtier::TensorParts& t : *split) {
    if (!kvtier::ParseEncoded(t).ok()) std::abort();
  }
  return 0;
}

namespace kvtier::fuzz {

// Rounds as a sender describes them: raw and KIVI with residual rows, one
// and two heads.
std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  for (const char* setting : {"raw", "kivi4:R=8", "kcvt2"}) {
    for (int heads : {1, 2}) {
      for (int d : {8, 64}) {
        auto codec = ParseCodecSetting(setting);
        if (!codec.ok()) continue;
        v1::SegmentPayload payload;
        for (int h = 0; h < heads; ++h) {
          const int64_t t = 5 + 11 * h;
          const int64_t shape[3] = {1, t, d};
          std::vector<float> x(static_cast<size_t>(t) * d);
          for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7 + h) % 13) / 4;
          for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
            auto enc = Encode(*codec, role, shape, x.data(), KernelLevel::kReference);
            if (enc.ok()) *payload.add_tensors() = *std::move(enc);
          }
        }
        const std::string bytes = payload.SerializeAsString();
        auto split = SplitPayload(bytes);
        if (!split.ok()) continue;
        std::vector<uint8_t> staged;
        std::vector<worker::Unstaging> unstaging;
        for (const TensorParts& p : *split) {
          auto view = ParseEncoded(p);
          if (!view.ok()) break;
          auto s = worker::StageView(*view, d, &staged);
          if (!s.ok()) break;
          auto u = worker::PlanUnstaging(p.bytes, *s);
          if (!u.ok()) break;
          unstaging.push_back(*std::move(u));
        }
        const std::string round =
            DeviceRoundToProto(3, staged.size(), std::string(64, 'h'), unstaging)
                .SerializeAsString();
        const char model = static_cast<char>((heads == 2 ? 1 : 0) | (d == 64 ? 2 : 0));
        seeds.push_back(JoinParts({round, std::string(1, model)}));
      }
    }
  }
  return seeds;
}

}  // namespace kvtier::fuzz
