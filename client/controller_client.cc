#include "client/controller_client.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/log.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "rpc/grpc_status.h"
#include "rpc/transport_args.h"

namespace kvtier {
ControllerClient::ControllerClient(ControllerClientOptions options) : options_(std::move(options)) {
  grpc::ChannelArguments args;
  ApplyReconnectArgs(&args);
  std::shared_ptr<grpc::ChannelCredentials> creds =
      ClientChannelCredentials(ClientTls{options_.tls_root_certs, options_.tls_server_name,
                                         options_.tls_cert_chain, options_.tls_private_key},
                               &args);
  for (absl::string_view t : absl::StrSplit(options_.target, ',', absl::SkipEmpty())) {
    stubs_.push_back(
        v1::Controller::NewStub(grpc::CreateCustomChannel(std::string(t), creds, args)));
  }
}

absl::StatusOr<std::unique_ptr<ControllerClient>> ControllerClient::Connect(
    ControllerClientOptions options) {
  std::unique_ptr<ControllerClient> c(new ControllerClient(std::move(options)));
  if (c->stubs_.empty()) return absl::InvalidArgumentError("ControllerClient needs a target");
  return c;
}

std::unique_ptr<grpc::ClientContext> ControllerClient::NewContext(const CallOptions& call) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
  if (!call.tenant.empty()) ctx->AddMetadata("kvtier-tenant", call.tenant);
  ctx->set_deadline(absl::ToChronoTime(call.DeadlineOr(options_.deadline)));
  return ctx;
}

template <typename Resp, typename Fn>
absl::StatusOr<Resp> ControllerClient::Call(const CallOptions& call, Fn fn) {
  const size_t n = stubs_.size();
  const size_t first = current_.load();
  const absl::Time deadline = call.DeadlineOr(options_.deadline);
  absl::Status last;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (first + k) % n;
    CallOptions c = call;
    // Each replica gets a share of what is left, so that one that does not
    // answer leaves time for the others.
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration() && k > 0) break;
    c.deadline = absl::Now() + left / static_cast<int64_t>(n - k);
    auto ctx = NewContext(c);
    Resp resp;
    const grpc::Status s = fn(stubs_[i].get(), ctx.get(), &resp);
    if (s.ok()) {
      current_.store(i);
      return resp;
    }
    last = FromGrpc(s);
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE &&
        s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      current_.store(i);
      return last;
    }
  }
  return last;
}

absl::StatusOr<v1::RegisterResponse> ControllerClient::Register(const v1::RegisterRequest& req,
                                                                const CallOptions& call) {
  return Call<v1::RegisterResponse>(
      call, [&](auto* stub, auto* ctx, auto* resp) { return stub->Register(ctx, req, resp); });
}

absl::StatusOr<v1::HeartbeatResponse> ControllerClient::Heartbeat(const v1::HeartbeatRequest& req,
                                                                  const CallOptions& call) {
  return Call<v1::HeartbeatResponse>(
      call, [&](auto* stub, auto* ctx, auto* resp) { return stub->Heartbeat(ctx, req, resp); });
}

absl::StatusOr<v1::RouteResponse> ControllerClient::Route(const v1::RouteRequest& req,
                                                          const CallOptions& call) {
  return Call<v1::RouteResponse>(
      call, [&](auto* stub, auto* ctx, auto* resp) { return stub->Route(ctx, req, resp); });
}

absl::StatusOr<v1::ListNodesResponse> ControllerClient::ListNodes(const CallOptions& call) {
  return Call<v1::ListNodesResponse>(
      call, [&](auto* stub, auto* ctx, auto* resp) { return stub->ListNodes(ctx, {}, resp); });
}

absl::StatusOr<v1::GetPolicyResponse> ControllerClient::GetPolicy(const v1::GetPolicyRequest& req,
                                                                  const CallOptions& call) {
  return Call<v1::GetPolicyResponse>(
      call, [&](auto* stub, auto* ctx, auto* resp) { return stub->GetPolicy(ctx, req, resp); });
}

absl::StatusOr<v1::SetPolicyResponse> ControllerClient::SetPolicy(const v1::SetPolicyRequest& req,
                                                                  const CallOptions& call) {
  return Call<v1::SetPolicyResponse>(
      call, [&](auto* stub, auto* ctx, auto* resp) { return stub->SetPolicy(ctx, req, resp); });
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
