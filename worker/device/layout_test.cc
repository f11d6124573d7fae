// The device working set's byte layout, on the host: a tensor encoded by the
// CPU codec, staged as UploadLayer stages it, and read with the very element
// loads the GPU kernel uses (kernels/cuda/seg_load.h) must decode to what
// DecodeRows gives, for every codec the device path reads, K and V, with and
// without residual rows. Runs on every machine; the GPU test
// (tests/worker_device_test.cc) covers the rest of the device path.
#include "worker/device/layout.h"

#include <unistd.h>

#include <cmath>
#include <random>
#include <string>

#include "encoded/encode.h"
#include "encoded/encoded_tensor.h"
#include "gtest/gtest.h"
#include "kernels/cuda/seg_load.h"
#include "kernels/half.h"
#include "tests/util/status_matchers.h"
#include "worker/device/transfer.h"
#include "worker/session.h"

namespace kvtier::worker {
namespace {

using ::kvtier::testing::StatusIs;

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = nd(rng) + (i % 7 == 0 ? 4.0f : 0.0f);  // Outlier channels.
  return x;
}

// Every codec setting the device path reads, with and without residual rows.
constexpr const char* kSettings[] = {"fp32",
                                     "raw",
                                     "bf16",
                                     "kivi2",
                                     "kivi4",
                                     "kivi8",
                                     "kcvt4",
                                     "kcvt2:R=5",
                                     "kivi4:g=16:R=8",
                                     "kivi2:g=64",
                                     "kivi8:dt=bf16:R=3"};

TEST(DeviceLayoutTest, StagedTensorsDecodeLikeTheCpuCodec) {
  int cases = 0;
  for (const char* setting : kSettings) {
    KVT_ASSERT_OK_AND_ASSIGN(CodecConfig codec, ParseCodecSetting(setting));
    for (int d : {8, 64, 128}) {
      for (int64_t t : {1, 7, 33, 64, 100}) {
        for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
          SCOPED_TRACE(std::string(setting) + " d=" + std::to_string(d) +
                       " t=" + std::to_string(t) + (role == TensorRole::kKey ? " K" : " V"));
          const std::vector<float> x = Random(static_cast<size_t>(t) * d, t * 131 + d);
          const int64_t shape[3] = {1, t, d};
          KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor enc,
                                   Encode(codec, role, shape, x.data(), KernelLevel::kReference));
          KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(enc));
          std::vector<float> want(x.size());
          DecodeRows(view, 0, 0, t, want.data(), KernelLevel::kReference);
          // Something staged before it, so offsets are not all zero.
          std::vector<uint8_t> host(3, 0xab);
          KVT_ASSERT_OK_AND_ASSIGN(StagedKv staged, StageView(view, d, &host));
          const cuda::SegKv kv = PlaceStaged(staged, host.data());
          double worst = 0;
          for (int64_t i = 0; i < t; ++i) {
            for (int c = 0; c < d; ++c) {
              const float got = cuda::SegLoad(kv, d, i, c);
              worst = std::max(worst, std::fabs(double(got) - want[i * d + c]) /
                                          (1e-6 + std::fabs(double(want[i * d + c]))));
            }
          }
          EXPECT_LT(worst, 1e-6);
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 11 * 3 * 5 * 2);
}

// A hand-off of a device working set reads each layer's staged array back
// and rebuilds the serialized tensors from it and the bytes kept on the
// host: byte for byte the tensors that were staged, for every codec the
// device path reads. A rebuilt tensor whose region lies outside the staged
// array is refused.
TEST(DeviceLayoutTest, UnstagingRebuildsTheSerializedTensorExactly) {
  int cases = 0;
  for (const char* setting : kSettings) {
    KVT_ASSERT_OK_AND_ASSIGN(CodecConfig codec, ParseCodecSetting(setting));
    for (int64_t t : {1, 33, 100}) {
      const int d = 64;
      SCOPED_TRACE(std::string(setting) + " t=" + std::to_string(t));
      // K and V of one head in a segment payload, as a RoundLayer holds them.
      v1::SegmentPayload payload;
      const int64_t shape[3] = {1, t, d};
      for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
        const std::vector<float> x =
            Random(static_cast<size_t>(t) * d, t * 17 + static_cast<int>(role));
        KVT_ASSERT_OK_AND_ASSIGN(*payload.add_tensors(),
                                 Encode(codec, role, shape, x.data(), KernelLevel::kReference));
      }
      const std::string bytes = payload.SerializeAsString();
      KVT_ASSERT_OK_AND_ASSIGN(std::vector<TensorParts> parts, SplitPayload(bytes));
      ASSERT_EQ(parts.size(), 2u);
      std::vector<uint8_t> host(5, 0xcd);
      std::vector<Unstaging> plans;
      for (const TensorParts& tp : parts) {
        KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(tp));
        KVT_ASSERT_OK_AND_ASSIGN(StagedKv staged, StageView(view, d, &host));
        KVT_ASSERT_OK_AND_ASSIGN(Unstaging u, PlanUnstaging(tp.bytes, staged));
        EXPECT_EQ(u.bytes(), tp.bytes.size());
        EXPECT_LT(u.rest.size(), 256u);  // Metadata and framing only.
        plans.push_back(std::move(u));
      }
      // What a download gives: the staged array, here a copy of it.
      const std::vector<uint8_t> downloaded = host;
      for (size_t i = 0; i < parts.size(); ++i) {
        std::string rebuilt = "x";
        ASSERT_THAT(Unstage(plans[i], downloaded.data(), downloaded.size(), &rebuilt),
                    ::kvtier::testing::IsOk());
        EXPECT_EQ(rebuilt.substr(1), parts[i].bytes);
        std::string truncated;
        EXPECT_THAT(Unstage(plans[i], downloaded.data(), 100, &truncated),
                    StatusIs(absl::StatusCode::kInternal));
        ++cases;
      }
      // A view whose buffers are not the tensor's (a copy elsewhere).
      KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(payload.tensors(0)));
      std::vector<uint8_t> other;
      KVT_ASSERT_OK_AND_ASSIGN(StagedKv staged, StageView(view, d, &other));
      EXPECT_THAT(PlanUnstaging(parts[0].bytes, staged), StatusIs(absl::StatusCode::kInternal));
    }
  }
  EXPECT_EQ(cases, 11 * 3 * 2);
}

