#include "services/controller/etcd_client.h"

#include <curl/curl.h>

#include <mutex>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace kvtier {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// One curl handle per thread, reused across calls so that its connections
// to etcd stay open (curl_easy_reset keeps them).
struct ThreadHandle {
  CURL* h = curl_easy_init();
  ~ThreadHandle() {
    if (h != nullptr) curl_easy_cleanup(h);
  }
};

size_t Collect(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

std::string B64(const std::string& s) { return absl::Base64Escape(s); }

// The gateway writes int64 fields as strings.
int64_t Int(const Struct& s, const std::string& field) {
  auto it = s.fields().find(field);
  if (it == s.fields().end()) return 0;
  int64_t v = 0;
  if (it->second.has_string_value()) {
    if (!absl::SimpleAtoi(it->second.string_value(), &v)) return 0;
    return v;
  }
  return static_cast<int64_t>(it->second.number_value());
}

const Struct* Sub(const Struct& s, const std::string& field) {
  auto it = s.fields().find(field);
  if (it == s.fields().end() || !it->second.has_struct_value()) return nullptr;
  return &it->second.struct_value();
}

std::string Bytes(const Struct& s, const std::string& field) {
  auto it = s.fields().find(field);
  std::string out;
  if (it != s.fields().end()) absl::Base64Unescape(it->second.string_value(), &out);
  return out;
}

absl::StatusOr<Struct> Parse(const std::string& json) {
  Struct s;
  auto st = google::protobuf::util::JsonStringToMessage(json, &s);
  if (!st.ok()) {
    return absl::InternalError(
        absl::StrCat("etcd answered what is not JSON: ", json.substr(0, 200)));
  }
  return s;
}

std::vector<EtcdKeyValue> Kvs(const Struct& range) {
  std::vector<EtcdKeyValue> out;
  auto it = range.fields().find("kvs");
  if (it == range.fields().end()) return out;
  for (const Value& v : it->second.list_value().values()) {
    const Struct& kv = v.struct_value();
    EtcdKeyValue e;
    e.key = Bytes(kv, "key");
    e.value = Bytes(kv, "value");
    e.create_revision = Int(kv, "create_revision");
    e.mod_revision = Int(kv, "mod_revision");
    e.lease = Int(kv, "lease");
    out.push_back(std::move(e));
  }
  return out;
}

// The first key after every key that starts with `prefix`.
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    if (static_cast<unsigned char>(prefix.back()) < 0xff) {
      prefix.back() = static_cast<char>(prefix.back() + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // Every key.
}

absl::StatusCode FromGrpcCode(int64_t code) {
  return code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Connect(EtcdOptions options) {
  if (options.endpoints.empty()) return absl::InvalidArgumentError("etcd: no endpoints");
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  std::unique_ptr<EtcdClient> c(new EtcdClient(std::move(options)));
  KVT_RETURN_IF_ERROR(c->Get("kvtier-connect-check").status());
  return c;
}

absl::StatusOr<std::string> EtcdClient::Post(const std::string& path, const std::string& json) {
  const size_t n = options_.endpoints.size();
  const size_t first = preferred_.load();
  std::string last_error;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (first + k) % n;
    const std::string url = options_.endpoints[i] + path;
    std::string body;
    thread_local ThreadHandle handle;
    CURL* h = handle.h;
    if (h == nullptr) return absl::InternalError("curl_easy_init failed");
    curl_easy_reset(h);
    curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, json.c_str());
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, static_cast<long>(json.size()));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS,
                     static_cast<long>(absl::ToInt64Milliseconds(options_.timeout)));
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, Collect);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &body);
    const CURLcode rc = curl_easy_perform(h);
    long http = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &http);
    curl_slist_free_all(headers);
    if (rc != CURLE_OK) {
      last_error = absl::StrCat(url, ": ", curl_easy_strerror(rc));
      continue;
    }
    if (http >= 500 && http != 500) {
      last_error = absl::StrCat(url, ": HTTP ", http);
      continue;
    }
    preferred_.store(i);
    if (http != 200) {
      // The gateway's error: {"error": ..., "code": GRPC_CODE, "message": ...}.
      absl::StatusOr<Struct> e = Parse(body);
      if (!e.ok()) return absl::InternalError(absl::StrCat(url, ": HTTP ", http));
      const int64_t code = Int(*e, "code");
      auto msg = e->fields().find("message");
      const absl::StatusCode c = FromGrpcCode(code);
      if (c == absl::StatusCode::kUnavailable) {
        last_error =
            absl::StrCat(url, ": ", msg == e->fields().end() ? "" : msg->second.string_value());
        continue;  // No leader on that member: try another.
      }
      return absl::Status(c,
                          absl::StrCat("etcd ", path, ": ",
                                       msg == e->fields().end() ? "" : msg->second.string_value()));
    }
    return body;
  }
  return absl::UnavailableError(absl::StrCat("no etcd endpoint answered (", last_error, ")"));
}

