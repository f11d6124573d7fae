// The kvtier-store gRPC service: the callback API over cachestore::Store.
// Every handler returns to gRPC at once; RocksDB I/O, fsync and checksum work
// run on the executor, which finishes the call.
#ifndef KVTIER_SERVICES_STORE_STORE_SERVICE_H_
#define KVTIER_SERVICES_STORE_STORE_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "base/executor.h"
#include "cachestore/quota.h"
#include "cachestore/store.h"
#include "kvtier/v1/store.grpc.pb.h"
#include "services/common/auth.h"
#include "services/store/store_metrics.h"

namespace kvtier {

struct StoreServiceOptions {
  // Payload bytes per GetSegments chunk message. Default: 1 MiB.
  size_t chunk_bytes = size_t{1} << 20;
  // Largest PutSegment chunk accepted. Default: 4 MiB.
  size_t max_chunk_bytes = size_t{4} << 20;
  // Most refs in one GetSegments call. Default: 4096.
  int max_refs = 4096;
  // Payload bytes that uploads in flight may declare together; a header that
  // would pass it gets RESOURCE_EXHAUSTED, so slow or idle uploads cannot pin
  // unbounded receive buffers. Default: 4 GiB.
  uint64_t max_inflight_upload_bytes = uint64_t{4} << 30;
};

// Thread-safe. `store`, `auth`, `executor` and `metrics` are not owned and
// must outlive the service and every call in flight (shut the server down
// first).
//
// PutSegment and GetSegments are "raw" methods: their messages are framed by
// hand (rpc/wire_format.h) so payload chunks are neither copied
// into protobuf objects nor serialized again; GetSegments sends slices that
// point into the stored payload. The wire format is the proto's.
class StoreService final
    : public v1::Store::WithRawCallbackMethod_PutSegment<
          v1::Store::WithRawCallbackMethod_GetSegments<v1::Store::CallbackService>> {
 public:
  StoreService(cachestore::Store* store, cachestore::QuotaManager* quotas,
               const Authenticator* auth, Executor* executor, StoreMetrics* metrics,
               StoreServiceOptions options = {});

  grpc::ServerReadReactor<grpc::ByteBuffer>* PutSegment(grpc::CallbackServerContext* ctx,
                                                        grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GetSegments(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* ListRounds(grpc::CallbackServerContext* ctx,
                                       const v1::ListRoundsRequest* request,
                                       v1::ListRoundsResponse* response) override;
  grpc::ServerUnaryReactor* DropRounds(grpc::CallbackServerContext* ctx,
                                       const v1::DropRoundsRequest* request,
                                       v1::DropRoundsResponse* response) override;
  grpc::ServerUnaryReactor* RecordRecalls(grpc::CallbackServerContext* ctx,
                                          const v1::RecordRecallsRequest* request,
                                          v1::RecordRecallsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteSession(grpc::CallbackServerContext* ctx,
                                          const v1::DeleteSessionRequest* request,
                                          v1::DeleteSessionResponse* response) override;
  grpc::ServerUnaryReactor* PinSession(grpc::CallbackServerContext* ctx,
                                       const v1::PinSessionRequest* request,
                                       v1::PinSessionResponse* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* request,
                                  v1::StatsResponse* response) override;

 private:
  class PutReactor;
  class GetReactor;

  // Runs `work` on the executor after authenticating (and, when `write`,
  // authorizing) the caller, then finishes the unary call with its status.
  template <typename Work>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, const char* method, bool write,
                                  Work work);

  cachestore::Store* const store_;
  cachestore::QuotaManager* const quotas_;
  const Authenticator* const auth_;
  Executor* const executor_;
  StoreMetrics* const metrics_;
  const StoreServiceOptions options_;
  std::atomic<uint64_t> inflight_upload_bytes_{0};
};

// Proto <-> engine conversions, shared with tests.
v1::SegmentInfo ToProto(const cachestore::SegmentInfo& info);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_STORE_STORE_SERVICE_H_