// The open round of a session arriving in a hand-off goes into the GPU's
// mirror token-major in fp32: each row of each head, widened from the
// model's dtype, at (row, head), whatever room the open round has beyond
// its rows.
TEST(DeviceLayoutTest, OpenRowsComeOutTokenMajor) {
  const int hkv = 3, d = 8;
  const int64_t rows = 5, cap = 7;
  for (DType dtype : {DType::kFp16, DType::kBf16, DType::kFp32}) {
    SCOPED_TRACE(DTypeName(dtype));
    const int es = DTypeSize(dtype);
    OpenLayer o;
    o.cap = cap;
    o.rows = rows;
    o.k.assign(static_cast<size_t>(hkv) * cap * d * es, 0xee);  // Room past `rows` is junk.
    o.v = o.k;
    // Row t of head h, channel c, holds t + h / 4 + c / 32 (K) or its negative
    // (V): exact in every dtype.
    auto value = [](int64_t t, int h, int c) { return t + h / 4.0f + c / 32.0f; };
    for (int h = 0; h < hkv; ++h) {
      for (int64_t t = 0; t < rows; ++t) {
        for (int c = 0; c < d; ++c) {
          const size_t at = (static_cast<size_t>(h) * cap + t) * d + c;
          const float kx = value(t, h, c), vx = -value(t, h, c);
          if (dtype == DType::kFp32) {
            std::memcpy(o.k.data() + at * 4, &kx, 4);
            std::memcpy(o.v.data() + at * 4, &vx, 4);
          } else {
            const uint16_t kb = dtype == DType::kFp16 ? FloatToHalf(kx) : FloatToBf16(kx);
            const uint16_t vb = dtype == DType::kFp16 ? FloatToHalf(vx) : FloatToBf16(vx);
            std::memcpy(o.k.data() + at * 2, &kb, 2);
            std::memcpy(o.v.data() + at * 2, &vb, 2);
          }
        }
      }
    }
    std::vector<float> k, v;
    OpenRowsTokenMajor(o, hkv, d, dtype, rows, &k, &v);
    ASSERT_EQ(k.size(), static_cast<size_t>(rows) * hkv * d);
    ASSERT_EQ(v.size(), k.size());
    for (int64_t t = 0; t < rows; ++t) {
      for (int h = 0; h < hkv; ++h) {
        for (int c = 0; c < d; ++c) {
          const size_t at = (static_cast<size_t>(t) * hkv + h) * d + c;
          ASSERT_EQ(k[at], value(t, h, c)) << "row " << t << " head " << h << " channel " << c;
          ASSERT_EQ(v[at], -value(t, h, c)) << "row " << t << " head " << h << " channel " << c;
        }
      }
    }
  }
}

