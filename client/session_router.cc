#include "client/session_router.h"

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "rpc/raw_call.h"
#include "rpc/transport_args.h"

namespace kvtier {

bool WorkerFailoverCandidate(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kAborted:
      return true;
    default:
      return false;
  }
}

absl::StatusOr<std::unique_ptr<SessionRouter>> SessionRouter::Connect(
    ControllerClientOptions controller, WorkerChannelOptions workers) {
  auto client = ControllerClient::Connect(std::move(controller));
  if (!client.ok()) return client.status();
  return std::unique_ptr<SessionRouter>(new SessionRouter(std::move(*client), std::move(workers)));
}

absl::StatusOr<v1::RouteResponse> SessionRouter::Route(const std::string& session,
                                                       const CallOptions& call) {
  {
    absl::MutexLock lock(&mu_);
    auto it = routes_.find(session);
    if (it != routes_.end()) return it->second;
  }
  v1::RouteRequest req;
  req.set_session_id(session);
  absl::StatusOr<v1::RouteResponse> r = client_->Route(req, call);
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat("Route ", session, ": ", r.status().message()));
  }
  absl::MutexLock lock(&mu_);
  routes_[session] = *r;
  return r;
}

absl::StatusOr<v1::RouteResponse> SessionRouter::Failover(const std::string& session,
                                                          const v1::RouteResponse& failed,
                                                          const CallOptions& call) {
  v1::RouteRequest req;
  req.set_session_id(session);
  req.set_avoid_worker_node_id(failed.worker_node_id());
  absl::StatusOr<v1::RouteResponse> r = client_->Route(req, call);
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat("Route ", session, " avoiding ", failed.worker_node_id(), ": ",
                                     r.status().message()));
  }
  LogWarn("session moved to another worker",
          {{"session", session}, {"from", failed.worker_node_id()}, {"to", r->worker_node_id()}});
  absl::MutexLock lock(&mu_);
  routes_[session] = *r;
  ++failovers_;
  return r;
}

absl::StatusOr<v1::RouteResponse> SessionRouter::FailoverDecode(const std::string& session,
                                                                const v1::RouteResponse& failed,
                                                                const CallOptions& call) {
  v1::RouteRequest req;
  req.set_session_id(session);
  req.set_avoid_worker_node_id(failed.decode_worker_node_id());
  absl::StatusOr<v1::RouteResponse> r = client_->Route(req, call);
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat("Route ", session, " avoiding decode worker ",
                                     failed.decode_worker_node_id(), ": ", r.status().message()));
  }
  LogWarn("session's decode steps moved off a decode worker that does not answer",
          {{"session", session},
           {"from", failed.decode_worker_node_id()},
           {"to", r->decode_worker_node_id().empty() ? r->worker_node_id()
                                                     : r->decode_worker_node_id()}});
  absl::MutexLock lock(&mu_);
  routes_[session] = *r;
  ++failovers_;
  return r;
}

absl::StatusOr<v1::RouteResponse> SessionRouter::Refresh(const std::string& session,
                                                         const CallOptions& call) {
  Forget(session);
  return Route(session, call);
}

void SessionRouter::Forget(const std::string& session) {
  absl::MutexLock lock(&mu_);
  routes_.erase(session);
}

std::shared_ptr<grpc::Channel> SessionRouter::Channel(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<grpc::Channel>& ch = channels_[address];
  if (ch == nullptr) {
    grpc::ChannelArguments args;
    ApplyReconnectArgs(&args);
    ch = grpc::CreateCustomChannel(
        address,
        ClientChannelCredentials(ClientTls{workers_.tls_root_certs, workers_.tls_server_name,
                                           workers_.tls_cert_chain, workers_.tls_private_key},
                                 &args),
        args);
  }
  return ch;
}

bool SessionRouter::Answers(const std::string& address, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  // grpc.health.v1.HealthCheckRequest{service: ""} is the empty message.
  RawCall call(Channel(address), &ctx, "/grpc.health.v1.Health/Check");
  grpc::ByteBuffer empty, reply;
  grpc::Slice nothing;
  empty = grpc::ByteBuffer(&nothing, 1);
  if (call.Write(empty) && call.WritesDone()) {
    while (call.Read(&reply)) {
    }
  }
  return call.Finish().ok();
}

uint64_t SessionRouter::failovers() const {
  absl::MutexLock lock(&mu_);
  return failovers_;
}

}  // namespace kvtier
