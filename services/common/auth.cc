#include "services/common/auth.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/log.h"
#include "base/names.h"
#include "base/status_macros.h"
#include "grpcpp/security/auth_context.h"

namespace kvtier {

Authenticator::Authenticator(std::vector<TenantEntry> entries)
    : enabled_(true), entries_(std::move(entries)) {
  constexpr absl::string_view kCert = "cert:";
  for (const TenantEntry& e : entries_) {
    if (absl::StartsWith(e.token, kCert)) {
      by_cert_[e.token.substr(kCert.size())] = e.principal;
    } else {
      by_token_[e.token] = e.principal;
    }
    if (!e.principal.node_id.empty()) bound_nodes_[e.principal.node_id] = e.principal.node_kind;
  }
}

absl::StatusOr<Authenticator> Authenticator::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read tenants file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return FromText(ss.str());
}

absl::StatusOr<Authenticator> Authenticator::FromText(const std::string& text) {
  std::vector<TenantEntry> entries;
  absl::flat_hash_map<std::string, int> seen;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::vector<std::string> f = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("tenants file line ", line_no, ": ", why));
    };
    // key=value limits at the end.
    std::vector<std::string> kv;
    while (f.size() > 3 && f.back().find('=') != std::string::npos) {
      kv.push_back(f.back());
      f.pop_back();
    }
    if (f.size() < 3 || f.size() > 4) {
      return bad("want: token tenant role [quota_bytes] [key=value ...]");
    }
    if (absl::StartsWith(f[0], "cert:")) {
      if (f[0].size() == 5) return bad("cert: needs the certificate's name after it");
    } else if (f[0].size() < 8) {
      return bad("tokens must be at least 8 characters");
    }
    TenantEntry e;
    e.token = f[0];
    e.principal.tenant = f[1];
    e.principal.caller = f[1];
    if (absl::Status s = ValidateName("tenant", f[1]); !s.ok()) return bad(s.message());
    if (f[2] == "readwrite") {
      e.principal.role = Role::kReadWrite;
    } else if (f[2] == "readonly") {
      e.principal.role = Role::kReadOnly;
    } else if (f[2] == "node") {
      e.principal.role = Role::kNode;
    } else {
      return bad("role must be readwrite, readonly or node");
    }
    if (f.size() == 4 && !absl::SimpleAtoi(f[3], &e.quota_bytes)) {
      return bad("quota_bytes must be a non-negative integer");
    }
    for (const std::string& item : kv) {
      const size_t eq = item.find('=');
      const std::string key = item.substr(0, eq);
      if (key == "node_id" || key == "node_kind") {
        const std::string value = item.substr(eq + 1);
        if (e.principal.role != Role::kNode) return bad(absl::StrCat(key, " is for node tokens"));
        if (key == "node_id") {
          if (absl::Status s = ValidateName("node_id", value); !s.ok()) return bad(s.message());
          e.principal.node_id = value;
        } else if (value == "worker" || value == "store") {
          e.principal.node_kind = value;
        } else {
          return bad("node_kind must be worker or store");
        }
        continue;
      }
      uint64_t value = 0;
      if (!absl::SimpleAtoi(item.substr(eq + 1), &value)) {
        return bad(absl::StrCat(key, " must be a non-negative integer"));
      }
      if (key == "max_sessions" && value <= 1'000'000) {
        e.limits.max_sessions = static_cast<int>(value);
      } else if (key == "max_working_set_mb" && value <= (uint64_t{1} << 30)) {
        e.limits.max_working_set_bytes = value << 20;
      } else if (key == "max_sessions" || key == "max_working_set_mb") {
        return bad(absl::StrCat(key, " is out of range"));
      } else {
        return bad(absl::StrCat("unknown key '", key,
                                "' (max_sessions=N, max_working_set_mb=N, node_id=ID, "
                                "node_kind=worker|store)"));
      }
    }
    if (e.principal.node_id.empty() != e.principal.node_kind.empty()) {
      return bad("node_id and node_kind go together");
    }
    if (!seen.emplace(e.token, line_no).second) return bad("duplicate token");
    if (!e.principal.node_id.empty()) {
      for (const TenantEntry& other : entries) {
        // Several tokens may name one node (rotation), as one kind.
        if (other.principal.node_id == e.principal.node_id &&
            other.principal.node_kind != e.principal.node_kind) {
          return bad(absl::StrCat("node_id ", e.principal.node_id, " is bound as a ",
                                  other.principal.node_kind, " on another line"));
        }
      }
    }
    entries.push_back(std::move(e));
  }
  if (entries.empty()) return absl::InvalidArgumentError("tenants file lists no tokens");
  return Authenticator(std::move(entries));
}

