#include "services/worker/transfer_proto.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "encoded/encode.h"
#include "rpc/policy_proto.h"

namespace kvtier {

namespace {

void EvictionToProto(const evict::Policy& p, v1::TransferEviction* t) {
  t->set_method(static_cast<uint32_t>(p.method));
  t->set_budget(p.budget);
  t->set_window(p.score.window);
  t->set_kernel(p.score.kernel);
  t->set_pooling(static_cast<uint32_t>(p.score.pooling));
  t->set_gqa(static_cast<uint32_t>(p.score.gqa));
  t->set_alpha(p.alpha);
  t->set_beta(p.beta);
  t->set_sinks(p.sinks);
  for (int64_t b : p.layer_budgets) t->add_layer_budgets(b);
  t->set_profile_name(p.profile_name);
}

absl::StatusOr<evict::Policy> EvictionFromProto(const v1::TransferEviction& t) {
  if (t.method() > static_cast<uint32_t>(evict::Method::kProfile) ||
      t.pooling() > static_cast<uint32_t>(evict::Pooling::kNone) ||
      t.gqa() > static_cast<uint32_t>(evict::GqaReduce::kMax)) {
    return absl::InvalidArgumentError(absl::StrCat("transfer eviction: method ", t.method(),
                                                   ", pooling ", t.pooling(), " or gqa ", t.gqa(),
                                                   " out of range"));
  }
  if (t.kernel() < 1 || t.kernel() % 2 == 0 || t.kernel() > 1023 || !(t.alpha() >= 0) ||
      !(t.alpha() <= 1) || !(t.beta() > 0) || !std::isfinite(t.beta()) || t.sinks() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer eviction: kernel ", t.kernel(), " (odd, 1..1023), alpha ", t.alpha(),
                     " (0..1), beta ", t.beta(), " (> 0) or sinks ", t.sinks(), " out of range"));
  }
  for (int64_t b : t.layer_budgets()) KVT_RETURN_IF_ERROR(evict::ValidateBudget(b, t.window()));
  evict::Policy p;
  p.method = static_cast<evict::Method>(t.method());
  p.budget = t.budget();
  p.score.window = t.window();
  p.score.kernel = t.kernel();
  p.score.pooling = static_cast<evict::Pooling>(t.pooling());
  p.score.gqa = static_cast<evict::GqaReduce>(t.gqa());
  p.alpha = t.alpha();
  p.beta = t.beta();
  p.sinks = t.sinks();
  p.layer_budgets.assign(t.layer_budgets().begin(), t.layer_budgets().end());
  p.profile_name = t.profile_name();
  return p;
}

}  // namespace

v1::TransferHeader HeaderToProto(const std::string& session_id, const worker::SessionImage& im) {
  v1::TransferHeader h;
  h.set_session_id(session_id);
  v1::ModelSpec* m = h.mutable_model();
  m->set_num_layers(static_cast<uint32_t>(im.shape.layers));
  m->set_num_q_heads(static_cast<uint32_t>(im.shape.q_heads));
  m->set_num_kv_heads(static_cast<uint32_t>(im.shape.kv_heads));
  m->set_head_dim(static_cast<uint32_t>(im.shape.head_dim));
  m->set_dtype(ToProto(im.shape.dtype));
  for (int w : im.shape.window) m->add_layer_window(static_cast<uint32_t>(w));
  m->set_model_digest(im.shape.model_digest);
  v1::TransferPolicy* p = h.mutable_policy();
  const CodecConfig& c = im.policy.codec;
  v1::TransferCodec* tc = p->mutable_codec();
  tc->set_codec(ToProto(c.codec));
  tc->set_bits(c.bits);
  tc->set_group_size(c.group_size);
  tc->set_residual_tokens(c.residual_tokens);
  tc->set_rank(c.rank);
  tc->set_outlier_fraction(c.outlier_fraction);
  tc->set_backbone(ToProto(c.backbone));
  tc->set_dtype(ToProto(c.dtype));
  tc->set_block_tokens(c.block_tokens);
  EvictionToProto(im.policy.eviction, p->mutable_eviction());
  p->set_watershed_layer(static_cast<uint32_t>(im.policy.watershed_layer));
  p->set_recall_mode(static_cast<uint32_t>(im.policy.recall.mode));
  p->set_recall_param(im.policy.recall.param);
  p->set_keep_recent_round(im.policy.keep_recent_round);
  p->set_release_after_end_round(im.policy.release_after_end_round);
  p->set_speculation_skew(im.policy.speculation.skew);
  p->set_speculation_alpha(im.policy.speculation.alpha);
  p->set_speculation_budget(im.policy.speculation.budget);
  p->set_speculation_pool_bytes(im.policy.speculation.pool_bytes);
  p->set_speculation_pool_low_bytes(im.policy.speculation.pool_low_bytes);
  EvictionToProto(im.round_eviction, h.mutable_round_eviction());
  h.set_incarnation(im.incarnation);
  for (const worker::SessionImage::Round& r : im.past) {
    v1::TransferRound* tr = h.add_rounds();
    tr->set_round(r.round);
    tr->set_tokens(r.tokens);
    tr->set_stored_bytes(r.stored_bytes);
  }
  return h;
}

