// The kvtier-store gRPC service: the callback API over cachestore::Store.
// Every handler returns to gRPC at once; RocksDB I/O, fsync and checksum work
// run on the executor, which finishes the call.
#ifndef KVTIER_SERVICES_STORE_STORE_SERVICE_H_
#define KVTIER_SERVICES_STORE_STORE_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
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
  // Each calling tenant's share of that budget (charged to the token's
  // tenant, so a node's uploads for its end tenants share the node's). 0 =
  // the budget divided by the number of tenants that may write, which
  // partitions it: no tenant's uploads can then push another's into
  // RESOURCE_EXHAUSTED. Default: 0.
  uint64_t tenant_inflight_upload_bytes = 0;
  // An upload that sends no bytes for this long (header included) is
  // cancelled and its share refunded. Zero or less: never. Default: 10 s.
  absl::Duration upload_idle_timeout = absl::Seconds(10);
  // Most payload bytes one GetSegments call may stream; a call asking for
  // more is OUT_OF_RANGE before a byte is sent. Default: 2 GiB.
  uint64_t max_get_bytes = uint64_t{2} << 30;
};

// Thread-safe. `store`, `auth`, `executor` and `metrics` are not owned and
// must outlive the service and every call in flight (shut the server down
// first).
//
// Every method is "raw". PutSegment(s) and GetSegments frame their messages
// by hand (rpc/wire_format.h) so payload chunks are neither copied into
// protobuf objects nor serialized again; GetSegments sends slices that point
// into the stored payload. The unary methods parse their requests here
// rather than in gRPC, so that bytes which do not parse are INVALID_ARGUMENT
// naming the message (gRPC's typed handler answers UNIMPLEMENTED with no
// details). The wire format is the proto's.
class StoreService final
    : public v1::Store::WithRawCallbackMethod_PutSegment<
          v1::Store::WithRawCallbackMethod_PutSegments<v1::Store::WithRawCallbackMethod_GetSegments<
              v1::Store::WithRawCallbackMethod_ListRounds<
                  v1::Store::WithRawCallbackMethod_DropRounds<
                      v1::Store::WithRawCallbackMethod_DropSegments<
                          v1::Store::WithRawCallbackMethod_RecordRecalls<
                              v1::Store::WithRawCallbackMethod_DeleteSession<
                                  v1::Store::WithRawCallbackMethod_PinSession<
                                      v1::Store::WithRawCallbackMethod_ListSessions<
                                          v1::Store::WithRawCallbackMethod_Stats<
                                              v1::Store::WithRawCallbackMethod_LookupChain<
                                                  v1::Store::CallbackService>>>>>>>>>>>> {
 public:
  StoreService(cachestore::Store* store, cachestore::QuotaManager* quotas,
               const Authenticator* auth, Executor* executor, StoreMetrics* metrics,
               StoreServiceOptions options = {});
  // Stops the idle-upload watchdog. Shut the server down first.
  ~StoreService() override;
  // Bytes that uploads in flight have reserved, over all tenants and for one.
  uint64_t InflightUploadBytes() const;
  uint64_t InflightUploadBytes(const std::string& tenant) const;

  grpc::ServerReadReactor<grpc::ByteBuffer>* PutSegment(grpc::CallbackServerContext* ctx,
                                                        grpc::ByteBuffer* response) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* PutSegments(grpc::CallbackServerContext* ctx,
                                                         grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GetSegments(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* ListRounds(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* DropRounds(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* DropSegments(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RecordRecalls(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* DeleteSession(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* PinSession(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* LookupChain(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;

 private:
  class PutReactor;
  class GetReactor;

  // Runs work(principal, &request, &response) on the executor after
  // authenticating (and, when `write`, authorizing) the caller and parsing
  // `raw` as Req (INVALID_ARGUMENT when it does not parse), then finishes the
  // unary call with its status and, when OK, the serialized response.
  template <typename Req, typename Resp, typename Work>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, const char* method, bool write,
                                  const grpc::ByteBuffer* raw, grpc::ByteBuffer* out, Work work);

  cachestore::Store* const store_;
  cachestore::QuotaManager* const quotas_;
  const Authenticator* const auth_;
  Executor* const executor_;
  StoreMetrics* const metrics_;
  const StoreServiceOptions options_;
  const uint64_t tenant_inflight_share_;  // Resolved tenant_inflight_upload_bytes.

  // Admission of uploads: reserves `bytes` of the in-flight budget for
  // `tenant`'s upload, or says whose limit it would pass.
  absl::Status AdmitUpload(const std::string& tenant, uint64_t bytes);
  void RefundUpload(const std::string& tenant, uint64_t bytes);
  // Watches uploads for idleness (upload_idle_timeout).
  void Register(PutReactor* r);
  void Unregister(PutReactor* r);
  void WatchIdleUploads();

  mutable absl::Mutex upload_mu_;
  uint64_t inflight_upload_bytes_ ABSL_GUARDED_BY(upload_mu_) = 0;
  absl::flat_hash_map<std::string, uint64_t> tenant_inflight_ ABSL_GUARDED_BY(upload_mu_);
  absl::flat_hash_set<PutReactor*> uploads_ ABSL_GUARDED_BY(upload_mu_);
  absl::Notification stop_;
  std::thread watchdog_;
};

// Proto <-> engine conversions, shared with tests.
v1::SegmentInfo ToProto(const cachestore::SegmentInfo& info);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_STORE_STORE_SERVICE_H_