TEST(DeviceLayoutTest, GearAndMisshapenTensorsAreRefused) {
  const std::vector<float> x = Random(40 * 64, 1);
  const int64_t shape[3] = {1, 40, 64};
  KVT_ASSERT_OK_AND_ASSIGN(CodecConfig gear, ParseCodecSetting("gear2"));
  KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor enc, Encode(gear, TensorRole::kKey, shape, x.data(),
                                                         KernelLevel::kReference));
  KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(enc));
  std::vector<uint8_t> host;
  EXPECT_THAT(StageView(view, 64, &host), StatusIs(absl::StatusCode::kUnimplemented));
  KVT_ASSERT_OK_AND_ASSIGN(CodecConfig kivi, ParseCodecSetting("kivi4"));
  KVT_ASSERT_OK_AND_ASSIGN(
      enc, Encode(kivi, TensorRole::kKey, shape, x.data(), KernelLevel::kReference));
  KVT_ASSERT_OK_AND_ASSIGN(view, ParseEncoded(enc));
  EXPECT_THAT(StageView(view, 128, &host), StatusIs(absl::StatusCode::kInvalidArgument));
}

// ---- The CUDA IPC path's host side (worker/device/transfer.h) ----

// One past round's layer as a sender holds it on its GPU: the serialized
// tensors (K, V per head, heads of the given lengths), the staged array the
// upload made of them, and how each tensor is made again from it.
struct SentRound {
  std::string payload;  // The tensors' SegmentPayload, which `parts` views.
  std::vector<TensorParts> parts;
  std::vector<uint8_t> staged;
  std::vector<std::pair<StagedKv, StagedKv>> plans;
  std::vector<Unstaging> unstaging;
};