absl::StatusOr<Principal> Authenticator::Authenticate(const grpc::ServerContextBase& ctx) const {
  KVT_ASSIGN_OR_RETURN(Principal caller, Caller(ctx));
  const auto& md = ctx.client_metadata();
  auto named = md.find(kTenantMetadata);
  if (named == md.end()) return caller;
  absl::string_view tenant(named->second.data(), named->second.size());
  if (caller.role != Role::kNode && enabled_) {
    return absl::PermissionDeniedError(absl::StrCat("tenant '", caller.tenant,
                                                    "' is not a node: its token may not act for "
                                                    "tenant '",
                                                    tenant, "'"));
  }
  KVT_RETURN_IF_ERROR(
      ValidateName(kTenantMetadata, std::string_view(tenant.data(), tenant.size())));
  return Principal{std::string(tenant), Role::kReadWrite, caller.caller, "", ""};
}

absl::Status Authenticator::RequireNodeIdentity(const Principal& p, const std::string& node_id,
                                                const std::string& kind) const {
  if (!enabled_) return absl::OkStatus();
  if (!p.node_id.empty()) {
    if (p.node_id == node_id && (kind.empty() || p.node_kind == kind)) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat(
        "this node token belongs to ", p.node_kind, " node '", p.node_id, "'; it may not act as ",
        kind.empty() ? "" : kind + " ", "node '", node_id.substr(0, kMaxNameLength), "'"));
  }
  if (auto it = bound_nodes_.find(node_id); it != bound_nodes_.end()) {
    return absl::PermissionDeniedError(
        absl::StrCat("node '", node_id,
                     "' is bound to a token of its own (node_id= in the tenants file); "
                     "this token may not act as it"));
  }
  return absl::OkStatus();
}

int Authenticator::UnboundNodeTokens() const {
  int n = 0;
  for (const TenantEntry& e : entries_) {
    if (e.principal.role == Role::kNode && e.principal.node_id.empty()) ++n;
  }
  return n;
}

std::map<std::string, TenantLimits> Authenticator::Limits() const {
  std::map<std::string, TenantLimits> out;
  for (const TenantEntry& e : entries_) {
    if (e.limits.max_sessions == 0 && e.limits.max_working_set_bytes == 0) continue;
    TenantLimits& l = out[e.principal.tenant];
    l.max_sessions = std::max(l.max_sessions, e.limits.max_sessions);
    l.max_working_set_bytes = std::max(l.max_working_set_bytes, e.limits.max_working_set_bytes);
  }
  return out;
}

int Authenticator::WritingTenants() const {
  if (!enabled_) return 1;
  absl::flat_hash_set<std::string> writers;
  for (const TenantEntry& e : entries_) {
    if (e.principal.role != Role::kReadOnly) writers.insert(e.principal.tenant);
  }
  return static_cast<int>(writers.size());
}

absl::StatusOr<Principal> Authenticator::Caller(const grpc::ServerContextBase& ctx) const {
  if (!enabled_) return Principal{"default", Role::kReadWrite, "default"};
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    // Mutual TLS: the client's verified certificate may name a cert: line.
    const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
    if (auth != nullptr && auth->IsPeerAuthenticated() && !by_cert_.empty()) {
      for (const grpc::string_ref& name : auth->GetPeerIdentity()) {
        auto p = by_cert_.find(absl::string_view(name.data(), name.size()));
        if (p != by_cert_.end()) return p->second;
      }
      return absl::UnauthenticatedError(
          "no 'authorization: Bearer <token>' metadata, and the client certificate names no "
          "cert: line of the tenants file");
    }
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  }
  absl::string_view v(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWith(v, kBearer)) {
    return absl::UnauthenticatedError("authorization metadata is not a Bearer token");
  }
  auto p = by_token_.find(v.substr(kBearer.size()));
  if (p == by_token_.end()) return absl::UnauthenticatedError("unknown bearer token");
  return p->second;
}

absl::Status Authenticator::RequireWrite(const Principal& p) {
  if (p.role != Role::kReadOnly) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("tenant '", p.tenant, "' token is readonly; this call writes"));
}

namespace {

bool IsLoopback(absl::string_view listen) {
  if (absl::StartsWith(listen, "unix:")) return true;
  absl::string_view host = listen;
  if (absl::StartsWith(host, "[")) {
    host = host.substr(
        1, host.find(']') == absl::string_view::npos ? host.size() - 1 : host.find(']') - 1);
  } else if (size_t colon = host.rfind(':'); colon != absl::string_view::npos) {
    host = host.substr(0, colon);
  }
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

}  // namespace

absl::Status CheckListenAuth(const std::string& listen, bool has_tenants_file,
                             bool allow_unauthenticated) {
  if (has_tenants_file || allow_unauthenticated || IsLoopback(listen)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("refusing to listen on ", listen,
                   " without authentication: give --tenants_file, or "
                   "--allow_unauthenticated to let any caller in as tenant 'default'"));
}

absl::StatusOr<Authenticator> ServerAuthenticator(const std::string& listen,
                                                  const std::string& tenants_file,
                                                  bool allow_unauthenticated) {
  KVT_RETURN_IF_ERROR(CheckListenAuth(listen, !tenants_file.empty(), allow_unauthenticated));
  if (!tenants_file.empty()) return Authenticator::FromFile(tenants_file);
  LogWarn("no --tenants_file: authentication is off, every caller is tenant 'default'");
  return Authenticator();
}

}  // namespace kvtier
