// The GPU working set (label gpu): a device session and a host session get
// the same rounds, and every layer's attention output must agree, for each
// codec the device path reads, with eviction, with recall fetching upper
// segments from a real kvtier-store and with rounds kept resident. Without a
// CUDA device (or without CUDA in the build) it skips with a message; the
// placement rules themselves are checked either way.
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/store_segments.h"
#include "gtest/gtest.h"
#include "kernels/crc32c.h"
#include "kernels/half.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"
#include "tests/util/worker_stack.h"
#include "worker/device/attention.h"
#include "worker/device/link_pool.h"
#include "worker/device/transfer.h"
#include "worker/engine.h"
#include "worker/session.h"
#include "worker/transfer.h"

namespace kvtier {
namespace {

// The hand-off half of an engine's API (worker/transfer.h).
worker::SessionTransfer Handoff(worker::Engine& e) { return worker::SessionTransfer(&e); }

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using worker::Engine;
using worker::EngineOptions;
using worker::ModelShape;
using worker::SessionPolicy;
using Placement = worker::EngineOptions::Placement;

constexpr ModelShape kShape{6, 8, 2, 64, DType::kFp16};

// Engine options for `placement`, with the host's fp32 kernels: kBest
// multiplies 2- and 4-bit codes as integers (kernels/attention.h), an error
// of its own (about 1e-2 of the output here) that the device, which
// dequantizes to fp32, does not make. Against kVectorized only the order of
// the sums differs.
EngineOptions Options(Placement placement) {
  EngineOptions o;
  o.placement = placement;
  o.level = KernelLevel::kVectorized;
  return o;
}

#define SKIP_WITHOUT_GPU()                                                         \
  if (absl::Status st_ = worker::DeviceStatus(); !st_.ok()) {                      \
    GTEST_SKIP() << "GPU working-set tests need a CUDA device: " << st_.message(); \
  }

class WorkerDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_ASSERT_OK(stack_.Start());
    segments_ = stack_.segments();
    const EngineOptions host_opts = Options(Placement::kHost);
    const EngineOptions dev_opts = Options(Placement::kDevice);
    host_ = std::make_unique<Engine>(segments_, host_opts);
    device_ = std::make_unique<Engine>(segments_, dev_opts);
  }

  // Runs `rounds` rounds (prefill of a topical question plus answer, then
  // decode steps) through both engines and returns the largest output
  // difference relative to the host output's scale.
  double RunBoth(const SessionPolicy& p, const std::string& tag, int rounds) {
    const std::string hs = "host-" + tag, ds = "dev-" + tag;
    EXPECT_THAT(host_->OpenSession(hs, kShape, p), IsOk());
    EXPECT_THAT(device_->OpenSession(ds, kShape, p), IsOk());
    std::mt19937 rng(42);
    std::normal_distribution<float> nd;
    const int d = kShape.head_dim;
    double worst = 0;
    auto layer = [&](int l, int64_t n, bool prefill, int topic) {
      std::vector<float> q(n * kShape.q_heads * d), k(n * kShape.kv_heads * d), v(k.size());
      for (size_t i = 0; i < q.size(); ++i) q[i] = nd(rng) + (int(i % d) == topic ? 3.f : 0.f);
      for (size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) + (int(i % d) == topic ? 3.f : 0.f);
      for (float& x : v) x = nd(rng);
      // Values of the model's dtype (fp16): the host's open round holds
      // them exactly, as the device's (fp32) does.
      for (float& x : k) x = HalfToFloat(FloatToHalf(x));
      for (float& x : v) x = HalfToFloat(FloatToHalf(x));
      std::vector<float> ho(q.size()), dout(q.size());
      if (prefill) {
        auto a = host_->PrefillLayer(hs, l, n, n / 2, q.data(), k.data(), v.data(), ho.data());
        auto b = device_->PrefillLayer(ds, l, n, n / 2, q.data(), k.data(), v.data(), dout.data());
        EXPECT_TRUE(a.ok()) << a.status();
        EXPECT_TRUE(b.ok()) << b.status();
        if (a.ok() && b.ok() && a->has_value()) {
          EXPECT_TRUE(b->has_value());
          if (b->has_value()) {
            EXPECT_EQ((*a)->selected, (*b)->selected) << "layer " << l;
          }
        }
      } else {
        EXPECT_THAT(host_->DecodeLayer(hs, l, q.data(), k.data(), v.data(), ho.data()), IsOk());
        EXPECT_THAT(device_->DecodeLayer(ds, l, q.data(), k.data(), v.data(), dout.data()), IsOk());
      }
      double scale = 1e-6;
      for (float x : ho) scale = std::max(scale, double(std::fabs(x)));
      for (size_t i = 0; i < ho.size(); ++i)
        worst = std::max(worst, std::fabs(double(ho[i]) - dout[i]) / scale);
    };
    for (int r = 0; r < rounds; ++r) {
      const int topic = (r * 7) % d;
      for (int l = 0; l < kShape.layers; ++l) layer(l, 9 + r, true, topic);
      for (int t = 0; t < 3; ++t) {
        for (int l = 0; l < kShape.layers; ++l) layer(l, 1, false, -1);
      }
      auto he = host_->EndRound(hs);
      auto de = device_->EndRound(ds);
      EXPECT_TRUE(he.ok()) << he.status();
      EXPECT_TRUE(de.ok()) << de.status();
      if (he.ok() && de.ok()) {
        EXPECT_EQ(he->stored_bytes, de->stored_bytes);
        EXPECT_EQ(he->working_set_bytes, de->working_set_bytes);
      }
    }
    auto hst = host_->Stats(hs);
    auto dst = device_->Stats(ds);
    EXPECT_TRUE(hst.ok() && dst.ok());
    if (hst.ok() && dst.ok()) {
      EXPECT_FALSE(hst->on_device);
      EXPECT_TRUE(dst->on_device);
      EXPECT_EQ(hst->device_bytes, 0u);
      EXPECT_GT(dst->device_bytes, 0u);
      EXPECT_EQ(hst->working_set_bytes, dst->working_set_bytes);
    }
    EXPECT_THAT(host_->CloseSession(hs, true), IsOk());
    EXPECT_THAT(device_->CloseSession(ds, true), IsOk());
    return worst;
  }

