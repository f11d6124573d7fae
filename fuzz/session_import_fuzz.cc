// A session arriving from another worker (TransferSession), as the receiver
// builds it: the header (HeaderFromProto), each layer's info and bytes
// (checked as the receiver checks them), the tail, then
// worker::Engine::ImportSession; an imported session is then decoded, ended
// and closed. A tenant can send any of this to a worker directly.
//
// Input: parts (fuzz_target.h): a TransferHeader, a TransferTail, then per
// layer a TransferLayer and the layer's bytes.
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "kvtier/v1/worker.pb.h"
#include "services/worker/transfer_proto.h"
#include "worker/engine.h"
#include "worker/memory_store.h"
#include "worker/transfer.h"

namespace {

// The hand-off half of an engine's API (worker/transfer.h).
kvtier::worker::SessionTransfer Handoff(kvtier::worker::Engine& e) {
  return kvtier::worker::SessionTransfer(&e);
}

kvtier::worker::EngineOptions Options() {
  kvtier::worker::EngineOptions eo;
  eo.level = kvtier::KernelLevel::kReference;
  eo.placement = kvtier::worker::EngineOptions::Placement::kHost;
  eo.max_working_set_bytes = 64 << 20;
  return eo;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> parts = kvtier::fuzz::SplitParts(data, size, 2 + 2 * 8);
  if (parts.size() < 2) return 0;
  kvtier::v1::TransferHeader header;
  kvtier::v1::TransferTail tail;
  if (!header.ParseFromString(parts[0]) || !tail.ParseFromString(parts[1])) return 0;
  absl::StatusOr<kvtier::worker::SessionImage> image = kvtier::HeaderFromProto(header);
  if (!image.ok() || image->shape.layers > 8 || image->shape.q_heads > 16 ||
      image->shape.head_dim > 128) {
    return 0;
  }
  kvtier::TailFromProto(tail, &*image);
  std::vector<kvtier::worker::LayerImage> layers;
  for (size_t i = 2; i + 1 < parts.size(); i += 2) {
    kvtier::v1::TransferLayer info;
    if (!info.ParseFromString(parts[i])) return 0;
    // The receiver's own checks: the announced sizes are what arrived.
    const std::string& bytes = parts[i + 1];
    if (info.past_bytes() + info.open_bytes() != bytes.size()) return 0;
    kvtier::worker::LayerImage li;
    li.layer = static_cast<int>(layers.size());
    li.rounds.assign(info.rounds().begin(), info.rounds().end());
    li.past = std::make_shared<const std::string>(bytes.substr(0, info.past_bytes()));
    li.open = bytes.substr(info.past_bytes());
    li.open_rows = info.open_rows();
    li.q_first = info.q_first();
    li.q_rows = info.q_rows();
    layers.push_back(std::move(li));
  }
  kvtier::worker::MemorySegmentStore store;
  kvtier::worker::Engine engine(&store, Options());
  const kvtier::worker::SessionKey key("tenant", "s");
  if (!Handoff(engine).ImportSession(key, *image, std::move(layers)).ok()) return 0;
  const kvtier::worker::ModelShape& sh = image->shape;
  std::vector<float> q(static_cast<size_t>(sh.q_heads) * sh.head_dim, 0.25f),
      kv(static_cast<size_t>(sh.kv_heads) * sh.head_dim, -0.5f), out(q.size());
  for (int l = 0; l < sh.layers; ++l) {
    if (!engine.DecodeLayer(key, l, q.data(), kv.data(), kv.data(), out.data()).ok()) {
      (void)engine.AbortStep(key);
      break;
    }
  }
  (void)engine.EndRound(key);
  (void)engine.Stats(key);
  (void)engine.CloseSession(key, false);
  return 0;
}

namespace kvtier::fuzz {

// Sessions exported from a real engine: a raw and a KIVI session with two
// stored rounds and an open one, SnapKV eviction (queries travel too).
std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  for (const char* codec : {"fp16", "kivi4"}) {
    kvtier::worker::MemorySegmentStore store;
    worker::Engine engine(&store, Options());
    const worker::ModelShape shape{3, 2, 1, 8, DType::kFp16};
    worker::SessionPolicy p;
    p.codec = *ParseCodecSetting(codec);
    p.eviction = *evict::ParsePolicy("snapkv:6:w=2");
    p.release_after_end_round = false;
    const worker::SessionKey key("tenant", "s");
    if (!engine.OpenSession(key, shape, p).ok()) continue;
    for (int round = 0; round < 3; ++round) {
      const int64_t n = 9;
      std::vector<float> q(n * 2 * 8), k(n * 8), out(q.size());
      for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>((i * 7 + round) % 11) / 8;
      for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>((i * 5 + round) % 13) / 8;
      for (int l = 0; l < shape.layers; ++l) {
        (void)engine.PrefillLayer(key, l, n, 0, q.data(), k.data(), k.data(), out.data());
      }
      if (round < 2) (void)engine.EndRound(key);
    }
    auto image = Handoff(engine).ExportSession(key);
    if (!image.ok() || !Handoff(engine).ExportTail(key, &*image).ok()) continue;
    std::vector<std::string> parts = {HeaderToProto("s", *image).SerializeAsString(),
                                      TailToProto(*image).SerializeAsString()};
    for (int l = 0; l < shape.layers; ++l) {
      auto li = Handoff(engine).ExportLayer(key, l);
      if (!li.ok()) break;
      v1::TransferLayer info;
      for (uint32_t r : li->rounds) info.add_rounds(r);
      const std::string past = li->PastBytes();
      info.set_past_bytes(past.size());
      info.set_open_rows(li->open_rows);
      info.set_q_first(li->q_first);
      info.set_q_rows(li->q_rows);
      info.set_open_bytes(li->open.size());
      parts.push_back(info.SerializeAsString());
      parts.push_back(past + li->open);
    }
    seeds.push_back(JoinParts(parts));
  }
  return seeds;
}

}  // namespace kvtier::fuzz
