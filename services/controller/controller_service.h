// The kvtier.v1.Controller service on gRPC's callback API, over
// controller::Controller. With the embedded back end every call is in-memory
// work under short locks and finishes on the callback thread that received
// it; with etcd, calls run on an executor of their own (they wait on etcd).
#ifndef KVTIER_SERVICES_CONTROLLER_CONTROLLER_SERVICE_H_
#define KVTIER_SERVICES_CONTROLLER_CONTROLLER_SERVICE_H_

#include <functional>
#include <memory>

#include "base/executor.h"
#include "controller/controller.h"
#include "kvtier/v1/controller.grpc.pb.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "services/common/auth.h"
#include "services/controller/coordination.h"
#include "services/controller/policy_book.h"
#include "services/controller/repairer.h"

namespace kvtier {

// Prometheus metrics of kvtier-controller. Thread-safe.
class ControllerMetrics {
 public:
  ControllerMetrics();
  // Refreshes the gauges from the controller's state.
  void Update(controller::Controller& c);
  // One finished RPC, its outcome by RequestOutcome(s)
  // (services/common/request_outcome.h).
  void Request(const char* method, const absl::Status& s);
  void Placed() { placed_.Increment(); }
  void DeclaredDead(size_t n) { dead_.Increment(static_cast<double>(n)); }
  // A GetPolicy answer: "registered", "tightened" or "not_found".
  void PolicyAnswer(const char* result) { policy_answers_.Add({{"result", result}}).Increment(); }
  void Policies(size_t n) { policies_.Set(static_cast<double>(n)); }
  void Leader(bool leading) { leader_.Set(leading ? 1 : 0); }
  // Adds what the repairer did since the last call.
  void UpdateRepair(const RepairStats& now);
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Gauge>& nodes_;
  prometheus::Gauge& placements_;
  prometheus::Gauge& epoch_;
  prometheus::Counter& placed_;
  prometheus::Counter& dead_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Gauge& repairs_pending_;
  prometheus::Gauge& under_replicated_;
  prometheus::Family<prometheus::Counter>& repair_family_;
  prometheus::Family<prometheus::Gauge>& pressure_;
  prometheus::Family<prometheus::Gauge>& nodes_by_pressure_;
  prometheus::Family<prometheus::Gauge>& node_sessions_;
  prometheus::Family<prometheus::Counter>& policy_answers_;
  prometheus::Gauge& policies_;
  prometheus::Gauge& leader_;
  absl::Mutex mu_;
  RepairStats last_repair_ ABSL_GUARDED_BY(mu_);
};

// Thread-safe; the pointers are not owned and must outlive the service.
struct PolicyServing {
  // Sessions idle at least this long are cold. Default: 60 s.
  absl::Duration cold_after = absl::Seconds(60);
};

// Every method is registered raw: requests are parsed here, not by gRPC, so
// that bytes which do not parse are INVALID_ARGUMENT naming the message
// (gRPC's typed handler answers UNIMPLEMENTED with no details).
class ControllerService final : public v1::Controller::WithRawCallbackMethod_Register<
                                    v1::Controller::WithRawCallbackMethod_Heartbeat<
                                        v1::Controller::WithRawCallbackMethod_Route<
                                            v1::Controller::WithRawCallbackMethod_ListNodes<
                                                v1::Controller::WithRawCallbackMethod_GetPolicy<
                                                    v1::Controller::WithRawCallbackMethod_SetPolicy<
                                                        v1::Controller::CallbackService>>>>>> {
 public:
  ControllerService(controller::Controller* controller, Coordination* coordination,
                    PolicyBook* policies, const Authenticator* auth, ControllerMetrics* metrics,
                    PolicyServing serving = {}, Executor* blocking = nullptr);

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                     grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                      grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Route(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                  grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* ListNodes(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                      grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* GetPolicy(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                      grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* SetPolicy(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                      grpc::ByteBuffer* resp) override;

 private:
  // Runs `body` (on the callback thread, or on the blocking executor when
  // there is one) and finishes the call with its status.
  grpc::ServerUnaryReactor* Run(grpc::CallbackServerContext* ctx, const char* method,
                                std::function<absl::Status()> body);
  // Run over a raw call: parses `raw` as Req (INVALID_ARGUMENT when it does
  // not parse), runs body(&req, &resp), serializes resp into `out`.
  template <typename Req, typename Resp, typename Body>
  grpc::ServerUnaryReactor* Parsed(grpc::CallbackServerContext* ctx, const char* method,
                                   const grpc::ByteBuffer* raw, grpc::ByteBuffer* out, Body body);

  controller::Controller* const controller_;
  Coordination* const coordination_;
  PolicyBook* const policies_;
  const Authenticator* const auth_;
  ControllerMetrics* const metrics_;
  const PolicyServing serving_;
  // Where calls run when the coordination back end does I/O (etcd): off
  // gRPC's callback threads. Null: on them (in-memory work only).
  Executor* const blocking_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_CONTROLLER_CONTROLLER_SERVICE_H_
