// The tenants file (services/common/auth.h), which both services parse at
// start-up from an operator's hand-edited text, and the codec and recall
// settings read from flags and policies.
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "kernels/codec.h"
#include "kernels/recall.h"
#include "services/common/auth.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvtier::Authenticator> a = kvtier::Authenticator::FromText(text);
  if (a.ok()) {
    // Whatever parsed obeys the file's rules.
    if (a->entries().empty()) __builtin_trap();
    for (const kvtier::TenantEntry& e : a->entries()) {
      if (e.token.size() < 8 || e.principal.tenant.empty()) __builtin_trap();
    }
    (void)a->WritingTenants();
  }
  // Flag-style settings: one per line.
  size_t at = 0;
  for (int i = 0; i < 8 && at <= text.size(); ++i) {
    const size_t nl = text.find('\n', at);
    const std::string line = text.substr(at, nl == std::string::npos ? std::string::npos : nl - at);
    absl::StatusOr<kvtier::CodecConfig> c = kvtier::ParseCodecSetting(line);
    if (c.ok()) {
      (void)kvtier::ValidateCodecConfig(*c);
      (void)kvtier::CodecSettingName(*c);
    }
    (void)kvtier::ParseRecall(line);
    if (nl == std::string::npos) break;
    at = nl + 1;
  }
  return 0;
}

namespace kvtier::fuzz {

std::vector<std::string> Seeds() {
  return {
      "# token            tenant   role        quota_bytes\n"
      "alice-secret-1     alice    readwrite   10737418240\n"
      "alice-reader       alice    readonly\n"
      "worker-7-secret    worker7  node\n",
      "tok-12345 acme.eu readwrite 100  # trailing\n\n\t\n",
      "kivi4\nkivi2:g=64\ngear4:R=4,r=2\nall\ntopk:3\nmass:0.95\n",
      "kcvt4:g=32,R=8\ngearl2:bb=kcvt,dt=bf16\nfp16\nbest:2\n",
  };
}

}  // namespace kvtier::fuzz