  testing::StoreStack stack_;
  StoreSegments* segments_ = nullptr;
  std::unique_ptr<Engine> host_, device_;
};

TEST_F(WorkerDeviceTest, PlacementFollowsTheBuildAndTheDevice) {
  SessionPolicy p;
  if (!worker::DeviceUsable()) {
    // kAuto falls back to host memory; kDevice says why it cannot.
    Engine automatic(segments_);
    KVT_ASSERT_OK(automatic.OpenSession("a", kShape, p));
    KVT_ASSERT_OK_AND_ASSIGN(auto st, automatic.Stats("a"));
    EXPECT_FALSE(st.on_device);
    EXPECT_THAT(device_->OpenSession("d", kShape, p),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    return;
  }
  Engine automatic(segments_);
  KVT_ASSERT_OK(automatic.OpenSession("a", kShape, p));
  KVT_ASSERT_OK_AND_ASSIGN(auto st, automatic.Stats("a"));
  EXPECT_TRUE(st.on_device);
  // A transfer's receiver prepares a device side (BeginImport) exactly
  // where the session will live on its GPU.
  auto device_side = [&](Engine& e) {
    std::unique_ptr<worker::PreparedImport> prep = Handoff(e).BeginImport(kShape, p);
    return prep != nullptr && prep->device != nullptr;
  };
  EXPECT_TRUE(device_side(automatic));
  EXPECT_FALSE(device_side(*host_));
  // GEAR is not read on the device: kAuto keeps it on the host, kDevice refuses.
  KVT_ASSERT_OK_AND_ASSIGN(p.codec, ParseCodecSetting("gear2"));
  KVT_ASSERT_OK(automatic.OpenSession("g", kShape, p));
  KVT_ASSERT_OK_AND_ASSIGN(st, automatic.Stats("g"));
  EXPECT_FALSE(st.on_device);
  EXPECT_FALSE(device_side(automatic));
  EXPECT_THAT(device_->OpenSession("g", kShape, p),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(WorkerDeviceTest, DeviceAttentionMatchesHostForEveryCodec) {
  SKIP_WITHOUT_GPU();
  struct Case {
    const char* codec;
    const char* recall;
    bool release;
    const char* evict;
  };
  const Case cases[] = {
      {"fp32", "all", true, nullptr},
      {"raw", "topk:2", true, nullptr},
      {"bf16", "topk:2", false, nullptr},
      {"kivi4", "adaptive:1", true, nullptr},
      {"kivi2:g=16:R=8", "all", false, nullptr},
      {"kcvt4", "topk:1", true, nullptr},
      {"kivi8", "topk:2", true, "snapkv:12:w=4"},
  };
  int i = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.codec) + " " + c.recall);
    SessionPolicy p;
    KVT_ASSERT_OK_AND_ASSIGN(p.codec, ParseCodecSetting(c.codec));
    KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall(c.recall));
    p.watershed_layer = 2;
    p.release_after_end_round = c.release;
    if (c.evict != nullptr) {
      KVT_ASSERT_OK_AND_ASSIGN(p.eviction, evict::ParsePolicy(c.evict));
    }
    // Both sessions decode the same bytes, so only summation order differs.
    EXPECT_LT(RunBoth(p, std::to_string(i++), 5), 2e-4);
  }
}

