// kvtier-controller's requests as it serves them: a real ControllerServer
// (embedded back end, auth off) in this process on 127.0.0.1:0, fresh for
// each input so that an input alone reproduces what it finds, fed a sequence
// of Register, Heartbeat, Route, ListNodes, GetPolicy and SetPolicy calls
// whose request bytes the fuzzer chooses: node names and addresses, the
// sessions a registering worker reports (which the controller adopts),
// roles, capacities, models and policies. Each call must end with a status
// before its deadline; afterwards ListNodes must answer and list every node
// once, in order, and the metrics must render.
//
// Input: parts (fuzz_target.h); each part is one call: its first byte picks
// the method (mod 6), the rest is the serialized request (a part that does
// not parse is skipped).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "base/log.h"
#include "fuzz/fuzz_target.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kvtier/v1/controller.grpc.pb.h"
#include "services/controller/controller_server.h"

namespace {

enum Method : char {
  kRegister = 0,
  kHeartbeat = 1,
  kRoute = 2,
  kListNodes = 3,
  kGetPolicy = 4,
  kSetPolicy = 5,
};

std::string Part(Method m, const google::protobuf::Message& request) {
  return std::string(1, m) + request.SerializeAsString();
}

kvtier::v1::RegisterRequest Node(const std::string& id, kvtier::v1::NodeKind kind,
                                 const std::string& address) {
  kvtier::v1::RegisterRequest r;
  r.set_node_id(id);
  r.set_kind(kind);
  r.set_address(address);
  r.set_capacity_bytes(uint64_t{1} << 30);
  return r;
}

kvtier::v1::ModelSpec Model() {
  kvtier::v1::ModelSpec m;
  m.set_num_layers(5);
  m.set_num_q_heads(8);
  m.set_num_kv_heads(4);
  m.set_head_dim(8);
  m.set_dtype(kvtier::v1::DTYPE_FP32);
  m.set_rope_theta(10000);
  m.set_name("tiny");
  return m;
}

// Runs one call of `stub`'s method `call` with the request `bytes` parse
// to; false when it did not end before its deadline.
template <typename Request, typename Response>
bool Run(const std::string& bytes, kvtier::v1::Controller::Stub* stub,
         grpc::Status (kvtier::v1::Controller::Stub::*call)(grpc::ClientContext*, const Request&,
                                                            Response*)) {
  Request req;
  if (!req.ParseFromString(bytes)) return true;
  Response resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  return (stub->*call)(&ctx, req, &resp).error_code() != grpc::StatusCode::DEADLINE_EXCEEDED;
}

}  // namespace

