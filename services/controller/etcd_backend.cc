#include "services/controller/etcd_backend.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace kvtier {

using controller::NodeInfo;
using controller::NodeKind;
using controller::NodeSpec;

EtcdBackend::EtcdBackend(std::unique_ptr<EtcdClient> etcd, EtcdBackendOptions options,
                         controller::Controller* controller)
    : etcd_(std::move(etcd)), options_(std::move(options)), controller_(controller) {}

std::string EtcdBackend::Encode(const Record& r) {
  return absl::StrCat(r.spec.kind == NodeKind::kWorker ? "worker" : "store", " ", r.spec.address,
                      " ", r.spec.capacity_bytes, " ", r.used, " ", r.sessions, " ",
                      r.spec.has_gpu ? 1 : 0, " ", r.lease, " ", r.heartbeat_ms, " ",
                      r.registered_ms, " ", controller::WorkerRoleName(r.spec.role));
}

std::optional<EtcdBackend::Record> EtcdBackend::Decode(const std::string& id,
                                                       const std::string& value) {
  std::vector<std::string> f = absl::StrSplit(value, ' ');
  // Nine fields, and the worker role tenth (records written before roles
  // have none: both).
  if ((f.size() != 9 && f.size() != 10) || (f[0] != "worker" && f[0] != "store")) {
    return std::nullopt;
  }
  Record r;
  r.spec.id = id;
  r.spec.kind = f[0] == "worker" ? NodeKind::kWorker : NodeKind::kStore;
  r.spec.address = f[1];
  int gpu = 0;
  if (!absl::SimpleAtoi(f[2], &r.spec.capacity_bytes) || !absl::SimpleAtoi(f[3], &r.used) ||
      !absl::SimpleAtoi(f[4], &r.sessions) || !absl::SimpleAtoi(f[5], &gpu) ||
      !absl::SimpleAtoi(f[6], &r.lease) || !absl::SimpleAtoi(f[7], &r.heartbeat_ms) ||
      !absl::SimpleAtoi(f[8], &r.registered_ms)) {
    return std::nullopt;
  }
  r.spec.has_gpu = gpu != 0;
  if (f.size() == 10) {
    if (f[9] == "prefill") {
      r.spec.role = controller::WorkerRole::kPrefill;
    } else if (f[9] == "decode") {
      r.spec.role = controller::WorkerRole::kDecode;
    } else if (f[9] != "both") {
      return std::nullopt;
    }
  }
  return r;
}

absl::Status EtcdBackend::NodeRegistered(const NodeSpec& spec) {
  controller::Membership& m = controller_->membership();
  KVT_ASSIGN_OR_RETURN(int64_t lease, etcd_->Grant(m.lease()));
  Record r;
  r.spec = spec;
  r.lease = lease;
  r.heartbeat_ms = m.options().clock->NowUnixMs();
  r.registered_ms = r.heartbeat_ms;
  KVT_RETURN_IF_ERROR(etcd_->Put(NodeKey(spec.id), Encode(r), lease).status());
  absl::MutexLock lock(&mu_);
  seen_[spec.id] = r.registered_ms;
  return absl::OkStatus();
}

absl::Status EtcdBackend::NodeHeartbeat(const std::string& id, uint64_t used_bytes,
                                        uint32_t active_sessions) {
  KVT_ASSIGN_OR_RETURN(std::optional<EtcdKeyValue> kv, etcd_->Get(NodeKey(id)));
  std::optional<Record> r = kv.has_value() ? Decode(id, kv->value) : std::nullopt;
  if (!r.has_value()) {
    return absl::NotFoundError(absl::StrCat("node ", id,
                                            " is not registered (or was declared "
                                            "dead); register again"));
  }
  absl::Status alive = etcd_->KeepAlive(r->lease);
  if (absl::IsNotFound(alive)) {
    return absl::NotFoundError(absl::StrCat("node ", id, "'s lease ran out; register again"));
  }
  KVT_RETURN_IF_ERROR(alive);
  r->used = used_bytes;
  r->sessions = active_sessions;
  r->heartbeat_ms = controller_->membership().options().clock->NowUnixMs();
  KVT_RETURN_IF_ERROR(etcd_->Put(NodeKey(id), Encode(*r), r->lease).status());
  controller::Membership& m = controller_->membership();
  if (absl::IsNotFound(m.Heartbeat(id, used_bytes, active_sessions))) {
    KVT_RETURN_IF_ERROR(m.Register(r->spec));
    KVT_RETURN_IF_ERROR(m.Heartbeat(id, used_bytes, active_sessions));
    absl::MutexLock lock(&mu_);
    seen_[id] = r->registered_ms;
  }
  return absl::OkStatus();
}