// Freed device blocks are reused (worker/device/block_cache.h): a second session
// like the first allocates less than it did, as its layers take the blocks
// the first one's gave back, and attends as exactly over blocks that held
// another session's bytes. A cap of 0 frees what is held.
TEST_F(WorkerDeviceTest, FreedDeviceBlocksServeTheNextSession) {
  SKIP_WITHOUT_GPU();
  auto allocs = [] {
    for (const worker::DeviceCallTime& t : worker::DeviceCallTimes()) {
      if (std::string(t.call) == "alloc") return t.count;
    }
    return uint64_t{0};
  };
  // Empty, so that the first session finds nothing earlier tests gave back.
  worker::SetDeviceCacheBytes(0);
  worker::SetDeviceCacheBytes(worker::kDefaultDeviceCacheBytes);
  SessionPolicy p;
  KVT_ASSERT_OK_AND_ASSIGN(p.codec, ParseCodecSetting("kivi4"));
  KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("all"));
  p.watershed_layer = 2;
  const uint64_t a0 = allocs();
  const worker::BlockCache::Stats s0 = worker::DeviceCacheState();
  EXPECT_LT(RunBoth(p, "blocks-a", 4), 2e-4);
  const uint64_t a1 = allocs();
  const worker::BlockCache::Stats s1 = worker::DeviceCacheState();
  EXPECT_GT(s1.cached_bytes, 0u) << "the closed session's blocks are held";
  EXPECT_LT(RunBoth(p, "blocks-b", 4), 2e-4);
  const uint64_t a2 = allocs();
  const worker::BlockCache::Stats s2 = worker::DeviceCacheState();
  EXPECT_GT(s2.reused - s1.reused, s1.reused - s0.reused);
  EXPECT_LT(a2 - a1, a1 - a0) << "cudaMalloc calls: first session " << a1 - a0 << ", second "
                              << a2 - a1;
  worker::SetDeviceCacheBytes(0);
  EXPECT_EQ(worker::DeviceCacheState().cached_bytes, 0u);
  worker::SetDeviceCacheBytes(worker::kDefaultDeviceCacheBytes);
}

// ---- Packed round layers across two processes (CUDA IPC) ----

std::string Hex(std::string_view b) {
  std::string out;
  for (unsigned char c : b) absl::StrAppendFormat(&out, "%02x", c);
  return out;
}

std::string Unhex(std::string_view h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(std::string(h.substr(i, 2)), nullptr, 16)));
  }
  return out;
}

// Tokens of the round layers the child packs (one KV head, raw fp16, d=128:
// 512 bytes a token, K and V): small ones, one over IpcPack's 4 MiB limit
// (named as it is), and enough 2 MB ones to fill a 16 MiB allocation.
constexpr int64_t kPackTokens[] = {1,    7,    64,   500,  8300, 33,   4000, 4000,
                                   4000, 4000, 4000, 4000, 4000, 4000, 4000, 4000};

// The child of IpcPackIsOpenedOnceAndCopiedOutAtItsOffsets, run in a process
// of its own (disabled: only that test runs it): uploads the round layers,
// packs them, prints where each lies with the CRC-32C of its staged array,
// and keeps them until its input says the parent is done.
TEST(WorkerIpcChild, DISABLED_PacksRoundLayers) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  std::vector<std::unique_ptr<worker::DeviceLayer>> layers;
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<worker::IpcPack> pack,
                           worker::NewIpcPack(uint64_t{64} << 20));
  for (int64_t tokens : kPackTokens) {
    std::vector<uint16_t> k(tokens * 128), v(tokens * 128);
    for (uint16_t& x : k) x = FloatToHalf(std::normal_distribution<float>()(rng));
    for (uint16_t& x : v) x = FloatToHalf(std::normal_distribution<float>()(rng));
    const EncodedView kv = EncodedView::Raw(DType::kFp16, k.data(), 1, tokens, 128, 0, 128);
    const EncodedView vv = EncodedView::Raw(DType::kFp16, v.data(), 1, tokens, 128, 0, 128);
    KVT_ASSERT_OK_AND_ASSIGN(auto layer, worker::UploadLayer({{kv, vv}}, 128));
    std::string staged;
    KVT_ASSERT_OK(layer->Download(&staged));
    KVT_ASSERT_OK_AND_ASSIGN(worker::IpcPlace place, pack->Place(*layer));
    std::printf("LAYER %s %llu %zu %u\n", Hex(place.handle).c_str(),
                static_cast<unsigned long long>(place.offset), staged.size(), Crc32c(staged));
    layers.push_back(std::move(layer));
  }
  KVT_ASSERT_OK(pack->Sync());
  std::printf("PACK %d %llu\nREADY\n", pack->allocations(),
              static_cast<unsigned long long>(pack->packed_bytes()));
  std::fflush(stdout);
  char line[16];
  ASSERT_NE(std::fgets(line, sizeof(line), stdin), nullptr);
}

