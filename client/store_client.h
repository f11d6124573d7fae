// A synchronous client for kvtier-store. Thread-safe: one client may be used
// from many threads (gRPC channels multiplex). Every call takes CallOptions;
// a call past its deadline returns DEADLINE_EXCEEDED, a store that cannot be
// reached UNAVAILABLE, never a hang.
#ifndef KVTIER_CLIENT_STORE_CLIENT_H_
#define KVTIER_CLIENT_STORE_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/call_options.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "kvtier/v1/store.grpc.pb.h"

namespace kvtier {

struct StoreClientOptions {
  // "host:port" of kvtier-store. Required.
  std::string target;
  // Bearer token; empty sends none (a store with auth off).
  std::string token;
  // PEM root certificate(s) to verify the store; empty = plaintext channel.
  std::string tls_root_certs;
  // TLS server name override (tests with self-signed certs). Default: none.
  std::string tls_server_name;
  // PEM of this client's certificate chain and key, for a store that
  // requires one (--tls_client_ca); empty: none presented.
  std::string tls_cert_chain, tls_private_key;
  // Payload bytes per PutSegment chunk. Range [1, 4 MiB]. Default: 1 MiB.
  size_t chunk_bytes = size_t{1} << 20;
  // Deadline of a call whose CallOptions set none (bulk uploads of the CLI
  // and benchmarks). A call's own CallOptions::deadline wins when sooner.
  // Default: 120 s.
  absl::Duration deadline = absl::Seconds(120);
};

// The header fields of one upload; payload_bytes and payload_crc32c are
// computed by PutSegment.
struct PutSegmentArgs {
  std::string session_id;
  uint32_t round = 0;
  uint32_t segment = 0;
  uint32_t layer_begin = 0;
  uint32_t layer_end = 1;
  const v1::RoundSummary* round_summary = nullptr;  // Optional; not owned.
  // Unset: the store's default TTL; 0: the session never expires.
  std::optional<uint32_t> session_ttl_seconds;
};

// One segment of a PutSegments call; `payload` must outlive the call.
struct PutSegmentsItem {
  PutSegmentArgs args;
  std::string_view payload;
};

struct FetchedSegment {
  v1::SegmentInfo info;
  v1::Tier served_from = v1::TIER_UNSPECIFIED;
  std::string payload;  // Serialized SegmentPayload; crc32c checked.
  // GetSegments with `missing_ok`: the store does not hold it (only
  // info.ref is set, the payload is empty).
  bool missing = false;
};

class StoreClient {
 public:
  // Creates the channel; does not wait for the store. INVALID_ARGUMENT for
  // bad options.
  static absl::StatusOr<std::unique_ptr<StoreClient>> Connect(StoreClientOptions options);

  // Uploads `payload` (a serialized SegmentPayload) in chunks. Returns the
  // store's status (see store.proto) on failure.
  absl::StatusOr<v1::PutSegmentResponse> PutSegment(const PutSegmentArgs& args,
                                                    std::string_view payload,
                                                    const CallOptions& call = {});

  // Uploads several segments in ONE call (what a call costs is most of a
  // small segment's put). Returns one result per item, in order: the
  // store's answer for that segment as PutSegment would give it. The outer
  // status is the call's own (store.proto, PutSegments); after an error
  // there, items may or may not be stored. INVALID_ARGUMENT for no items
  // or more than 4096.
  absl::StatusOr<std::vector<absl::StatusOr<v1::PutSegmentResponse>>> PutSegments(
      const std::vector<PutSegmentsItem>& items, const CallOptions& call = {});

  // Fetches segments of one session in ONE call. DATA_LOSS if a payload
  // arrives with a wrong checksum; INTERNAL if the stream is malformed.
  // `uncounted`: a copy (repair), not a recall; the store's recall counters
  // stay as they are. `missing_ok`: a segment the store does not hold comes
  // back in its place with `missing` set, instead of failing the call with
  // NOT_FOUND (an unknown session still does).
  absl::StatusOr<std::vector<FetchedSegment>> GetSegments(const std::string& session_id,
                                                          const std::vector<v1::SegmentRef>& refs,
                                                          const CallOptions& call = {},
                                                          bool uncounted = false,
                                                          bool missing_ok = false);

  absl::StatusOr<v1::ListRoundsResponse> ListRounds(const std::string& session_id,
                                                    const CallOptions& call = {});
  absl::StatusOr<v1::DropRoundsResponse> DropRounds(const std::string& session_id,
                                                    const std::vector<uint32_t>& rounds,
                                                    const CallOptions& call = {});
  // Drops single segments, keeping their rounds (see store.proto).
  absl::StatusOr<v1::DropSegmentsResponse> DropSegments(const std::string& session_id,
                                                        const std::vector<v1::SegmentRef>& refs,
                                                        const CallOptions& call = {});
  // Counts recalls served without a fetch (see store.proto).
  absl::StatusOr<v1::RecordRecallsResponse> RecordRecalls(const std::string& session_id,
                                                          const std::vector<uint32_t>& rounds,
                                                          const CallOptions& call = {});
  absl::StatusOr<v1::DeleteSessionResponse> DeleteSession(const std::string& session_id,
                                                          const CallOptions& call = {});
  absl::Status PinSession(const std::string& session_id, bool pinned, const CallOptions& call = {});
  absl::StatusOr<v1::ListSessionsResponse> ListSessions(const v1::ListSessionsRequest& req,
                                                        const CallOptions& call = {});
  absl::StatusOr<v1::StatsResponse> Stats(const CallOptions& call = {});

  // For callers that drive the raw stub (tests of malformed streams): a
  // context with the token and the call's deadline (or the default) set.
  std::unique_ptr<grpc::ClientContext> NewContext(const CallOptions& call = {}) const;
  v1::Store::Stub* stub() { return stub_.get(); }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  StoreClient(StoreClientOptions options, std::shared_ptr<grpc::Channel> channel);

  const StoreClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Store::Stub> stub_;
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_STORE_CLIENT_H_