void MakeSentRound(const char* setting, int d, const std::vector<int64_t>& lens, SentRound* r) {
  KVT_ASSERT_OK_AND_ASSIGN(CodecConfig codec, ParseCodecSetting(setting));
  v1::SegmentPayload payload;
  for (size_t h = 0; h < lens.size(); ++h) {
    const int64_t shape[3] = {1, lens[h], d};
    for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
      const std::vector<float> x =
          Random(static_cast<size_t>(lens[h]) * d, h * 7 + static_cast<int>(role));
      KVT_ASSERT_OK_AND_ASSIGN(*payload.add_tensors(),
                               Encode(codec, role, shape, x.data(), KernelLevel::kReference));
    }
  }
  r->payload = payload.SerializeAsString();
  KVT_ASSERT_OK_AND_ASSIGN(r->parts, SplitPayload(r->payload));
  for (size_t h = 0; h < lens.size(); ++h) {
    KVT_ASSERT_OK_AND_ASSIGN(EncodedView k, ParseEncoded(r->parts[2 * h]));
    KVT_ASSERT_OK_AND_ASSIGN(EncodedView v, ParseEncoded(r->parts[2 * h + 1]));
    KVT_ASSERT_OK_AND_ASSIGN(StagedKv pk, StageView(k, d, &r->staged));
    KVT_ASSERT_OK_AND_ASSIGN(StagedKv pv, StageView(v, d, &r->staged));
    KVT_ASSERT_OK_AND_ASSIGN(Unstaging uk, PlanUnstaging(r->parts[2 * h].bytes, pk));
    KVT_ASSERT_OK_AND_ASSIGN(Unstaging uv, PlanUnstaging(r->parts[2 * h + 1].bytes, pv));
    r->unstaging.push_back(std::move(uk));
    r->unstaging.push_back(std::move(uv));
    r->plans.emplace_back(std::move(pk), std::move(pv));
  }
}

bool SameKv(const cuda::SegKv& a, const cuda::SegKv& b) {
  return a.dtype == b.dtype && a.quantized_kind == b.quantized_kind && a.bits == b.bits &&
         a.group == b.group && a.key == b.key && a.quantized == b.quantized &&
         a.token_stride == b.token_stride && a.raw == b.raw && a.codes == b.codes &&
         a.scales == b.scales && a.zeros == b.zeros &&
         (a.quantized_kind == 0 || a.residual == b.residual);
}

// A receiver lays a device round out itself from the sender's description
// (the tensors' metadata and where their regions go): for every codec the
// device reads, it finds the sender's descriptors, token counts and sizes,
// and the tensors it would read back equal the sender's byte for byte.
TEST(DeviceTransferTest, ReceiverLaysOutTheSendersRoundExactly) {
  int cases = 0;
  for (const char* setting : kSettings) {
    for (const std::vector<int64_t>& lens :
         std::vector<std::vector<int64_t>>{{1}, {33, 100, 7}, {64, 1, 5}}) {
      SCOPED_TRACE(std::string(setting) + " heads=" + std::to_string(lens.size()));
      const int d = 64;
      SentRound sent;
      MakeSentRound(setting, d, lens, &sent);
      KVT_ASSERT_OK_AND_ASSIGN(
          DeviceRoundLayout got,
          CheckDeviceRound(sent.unstaging, sent.staged.size(), static_cast<int>(lens.size()), d));
      EXPECT_EQ(got.staged_bytes, sent.staged.size());
      EXPECT_EQ(got.lens, lens);
      int64_t bytes = 0;
      for (const TensorParts& p : sent.parts) bytes += static_cast<int64_t>(p.bytes.size());
      EXPECT_EQ(got.bytes, bytes);
      ASSERT_EQ(got.heads.size(), lens.size());
      for (size_t h = 0; h < lens.size(); ++h) {
        // Placed at the same base, the descriptors are the sender's.
        EXPECT_TRUE(SameKv(PlaceStaged(got.heads[h].first, sent.staged.data()),
                           PlaceStaged(sent.plans[h].first, sent.staged.data())));
        EXPECT_TRUE(SameKv(PlaceStaged(got.heads[h].second, sent.staged.data()),
                           PlaceStaged(sent.plans[h].second, sent.staged.data())));
      }
      ASSERT_EQ(got.unstaging.size(), sent.parts.size());
      for (size_t t = 0; t < sent.parts.size(); ++t) {
        std::string rebuilt;
        ASSERT_THAT(Unstage(got.unstaging[t], sent.staged.data(), sent.staged.size(), &rebuilt),
                    ::kvtier::testing::IsOk());
        EXPECT_EQ(rebuilt, sent.parts[t].bytes);
      }
      ++cases;
    }
  }
  EXPECT_EQ(cases, 11 * 3);
}