absl::StatusOr<int64_t> EtcdClient::Grant(absl::Duration ttl) {
  const int64_t seconds =
      std::max<int64_t>(1, absl::ToInt64Seconds(absl::Ceil(ttl, absl::Seconds(1))));
  KVT_ASSIGN_OR_RETURN(std::string body,
                       Post("/v3/lease/grant", absl::StrCat("{\"TTL\":\"", seconds, "\"}")));
  KVT_ASSIGN_OR_RETURN(Struct s, Parse(body));
  const int64_t id = Int(s, "ID");
  if (id == 0) return absl::InternalError(absl::StrCat("etcd lease grant gave no ID: ", body));
  return id;
}

absl::Status EtcdClient::KeepAlive(int64_t lease) {
  KVT_ASSIGN_OR_RETURN(std::string body,
                       Post("/v3/lease/keepalive", absl::StrCat("{\"ID\":\"", lease, "\"}")));
  KVT_ASSIGN_OR_RETURN(Struct s, Parse(body));
  const Struct* r = Sub(s, "result");
  if (r == nullptr || Int(*r, "TTL") <= 0) {
    return absl::NotFoundError(absl::StrCat("etcd lease ", lease, " expired"));
  }
  return absl::OkStatus();
}

absl::Status EtcdClient::Revoke(int64_t lease) {
  return Post("/v3/lease/revoke", absl::StrCat("{\"ID\":\"", lease, "\"}")).status();
}

absl::StatusOr<int64_t> EtcdClient::Put(const std::string& key, const std::string& value,
                                        int64_t lease) {
  KVT_ASSIGN_OR_RETURN(
      std::string body,
      Post("/v3/kv/put", absl::StrCat("{\"key\":\"", B64(key), "\",\"value\":\"", B64(value),
                                      "\",\"lease\":\"", lease, "\"}")));
  KVT_ASSIGN_OR_RETURN(Struct s, Parse(body));
  const Struct* h = Sub(s, "header");
  return h == nullptr ? 0 : Int(*h, "revision");
}

absl::StatusOr<std::optional<EtcdKeyValue>> EtcdClient::Get(const std::string& key) {
  KVT_ASSIGN_OR_RETURN(std::string body,
                       Post("/v3/kv/range", absl::StrCat("{\"key\":\"", B64(key), "\"}")));
  KVT_ASSIGN_OR_RETURN(Struct s, Parse(body));
  std::vector<EtcdKeyValue> kvs = Kvs(s);
  if (kvs.empty()) return std::optional<EtcdKeyValue>();
  return std::optional<EtcdKeyValue>(std::move(kvs.front()));
}

absl::StatusOr<std::vector<EtcdKeyValue>> EtcdClient::GetPrefix(const std::string& prefix) {
  KVT_ASSIGN_OR_RETURN(
      std::string body,
      Post("/v3/kv/range", absl::StrCat("{\"key\":\"", B64(prefix), "\",\"range_end\":\"",
                                        B64(PrefixEnd(prefix)), "\"}")));
  KVT_ASSIGN_OR_RETURN(Struct s, Parse(body));
  return Kvs(s);
}

absl::Status EtcdClient::Delete(const std::string& key) {
  return Post("/v3/kv/deleterange", absl::StrCat("{\"key\":\"", B64(key), "\"}")).status();
}

absl::StatusOr<bool> EtcdClient::CompareAndPut(const std::string& key, const std::string& value,
                                               int64_t expected_mod_revision, int64_t lease) {
  const std::string k = B64(key);
  const std::string json =
      absl::StrCat("{\"compare\":[{\"key\":\"", k, "\",\"target\":\"MOD\",\"result\":\"EQUAL\",",
                   "\"mod_revision\":\"", expected_mod_revision, "\"}],",
                   "\"success\":[{\"request_put\":{\"key\":\"", k, "\",\"value\":\"", B64(value),
                   "\",\"lease\":\"", lease, "\"}}]}");
  KVT_ASSIGN_OR_RETURN(std::string body, Post("/v3/kv/txn", json));
  KVT_ASSIGN_OR_RETURN(Struct s, Parse(body));
  auto it = s.fields().find("succeeded");
  return it != s.fields().end() && it->second.bool_value();
}

}  // namespace kvtier
