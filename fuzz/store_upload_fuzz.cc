// The store's upload streams (PutSegment and PutSegments) as kvtier-store
// serves them: a real StoreService over a real cachestore::Store, in this
// process on 127.0.0.1:0, fed message sequences whose bytes the fuzzer
// chooses (headers, chunks, garbage, in any order and any sizes). Each call
// must end with a status (never hang: the client half-closes), and once it
// has ended nothing it reserved may remain: no upload budget in flight, no
// quota reserved; after the session is deleted, no quota used.
//
// Input: parts (fuzz_target.h); part 0's first byte picks the method (even:
// PutSegments, odd: PutSegment), every later part is one message's bytes.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "base/log.h"
#include "fuzz/fuzz_target.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kernels/crc32c.h"
#include "kvtier/v1/store.grpc.pb.h"
#include "rpc/raw_call.h"
#include "services/store/store_server.h"
#include "testing/test_util.h"

namespace {

constexpr char kSession[] = "f";

struct Fixture {
  kvtier::testing::TempDir dir;
  std::unique_ptr<kvtier::StoreServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<kvtier::v1::Store::Stub> stub;
};

// Built by the first input, destroyed by TearDown: the server stops (its
// threads joined, RocksDB closed) and the temporary directory goes before
// the process exits.
Fixture* fixture = nullptr;

Fixture& Get() {
  static Fixture* f = [] {
    fixture = new Fixture;
    Fixture* f = fixture;
    kvtier::SetLogLevel(kvtier::LogLevel::kWarn);  // Not a line per refused upload.
    kvtier::StoreServerOptions o;
    o.listen = "127.0.0.1:0";
    o.metrics_listen = "";
    o.executor_threads = 2;
    o.store.path = f->dir.path() + "/db";
    o.store.sync_writes = false;
    o.store.max_segment_bytes = 1 << 20;      // Larger declared sizes are refused.
    o.store.inline_payload_max_bytes = 4096;  // Payload files for the larger seeds.
    o.service.max_chunk_bytes = 64 << 10;
    auto s = kvtier::StoreServer::Start(o);
    if (!s.ok()) {
      std::fprintf(stderr, "store_upload_fuzz: %s\n", s.status().ToString().c_str());
      __builtin_trap();
    }
    f->server = *std::move(s);
    // After the server's statics exist, so that at exit it stops before
    // they are destroyed (libFuzzer ends with exit()).
    std::atexit(kvtier::fuzz::TearDown);
    f->channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(f->server->port()),
                                     grpc::InsecureChannelCredentials());
    f->stub = kvtier::v1::Store::NewStub(f->channel);
    return f;
  }();
  return *f;
}

std::string Header(uint32_t round, uint32_t segment, const std::string& payload,
                   const std::string& session = kSession) {
  kvtier::v1::PutSegmentRequest r;
  kvtier::v1::PutSegmentHeader* h = r.mutable_header();
  h->set_session_id(session);
  h->mutable_ref()->set_round(round);
  h->mutable_ref()->set_segment(segment);
  h->set_layer_begin(0);
  h->set_layer_end(4);
  h->set_payload_bytes(payload.size());
  h->set_payload_crc32c(kvtier::Crc32c(payload));
  return r.SerializeAsString();
}

std::string Chunk(const std::string& bytes) {
  kvtier::v1::PutSegmentRequest r;
  r.set_chunk(bytes);
  return r.SerializeAsString();
}

}  // namespace

namespace kvtier::fuzz {

void TearDown() {
  delete fixture;
  fixture = nullptr;
}

std::vector<std::string> Seeds() {
  const std::string a = testing::MakePayload(1500, 1), b = testing::MakePayload(9000, 2);
  const std::string kBatch(1, '\0'), kSingle(1, '\1');
  std::vector<std::string> seeds;
  // PutSegments: two segments; one refused at its header (a bad name) whose
  // bytes are dropped; a corrupt one; a truncated one.
  seeds.push_back(JoinParts({kBatch, Header(0, 0, a), Chunk(a), Header(0, 1, b),
                             Chunk(b.substr(0, 5000)), Chunk(b.substr(5000))}));
  seeds.push_back(
      JoinParts({kBatch, Header(1, 0, a, "bad name!"), Chunk(a), Header(1, 0, a), Chunk(a)}));
  std::string flipped = b;
  flipped[flipped.size() / 2] ^= 1;
  seeds.push_back(JoinParts({kBatch, Header(2, 0, b), Chunk(flipped), Header(3, 0, a), Chunk(a)}));
  seeds.push_back(JoinParts({kBatch, Header(4, 0, b), Chunk(b.substr(0, 100))}));
  // PutSegment: whole, and with a second header.
  seeds.push_back(JoinParts({kSingle, Header(5, 0, b), Chunk(b)}));
  seeds.push_back(JoinParts({kSingle, Header(6, 0, a), Header(6, 1, a), Chunk(a)}));
  return seeds;
}

}  // namespace kvtier::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> parts = kvtier::fuzz::SplitParts(data, size, 32);
  if (parts.empty() || parts[0].empty()) return 0;
  Fixture& f = Get();
  const bool batch = (parts[0][0] & 1) == 0;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    kvtier::RawCall rpc(f.channel, &ctx,
                        batch ? "/kvtier.v1.Store/PutSegments" : "/kvtier.v1.Store/PutSegment");
    bool ok = true;
    for (size_t i = 1; ok && i < parts.size(); ++i) {
      grpc::Slice slice(parts[i].data(), parts[i].size());
      ok = rpc.Write(grpc::ByteBuffer(&slice, 1));
    }
    if (ok) ok = rpc.WritesDone();
    grpc::ByteBuffer reply;
    if (ok) (void)rpc.Read(&reply);
    const grpc::Status s = rpc.Finish();
    // Every stream ends: the store answers or fails it, never waits on.
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) __builtin_trap();
  }
  // The store refunds and aborts before it answers.
  if (f.server->service()->InflightUploadBytes() != 0) __builtin_trap();
  if (f.server->quotas()->Usage("default").reserved_bytes != 0) __builtin_trap();
  // Whatever sessions the mutated headers named go, and their bytes with them.
  kvtier::v1::ListSessionsRequest list;
  list.set_limit(10000);
  kvtier::v1::ListSessionsResponse sessions;
  grpc::ClientContext list_ctx;
  if (!f.stub->ListSessions(&list_ctx, list, &sessions).ok()) __builtin_trap();
  for (const auto& s : sessions.sessions()) {
    kvtier::v1::DeleteSessionRequest del;
    del.set_session_id(s.session_id());
    kvtier::v1::DeleteSessionResponse deleted;
    grpc::ClientContext del_ctx;
    (void)f.stub->DeleteSession(&del_ctx, del, &deleted);
  }
  if (f.server->quotas()->Usage("default").used_bytes != 0) __builtin_trap();
  return 0;
}
