// What the benches that run a worker engine in process share: a kvtier-store
// process in a temp directory for the engine to write to, and fp16-exact
// random inputs.
#ifndef KVTIER_BENCH_ENGINE_STORE_H_
#define KVTIER_BENCH_ENGINE_STORE_H_

#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "client/store_segments.h"
#include "kernels/half.h"
#include "testing/store_process.h"
#include "testing/test_util.h"

namespace kvtier::bench {

class EngineStore {
 public:
  // Starts kvtier-store with `flags` and connects to it (calls wait up to
  // `deadline`); on failure prints "kvtier-bench <bench>: <error>" and
  // returns null.
  static std::unique_ptr<EngineStore> Start(const char* bench, std::vector<std::string> flags,
                                            absl::Duration deadline) {
    auto s = std::unique_ptr<EngineStore>(new EngineStore);
    s->store_ = std::make_unique<testing::StoreProcess>(s->tmp_.path() + "/db", std::move(flags));
    absl::Status st = s->store_->Start();
    if (st.ok()) {
      StoreClientOptions so;
      so.target = s->store_->target();
      so.deadline = deadline;
      auto client = StoreClient::Connect(so);
      if (client.ok()) {
        s->segments_ = std::make_unique<StoreSegments>(std::move(*client));
        return s;
      }
      st = client.status();
    }
    std::fprintf(stderr, "kvtier-bench %s: %s\n", bench, st.ToString().c_str());
    return nullptr;
  }
  StoreSegments* segments() { return segments_.get(); }

 private:
  EngineStore() = default;
  testing::TempDir tmp_;
  std::unique_ptr<testing::StoreProcess> store_;
  std::unique_ptr<StoreSegments> segments_;
};

// n normal draws, each rounded to fp16 (so an fp16 open round holds them
// exactly).
inline std::vector<float> DrawHalfExact(size_t n, std::mt19937* rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (float& e : x) e = HalfToFloat(FloatToHalf(nd(*rng)));
  return x;
}

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_ENGINE_STORE_H_