// IpcPack and IpcSource between two processes, as a hand-off's sender and
// receiver use them: the small round layers share allocations (two 16 MiB
// ones here), the one over 4 MiB keeps its own, the receiver opens each
// allocation once and every layer it copies out equals the sender's bytes;
// an offset off the 256-byte grid, or a layer past its allocation's end, is
// refused before any copy.
TEST(WorkerIpcTest, IpcPackIsOpenedOnceAndCopiedOutAtItsOffsets) {
  SKIP_WITHOUT_GPU();
  ::kvtier::testing::SelfChild child({"--gtest_also_run_disabled_tests",
                                      "--gtest_filter=WorkerIpcChild.DISABLED_PacksRoundLayers"});
  ASSERT_TRUE(child.started());
  std::FILE* in = child.out();
  struct Placed {
    std::string handle;
    uint64_t offset = 0;
    size_t bytes = 0;
    uint32_t crc = 0;
  };
  std::vector<Placed> placed;
  int allocations = -1;
  bool ready = false;
  std::string child_out;
  char line[512];
  while (!ready && std::fgets(line, sizeof(line), in) != nullptr) {
    child_out += line;
    char hex[256];
    unsigned long long offset = 0, packed = 0;
    size_t bytes = 0;
    unsigned crc = 0;
    int n = 0;
    if (std::sscanf(line, "LAYER %255s %llu %zu %u", hex, &offset, &bytes, &crc) == 4) {
      placed.push_back({Unhex(hex), offset, bytes, crc});
    } else if (std::sscanf(line, "PACK %d %llu", &n, &packed) == 2) {
      allocations = n;
    } else if (std::strncmp(line, "READY", 5) == 0) {
      ready = true;
    }
  }
  ASSERT_TRUE(ready) << "the child did not pack its layers:\n" << child_out;
  ASSERT_EQ(placed.size(), std::size(kPackTokens));
  EXPECT_EQ(allocations, 2);
  std::set<std::string> handles;
  for (const Placed& p : placed) handles.insert(p.handle);
  EXPECT_EQ(handles.size(), 3u) << "two allocations of packed layers, and the large layer's own";
  // Layer i copied out through `source` holds the child's bytes.
  auto copies = [&](worker::IpcSource* source, size_t i) {
    SCOPED_TRACE(absl::StrCat("layer ", i, " at ", placed[i].offset));
    worker::DeviceRoundLayout layout;
    layout.staged_bytes = placed[i].bytes;
    KVT_ASSERT_OK_AND_ASSIGN(auto layer,
                             source->CopyLayer(placed[i].handle, placed[i].offset, layout));
    std::string got;
    KVT_ASSERT_OK(layer->Download(&got));
    EXPECT_EQ(got.size(), placed[i].bytes);
    EXPECT_EQ(Crc32c(got), placed[i].crc);
  };
  {
    std::unique_ptr<worker::IpcSource> source = worker::NewIpcSource(/*keep_open=*/true);
    for (size_t i = 0; i < placed.size(); ++i) {
      EXPECT_EQ(placed[i].offset % 256, 0u) << i;
      if (kPackTokens[i] == 8300) {
        EXPECT_EQ(placed[i].offset, 0u);
      }
      copies(source.get(), i);
    }
    EXPECT_EQ(source->opened(), 3);
    worker::DeviceRoundLayout layout;
    layout.staged_bytes = 512;
    EXPECT_THAT(source->CopyLayer(placed[1].handle, 100, layout).status(),
                StatusIs(absl::StatusCode::kInvalidArgument));
    layout.staged_bytes = placed[1].bytes;
    EXPECT_THAT(
        source->CopyLayer(placed[1].handle, worker::IpcPack::kIpcPackBytes - 256, layout).status(),
        StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(source->CopyLayer(placed[1].handle, uint64_t{1} << 62, layout).status(),
                StatusIs(absl::StatusCode::kInvalidArgument));
  }  // Every handle closed before the child may free its memory.
  {
    // A receiver of a sender that does not pack: each copy opens and closes
    // its allocation (two layers of one allocation: opened twice).
    std::unique_ptr<worker::IpcSource> source = worker::NewIpcSource(/*keep_open=*/false);
    for (size_t i : {0, 1}) copies(source.get(), i);
    EXPECT_EQ(source->opened(), 2);
  }
  ASSERT_TRUE(child.Send("done\n"));
  const int status = child.Wait(&child_out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << child_out;
}

// One step of session `id`, the same inputs to every engine given (K/V of
// the model's dtype); each one's outputs, every layer's in order.
std::vector<std::vector<float>> Step(const std::string& id, const std::vector<Engine*>& engines,
                                     int64_t n, bool prefill, std::mt19937* rng) {
  std::normal_distribution<float> nd;
  const int d = kShape.head_dim;
  std::vector<std::vector<float>> outs(engines.size());
  for (int l = 0; l < kShape.layers; ++l) {
    std::vector<float> q(n * kShape.q_heads * d), k(n * kShape.kv_heads * d), v(k.size());
    for (float& x : q) x = nd(*rng);
    for (float& x : k) x = HalfToFloat(FloatToHalf(nd(*rng)));
    for (float& x : v) x = HalfToFloat(FloatToHalf(nd(*rng)));
    for (size_t e = 0; e < engines.size(); ++e) {
      std::vector<float> out(q.size());
      if (prefill) {
        auto r =
            engines[e]->PrefillLayer(id, l, n, n / 2, q.data(), k.data(), v.data(), out.data());
        EXPECT_TRUE(r.ok()) << r.status();
      } else {
        EXPECT_THAT(engines[e]->DecodeLayer(id, l, q.data(), k.data(), v.data(), out.data()),
                    IsOk());
      }
      outs[e].insert(outs[e].end(), out.begin(), out.end());
    }
  }
  return outs;
}

// The largest difference between two engines' outputs, relative to the
// first one's scale.
double Worst(const std::vector<float>& want, const std::vector<float>& got) {
  double scale = 1e-6, worst = 0;
  for (float x : want) scale = std::max(scale, double(std::fabs(x)));
  for (size_t j = 0; j < want.size() && j < got.size(); ++j) {
    worst = std::max(worst, std::fabs(double(want[j]) - got[j]) / scale);
  }
  return want.size() == got.size() ? worst : 1e9;
}

// A session moved between engines the way kvtier-worker's TransferSession
// moves it (export, layer by layer, then import), in process.
absl::Status Move(Engine& from, Engine& to, const std::string& id) {
  auto image = Handoff(from).ExportSession(id);
  if (!image.ok()) return image.status();
  std::vector<worker::LayerImage> layers;
  for (int l = 0; l < kShape.layers; ++l) {
    auto li = Handoff(from).ExportLayer(id, l);
    if (!li.ok()) return li.status();
    layers.push_back(*std::move(li));
  }
  if (absl::Status st = Handoff(from).ExportTail(id, &*image); !st.ok()) return st;
  if (absl::Status st = Handoff(to).ImportSession(id, *image, std::move(layers)); !st.ok())
    return st;
  return Handoff(from).ForgetSession(id, /*keep_rounds=*/false);
}

// Move as kvtier-worker's receiver does it for a session it places on its
// GPU: the device side made at the header (BeginImport), each layer
// checked and split as it lands, then uploaded with its open round
// (PrepareLayer), and the import at the tail adopting them. *prepared
// says whether the receiver prepared a device side (it does not for a host
// placement: only the open rounds).
absl::Status MovePrepared(Engine& from, Engine& to, const std::string& id, bool* prepared) {
  auto image = Handoff(from).ExportSession(id);
  if (!image.ok()) return image.status();
  std::unique_ptr<worker::PreparedImport> prep =
      Handoff(to).BeginImport(image->shape, image->policy);
  if (prep == nullptr) return absl::InternalError("BeginImport prepared nothing");
  *prepared = prep->device != nullptr;
  std::vector<worker::LayerImage> layers;
  for (int l = 0; l < kShape.layers; ++l) {
    auto li = Handoff(from).ExportLayer(id, l);
    if (!li.ok()) return li.status();
    li->past = std::make_shared<const std::string>(li->PastBytes());
    li->past_pieces.clear();
    if (absl::Status st = li->CheckPast(kShape.kv_heads, kShape.head_dim); !st.ok()) return st;
    if (absl::Status st = Handoff(to).PrepareLayer(*prep, *li); !st.ok()) return st;
    layers.push_back(*std::move(li));
  }
  if (absl::Status st = Handoff(from).ExportTail(id, &*image); !st.ok()) return st;
  if (absl::Status st =
          Handoff(to).ImportSession(id, *image, std::move(layers), nullptr, std::move(prep));
      !st.ok()) {
    return st;
  }
  return Handoff(from).ForgetSession(id, /*keep_rounds=*/false);
}

// The same with the layers on the GPU lent as they are, as the CUDA IPC
// path lends them: the receiver lays each device round out from the
// sender's description (CheckDeviceRound, as TransferSession does) and
// imports it without a read-back; only the device copy between processes
// is left out (in process the layer is shared). `lent` counts the rounds.
// With `reused`, the rounds `to` still holds (its hand-off cache) stay out
// of the layers, as HeldRounds makes a sender leave them out, and *reused
// gets their bytes.
absl::Status MoveLent(Engine& from, Engine& to, const std::string& id, int* lent,
                      uint64_t* reused = nullptr) {
  auto image = Handoff(from).ExportSession(id);
  if (!image.ok()) return image.status();
  std::vector<worker::HandoffCache::Held> held;
  if (reused != nullptr)
    held = Handoff(to).HeldRounds(id, image->incarnation, absl::Now() + absl::Minutes(1));
  std::vector<worker::LayerImage> layers;
  for (int l = 0; l < kShape.layers; ++l) {
    auto li = Handoff(from).ExportLayer(id, l, /*device_rounds=*/true);
    if (!li.ok()) return li.status();
    li->LeaveOut(held);
    for (worker::LayerImage::DeviceRound& d : li->device_rounds) {
      auto layout = worker::CheckDeviceRound(d.layer->unstaging(), d.layer->staged_bytes(),
                                             kShape.kv_heads, kShape.head_dim);
      if (!layout.ok()) return layout.status();
      if (layout->bytes != d.bytes) return absl::InternalError("laid out to another size");
      d.lens = layout->lens;
      ++*lent;
    }
    li->past = std::make_shared<const std::string>(li->PastBytes());
    layers.push_back(*std::move(li));
  }
  if (absl::Status st = Handoff(from).ExportTail(id, &*image); !st.ok()) return st;
  if (absl::Status st = Handoff(to).ImportSession(id, *image, std::move(layers), reused);
      !st.ok()) {
    return st;
  }
  return Handoff(from).ForgetSession(id, /*keep_rounds=*/true);
}

// A device session hands off like a host one (docs/transfer.md): the past
// tensors it sends, read back from the GPU, are byte for byte those of a
// host session given the same steps; moved off the GPU it decodes exactly as
// that host session does; a host session moved onto the GPU, open round
// included, decodes as it within the device tolerance and ends its round.
TEST_F(WorkerDeviceTest, DeviceSessionsHandOffByteForByte) {
  SKIP_WITHOUT_GPU();
  const EngineOptions host_opts = Options(Placement::kHost);
  const EngineOptions dev_opts = Options(Placement::kDevice);
  int i = 0;
  for (const char* codec : {"kivi4:R=8", "raw", "kcvt2"}) {
    SCOPED_TRACE(codec);
    const std::string id = "m" + std::to_string(i++);
    SessionPolicy p;
    KVT_ASSERT_OK_AND_ASSIGN(p.codec, ParseCodecSetting(codec));
    KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("all"));
    p.watershed_layer = 2;
    p.release_after_end_round = false;
    Engine ref(segments_, host_opts), off_gpu(segments_, host_opts), on_gpu(segments_, dev_opts);
    // A second host twin, moved onto the GPU the way the receiver of a
    // TransferSession stream does it (MovePrepared), and one moved onto a
    // host engine that way, which prepares nothing.
    Engine twin(segments_, host_opts), twin_host(segments_, host_opts);
    Engine prepared_gpu(segments_, dev_opts), prepared_host(segments_, host_opts);
    for (Engine* e : {host_.get(), device_.get(), &ref, &twin, &twin_host})
      KVT_ASSERT_OK(e->OpenSession(id, kShape, p));
    std::mt19937 rng(7);
    auto step = [&](const std::vector<Engine*>& engines, int64_t n, bool prefill) {
      return Step(id, engines, n, prefill, &rng);
    };
    const std::vector<Engine*> all = {host_.get(), device_.get(), &ref, &twin, &twin_host};
    for (int r = 0; r < 2; ++r) {
      step(all, 12, true);
      step(all, 1, false);
      for (Engine* e : all) KVT_ASSERT_OK(e->EndRound(id).status());
    }
    step(all, 10, true);  // An open round travels too.
    KVT_ASSERT_OK_AND_ASSIGN(auto st, device_->Stats(id));
    ASSERT_TRUE(st.on_device);
    for (int l = 0; l < kShape.layers; ++l) {
      KVT_ASSERT_OK_AND_ASSIGN(worker::LayerImage hl, Handoff(*host_).ExportLayer(id, l));
      KVT_ASSERT_OK_AND_ASSIGN(worker::LayerImage dl, Handoff(*device_).ExportLayer(id, l));
      EXPECT_EQ(hl.rounds, dl.rounds) << "layer " << l;
      EXPECT_EQ(hl.rounds.size(), 2u) << "layer " << l;
      EXPECT_TRUE(hl.PastBytes() == dl.PastBytes()) << "layer " << l;
      EXPECT_TRUE(hl.open == dl.open) << "layer " << l;
    }
    KVT_ASSERT_OK(Move(*device_, off_gpu, id));
    KVT_ASSERT_OK(Move(*host_, on_gpu, id));
    bool prepared = false;
    KVT_ASSERT_OK(MovePrepared(twin, prepared_gpu, id, &prepared));
    EXPECT_TRUE(prepared);
    KVT_ASSERT_OK(MovePrepared(twin_host, prepared_host, id, &prepared));
    EXPECT_FALSE(prepared);
    KVT_ASSERT_OK_AND_ASSIGN(st, off_gpu.Stats(id));
    EXPECT_FALSE(st.on_device);
    KVT_ASSERT_OK_AND_ASSIGN(st, on_gpu.Stats(id));
    EXPECT_TRUE(st.on_device);
    KVT_ASSERT_OK_AND_ASSIGN(st, prepared_gpu.Stats(id));
    EXPECT_TRUE(st.on_device);
    for (int t = 0; t < 2; ++t) {
      auto outs = step({&ref, &off_gpu, &on_gpu, &prepared_gpu, &prepared_host}, 1, false);
      EXPECT_TRUE(outs[0] == outs[1]) << "decode step " << t << " off the GPU";
      EXPECT_LT(Worst(outs[0], outs[2]), 2e-4) << "decode step " << t << " on the GPU";
      EXPECT_LT(Worst(outs[0], outs[3]), 2e-4) << "decode step " << t << " on the GPU, prepared";
      EXPECT_TRUE(outs[0] == outs[4]) << "decode step " << t << " prepared, host placement";
    }
    // Handed on again from the prepared session: its past tensors, read
    // back from the GPU, are those of the host session.
    for (int l = 0; l < kShape.layers; ++l) {
      KVT_ASSERT_OK_AND_ASSIGN(worker::LayerImage hl, Handoff(ref).ExportLayer(id, l));
      KVT_ASSERT_OK_AND_ASSIGN(worker::LayerImage dl, Handoff(prepared_gpu).ExportLayer(id, l));
      EXPECT_TRUE(hl.PastBytes() == dl.PastBytes()) << "layer " << l;
      EXPECT_TRUE(hl.open == dl.open) << "layer " << l;
    }
    for (Engine* e : {&ref, &off_gpu, &on_gpu, &prepared_gpu, &prepared_host})
      KVT_ASSERT_OK(e->EndRound(id).status());
  }
}

// Device rounds imported as the CUDA IPC path imports them: onto a device
// session they stay on the GPU (no read-back) and it decodes as a host
// session given the same steps, within the device tolerance; handed back,
// the rounds the first engine kept on its GPU are not sent again; onto a
// host session they are read back and it decodes exactly as that host
// session.
TEST_F(WorkerDeviceTest, LentDeviceRoundsImportAsTheReceiverLaysThemOut) {
  SKIP_WITHOUT_GPU();
  const EngineOptions host_opts = Options(Placement::kHost);
  const EngineOptions dev_opts = Options(Placement::kDevice);
  int i = 0;
  for (const char* codec : {"kivi4:R=8", "raw"}) {
    SCOPED_TRACE(codec);
    const std::string id = "lent" + std::to_string(i++);
    SessionPolicy p;
    KVT_ASSERT_OK_AND_ASSIGN(p.codec, ParseCodecSetting(codec));
    KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("all"));
    p.watershed_layer = 2;
    p.release_after_end_round = false;
    Engine ref(segments_, host_opts), dev2(segments_, dev_opts), host2(segments_, host_opts);
    KVT_ASSERT_OK(device_->OpenSession(id, kShape, p));
    KVT_ASSERT_OK(ref.OpenSession(id, kShape, p));
    std::mt19937 rng(11);
    auto step = [&](const std::vector<Engine*>& engines, int64_t n, bool prefill) {
      return Step(id, engines, n, prefill, &rng);
    };
    for (int r = 0; r < 2; ++r) {
      step({device_.get(), &ref}, 12, true);
      step({device_.get(), &ref}, 1, false);
      for (Engine* e : {device_.get(), &ref}) KVT_ASSERT_OK(e->EndRound(id).status());
    }
    step({device_.get(), &ref}, 10, true);
    int lent = 0;
    KVT_ASSERT_OK(MoveLent(*device_, dev2, id, &lent));
    // Two rounds at every layer but L_w, which keeps host tensors.
    EXPECT_EQ(lent, 2 * (kShape.layers - 1));
    KVT_ASSERT_OK_AND_ASSIGN(auto st, dev2.Stats(id));
    EXPECT_TRUE(st.on_device);
    auto outs = step({&ref, &dev2}, 1, false);
    EXPECT_LT(Worst(outs[0], outs[1]), 2e-4);
    // Back to the first engine, which kept the rounds it handed off on its
    // GPU (its hand-off cache): none of them is lent again.
    lent = 0;
    uint64_t reused = 0;
    KVT_ASSERT_OK(MoveLent(dev2, *device_, id, &lent, &reused));
    EXPECT_EQ(lent, 0);
    EXPECT_GT(reused, 0u);
    outs = step({&ref, device_.get()}, 1, false);
    EXPECT_LT(Worst(outs[0], outs[1]), 2e-4);
    lent = 0;
    KVT_ASSERT_OK(MoveLent(*device_, host2, id, &lent));
    EXPECT_EQ(lent, 2 * (kShape.layers - 1));
    KVT_ASSERT_OK_AND_ASSIGN(st, host2.Stats(id));
    EXPECT_FALSE(st.on_device);
    outs = step({&ref, &host2}, 1, false);
    EXPECT_TRUE(outs[0] == outs[1]) << "decode off the GPU";
    for (Engine* e : {&ref, &host2}) KVT_ASSERT_OK(e->EndRound(id).status());
  }
}