// Whatever a sender (or anyone reaching TransferSession) claims, the
// receiver refuses a description that does not lay out as its metadata says,
// before it opens a handle: regions moved, resized or beyond the staged
// array, a wrong staged size, metadata that does not parse, the wrong
// number of tensors, K and V of different lengths, another head_dim.
TEST(DeviceTransferTest, ReceiverRefusesADescriptionThatDoesNotLayOut) {
  const int d = 64;
  SentRound sent;
  MakeSentRound("kivi4:R=8", d, {40, 40}, &sent);
  const size_t size = sent.staged.size();
  ASSERT_THAT(CheckDeviceRound(sent.unstaging, size, 2, d), ::kvtier::testing::IsOk());
  auto refused = [&](std::vector<Unstaging> u, size_t staged, int heads, int dim) {
    return CheckDeviceRound(std::move(u), staged, heads, dim).status();
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  {
    std::vector<Unstaging> u = sent.unstaging;
    u[1].cuts[0].offset += 256;  // Another tensor's place.
    EXPECT_THAT(refused(u, size, 2, d), StatusIs(kInvalid));
  }
  {
    std::vector<Unstaging> u = sent.unstaging;
    u[2].cuts[1].size += 2;  // The metadata says otherwise.
    EXPECT_THAT(refused(u, size, 2, d), StatusIs(kInvalid));
  }
  {
    std::vector<Unstaging> u = sent.unstaging;
    u[3].cuts.back().size = size_t{1} << 60;  // Far past the staged array.
    EXPECT_THAT(refused(u, size, 2, d), StatusIs(kInvalid, ::testing::HasSubstr("exceed")));
  }
  {
    std::vector<Unstaging> u = sent.unstaging;
    std::swap(u[0].cuts[0], u[0].cuts[1]);  // Out of order.
    EXPECT_THAT(refused(u, size, 2, d), StatusIs(kInvalid));
  }
  EXPECT_THAT(refused(sent.unstaging, size + 1, 2, d), StatusIs(kInvalid));
  EXPECT_THAT(refused(sent.unstaging, size - 1, 2, d), StatusIs(kInvalid));
  EXPECT_THAT(refused(sent.unstaging, size, 3, d), StatusIs(kInvalid));
  EXPECT_THAT(refused(sent.unstaging, size, 2, 128), StatusIs(kInvalid));
  {
    std::vector<Unstaging> u = sent.unstaging;
    u[0].rest.assign(u[0].rest.size(), '\xff');  // Metadata that does not parse.
    EXPECT_THAT(refused(u, size, 2, d), StatusIs(kInvalid));
  }
  {
    // K of 40 tokens with V of 24: laid out from a round of other lengths.
    SentRound other;
    MakeSentRound("kivi4:R=8", d, {24, 24}, &other);
    std::vector<Unstaging> u = sent.unstaging;
    u[1] = other.unstaging[1];
    EXPECT_THAT(refused(u, size, 2, d), StatusIs(kInvalid));
  }
}

TEST(DeviceTransferTest, IpcPeersMustShareNodeAndGpuFromAnotherProcess) {
  DeviceIdentity local{"boot-a", std::string(16, '\1'), 100, "", ""};
  DeviceIdentity peer{"boot-a", std::string(16, '\1'), 200, std::string(64, 'h'), "nonce"};
  EXPECT_THAT(IpcPeerCheck(local, peer), ::kvtier::testing::IsOk());
  const auto kRefused = absl::StatusCode::kFailedPrecondition;
  DeviceIdentity p = peer;
  p.boot_id = "boot-b";
  EXPECT_THAT(IpcPeerCheck(local, p), StatusIs(kRefused, ::testing::HasSubstr("another node")));
  p = peer;
  p.gpu_uuid = std::string(16, '\2');
  EXPECT_THAT(IpcPeerCheck(local, p), StatusIs(kRefused, ::testing::HasSubstr("another GPU")));
  p = peer;
  p.pid = local.pid;
  EXPECT_THAT(IpcPeerCheck(local, p), StatusIs(kRefused, ::testing::HasSubstr("this process")));
  p = peer;
  p.probe_handle.clear();
  EXPECT_THAT(IpcPeerCheck(local, p), StatusIs(kRefused, ::testing::HasSubstr("no complete")));
  DeviceIdentity blind = local;
  blind.boot_id.clear();
  EXPECT_THAT(IpcPeerCheck(blind, peer), StatusIs(kRefused));
  // This node's boot id is what the identities compare.
  EXPECT_EQ(BootId().size(), 36u);
}

// A path that failed with a sender process is refused to it from then on,
// and to no one else.
TEST(DeviceTransferTest, FailedPathsAreRefusedToThatSender) {
  DevicePeerFailures f;
  DeviceIdentity a{"boot-a", std::string(16, '\1'), 200, "h", "n", true};
  DeviceIdentity b = a;
  b.pid = 201;
  EXPECT_THAT(f.Check(a, "cuda_ipc"), ::kvtier::testing::IsOk());
  f.Record(a, "cuda_ipc", absl::InternalError("copy device round: an illegal memory access"));
  EXPECT_THAT(f.Check(a, "cuda_ipc"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::HasSubstr("cuda_ipc path failed with this sender before (copy")));
  EXPECT_THAT(f.Check(a, "nccl"), ::kvtier::testing::IsOk());
  EXPECT_THAT(f.Check(b, "cuda_ipc"), ::kvtier::testing::IsOk());
}

// Same GPU: CUDA IPC (its checks); another GPU: NCCL when both sides have
// it, on this node or another; otherwise the reason.
TEST(DeviceTransferTest, DevicePathFollowsTheGpusAndNccl) {
  DeviceIdentity local{"boot-a", std::string(16, '\1'), 100, "", "", true};
  DeviceIdentity peer{"boot-a", std::string(16, '\1'), 200, std::string(64, 'h'), "nonce", true};
  auto path = [](const DeviceIdentity& a, const DeviceIdentity& b) {
    absl::StatusOr<std::string> p = ChooseDevicePath(a, b);
    return p.ok() ? *p : p.status().ToString();
  };
  EXPECT_EQ(path(local, peer), "cuda_ipc");
  DeviceIdentity same_process = peer;
  same_process.pid = local.pid;
  EXPECT_THAT(
      ChooseDevicePath(local, same_process),
      StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("this process")));
  DeviceIdentity other_gpu = peer;
  other_gpu.gpu_uuid = std::string(16, '\2');
  EXPECT_EQ(path(local, other_gpu), "nccl");
  other_gpu.boot_id = "boot-b";  // Another node: NCCL all the same.
  EXPECT_EQ(path(local, other_gpu), "nccl");
  other_gpu.nccl = false;
  EXPECT_THAT(ChooseDevicePath(local, other_gpu),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::HasSubstr("the sender was built without NCCL")));
  other_gpu.nccl = true;
  local.nccl = false;
  EXPECT_THAT(ChooseDevicePath(local, other_gpu),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::HasSubstr("this worker was built without NCCL")));
}

