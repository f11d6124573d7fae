#include "client/controller_client.h"

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "rpc/grpc_status.h"
#include "rpc/transport_args.h"

namespace kvtier {
namespace {

template <typename T>
absl::StatusOr<T> Finish(const grpc::Status& s, T resp) {
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

}  // namespace

ControllerClient::ControllerClient(ControllerClientOptions options) : options_(std::move(options)) {
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (options_.tls_root_certs.empty()) {
    creds = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options_.tls_root_certs;
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  ApplyReconnectArgs(&args);
  stub_ = v1::Controller::NewStub(grpc::CreateCustomChannel(options_.target, creds, args));
}

absl::StatusOr<std::unique_ptr<ControllerClient>> ControllerClient::Connect(
    ControllerClientOptions options) {
  if (options.target.empty()) {
    return absl::InvalidArgumentError("ControllerClient needs a target");
  }
  return std::unique_ptr<ControllerClient>(new ControllerClient(std::move(options)));
}

std::unique_ptr<grpc::ClientContext> ControllerClient::NewContext(const CallOptions& call) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
  if (!call.tenant.empty()) ctx->AddMetadata("kvtier-tenant", call.tenant);
  ctx->set_deadline(absl::ToChronoTime(call.DeadlineOr(options_.deadline)));
  return ctx;
}

absl::StatusOr<v1::RegisterResponse> ControllerClient::Register(const v1::RegisterRequest& req,
                                                                const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::RegisterResponse resp;
  grpc::Status s = stub_->Register(ctx.get(), req, &resp);
  return Finish(s, std::move(resp));
}

absl::StatusOr<v1::HeartbeatResponse> ControllerClient::Heartbeat(const v1::HeartbeatRequest& req,
                                                                  const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::HeartbeatResponse resp;
  grpc::Status s = stub_->Heartbeat(ctx.get(), req, &resp);
  return Finish(s, std::move(resp));
}

absl::StatusOr<v1::RouteResponse> ControllerClient::Route(const v1::RouteRequest& req,
                                                          const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::RouteResponse resp;
  grpc::Status s = stub_->Route(ctx.get(), req, &resp);
  return Finish(s, std::move(resp));
}

absl::StatusOr<v1::ListNodesResponse> ControllerClient::ListNodes(const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::ListNodesResponse resp;
  grpc::Status s = stub_->ListNodes(ctx.get(), {}, &resp);
  return Finish(s, std::move(resp));
}

absl::StatusOr<v1::GetPolicyResponse> ControllerClient::GetPolicy(const v1::GetPolicyRequest& req,
                                                                  const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::GetPolicyResponse resp;
  grpc::Status s = stub_->GetPolicy(ctx.get(), req, &resp);
  return Finish(s, std::move(resp));
}

absl::StatusOr<v1::SetPolicyResponse> ControllerClient::SetPolicy(const v1::SetPolicyRequest& req,
                                                                  const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::SetPolicyResponse resp;
  grpc::Status s = stub_->SetPolicy(ctx.get(), req, &resp);
  return Finish(s, std::move(resp));
}

absl::StatusOr<std::unique_ptr<NodeAgent>> NodeAgent::Start(NodeAgentOptions options) {
  std::unique_ptr<NodeAgent> a(new NodeAgent(std::move(options)));
  auto c = ControllerClient::Connect(a->options_.controller);
  if (!c.ok()) return c.status();
  a->client_ = std::move(*c);
  a->thread_ = std::thread([raw = a.get()] { raw->Run(); });
  return a;
}

NodeAgent::~NodeAgent() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

void NodeAgent::Run() {
  absl::Duration interval = absl::Seconds(1);
  bool reported_outage = false;
  const std::string& id = options_.node.node_id();
  do {
    absl::Status st;
    if (!registered_.load()) {
      v1::RegisterRequest req = options_.node;
      if (options_.sessions) {
        for (v1::HeldSession& h : options_.sessions()) *req.add_sessions() = std::move(h);
      }
      absl::StatusOr<v1::RegisterResponse> r = client_->Register(req);
      st = r.status();
      if (r.ok()) {
        registered_.store(true);
        NoteEpoch(r->epoch());
        if (r->heartbeat_interval_ms() > 0) {
          interval = absl::Milliseconds(r->heartbeat_interval_ms());
        }
        LogInfo("registered with the controller", {{"node", id},
                                                   {"controller", options_.controller.target},
                                                   {"epoch", r->epoch()},
                                                   {"sessions", req.sessions_size()}});
      }
    } else {
      v1::HeartbeatRequest hb;
      hb.set_node_id(id);
      if (options_.usage) {
        const NodeUsage u = options_.usage();
        hb.set_used_bytes(u.used_bytes);
        hb.set_active_sessions(u.active_sessions);
      }
      absl::StatusOr<v1::HeartbeatResponse> r =
          client_->Heartbeat(hb, CallOptions::Within(interval));
      st = r.status();
      if (r.ok()) {
        NoteEpoch(r->epoch());
        if (options_.on_heartbeat) options_.on_heartbeat(*r);
      } else if (absl::IsNotFound(r.status())) {
        LogWarn("the controller no longer knows this node; registering again", {{"node", id}});
        registered_.store(false);  // At the next tick.
        st = absl::OkStatus();     // Reachable: not an outage.
      }
    }
    if (!st.ok() && !reported_outage) {
      LogWarn("controller unreachable; retrying",
              {{"node", id}, {"controller", options_.controller.target}, {"error", st.ToString()}});
      reported_outage = true;
    } else if (st.ok() && reported_outage) {
      LogInfo("controller reachable again", {{"node", id}});
      reported_outage = false;
    }
  } while (!stop_.WaitForNotificationWithTimeout(interval));
}

}  // namespace kvtier