// The NCCL path's links between two GPUs (docs/transfer.md, "The NCCL
// path"), in one process with a thread per rank: the sender's device rounds
// (a session's, exported as a hand-off lends them) go from the first GPU to
// the second, where each is laid out from the sender's description alone
// (CheckDeviceRound); every round read back on the second GPU equals the
// sender's bytes. The same two communicators, kept in a LinkPool on each
// side and taken out as a reused hand-off takes them, then carry the rounds
// of a second layer. Needs two GPUs and NCCL; skips otherwise.
TEST_F(WorkerDeviceTest, NcclLinksCarryDeviceRoundsBetweenTwoGpusAndServeAgain) {
  SKIP_WITHOUT_GPU();
  if (worker::DeviceCount() < 2) {
    GTEST_SKIP() << "the NCCL path needs two GPUs; " << worker::DeviceCount() << " visible";
  }
  if (!worker::NcclBuiltIn()) {
    GTEST_SKIP() << "this build has no NCCL, or libnccl.so.2 did not load";
  }
  SessionPolicy p;
  KVT_ASSERT_OK_AND_ASSIGN(p.codec, ParseCodecSetting("kivi4:R=8"));
  KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("all"));
  p.watershed_layer = 2;
  p.release_after_end_round = false;
  const std::string id = "nccl";
  KVT_ASSERT_OK(device_->OpenSession(id, kShape, p));
  std::mt19937 rng(5);
  for (int r = 0; r < 2; ++r) {
    Step(id, {device_.get()}, 12, true, &rng);
    Step(id, {device_.get()}, 1, false, &rng);
    KVT_ASSERT_OK(device_->EndRound(id).status());
  }
  // Layers 0 and 1 (not L_w, which keeps host tensors): their device rounds.
  std::vector<std::vector<std::shared_ptr<worker::DeviceLayer>>> layers(2);
  for (int l = 0; l < 2; ++l) {
    KVT_ASSERT_OK_AND_ASSIGN(worker::LayerImage li, Handoff(*device_).ExportLayer(id, l, true));
    ASSERT_EQ(li.device_rounds.size(), 2u) << "layer " << l;
    for (auto& d : li.device_rounds) layers[l].push_back(d.layer);
  }
  KVT_ASSERT_OK_AND_ASSIGN(std::string link_id, worker::NewLinkId());
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  worker::LinkPool senders, receivers;  // Each side's pool.
  // Rank 1 on the second GPU: joins (layer 0) or takes the promised link
  // (layer 1), receives the layer's rounds, reads them back.
  auto receive = [&](int l, bool reused, std::vector<std::string>* got) -> absl::Status {
    KVT_RETURN_IF_ERROR(worker::UseDevice(1));
    std::unique_ptr<worker::DeviceLink> link;
    if (reused) {
      KVT_ASSIGN_OR_RETURN(link, receivers.TakePromised("sender", link_id));
    } else {
      KVT_ASSIGN_OR_RETURN(link, worker::JoinLink(link_id, 1, deadline));
    }
    for (const auto& sent : layers[l]) {
      KVT_ASSIGN_OR_RETURN(worker::DeviceRoundLayout layout,
                           worker::CheckDeviceRound(sent->unstaging(), sent->staged_bytes(),
                                                    kShape.kv_heads, kShape.head_dim));
      KVT_ASSIGN_OR_RETURN(std::unique_ptr<worker::DeviceLayer> in,
                           link->Receive(std::move(layout), deadline));
      got->emplace_back();
      KVT_RETURN_IF_ERROR(in->Download(&got->back()));
    }
    receivers.Put("sender", link_id, std::move(link));
    return absl::OkStatus();
  };
  auto send = [&](int l, bool reused) -> absl::Status {
    KVT_RETURN_IF_ERROR(worker::UseDevice(0));
    std::unique_ptr<worker::DeviceLink> link;
    if (reused) {
      std::optional<worker::LinkPool::Link> idle = senders.Take("receiver");
      if (!idle.has_value() || idle->id != link_id) {
        return absl::InternalError("the sender's pool lost the link");
      }
      link = std::move(idle->link);
    } else {
      KVT_ASSIGN_OR_RETURN(link, worker::JoinLink(link_id, 0, deadline));
    }
    for (const auto& layer : layers[l]) KVT_RETURN_IF_ERROR(link->Send(*layer, deadline));
    senders.Put("receiver", link_id, std::move(link));
    return absl::OkStatus();
  };
  for (int l = 0; l < 2; ++l) {
    SCOPED_TRACE(l == 0 ? "a new communicator" : "the kept communicator");
    const bool reused = l > 0;
    if (reused) {
      ASSERT_TRUE(receivers.Promise("sender", link_id));
    }
    std::vector<std::string> got;
    absl::Status received, sent;
    std::thread rank1([&] { received = receive(l, reused, &got); });
    std::thread rank0([&] { sent = send(l, reused); });
    rank0.join();
    rank1.join();
    KVT_ASSERT_OK(sent);
    KVT_ASSERT_OK(received);
    ASSERT_EQ(got.size(), layers[l].size());
    for (size_t r = 0; r < got.size(); ++r) {
      std::string want;
      KVT_ASSERT_OK(layers[l][r]->Download(&want));
      EXPECT_TRUE(got[r] == want) << "round " << r << " of layer " << l;
    }
  }
  EXPECT_EQ(senders.idle(), 1u);
  EXPECT_EQ(receivers.idle(), 1u);
  KVT_ASSERT_OK(device_->CloseSession(id, true));
}

}  // namespace
}  // namespace kvtier
