// worker::SegmentStore over kvtier-store's gRPC client: the worker's rounds
// go to a real store.
#ifndef KVTIER_CLIENT_STORE_SEGMENTS_H_
#define KVTIER_CLIENT_STORE_SEGMENTS_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "client/store_client.h"
#include "worker/segment_store.h"

namespace kvtier {

class StoreSegments : public worker::SegmentStore {
 public:
  explicit StoreSegments(std::unique_ptr<StoreClient> client) : client_(std::move(client)) {}

  absl::Status Put(const std::string& session, const Segment& s, uint32_t layer_begin,
                   uint32_t layer_end, std::string_view payload, const CallOptions& call) override;
  // One PutSegments call.
  std::vector<absl::Status> PutMany(const std::string& session,
                                    const std::vector<SegmentWrite>& writes,
                                    const CallOptions& call) override;
  // One GetSegments call with missing_ok.
  absl::StatusOr<std::vector<std::optional<std::string>>> GetPresent(
      const std::string& session, const std::vector<Segment>& segments,
      const CallOptions& call) override;
  absl::StatusOr<std::vector<std::string>> Get(const std::string& session,
                                               const std::vector<Segment>& segments,
                                               const CallOptions& call) override;
  absl::Status Delete(const std::string& session, const CallOptions& call) override;
  absl::Status DropRound(const std::string& session, uint32_t round,
                         const CallOptions& call) override;
  absl::Status DropSegments(const std::string& session, const std::vector<Segment>& segments,
                            const CallOptions& call) override;
  absl::Status RecordRecalls(const std::string& session, const std::vector<uint32_t>& rounds,
                             const CallOptions& call) override;
  absl::StatusOr<std::vector<StoredRound>> List(const std::string& session,
                                                const CallOptions& call) override;

  StoreClient* client() { return client_.get(); }
  // GetSegments calls made so far.
  uint64_t get_calls() const { return get_calls_.load(); }
  // RecordRecalls calls made so far.
  uint64_t record_calls() const { return record_calls_.load(); }

 private:
  std::unique_ptr<StoreClient> client_;
  std::atomic<uint64_t> get_calls_{0};
  std::atomic<uint64_t> record_calls_{0};
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_STORE_SEGMENTS_H_
