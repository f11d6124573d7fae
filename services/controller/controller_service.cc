#include "services/controller/controller_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/names.h"
#include "base/status_macros.h"
#include "rpc/grpc_status.h"
#include "rpc/wire_format.h"
#include "services/common/request_outcome.h"

namespace kvtier {
namespace {

using controller::NodeInfo;
using controller::NodeKind;

v1::NodeKind ToProto(NodeKind k) {
  return k == NodeKind::kWorker ? v1::NODE_KIND_WORKER : v1::NODE_KIND_STORE;
}

v1::PressureLevel ToProto(controller::Pressure p) {
  switch (p) {
    case controller::Pressure::kNone:
      return v1::PRESSURE_NONE;
    case controller::Pressure::kModerate:
      return v1::PRESSURE_MODERATE;
    case controller::Pressure::kHigh:
      return v1::PRESSURE_HIGH;
  }
  return v1::PRESSURE_NONE;
}

// Register and Heartbeat come from nodes: a node token (or auth off) that
// may act as node `id` of `kind` (Authenticator::RequireNodeIdentity).
absl::Status RequireNode(const Authenticator& auth, const grpc::CallbackServerContext& ctx,
                         const std::string& id, const std::string& kind) {
  KVT_ASSIGN_OR_RETURN(Principal p, auth.Authenticate(ctx));
  if (auth.enabled() && p.role != Role::kNode) {
    return absl::PermissionDeniedError(
        absl::StrCat("tenant '", p.tenant,
                     "' is not a node: Register and Heartbeat need a node "
                     "token"));
  }
  return auth.RequireNodeIdentity(p, id, kind);
}

}  // namespace

ControllerMetrics::ControllerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      nodes_(prometheus::BuildGauge()
                 .Name("kvtier_controller_nodes")
                 .Help("Nodes known, by kind and state")
                 .Register(*registry_)),
      placements_(prometheus::BuildGauge()
                      .Name("kvtier_controller_placements")
                      .Help("Recorded session placements")
                      .Register(*registry_)
                      .Add({})),
      epoch_(prometheus::BuildGauge()
                 .Name("kvtier_controller_epoch")
                 .Help("The placement epoch")
                 .Register(*registry_)
                 .Add({})),
      placed_(prometheus::BuildCounter()
                  .Name("kvtier_controller_placed_total")
                  .Help("Sessions placed or moved by Route")
                  .Register(*registry_)
                  .Add({})),
      dead_(prometheus::BuildCounter()
                .Name("kvtier_controller_nodes_declared_dead_total")
                .Help("Nodes whose lease ran out")
                .Register(*registry_)
                .Add({})),
      requests_(prometheus::BuildCounter()
                    .Name("kvtier_controller_requests_total")
                    .Help("RPCs by method and outcome")
                    .Register(*registry_)),
      repairs_pending_(prometheus::BuildGauge()
                           .Name("kvtier_controller_repairs_pending")
                           .Help("Sessions whose new replica is waiting for or receiving a copy")
                           .Register(*registry_)
                           .Add({})),
      under_replicated_(prometheus::BuildGauge()
                            .Name("kvtier_controller_under_replicated_sessions")
                            .Help("Placed sessions with fewer store replicas than --replicas")
                            .Register(*registry_)
                            .Add({})),
      repair_family_(prometheus::BuildCounter()
                         .Name("kvtier_controller_repair_total")
                         .Help("Repair work done: sessions (ok, failed attempts), segments "
                               "(copied, present), bytes copied")
                         .Register(*registry_)),
      pressure_(prometheus::BuildGauge()
                    .Name("kvtier_controller_node_pressure")
                    .Help("Memory pressure of each live node: 0 none, 1 moderate, 2 high")
                    .Register(*registry_)),
      nodes_by_pressure_(prometheus::BuildGauge()
                             .Name("kvtier_controller_nodes_by_pressure")
                             .Help("Live nodes at each pressure level")
                             .Register(*registry_)),
      node_sessions_(prometheus::BuildGauge()
                         .Name("kvtier_controller_node_sessions")
                         .Help("Sessions each live node reports holding (its last heartbeat)")
                         .Register(*registry_)),
      policy_answers_(prometheus::BuildCounter()
                          .Name("kvtier_controller_policy_answers_total")
                          .Help("GetPolicy answers: as registered, tightened for a cold session "
                                "under pressure, or no policy for the model")
                          .Register(*registry_)),
      policies_(prometheus::BuildGauge()
                    .Name("kvtier_controller_policies")
                    .Help("Models with a registered policy")
                    .Register(*registry_)
                    .Add({})),
      leader_(prometheus::BuildGauge()
                  .Name("kvtier_controller_leader")
                  .Help("1 while this replica runs the background sweep (always, without etcd)")
                  .Register(*registry_)
                  .Add({})) {
  leader_.Set(1);
}

void ControllerMetrics::UpdateRepair(const RepairStats& now) {
  auto add = [&](const char* what, uint64_t now_v, uint64_t was) {
    if (now_v > was) {
      repair_family_.Add({{"what", what}}).Increment(static_cast<double>(now_v - was));
    }
  };
  absl::MutexLock lock(&mu_);
  add("sessions_ok", now.sessions_repaired, last_repair_.sessions_repaired);
  add("sessions_empty", now.sessions_empty, last_repair_.sessions_empty);
  add("sessions_failed", now.sessions_failed, last_repair_.sessions_failed);
  add("segments_copied", now.segments_copied, last_repair_.segments_copied);
  add("segments_present", now.segments_present, last_repair_.segments_present);
  add("bytes", now.bytes_copied, last_repair_.bytes_copied);
  last_repair_ = now;
}

void ControllerMetrics::Update(controller::Controller& c) {
  double counts[2][2] = {{0, 0}, {0, 0}};
  double by_level[3] = {0, 0, 0};
  for (const NodeInfo& n : c.membership().All()) {
    counts[n.spec.kind == NodeKind::kWorker ? 0 : 1][n.live ? 0 : 1] += 1;
    const controller::Pressure p = c.membership().PressureOf(n);
    if (n.live) by_level[static_cast<int>(p)] += 1;
    pressure_.Add({{"node", n.spec.id}, {"kind", controller::NodeKindName(n.spec.kind)}})
        .Set(static_cast<double>(static_cast<int>(p)));
    node_sessions_.Add({{"node", n.spec.id}, {"kind", controller::NodeKindName(n.spec.kind)}})
        .Set(n.live ? static_cast<double>(n.active_sessions) : 0.0);
  }
  for (const controller::Pressure p : {controller::Pressure::kNone, controller::Pressure::kModerate,
                                       controller::Pressure::kHigh}) {
    nodes_by_pressure_.Add({{"level", controller::PressureName(p)}})
        .Set(by_level[static_cast<int>(p)]);
  }
  for (int k = 0; k < 2; ++k) {
    for (int l = 0; l < 2; ++l) {
      nodes_.Add({{"kind", k == 0 ? "worker" : "store"}, {"state", l == 0 ? "live" : "dead"}})
          .Set(counts[k][l]);
    }
  }
  placements_.Set(static_cast<double>(c.Placements()));
  repairs_pending_.Set(static_cast<double>(c.RepairsPending()));
  under_replicated_.Set(static_cast<double>(c.UnderReplicated()));
  epoch_.Set(static_cast<double>(c.membership().epoch()));
}

void ControllerMetrics::Request(const char* method, const absl::Status& s) {
  requests_.Add({{"method", method}, {"outcome", RequestOutcome(s)}}).Increment();
}

ControllerService::ControllerService(controller::Controller* controller, Coordination* coordination,
                                     PolicyBook* policies, const Authenticator* auth,
                                     ControllerMetrics* metrics, PolicyServing serving,
                                     Executor* blocking)
    : controller_(controller),
      coordination_(coordination),
      policies_(policies),
      auth_(auth),
      metrics_(metrics),
      serving_(serving),
      blocking_(blocking) {
  metrics_->Policies(policies_->size());
}

grpc::ServerUnaryReactor* ControllerService::Run(grpc::CallbackServerContext* ctx,
                                                 const char* method,
                                                 std::function<absl::Status()> body) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  auto finish = [this, r, method, body = std::move(body)] {
    const absl::Status s = body();
    metrics_->Request(method, s);
    r->Finish(ToGrpc(s));
  };
  if (blocking_ == nullptr) {
    finish();
  } else {
    blocking_->Schedule(std::move(finish));
  }
  return r;
}