absl::StatusOr<worker::SessionImage> HeaderFromProto(const v1::TransferHeader& h) {
  worker::SessionImage im;
  KVT_ASSIGN_OR_RETURN(im.shape, ShapeFromProto(h.model()));
  const v1::TransferPolicy& p = h.policy();
  const v1::TransferCodec& tc = p.codec();
  CodecConfig& c = im.policy.codec;
  c.codec = FromProto(tc.codec());
  c.bits = tc.bits();
  c.group_size = tc.group_size();
  c.residual_tokens = tc.residual_tokens();
  c.rank = tc.rank();
  c.outlier_fraction = tc.outlier_fraction();
  c.backbone = FromProto(tc.backbone());
  c.dtype = FromProto(tc.dtype());
  c.block_tokens = tc.block_tokens();
  KVT_ASSIGN_OR_RETURN(im.policy.eviction, EvictionFromProto(p.eviction()));
  KVT_ASSIGN_OR_RETURN(im.round_eviction, EvictionFromProto(h.round_eviction()));
  if (p.recall_mode() > static_cast<uint32_t>(RecallMode::kMass) ||
      !std::isfinite(p.recall_param())) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer recall mode ", p.recall_mode(), " out of range"));
  }
  im.policy.watershed_layer = static_cast<int>(p.watershed_layer());
  im.policy.recall.mode = static_cast<RecallMode>(p.recall_mode());
  im.policy.recall.param = p.recall_param();
  im.policy.keep_recent_round = p.keep_recent_round();
  im.policy.release_after_end_round = p.release_after_end_round();
  im.policy.speculation.skew = p.speculation_skew();
  im.policy.speculation.alpha = p.speculation_alpha();
  im.policy.speculation.budget = p.speculation_budget();
  im.policy.speculation.pool_bytes = p.speculation_pool_bytes();
  im.policy.speculation.pool_low_bytes = p.speculation_pool_low_bytes();
  im.incarnation = h.incarnation();
  for (const v1::TransferRound& r : h.rounds()) {
    im.past.push_back({r.round(), r.tokens(), r.stored_bytes()});
  }
  return im;
}

v1::TransferTail TailToProto(const worker::SessionImage& im) {
  v1::TransferTail t;
  t.set_open_tokens(im.open_tokens);
  t.set_recall_ready(im.recall_ready);
  for (uint32_t r : im.selected) t.add_selected(r);
  for (uint32_t r : im.upper_gone) t.add_upper_gone(r);
  for (uint32_t r : im.round_resident) t.add_round_resident(r);
  for (uint32_t r : im.unreported_recalls) t.add_unreported_recalls(r);
  t.set_rounds(im.rounds);
  t.set_tokens(im.tokens);
  t.set_peak_working_set_bytes(im.peak_working_set_bytes);
  t.set_full_cache_bytes(im.full_cache_bytes);
  return t;
}

void TailFromProto(const v1::TransferTail& t, worker::SessionImage* im) {
  im->open_tokens = t.open_tokens();
  im->recall_ready = t.recall_ready();
  im->selected.assign(t.selected().begin(), t.selected().end());
  im->upper_gone.assign(t.upper_gone().begin(), t.upper_gone().end());
  im->round_resident.assign(t.round_resident().begin(), t.round_resident().end());
  im->unreported_recalls.assign(t.unreported_recalls().begin(), t.unreported_recalls().end());
  im->rounds = t.rounds();
  im->tokens = t.tokens();
  im->peak_working_set_bytes = t.peak_working_set_bytes();
  im->full_cache_bytes = t.full_cache_bytes();
}

v1::DeviceIdentity IdentityToProto(const worker::DeviceIdentity& id) {
  v1::DeviceIdentity p;
  p.set_boot_id(id.boot_id);
  p.set_gpu_uuid(id.gpu_uuid);
  p.set_pid(id.pid);
  p.set_probe_handle(id.probe_handle);
  p.set_probe_nonce(id.probe_nonce);
  p.set_nccl(id.nccl);
  return p;
}

worker::DeviceIdentity IdentityFromProto(const v1::DeviceIdentity& p) {
  worker::DeviceIdentity id;
  id.boot_id = p.boot_id();
  id.gpu_uuid = p.gpu_uuid();
  id.pid = p.pid();
  id.probe_handle = p.probe_handle();
  id.probe_nonce = p.probe_nonce();
  id.nccl = p.nccl();
  return id;
}

v1::TransferDeviceRound DeviceRoundToProto(uint32_t round, size_t staged_bytes,
                                           std::string ipc_handle,
                                           const std::vector<worker::Unstaging>& tensors) {
  v1::TransferDeviceRound r;
  r.set_round(round);
  r.set_staged_bytes(staged_bytes);
  r.set_ipc_handle(std::move(ipc_handle));
  for (const worker::Unstaging& u : tensors) {
    v1::TransferStagedTensor* t = r.add_tensors();
    t->set_rest(u.rest);
    for (const worker::Unstaging::Cut& c : u.cuts) {
      t->add_cut_at(c.at);
      t->add_cut_offset(c.offset);
      t->add_cut_size(c.size);
    }
  }
  return r;
}

absl::StatusOr<std::vector<worker::Unstaging>> StagedTensorsFromProto(
    const v1::TransferDeviceRound& r) {
  std::vector<worker::Unstaging> out;
  for (const v1::TransferStagedTensor& t : r.tensors()) {
    if (t.cut_offset_size() != t.cut_at_size() || t.cut_size_size() != t.cut_at_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device round ", r.round(), " has a tensor whose cut lists differ in length"));
    }
    worker::Unstaging u;
    u.rest = t.rest();
    for (int i = 0; i < t.cut_at_size(); ++i) {
      u.cuts.push_back({static_cast<size_t>(t.cut_at(i)), static_cast<size_t>(t.cut_offset(i)),
                        static_cast<size_t>(t.cut_size(i))});
    }
    out.push_back(std::move(u));
  }
  return out;
}

}  // namespace kvtier
