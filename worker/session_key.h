// A worker session's identity: the end tenant it belongs to and the session
// name that tenant chose. Kept as a pair, never joined into one string, so
// that no choice of names lets one tenant reach another's session.
#ifndef KVTIER_WORKER_SESSION_KEY_H_
#define KVTIER_WORKER_SESSION_KEY_H_

#include <compare>
#include <string>

namespace kvtier::worker {

struct SessionKey {
  // The end tenant; empty means the store client's own tenant (in-process
  // use, tests). The engine passes it to the store as the tenant its calls
  // act for (CallOptions::tenant), so store quotas and keys are per tenant.
  std::string tenant;
  // The session name, unique within the tenant. The store's session name.
  std::string session;

  SessionKey(std::string t, std::string s) : tenant(std::move(t)), session(std::move(s)) {}
  // A bare name is a session of the store client's own tenant.
  SessionKey(std::string s) : session(std::move(s)) {}  // NOLINT(google-explicit-constructor)
  SessionKey(const char* s) : session(s) {}             // NOLINT(google-explicit-constructor)

  // "tenant/session" (or "session"), for logs and errors; '/' cannot occur
  // in either name.
  std::string ToString() const { return tenant.empty() ? session : tenant + "/" + session; }

  friend bool operator==(const SessionKey&, const SessionKey&) = default;
  friend auto operator<=>(const SessionKey&, const SessionKey&) = default;
};

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_SESSION_KEY_H_