absl::Status EtcdBackend::Reconcile() {
  KVT_ASSIGN_OR_RETURN(std::vector<EtcdKeyValue> kvs,
                       etcd_->GetPrefix(options_.prefix + "/nodes/"));
  controller::Membership& m = controller_->membership();
  const int64_t now = m.options().clock->NowUnixMs();
  const int64_t lease_ms = absl::ToInt64Milliseconds(m.lease());
  std::map<std::string, NodeInfo> local;
  for (NodeInfo& n : m.All()) local[n.spec.id] = std::move(n);
  absl::MutexLock lock(&mu_);
  for (const EtcdKeyValue& kv : kvs) {
    const std::string id = kv.key.substr(options_.prefix.size() + 7);  // After "/nodes/".
    std::optional<Record> r = Decode(id, kv.value);
    if (!r.has_value() || now - r->heartbeat_ms > lease_ms) continue;  // Left to expire.
    auto it = local.find(id);
    const bool known =
        it != local.end() && it->second.live && it->second.spec.address == r->spec.address;
    auto seen = seen_.find(id);
    if (!known || seen == seen_.end() || seen->second != r->registered_ms) {
      absl::Status st = m.Register(r->spec);
      if (!st.ok()) {
        LogWarn("a node record in etcd does not fit this replica's membership",
                {{"node", id}, {"error", st.ToString()}});
        continue;
      }
      seen_[id] = r->registered_ms;
    }
    absl::Status st = m.Heartbeat(id, r->used, r->sessions);
    if (!st.ok())
      LogWarn("cannot apply a node's heartbeat", {{"node", id}, {"error", st.ToString()}});
  }
  return absl::OkStatus();
}

bool EtcdBackend::Sync() {
  absl::Status pulled = Reconcile();
  if (!pulled.ok()) LogWarn("cannot read node records from etcd", {{"error", pulled.ToString()}});
  return Campaign();
}

bool EtcdBackend::Campaign() {
  absl::MutexLock lock(&mu_);
  const bool was = leader_.load();
  auto step_down = [&](const absl::Status& why) {
    mu_.AssertHeld();
    if (was)
      LogWarn("no longer the leader controller",
              {{"replica", options_.replica_id}, {"why", why.ToString()}});
    leader_.store(false);
    return false;
  };
  if (leader_lease_ != 0) {
    absl::Status alive = etcd_->KeepAlive(leader_lease_);
    if (absl::IsNotFound(alive))
      leader_lease_ = 0;
    else if (!alive.ok())
      return step_down(alive);
  }
  if (leader_lease_ == 0) {
    absl::StatusOr<int64_t> lease = etcd_->Grant(options_.leader_lease);
    if (!lease.ok()) return step_down(lease.status());
    leader_lease_ = *lease;
  }
  const std::string key = options_.prefix + "/leader";
  absl::StatusOr<bool> won = etcd_->CompareAndPut(key, options_.replica_id, 0, leader_lease_);
  if (!won.ok()) return step_down(won.status());
  bool leading = *won;
  if (!leading) {
    absl::StatusOr<std::optional<EtcdKeyValue>> cur = etcd_->Get(key);
    if (!cur.ok()) return step_down(cur.status());
    leading =
        cur->has_value() && (*cur)->value == options_.replica_id && (*cur)->lease == leader_lease_;
  }
  if (leading != was) {
    LogInfo(leading ? "elected leader controller" : "following another leader controller",
            {{"replica", options_.replica_id}});
  }
  leader_.store(leading);
  return leading;
}

absl::Status EtcdBackend::PutPolicy(const std::string& model, const std::string& bytes) {
  return etcd_->Put(options_.prefix + "/policies/" + model, bytes).status();
}

absl::StatusOr<std::optional<std::string>> EtcdBackend::GetPolicy(const std::string& model) {
  KVT_ASSIGN_OR_RETURN(std::optional<EtcdKeyValue> kv,
                       etcd_->Get(options_.prefix + "/policies/" + model));
  if (!kv.has_value()) return std::optional<std::string>();
  return std::optional<std::string>(std::move(kv->value));
}

namespace {

std::optional<controller::PlacementShare::Entry> ParseEntry(const EtcdKeyValue& kv) {
  std::vector<std::string> f = absl::StrSplit(kv.value, ' ');
  if (f.size() != 2 || f[0].empty()) return std::nullopt;
  controller::PlacementShare::Entry e;
  e.worker = f[0];
  e.stores = absl::StrSplit(f[1], ',', absl::SkipEmpty());
  e.version = kv.mod_revision;
  return e;
}

}  // namespace

absl::StatusOr<std::optional<controller::PlacementShare::Entry>> EtcdBackend::Load(
    const std::string& tenant, const std::string& session) {
  KVT_ASSIGN_OR_RETURN(
      std::optional<EtcdKeyValue> kv,
      etcd_->Get(absl::StrCat(options_.prefix, "/placements/", tenant, "/", session)));
  if (!kv.has_value()) return std::optional<Entry>();
  return ParseEntry(*kv);
}

absl::StatusOr<bool> EtcdBackend::Save(const std::string& tenant, const std::string& session,
                                       const Entry& entry, int64_t expected_version) {
  return etcd_->CompareAndPut(absl::StrCat(options_.prefix, "/placements/", tenant, "/", session),
                              absl::StrCat(entry.worker, " ", absl::StrJoin(entry.stores, ",")),
                              expected_version);
}

absl::StatusOr<std::vector<std::pair<std::pair<std::string, std::string>, EtcdBackend::Entry>>>
EtcdBackend::LoadAll() {
  const std::string prefix = options_.prefix + "/placements/";
  KVT_ASSIGN_OR_RETURN(std::vector<EtcdKeyValue> kvs, etcd_->GetPrefix(prefix));
  std::vector<std::pair<std::pair<std::string, std::string>, Entry>> out;
  for (const EtcdKeyValue& kv : kvs) {
    const std::string rest = kv.key.substr(prefix.size());
    const size_t slash = rest.find('/');
    std::optional<Entry> e = ParseEntry(kv);
    if (slash == std::string::npos || !e.has_value()) continue;
    out.push_back({{rest.substr(0, slash), rest.substr(slash + 1)}, *std::move(e)});
  }
  return out;
}

}  // namespace kvtier
