#include "rpc/policy_proto.h"

#include <algorithm>
#include <string_view>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "encoded/encode.h"

namespace kvtier {

absl::StatusOr<worker::ModelShape> ShapeFromProto(const v1::ModelSpec& m) {
  worker::ModelShape s;
  s.layers = static_cast<int>(m.num_layers());
  s.q_heads = static_cast<int>(m.num_q_heads());
  s.kv_heads = static_cast<int>(m.num_kv_heads());
  s.head_dim = static_cast<int>(m.head_dim());
  switch (m.dtype()) {
    case v1::DTYPE_FP32:
    case v1::DTYPE_FP16:
    case v1::DTYPE_BF16:
      s.dtype = FromProto(m.dtype());
      break;
    default:
      return absl::InvalidArgumentError("ModelSpec.dtype must be fp16, bf16 or fp32");
  }
  if (s.layers < 1 || s.layers > 1024 || s.q_heads < 1 || s.q_heads > 1024 || s.kv_heads < 1 ||
      s.q_heads % s.kv_heads != 0 || s.head_dim < 1 || s.head_dim > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad ModelSpec: layers ", s.layers, ", q_heads ", s.q_heads, ", kv_heads ",
                     s.kv_heads, " (must divide q_heads), head_dim ", s.head_dim));
  }
  if (m.layer_window_size() != 0) {
    if (m.layer_window_size() != s.layers) {
      return absl::InvalidArgumentError(absl::StrCat("bad ModelSpec: ", m.layer_window_size(),
                                                     " layer_window entries for ", s.layers,
                                                     " layers"));
    }
    for (int l = 0; l < s.layers; ++l) {
      if (m.layer_window(l) > (1u << 24)) {
        return absl::InvalidArgumentError(absl::StrCat("bad ModelSpec: layer_window[", l,
                                                       "] = ", m.layer_window(l), " exceeds 2^24"));
      }
      s.window.push_back(static_cast<int>(m.layer_window(l)));
    }
    if (!s.sliding()) s.window.clear();
  }
  s.model_digest = m.model_digest();
  return s;
}

namespace {

absl::StatusOr<CodecConfig> CodecFromProto(const v1::Policy& p, DType model_dtype) {
  const v1::CodecParams& cp = p.codec_params();
  switch (p.codec()) {
    case v1::CODEC_UNSPECIFIED:
    case v1::CODEC_RAW: {
      // Lossless for the model: its own dtype.
      CodecConfig c = worker::SessionPolicy::RawFp32Codec();
      if (model_dtype == DType::kFp16 || model_dtype == DType::kBf16) c.dtype = model_dtype;
      return c;
    }
    case v1::CODEC_KIVI:
    case v1::CODEC_KCVT:
    case v1::CODEC_GEAR:
    case v1::CODEC_GEAR_L: {
      CodecConfig c;
      c.codec = FromProto(p.codec());
      const bool gear = p.codec() == v1::CODEC_GEAR || p.codec() == v1::CODEC_GEAR_L;
      c.bits = cp.bits() != 0 ? static_cast<int>(cp.bits()) : (gear ? 2 : 4);
      if (cp.group_size() != 0) c.group_size = static_cast<int>(cp.group_size());
      c.residual_tokens = static_cast<int>(cp.residual_tokens());
      if (cp.rank() != 0) c.rank = static_cast<int>(cp.rank());
      if (cp.outlier_fraction() != 0) c.outlier_fraction = cp.outlier_fraction();
      if (cp.backbone() != v1::CODEC_UNSPECIFIED) c.backbone = FromProto(cp.backbone());
      return c;
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown codec ", p.codec()));
  }
}

absl::StatusOr<evict::Policy> EvictionFromProto(const v1::Policy& p) {
  const std::string& name = p.eviction();
  if (name.empty() || name == "none") return worker::SessionPolicy::NoEviction();
  evict::Policy e;
  if (absl::StartsWith(name, "profile:")) {
    // A layer profile travels as its budgets: the worker (and the
    // controller, validating) opens no file a client names.
    if (p.layer_budgets().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "eviction '", name,
          "' needs layer_budgets: a layer profile travels as its per-layer budgets (the name is "
          "only a label; no file is read)"));
    }
    e.method = evict::Method::kProfile;
    e.profile_name = name.substr(std::string_view("profile:").size());
    e.layer_budgets.assign(p.layer_budgets().begin(), p.layer_budgets().end());
    e.budget = *std::max_element(e.layer_budgets.begin(), e.layer_budgets.end());
    e.score.window =
        evict::DefaultWindow(*std::min_element(e.layer_budgets.begin(), e.layer_budgets.end()));
  } else {
    if (p.budget_tokens() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("eviction '", name,
                       "' needs budget_tokens (0 means no eviction only "
                       "with eviction unset or \"none\")"));
    }
    // The method's name; its parameters are set field by field below.
    KVT_ASSIGN_OR_RETURN(e, evict::ParsePolicy(absl::StrCat(name, ":", p.budget_tokens())));
  }
  if (p.window() != 0) e.score.window = static_cast<int>(p.window());
  if (p.pool_kernel() != 0) e.score.kernel = static_cast<int>(p.pool_kernel());
  if (p.ada_alpha() != 0) e.alpha = p.ada_alpha();
  if (p.pyramid_beta() != 0) e.beta = p.pyramid_beta();
  for (int64_t b : e.layer_budgets) KVT_RETURN_IF_ERROR(evict::ValidateBudget(b, e.score.window));
  return e;
}

}  // namespace

