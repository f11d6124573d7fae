#include "services/common/metrics_exposer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "CivetServer.h"
#include "absl/strings/str_cat.h"
#include "base/memory.h"
#include "base/version.h"
#include "civetweb.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "prometheus/metric_type.h"

namespace kvtier {

// The health functions of this process's metrics ports. civetweb's request
// callback has no user pointer of ours (CivetServer keeps its own), so the
// port the request arrived on selects the function.
class HealthRegistration {
 public:
  HealthRegistration(int port, HealthFn fn) : port_(port) {
    std::lock_guard<std::mutex> lock(Mu());
    Ports()[port_] = std::move(fn);
  }
  ~HealthRegistration() {
    std::lock_guard<std::mutex> lock(Mu());
    Ports().erase(port_);
  }
  HealthRegistration(const HealthRegistration&) = delete;
  HealthRegistration& operator=(const HealthRegistration&) = delete;

  // The report for a request on `port`; not ready while the port is not
  // registered yet (the server is still starting).
  static HealthReport Report(int port) {
    HealthFn fn;
    {
      std::lock_guard<std::mutex> lock(Mu());
      auto it = Ports().find(port);
      if (it == Ports().end()) return {true, false, "starting"};
      fn = it->second;
    }
    return fn ? fn() : HealthReport{};
  }

 private:
  static std::mutex& Mu() {
    static std::mutex mu;
    return mu;
  }
  static std::map<int, HealthFn>& Ports() {
    static auto* ports = new std::map<int, HealthFn>();
    return *ports;
  }
  const int port_;
};

namespace {

// civetweb's begin_request: answers /healthz and /readyz itself (returning
// the status code it sent) and leaves every other path to the exposer (0).
int AnswerHealth(mg_connection* conn) {
  const mg_request_info* ri = mg_get_request_info(conn);
  if (ri == nullptr || ri->local_uri == nullptr) return 0;
  const bool live = std::strcmp(ri->local_uri, "/healthz") == 0;
  const bool ready = std::strcmp(ri->local_uri, "/readyz") == 0;
  if (!live && !ready) return 0;
  const HealthReport r = HealthRegistration::Report(ri->server_port);
  const bool ok = live ? r.live : r.ready;
  const std::string body =
      ok ? "ok\n" : absl::StrCat(r.reason.empty() ? "not ready" : r.reason, "\n");
  const int code = ok ? 200 : 503;
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %zu\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            code, ok ? "OK" : "Service Unavailable", body.size());
  if (std::strcmp(ri->request_method, "HEAD") != 0) mg_write(conn, body.data(), body.size());
  return code;
}

// The process: its memory, read at each scrape (RSS under the name
// Prometheus' client libraries use, its peak, and the heap's split,
// base/memory.h), and kvtier's version as a constant 1 with labels (the
// usual *_build_info shape, for dashboards to join on).
class ProcessCollectable : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    const ProcessMemory m = ReadProcessMemory();
    auto gauge = [](const char* name, const char* help, uint64_t v) {
      prometheus::MetricFamily f;
      f.name = name;
      f.help = help;
      f.type = prometheus::MetricType::Gauge;
      prometheus::ClientMetric c;
      c.gauge.value = static_cast<double>(v);
      f.metric.push_back(c);
      return f;
    };
    return {gauge("process_resident_memory_bytes", "Resident set size (VmRSS).", m.resident_bytes),
            gauge("kvtier_process_peak_resident_memory_bytes",
                  "Largest resident set size so far (VmHWM).", m.peak_resident_bytes),
            gauge("kvtier_process_heap_in_use_bytes", "Heap allocated and not freed (mallinfo2).",
                  m.heap_in_use_bytes),
            gauge("kvtier_process_heap_free_bytes",
                  "Freed heap the allocator keeps for reuse (mallinfo2).", m.heap_free_bytes),
            BuildInfo()};
  }

 private:
  static prometheus::MetricFamily BuildInfo() {
    prometheus::MetricFamily f;
    f.name = "kvtier_build_info";
    f.help = "kvtier's version and build type (value 1).";
    f.type = prometheus::MetricType::Gauge;
    prometheus::ClientMetric c;
    c.label = {{"version", KvtierVersionNumber()}, {"build_type", KvtierBuildType()}};
    c.gauge.value = 1;
    f.metric.push_back(c);
    return f;
  }
};

}  // namespace

absl::StatusOr<MetricsEndpoint> ServeMetrics(
    const std::string& address,
    const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables, HealthFn health) {
  static const CivetCallbacks kCallbacks = [] {
    CivetCallbacks c;  // Its constructor clears every callback.
    c.begin_request = AnswerHealth;
    return c;
  }();
  MetricsEndpoint e;
  try {
    e.exposer = std::make_unique<prometheus::Exposer>(address, 2, &kCallbacks);
  } catch (const std::exception& ex) {
    // CivetServer says only "null context when constructing CivetServer"
    // when the port is taken (a second kvtier process on this host).
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", address, " (", ex.what(),
        "); is another process listening there? Pick a free port with --metrics_listen=HOST:PORT "
        "(port 0: any free one) or turn metrics off with --metrics_listen="));
  }
  for (const auto& c : collectables) e.exposer->RegisterCollectable(c);
  e.process = std::make_shared<ProcessCollectable>();
  e.exposer->RegisterCollectable(e.process);
  const std::vector<int> ports = e.exposer->GetListeningPorts();
  e.port = ports.empty() ? 0 : ports[0];
  e.health = std::make_shared<HealthRegistration>(e.port, std::move(health));
  const std::string host = address.substr(0, address.rfind(':'));
  in_addr probe{};
  if (host.empty() || host == "0.0.0.0") {
    e.wake_host = "127.0.0.1";
  } else if (inet_pton(AF_INET, host.c_str(), &probe) == 1) {
    e.wake_host = host;
  }
  return e;
}

MetricsEndpoint::~MetricsEndpoint() { Stop(); }

void MetricsEndpoint::Stop() {
  health.reset();
  if (exposer == nullptr) return;
  std::atomic<bool> stopped{false};
  std::thread waker;
  if (!wake_host.empty() && port > 0) {
    waker = std::thread([this, &stopped] {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(port));
      if (inet_pton(AF_INET, wake_host.c_str(), &a.sin_addr) != 1) return;
      while (!stopped.load()) {
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) return;
        (void)connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a));
        close(fd);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    });
  }
  exposer.reset();
  stopped.store(true);
  if (waker.joinable()) waker.join();
}

}  // namespace kvtier