// A device layer whose "device memory" is a host array: what a hand-off
// reads back when it takes the gRPC path, without a GPU.
class HostStagedLayer : public DeviceLayer {
 public:
  HostStagedLayer(std::vector<uint8_t> staged, std::vector<Unstaging> u)
      : staged_(std::move(staged)) {
    unstaging_ = std::move(u);
  }
  int64_t bytes() const override { return static_cast<int64_t>(staged_.size()); }
  absl::Status Download(std::string* staged) const override {
    staged->assign(staged_.begin(), staged_.end());
    return absl::OkStatus();
  }
  size_t staged_bytes() const override { return staged_.size(); }
  absl::StatusOr<std::string> IpcHandle() const override {
    return absl::UnimplementedError("host memory");
  }

 private:
  std::vector<uint8_t> staged_;
};

// A layer export that lent a device round (ExportLayer's device_rounds)
// and goes over gRPC after all reads it back where its pieces belong: the
// payload equals the one of an all-host export. A round the receiver holds
// is left out, device or not, and counted.
TEST(DeviceTransferTest, DeviceRoundsReadBackInPlaceOrAreLeftOut) {
  const int d = 32;
  SentRound r3, r5, r8;
  MakeSentRound("kivi2", d, {9, 12}, &r3);
  MakeSentRound("kcvt4", d, {20, 3}, &r5);
  MakeSentRound("raw", d, {4, 4}, &r8);
  auto make = [&]() {
    LayerImage li;
    li.layer = 2;
    li.rounds = {3, 5, 8};
    auto framing = std::make_shared<std::string>();
    auto add = [&](const SentRound& r) {
      for (const TensorParts& p : r.parts) {
        const size_t at = framing->size();
        AppendPayloadFraming(p.bytes.size(), framing.get());
        li.past_pieces.push_back(
            {nullptr, std::string_view(framing->data() + at, framing->size() - at), std::nullopt});
        li.past_pieces.push_back({nullptr, p.bytes, p.outside});
      }
    };
    framing->reserve(4096);  // Views into it stay put.
    li.round_first_piece.push_back(0);
    add(r3);
    li.round_first_piece.push_back(li.past_pieces.size());
    li.round_first_piece.push_back(li.past_pieces.size());  // Round 5: lent.
    add(r8);
    li.round_first_piece.push_back(li.past_pieces.size());
    for (LayerImage::Piece& p : li.past_pieces) p.owner = framing;
    li.device_rounds.push_back(
        {5, std::make_shared<HostStagedLayer>(r5.staged, r5.unstaging), {}, 0});
    for (const TensorParts& p : r5.parts) li.device_rounds[0].bytes += p.bytes.size();
    return li;
  };
  std::vector<std::string_view> all;
  for (const SentRound* r : {&r3, &r5, &r8}) {
    for (const TensorParts& p : r->parts) all.push_back(p.bytes);
  }
  LayerImage li = make();
  ASSERT_THAT(li.ResolveDevice(), ::kvtier::testing::IsOk());
  EXPECT_TRUE(li.device_rounds.empty());
  EXPECT_EQ(li.PastBytes(), SerializePayload(all));
  EXPECT_EQ(li.round_first_piece, (std::vector<size_t>{0, 8, 16, 24}));

  // The receiver holds round 5 at this layer, and round 8 at another.
  LayerImage left = make();
  const uint64_t left_out = left.LeaveOut({{5, {1, 2}}, {8, {7}}});
  uint64_t r5_bytes = 0;
  for (const TensorParts& p : r5.parts) r5_bytes += p.bytes.size();
  EXPECT_EQ(left_out, r5_bytes);
  EXPECT_TRUE(left.device_rounds.empty());
  EXPECT_EQ(left.reused, (std::vector<uint32_t>{5}));
  ASSERT_THAT(left.ResolveDevice(), ::kvtier::testing::IsOk());
  std::vector<std::string_view> kept;
  for (const SentRound* r : {&r3, &r8}) {
    for (const TensorParts& p : r->parts) kept.push_back(p.bytes);
  }
  EXPECT_EQ(left.PastBytes(), SerializePayload(kept));

  // A lent layer that cannot be read back fails the export, not silently.
  LayerImage blind = make();
  blind.device_rounds[0].layer =
      std::make_shared<HostStagedLayer>(r5.staged, std::vector<Unstaging>{});
  EXPECT_THAT(blind.ResolveDevice(), StatusIs(absl::StatusCode::kInternal));
}

}  // namespace
}  // namespace kvtier::worker