absl::StatusOr<worker::SessionPolicy> PolicyFromProto(const v1::Policy& p, DType model_dtype) {
  worker::SessionPolicy s;
  KVT_ASSIGN_OR_RETURN(s.codec, CodecFromProto(p, model_dtype));
  KVT_RETURN_IF_ERROR(ValidateCodecConfig(s.codec));
  KVT_ASSIGN_OR_RETURN(s.eviction, EvictionFromProto(p));
  // 0 is proto3's unset: the engine's default, L / 3. The engine checks the
  // layer against the model; here only that it fits an int.
  if (p.watershed_layer() > uint32_t{1024}) {
    return absl::InvalidArgumentError(absl::StrCat("watershed_layer ", p.watershed_layer(),
                                                   " is beyond any model (at most 1024 layers)"));
  }
  s.watershed_layer = p.watershed_layer() == 0 ? -1 : static_cast<int>(p.watershed_layer());
  if (!p.recall().empty()) {
    KVT_ASSIGN_OR_RETURN(s.recall, ParseRecall(p.recall()));
  }
  // Presence-aware: unset keeps the documented default (true).
  if (p.has_keep_recent_round()) s.keep_recent_round = p.keep_recent_round();
  if (p.has_release_after_end_round()) s.release_after_end_round = p.release_after_end_round();
  // Speculation: the engine checks the skew against the model, and alpha.
  s.speculation.skew = p.speculation_skew();
  if (p.speculation_alpha() != 0) s.speculation.alpha = p.speculation_alpha();
  if (p.speculation_budget() > uint32_t{1} << 30) {
    return absl::InvalidArgumentError(
        absl::StrCat("speculation_budget ", p.speculation_budget(), " is beyond any context"));
  }
  s.speculation.budget = static_cast<int>(p.speculation_budget());
  if (p.speculation_pool_bytes() > uint64_t{1} << 56) {
    return absl::InvalidArgumentError(absl::StrCat(
        "speculation_pool_bytes ", p.speculation_pool_bytes(), " is beyond any host memory"));
  }
  s.speculation.pool_bytes = static_cast<int64_t>(p.speculation_pool_bytes());
  if (p.speculation_pool_low_bytes() > p.speculation_pool_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("speculation_pool_low_bytes ", p.speculation_pool_low_bytes(),
                     " must be at most speculation_pool_bytes (", p.speculation_pool_bytes(),
                     "); 0 trims to the cap itself"));
  }
  s.speculation.pool_low_bytes = static_cast<int64_t>(p.speculation_pool_low_bytes());
  if (s.speculation.pool_bytes > 0 && s.speculation.skew.empty()) {
    return absl::InvalidArgumentError(
        "speculation_pool_bytes needs speculation_skew: the pool evicts by speculation's fetch "
        "counts");
  }
  return s;
}