namespace kvtier::fuzz {

std::vector<std::string> Seeds() {
  using v1::NODE_KIND_STORE;
  using v1::NODE_KIND_WORKER;
  std::vector<std::string> seeds;
  v1::HeartbeatRequest beat;
  beat.set_node_id("w1");
  beat.set_used_bytes(uint64_t{900} << 20);  // Under pressure.
  beat.set_active_sessions(3);
  v1::RouteRequest route;
  route.set_session_id("chat-1");
  *route.mutable_model() = Model();
  route.set_need_bytes(4096);
  v1::SetPolicyRequest set;
  set.set_model_name("tiny");
  set.mutable_policy()->set_codec(v1::CODEC_KIVI);
  set.mutable_policy()->mutable_codec_params()->set_bits(4);
  set.mutable_policy()->set_eviction("snapkv");
  set.mutable_policy()->set_budget_tokens(256);
  set.mutable_policy()->set_recall("topk:2");
  v1::SetPolicyRequest profiled;
  profiled.set_model_name("tiny");
  profiled.mutable_policy()->set_window(4);
  for (uint32_t b : {64u, 40u, 12u, 12u, 8u}) profiled.add_layer_budgets(b);
  profiled.set_profile_name("evolkv-tiny");
  v1::GetPolicyRequest ask;
  ask.set_session_id("chat-1");
  *ask.mutable_model() = Model();
  ask.set_idle_ms(120000);
  ask.set_node_id("w1");
  const v1::ListNodesRequest list;
  // Nodes, a route, policies and the policy a cold session gets.
  seeds.push_back(
      JoinParts({Part(kRegister, Node("s1", NODE_KIND_STORE, "127.0.0.1:7001")),
                 Part(kRegister, Node("s2", NODE_KIND_STORE, "127.0.0.1:7002")),
                 Part(kRegister, Node("w1", NODE_KIND_WORKER, "127.0.0.1:7101")),
                 Part(kHeartbeat, beat), Part(kRoute, route), Part(kSetPolicy, set),
                 Part(kSetPolicy, profiled), Part(kGetPolicy, ask), Part(kListNodes, list)}));
  // A worker that registers with sessions it holds (adopted), one of them
  // on a store nobody registered; a second registration under the same name.
  v1::RegisterRequest holder = Node("w2", NODE_KIND_WORKER, "127.0.0.1:7102");
  v1::HeldSession* held = holder.add_sessions();
  held->set_tenant("default");
  held->set_session_id("chat-2");
  held->add_store_addresses("127.0.0.1:7001");
  held->add_store_addresses("127.0.0.1:7999");
  v1::HeldSession* other = holder.add_sessions();
  other->set_tenant("acme");
  other->set_session_id("chat-3");
  seeds.push_back(JoinParts({Part(kRegister, Node("s1", NODE_KIND_STORE, "127.0.0.1:7001")),
                             Part(kRegister, holder), Part(kRegister, holder), Part(kRoute, route),
                             Part(kListNodes, list)}));
  // Prefill and decode workers: a route names both.
  v1::RegisterRequest prefill = Node("p1", NODE_KIND_WORKER, "127.0.0.1:7201");
  prefill.set_role(v1::WORKER_ROLE_PREFILL);
  prefill.set_has_gpu(true);
  v1::RegisterRequest decode = Node("d1", NODE_KIND_WORKER, "127.0.0.1:7202");
  decode.set_role(v1::WORKER_ROLE_DECODE);
  v1::RouteRequest avoid = route;
  avoid.set_avoid_worker_node_id("p1");
  seeds.push_back(JoinParts({Part(kRegister, Node("s1", NODE_KIND_STORE, "127.0.0.1:7001")),
                             Part(kRegister, prefill), Part(kRegister, decode), Part(kRoute, route),
                             Part(kRoute, avoid), Part(kListNodes, list)}));
  return seeds;
}

}  // namespace kvtier::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> parts = kvtier::fuzz::SplitParts(data, size, 24);
  if (parts.empty()) return 0;
  static const bool quiet = [] {
    kvtier::SetLogLevel(kvtier::LogLevel::kError);  // Not "authentication is off" each time.
    return true;
  }();
  (void)quiet;
  kvtier::ControllerServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.controller.replicas = 2;
  o.controller.membership.warmup = absl::ZeroDuration();
  auto server = kvtier::ControllerServer::Start(o);
  if (!server.ok()) {
    std::fprintf(stderr, "controller_request_fuzz: %s\n", server.status().ToString().c_str());
    __builtin_trap();
  }
  auto stub = kvtier::v1::Controller::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials()));
  namespace v1 = kvtier::v1;
  using Stub = v1::Controller::Stub;
  for (const std::string& part : parts) {
    if (part.empty()) continue;
    const std::string bytes = part.substr(1);
    bool ended = true;
    switch (static_cast<unsigned char>(part[0]) % 6) {
      case kRegister:
        ended = Run(bytes, stub.get(), &Stub::Register);
        break;
      case kHeartbeat:
        ended = Run(bytes, stub.get(), &Stub::Heartbeat);
        break;
      case kRoute:
        ended = Run(bytes, stub.get(), &Stub::Route);
        break;
      case kListNodes:
        ended = Run(bytes, stub.get(), &Stub::ListNodes);
        break;
      case kGetPolicy:
        ended = Run(bytes, stub.get(), &Stub::GetPolicy);
        break;
      default:
        ended = Run(bytes, stub.get(), &Stub::SetPolicy);
        break;
    }
    if (!ended) __builtin_trap();  // A call the controller never answered.
  }
  // The controller still answers, with every node once, in order.
  v1::ListNodesResponse nodes;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  if (!stub->ListNodes(&ctx, v1::ListNodesRequest(), &nodes).ok()) __builtin_trap();
  for (int i = 1; i < nodes.nodes_size(); ++i) {
    if (!(nodes.nodes(i - 1).node_id() < nodes.nodes(i).node_id())) __builtin_trap();
  }
  (void)(*server)->RenderMetrics();
  return 0;
}