template <typename Req, typename Resp, typename Body>
grpc::ServerUnaryReactor* ControllerService::Parsed(grpc::CallbackServerContext* ctx,
                                                    const char* method, const grpc::ByteBuffer* raw,
                                                    grpc::ByteBuffer* out, Body body) {
  return Run(ctx, method, [raw, out, body = std::move(body)]() -> absl::Status {
    Req req;
    Resp resp;
    KVT_RETURN_IF_ERROR(wire::Parse(*raw, &req));
    KVT_RETURN_IF_ERROR(body(&req, &resp));
    *out = wire::Serialize(resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ControllerService::Register(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* raw,
                                                      grpc::ByteBuffer* out) {
  return Parsed<v1::RegisterRequest, v1::RegisterResponse>(
      ctx, "Register", raw, out,
      [this, ctx](const v1::RegisterRequest* req, v1::RegisterResponse* resp) -> absl::Status {
        controller::NodeSpec spec;
        spec.id = req->node_id();
        switch (req->kind()) {
          case v1::NODE_KIND_WORKER:
            spec.kind = NodeKind::kWorker;
            break;
          case v1::NODE_KIND_STORE:
            spec.kind = NodeKind::kStore;
            break;
          default:
            return absl::InvalidArgumentError("kind must be NODE_KIND_WORKER or NODE_KIND_STORE");
        }
        KVT_RETURN_IF_ERROR(
            RequireNode(*auth_, *ctx, spec.id, controller::NodeKindName(spec.kind)));
        spec.address = req->address();
        spec.capacity_bytes = req->capacity_bytes();
        spec.has_gpu = req->has_gpu();
        switch (req->role()) {
          case v1::WORKER_ROLE_BOTH:
            break;
          case v1::WORKER_ROLE_PREFILL:
            spec.role = controller::WorkerRole::kPrefill;
            break;
          case v1::WORKER_ROLE_DECODE:
            spec.role = controller::WorkerRole::kDecode;
            break;
          default:
            return absl::InvalidArgumentError(absl::StrCat("unknown worker role ", req->role()));
        }
        if (spec.kind == NodeKind::kStore && spec.role != controller::WorkerRole::kBoth) {
          return absl::InvalidArgumentError("a store has no worker role");
        }
        // The sessions a worker reports name their stores: checked before any
        // of them is adopted.
        for (const v1::HeldSession& h : req->sessions()) {
          KVT_RETURN_IF_ERROR(ValidateName("held session tenant", h.tenant()));
          KVT_RETURN_IF_ERROR(ValidateName("held session id", h.session_id()));
          for (const std::string& a : h.store_addresses()) {
            KVT_RETURN_IF_ERROR(ValidateAddress("held session store address", a));
          }
        }
        KVT_RETURN_IF_ERROR(controller_->membership().Register(spec));
        KVT_RETURN_IF_ERROR(coordination_->NodeRegistered(spec));
        if (spec.kind == NodeKind::kWorker && coordination_->AdoptsReports()) {
          for (const v1::HeldSession& h : req->sessions()) {
            controller_->Adopt(spec.id, h.tenant(), h.session_id(),
                               {h.store_addresses().begin(), h.store_addresses().end()});
          }
        }
        resp->set_heartbeat_interval_ms(static_cast<uint32_t>(
            absl::ToInt64Milliseconds(controller_->membership().options().heartbeat_interval)));
        resp->set_epoch(controller_->membership().epoch());
        metrics_->Update(*controller_);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* ControllerService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* raw,
                                                       grpc::ByteBuffer* out) {
  return Parsed<v1::HeartbeatRequest, v1::HeartbeatResponse>(
      ctx, "Heartbeat", raw, out,
      [this, ctx](const v1::HeartbeatRequest* req, v1::HeartbeatResponse* resp) -> absl::Status {
        controller::Membership& m = controller_->membership();
        const std::optional<NodeInfo> known = m.Get(req->node_id());
        // A node not (or no longer) known answers NOT_FOUND below: only an id
        // that is known has a kind to check.
        KVT_RETURN_IF_ERROR(RequireNode(
            *auth_, *ctx, req->node_id(),
            known.has_value() ? controller::NodeKindName(known->spec.kind) : std::string()));
        KVT_RETURN_IF_ERROR(coordination_->NodeHeartbeat(req->node_id(), req->used_bytes(),
                                                         req->active_sessions()));
        const std::optional<NodeInfo> node = m.Get(req->node_id());
        resp->set_pressure(
            ToProto(node.has_value() ? m.PressureOf(*node) : controller::Pressure::kNone));
        resp->set_epoch(m.epoch());
        resp->set_cold_idle_ms(
            static_cast<uint64_t>(absl::ToInt64Milliseconds(serving_.cold_after)));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* ControllerService::Route(grpc::CallbackServerContext* ctx,
                                                   const grpc::ByteBuffer* raw,
                                                   grpc::ByteBuffer* out) {
  return Parsed<v1::RouteRequest, v1::RouteResponse>(
      ctx, "Route", raw, out,
      [this, ctx](const v1::RouteRequest* req, v1::RouteResponse* resp) -> absl::Status {
        KVT_ASSIGN_OR_RETURN(Principal p, auth_->Authenticate(*ctx));
        KVT_ASSIGN_OR_RETURN(controller::Placement pl,
                             controller_->Route(p.tenant, req->session_id(), req->need_bytes(),
                                                req->avoid_worker_node_id()));
        resp->set_worker_address(pl.worker.spec.address);
        resp->set_worker_node_id(pl.worker.spec.id);
        for (const NodeInfo& st : pl.stores) {
          resp->add_store_addresses(st.spec.address);
          resp->add_store_node_ids(st.spec.id);
        }
        resp->set_store_address(pl.stores.front().spec.address);
        resp->set_epoch(pl.epoch);
        resp->set_placed_now(pl.placed_now);
        if (pl.decode_worker.has_value()) {
          resp->set_decode_worker_address(pl.decode_worker->spec.address);
          resp->set_decode_worker_node_id(pl.decode_worker->spec.id);
        }
        if (pl.placed_now) metrics_->Placed();
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* ControllerService::ListNodes(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* raw,
                                                       grpc::ByteBuffer* out) {
  return Parsed<v1::ListNodesRequest, v1::ListNodesResponse>(
      ctx, "ListNodes", raw, out,
      [this, ctx](const v1::ListNodesRequest*, v1::ListNodesResponse* resp) -> absl::Status {
        KVT_RETURN_IF_ERROR(auth_->Authenticate(*ctx).status());
        controller::Membership& m = controller_->membership();
        const int64_t now = m.options().clock->NowUnixMs();
        resp->set_epoch(m.epoch());
        for (const NodeInfo& n : m.All()) {
          v1::NodeStatus* o = resp->add_nodes();
          o->set_node_id(n.spec.id);
          o->set_kind(ToProto(n.spec.kind));
          o->set_address(n.spec.address);
          o->set_live(n.live);
          o->set_capacity_bytes(n.spec.capacity_bytes);
          o->set_role(n.spec.role == controller::WorkerRole::kPrefill  ? v1::WORKER_ROLE_PREFILL
                      : n.spec.role == controller::WorkerRole::kDecode ? v1::WORKER_ROLE_DECODE
                                                                       : v1::WORKER_ROLE_BOTH);
          o->set_used_bytes(n.used_bytes);
          o->set_active_sessions(n.active_sessions);
          o->set_since_heartbeat_ms(
              static_cast<uint64_t>(std::max<int64_t>(0, now - n.last_heartbeat_ms)));
          o->set_placement_weight(n.live ? m.Weight(n) : 0.0);
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* ControllerService::GetPolicy(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* raw,
                                                       grpc::ByteBuffer* out) {
  return Parsed<v1::GetPolicyRequest, v1::GetPolicyResponse>(
      ctx, "GetPolicy", raw, out,
      [this, ctx](const v1::GetPolicyRequest* req, v1::GetPolicyResponse* resp) -> absl::Status {
        KVT_ASSIGN_OR_RETURN(Principal p, auth_->Authenticate(*ctx));
        KVT_RETURN_IF_ERROR(ValidateName("session_id", req->session_id()));
        const std::string& model = req->model().name();
        std::optional<v1::SetPolicyRequest> reg = policies_->Get(model);
        if (!reg.has_value()) {
          metrics_->PolicyAnswer("not_found");
          return absl::NotFoundError(absl::StrCat(
              "no policy registered for model '", model,
              "' (kvtier policy set --model=NAME ...); open the session with an explicit Policy"));
        }
        controller::Pressure level = controller::Pressure::kNone;
        for (const NodeInfo& n : controller_->NodesOf(p.tenant, req->session_id())) {
          level = std::max(level, controller_->membership().PressureOf(n));
        }
        if (const std::optional<NodeInfo> asker = controller_->membership().Get(req->node_id());
            asker.has_value()) {
          level = std::max(level, controller_->membership().PressureOf(*asker));
        }
        const bool cold =
            req->idle_ms() > 0 && absl::Milliseconds(req->idle_ms()) >= serving_.cold_after;
        const bool tighten = cold && level != controller::Pressure::kNone;
        *resp = AnswerPolicy(*reg, tighten);
        resp->set_pressure(ToProto(level));
        metrics_->PolicyAnswer(tighten ? "tightened" : "registered");
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* ControllerService::SetPolicy(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* raw,
                                                       grpc::ByteBuffer* out) {
  return Parsed<v1::SetPolicyRequest, v1::SetPolicyResponse>(
      ctx, "SetPolicy", raw, out,
      [this, ctx](const v1::SetPolicyRequest* req, v1::SetPolicyResponse* resp) -> absl::Status {
        KVT_ASSIGN_OR_RETURN(Principal p, auth_->Authenticate(*ctx));
        if (auth_->enabled() && p.role != Role::kNode) {
          return absl::PermissionDeniedError(
              absl::StrCat("tenant '", p.tenant,
                           "' may not register policies: SetPolicy needs a "
                           "node token (the operator's)"));
        }
        KVT_ASSIGN_OR_RETURN(bool replaced, policies_->Set(*req));
        resp->set_replaced(replaced);
        metrics_->Policies(policies_->size());
        LogInfo("policy registered", {{"model", req->model_name()},
                                      {"eviction", req->policy().eviction()},
                                      {"codec", v1::Codec_Name(req->policy().codec())},
                                      {"layer_budgets", req->layer_budgets_size()},
                                      {"replaced", replaced}});
        return absl::OkStatus();
      });
}

}  // namespace kvtier
