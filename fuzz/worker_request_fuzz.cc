// The worker's request handling, as kvtier-worker runs it on each message:
// OpenSession's model and policy (ShapeFromProto, PolicyFromProto), then a
// sequence of LayerRequest and DecodeRequest messages checked and converted
// (DenseTokens, AppendDense) and fed to a real worker::Engine, whose store is
// down (every store call UNAVAILABLE: a condition the engine must handle).
//
// Input: parts (fuzz_target.h); part 0 is an OpenSessionRequest, each later
// part a LayerRequest (first byte even) or a DecodeRequest (odd).
#include <string>
#include <vector>

#include "encoded/encode.h"
#include "fuzz/fuzz_target.h"
#include "kvtier/v1/worker.pb.h"
#include "rpc/dense_tensor.h"
#include "rpc/policy_proto.h"
#include "worker/engine.h"
#include "worker/memory_store.h"

namespace {

// Bounds that keep one input cheap: the engine itself allows far more.
bool Small(const kvtier::worker::ModelShape& s) {
  return s.layers <= 8 && s.q_heads <= 16 && s.head_dim <= 128;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> parts = kvtier::fuzz::SplitParts(data, size, 24);
  if (parts.empty()) return 0;
  kvtier::v1::OpenSessionRequest open;
  if (!open.ParseFromString(parts[0])) return 0;
  absl::StatusOr<kvtier::worker::ModelShape> shape = kvtier::ShapeFromProto(open.model());
  absl::StatusOr<kvtier::worker::SessionPolicy> policy =
      kvtier::PolicyFromProto(open.policy(), kvtier::FromProto(open.model().dtype()));
  if (!shape.ok() || !policy.ok() || !Small(*shape)) return 0;
  kvtier::worker::MemorySegmentStore store;
  store.FailAll(absl::UnavailableError("the store is down"));
  kvtier::worker::EngineOptions eo;
  eo.level = kvtier::KernelLevel::kReference;
  eo.store_deadline = absl::Milliseconds(50);
  kvtier::worker::Engine engine(&store, eo);
  const kvtier::worker::SessionKey key("tenant", "s");
  if (!engine.OpenSession(key, *shape, *policy).ok()) return 0;
  (void)kvtier::EffectivePolicy(open.policy(), *policy);
  const int d = shape->head_dim;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string body = parts[i].empty() ? std::string() : parts[i].substr(1);
    const bool decode = !parts[i].empty() && (parts[i][0] & 1);
    std::vector<float> q, k, v;
    if (!decode) {
      kvtier::v1::LayerRequest req;
      if (!req.ParseFromString(body)) continue;
      if (!kvtier::AppendDense(req.q(), shape->q_heads, d, "q", &q).ok() ||
          !kvtier::AppendDense(req.k(), shape->kv_heads, d, "k", &k).ok() ||
          !kvtier::AppendDense(req.v(), shape->kv_heads, d, "v", &v).ok()) {
        continue;
      }
      const int64_t n = static_cast<int64_t>(q.size()) / (int64_t{shape->q_heads} * d);
      if (n < 1 || n > 256 || k.size() != static_cast<size_t>(n) * shape->kv_heads * d ||
          v.size() != k.size()) {
        continue;
      }
      std::vector<float> out(q.size());
      if (!engine
               .PrefillLayer(key, static_cast<int>(req.layer()), n,
                             static_cast<int64_t>(req.question_tokens()), q.data(), k.data(),
                             v.data(), out.data())
               .ok()) {
        (void)engine.AbortStep(key);
      }
    } else {
      kvtier::v1::DecodeRequest req;
      if (!req.ParseFromString(body)) continue;
      for (const kvtier::v1::DecodeItem& it : req.items()) {
        q.clear();
        k.clear();
        v.clear();
        if (!kvtier::AppendDense(it.q(), shape->q_heads, d, "q", &q).ok() ||
            !kvtier::AppendDense(it.k(), shape->kv_heads, d, "k", &k).ok() ||
            !kvtier::AppendDense(it.v(), shape->kv_heads, d, "v", &v).ok() ||
            q.size() != static_cast<size_t>(shape->q_heads) * d ||
            k.size() != static_cast<size_t>(shape->kv_heads) * d || v.size() != k.size()) {
          continue;
        }
        std::vector<float> out(q.size());
        if (!engine
                 .DecodeLayer(key, static_cast<int>(it.layer()), q.data(), k.data(), v.data(),
                              out.data())
                 .ok()) {
          (void)engine.AbortStep(key);
        }
      }
    }
    if (parts[i].size() > 1 && (parts[i][0] & 6) == 6) (void)engine.EndRound(key);
  }
  (void)engine.Stats(key);
  (void)engine.CloseSession(key, false);
  return 0;
}

namespace kvtier::fuzz {

namespace {

v1::DenseTensor Dense(int64_t tokens, int heads, int d, v1::DType dtype, float base) {
  v1::DenseTensor t;
  t.set_dtype(dtype);
  t.add_shape(tokens);
  t.add_shape(heads);
  t.add_shape(d);
  const int64_t n = tokens * heads * d;
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[i] = base + 0.01f * static_cast<float>(i % 17);
  WriteDense(x.data(), 0, tokens, heads, d, dtype, &t);
  return t;
}

}  // namespace

std::vector<std::string> Seeds() {
  constexpr int kLayers = 3, kQ = 4, kKv = 2, kD = 8;
  std::vector<std::string> seeds;
  for (const char* codec_eviction : {"raw|", "kivi4|snapkv", "fp16|pyramidkv"}) {
    const std::string ce(codec_eviction);
    v1::OpenSessionRequest open;
    open.set_session_id("s");
    open.mutable_model()->set_num_layers(kLayers);
    open.mutable_model()->set_num_q_heads(kQ);
    open.mutable_model()->set_num_kv_heads(kKv);
    open.mutable_model()->set_head_dim(kD);
    open.mutable_model()->set_dtype(v1::DTYPE_FP16);
    open.mutable_policy()->set_watershed_layer(1);
    const std::string evict = ce.substr(ce.find('|') + 1);
    if (!evict.empty()) {
      open.mutable_policy()->set_eviction(evict);
      open.mutable_policy()->set_budget_tokens(8);
    }
    std::vector<std::string> parts = {open.SerializeAsString()};
    for (int l = 0; l < kLayers; ++l) {
      v1::LayerRequest r;
      if (l == 0) r.set_session_id("s");
      r.set_layer(l);
      *r.mutable_q() = Dense(5, kQ, kD, v1::DTYPE_FP16, 0.1f * l);
      *r.mutable_k() = Dense(5, kKv, kD, v1::DTYPE_FP16, 0.2f);
      *r.mutable_v() = Dense(5, kKv, kD, v1::DTYPE_FP32, -0.3f);
      parts.push_back(std::string(1, l == kLayers - 1 ? '\x06' : '\x00') + r.SerializeAsString());
    }
    for (int l = 0; l < kLayers; ++l) {
      v1::DecodeRequest r;
      v1::DecodeItem* it = r.add_items();
      it->set_session_id("s");
      it->set_layer(l);
      *it->mutable_q() = Dense(1, kQ, kD, v1::DTYPE_BF16, 0.5f);
      *it->mutable_k() = Dense(1, kKv, kD, v1::DTYPE_FP16, 0.1f);
      *it->mutable_v() = Dense(1, kKv, kD, v1::DTYPE_FP16, 0.2f);
      parts.push_back(std::string(1, '\x01') + r.SerializeAsString());
    }
    seeds.push_back(JoinParts(parts));
  }
  return seeds;
}

}  // namespace kvtier::fuzz
