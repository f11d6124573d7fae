#include "worker/skew_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/log.h"
#include "kernels/crc32c.h"

namespace kvtier::worker {

std::string SkewRegistry::Id(std::string_view bytes) {
  // The CRC-32C of the content (not of the whole file, whose own trailing
  // CRC makes that a constant) and the size.
  if (bytes.size() < 4) return "";
  return absl::StrFormat("%08x-%d", Crc32c(bytes.substr(0, bytes.size() - 4)), bytes.size());
}

absl::StatusOr<std::string> SkewRegistry::Put(std::string_view bytes, const std::string& tenant) {
  if (bytes.size() < 4) return absl::InvalidArgumentError("skew file: too short");
  const std::string id = Id(bytes);
  {
    absl::MutexLock lock(&mu_);
    if (auto it = skews_.find(id); it != skews_.end()) {
      it->second.last_use = ++tick_;
      return id;
    }
  }
  auto parsed = spec::ParseSkew(absl::string_view(bytes.data(), bytes.size()));
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(),
                        absl::StrCat("skew file: ", parsed.status().message()));
  }
  auto skew = std::make_shared<const spec::SkewModel>(std::move(*parsed));
  absl::MutexLock lock(&mu_);
  if (auto it = skews_.find(id); it != skews_.end()) {  // Another upload won.
    it->second.last_use = ++tick_;
    return id;
  }
  if (!tenant.empty()) {
    int mine = 0;
    for (const auto& [k, e] : skews_) mine += e.owner == tenant ? 1 : 0;
    if (mine >= kMaxPerTenant && !EvictLocked(tenant, /*only_owner=*/true)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tenant '", tenant, "' holds its share of ", kMaxPerTenant,
                       " skews on this worker, each in use by a session; close one first"));
    }
  }
  if (static_cast<int>(skews_.size()) >= kMaxSkews && !EvictLocked("", /*only_owner=*/false)) {
    return absl::ResourceExhaustedError(absl::StrCat("the worker holds its maximum of ", kMaxSkews,
                                                     " skews, each in use by a session"));
  }
  const std::string model = skew->model;
  skews_[id] = Entry{std::move(skew), tenant, ++tick_};
  LogInfo("skew loaded", {{"skew", id}, {"model", model}, {"tenant", tenant}});
  return id;
}

bool SkewRegistry::EvictLocked(const std::string& owner, bool only_owner) {
  auto victim = skews_.end();
  for (auto it = skews_.begin(); it != skews_.end(); ++it) {
    const Entry& e = it->second;
    if (e.owner.empty() || (only_owner && e.owner != owner)) continue;
    if (e.model.use_count() > 1) continue;  // A session holds it.
    if (victim == skews_.end() || e.last_use < victim->second.last_use) victim = it;
  }
  if (victim == skews_.end()) return false;
  LogInfo("skew dropped to make room", {{"skew", victim->first}, {"tenant", victim->second.owner}});
  skews_.erase(victim);
  return true;
}

std::shared_ptr<const spec::SkewModel> SkewRegistry::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = skews_.find(id);
  if (it == skews_.end()) return nullptr;
  it->second.last_use = ++tick_;
  return it->second.model;
}

}  // namespace kvtier::worker