absl::StatusOr<worker::SessionPolicy> PolicyFromAnswer(const v1::GetPolicyResponse& a,
                                                       DType model_dtype) {
  if (a.layer_budgets().empty()) return PolicyFromProto(a.policy(), model_dtype);
  v1::Policy p = a.policy();
  p.clear_eviction();
  KVT_ASSIGN_OR_RETURN(worker::SessionPolicy s, PolicyFromProto(p, model_dtype));
  evict::Policy e;
  e.method = evict::Method::kProfile;
  if (p.window() != 0) e.score.window = static_cast<int>(p.window());
  if (p.pool_kernel() != 0) e.score.kernel = static_cast<int>(p.pool_kernel());
  e.layer_budgets.assign(a.layer_budgets().begin(), a.layer_budgets().end());
  for (int64_t b : e.layer_budgets) KVT_RETURN_IF_ERROR(evict::ValidateBudget(b, e.score.window));
  e.budget = *std::max_element(e.layer_budgets.begin(), e.layer_budgets.end());
  e.profile_name = a.profile_name().empty() ? "controller" : a.profile_name();
  s.eviction = std::move(e);
  return s;
}

v1::Policy EffectivePolicy(const v1::Policy& requested, const worker::SessionPolicy& eff) {
  v1::Policy p = requested;
  p.set_watershed_layer(static_cast<uint32_t>(eff.watershed_layer));
  p.set_recall(RecallName(eff.recall));
  p.set_keep_recent_round(eff.keep_recent_round);
  p.set_release_after_end_round(eff.release_after_end_round);
  if (!eff.speculation.skew.empty()) p.set_speculation_alpha(eff.speculation.alpha);
  return p;
}

v1::RecallDecision RecallToProto(const worker::RecallReport& r) {
  v1::RecallDecision d;
  for (uint32_t s : r.selected) d.add_selected_rounds(s);
  for (double s : r.scores) d.add_round_scores(static_cast<float>(s));
  d.set_bytes_fetched(r.bytes_fetched);
  d.set_fetched_segments(static_cast<uint32_t>(r.fetched_segments));
  d.set_fetch_ms(r.fetch_ms);
  d.set_exposed_ms(r.exposed_ms);
  return d;
}

v1::EndRoundResponse EndRoundToProto(const worker::EndRoundReport& r) {
  v1::EndRoundResponse resp;
  resp.set_round(r.round);
  resp.set_stored_bytes(r.stored_bytes);
  resp.set_working_set_bytes(r.working_set_bytes);
  resp.set_round_working_set_bytes(r.round_working_set_bytes);
  resp.set_full_cache_bytes(r.full_cache_bytes);
  for (uint32_t x : r.recalls_recorded) resp.add_recalls_counted(x);
  resp.set_compression_ratio(r.stored_bytes > 0 ? static_cast<float>(r.full_bytes) /
                                                      static_cast<float>(r.stored_bytes)
                                                : 0.0f);
  for (const worker::SpeculationLayerStats& l : r.speculation) {
    v1::SpeculationLayer* o = resp.add_speculation();
    o->set_steps(l.steps);
    o->set_past_tokens(l.past_tokens);
    o->set_kept(l.kept);
    o->set_gathered(l.gathered);
    o->set_bytes_speculative(l.bytes_speculative);
    o->set_bytes_dense(l.bytes_dense);
    o->set_sampled(l.sampled);
    o->set_hit_sum(l.hit_sum);
    o->set_mass_sum(l.mass_sum);
  }
  if (r.pool.cap_bytes > 0) {
    v1::SpeculationPool* p = resp.mutable_speculation_pool();
    p->set_cap_bytes(r.pool.cap_bytes);
    p->set_bytes_before(r.pool.bytes_before);
    p->set_bytes_after(r.pool.bytes_after);
    p->set_evicted_tokens(r.pool.evicted_tokens);
    p->set_reencoded_layers(r.pool.reencoded_layers);
    p->set_ms(r.pool.ms);
  }
  *resp.mutable_worker_memory() = ProcessMemoryToProto(r.process_memory);
  return resp;
}

v1::ProcessMemory ProcessMemoryToProto(const ProcessMemory& m) {
  v1::ProcessMemory p;
  p.set_resident_bytes(m.resident_bytes);
  p.set_peak_resident_bytes(m.peak_resident_bytes);
  p.set_heap_in_use_bytes(m.heap_in_use_bytes);
  p.set_heap_free_bytes(m.heap_free_bytes);
  return p;
}

}  // namespace kvtier
