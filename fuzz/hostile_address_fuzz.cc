// Addresses as a hostile tenant or node would send them, through the two
// places that take one from a request: kvtier-controller's Register (a real
// ControllerServer, embedded back end, in this process on 127.0.0.1:0, one
// per input) and a worker's check of a session's store replicas
// (KnownNodes over that controller's ListNodes, as kvtier-worker builds
// it). For every address:
//   - Register answers OK only for an address that ValidateAddress takes,
//     and the controller then lists it byte for byte; otherwise
//     INVALID_ARGUMENT or ALREADY_EXISTS, never another code;
//   - KnownNodes answers OK only for the worker's own store or a store the
//     controller lists, INVALID_ARGUMENT exactly when ValidateAddress
//     refuses, PERMISSION_DENIED otherwise;
//   - no error message is longer than 1 KiB, whatever the address's size.
//
// Input: parts (fuzz_target.h); each part is one address. Part i registers
// store node "n<i>".
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "base/log.h"
#include "base/names.h"
#include "fuzz/fuzz_target.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kvtier/v1/controller.grpc.pb.h"
#include "services/controller/controller_server.h"
#include "services/worker/known_nodes.h"

namespace {

constexpr char kOwnStore[] = "127.0.0.1:7070";
constexpr size_t kMaxMessage = 1024;

void Check(bool ok, const char* what, const std::string& address) {
  if (ok) return;
  std::fprintf(stderr, "hostile_address_fuzz: %s for an address of %zu bytes\n", what,
               address.size());
  __builtin_trap();
}

}  // namespace

namespace kvtier::fuzz {

std::vector<std::string> Seeds() {
  return {
      JoinParts({"127.0.0.1:7001", "127.0.0.1:7002", "[::1]:7003", "unix:/run/kvtier.sock"}),
      JoinParts(
          {"127.0.0.1:70 01", "127.0.0.1:7001\n", std::string("127.0.0.1:7\0", 11), "h\xc3\xa9:1"}),
      JoinParts({std::string(300, 'a') + ":1", "127.0.0.1", ":7001", "127.0.0.1:0",
                 "127.0.0.1:65536", "[::g]:1", "evil/host:1", kOwnStore}),
      JoinParts({"store-1.kvtier.svc.cluster.local:7070", "store-1.kvtier.svc.cluster.local:7070",
                 "unix:"}),
  };
}

}  // namespace kvtier::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> addresses = kvtier::fuzz::SplitParts(data, size, 16);
  if (addresses.empty()) return 0;
  static const bool quiet = [] {
    kvtier::SetLogLevel(kvtier::LogLevel::kError);
    return true;
  }();
  (void)quiet;
  namespace v1 = kvtier::v1;
  kvtier::ControllerServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.controller.membership.warmup = absl::ZeroDuration();
  auto server = kvtier::ControllerServer::Start(o);
  if (!server.ok()) {
    std::fprintf(stderr, "hostile_address_fuzz: %s\n", server.status().ToString().c_str());
    __builtin_trap();
  }
  const std::string target = "127.0.0.1:" + std::to_string((*server)->port());
  auto stub =
      v1::Controller::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  std::set<std::string> registered;
  for (size_t i = 0; i < addresses.size(); ++i) {
    const std::string& a = addresses[i];
    v1::RegisterRequest r;
    r.set_node_id("n" + std::to_string(i));
    r.set_kind(v1::NODE_KIND_STORE);
    r.set_address(a);
    v1::RegisterResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    const grpc::Status st = stub->Register(&ctx, r, &resp);
    const bool valid = kvtier::ValidateAddress("address", a).ok();
    if (st.ok()) {
      Check(valid, "Register took an address ValidateAddress refuses", a);
      registered.insert(a);
    } else {
      Check(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                st.error_code() == grpc::StatusCode::ALREADY_EXISTS,
            "Register answered a code other than INVALID_ARGUMENT or ALREADY_EXISTS", a);
      Check(st.error_code() != grpc::StatusCode::INVALID_ARGUMENT || !valid,
            "Register refused an address ValidateAddress takes", a);
      Check(st.error_message().size() <= kMaxMessage, "Register's error is too long", a);
    }
  }
  v1::ListNodesResponse nodes;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    if (!stub->ListNodes(&ctx, v1::ListNodesRequest(), &nodes).ok()) __builtin_trap();
  }
  std::set<std::string> listed;
  for (const v1::NodeStatus& n : nodes.nodes()) listed.insert(n.address());
  Check(listed == registered, "ListNodes does not list exactly the registered addresses", "");

  std::shared_ptr<v1::Controller::Stub> shared = std::move(stub);
  kvtier::KnownNodes known(
      {"store replica address", "--store or the controller's stores", {kOwnStore}, false},
      [shared](const kvtier::CallOptions& call) -> absl::StatusOr<std::vector<std::string>> {
        grpc::ClientContext ctx;
        ctx.set_deadline(absl::ToChronoTime(call.deadline));
        v1::ListNodesResponse got;
        const grpc::Status st = shared->ListNodes(&ctx, v1::ListNodesRequest(), &got);
        if (!st.ok()) return absl::UnavailableError(st.error_message());
        std::vector<std::string> out;
        for (const auto& n : got.nodes()) out.push_back(n.address());
        return out;
      });
  for (const std::string& a : addresses) {
    const absl::Status s = known.Check({a}, kvtier::CallOptions::Within(absl::Seconds(20)));
    const bool valid = kvtier::ValidateAddress("address", a).ok();
    const bool mine = a == kOwnStore || listed.count(a) != 0;
    if (s.ok()) {
      Check(valid && mine, "KnownNodes took an address that is not a known store", a);
    } else if (absl::IsInvalidArgument(s)) {
      Check(!valid, "KnownNodes refused a valid address as malformed", a);
    } else {
      Check(absl::IsPermissionDenied(s) && valid && !mine,
            "KnownNodes refused a known store, or with the wrong code", a);
    }
    Check(s.message().size() <= kMaxMessage, "KnownNodes' error is too long", a);
  }
  return 0;
}
