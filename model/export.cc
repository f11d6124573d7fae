#include "model/export.h"

#include "absl/strings/str_cat.h"
#include "model/gguf_writer.h"

namespace kvtier::model {
namespace {

std::string Bytes(const float* p, size_t n) {
  return std::string(reinterpret_cast<const char*>(p), n * sizeof(float));
}

void Add(GgufWriter* w, const std::string& name, const std::vector<float>& v) {
  w->AddTensor(name, GgmlType::kF32, {static_cast<int64_t>(v.size())}, Bytes(v.data(), v.size()));
}

void Add(GgufWriter* w, const std::string& name, const Matrix& m) {
  std::vector<float> all(static_cast<size_t>(m.rows) * m.cols);
  for (int r = 0; r < m.rows; ++r) m.Row(r, all.data() + static_cast<size_t>(r) * m.cols);
  w->AddTensor(name, GgmlType::kF32, {m.cols, m.rows}, Bytes(all.data(), all.size()));
}

}  // namespace

absl::Status ExportGguf(const Model& m, const ExportOptions& o, const std::string& path) {
  if (o.arch != "llama" && o.arch != "gemma3") {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot export as architecture ", o.arch, " (llama or gemma3)"));
  }
  const ModelConfig& c = m.config();
  const std::string p = o.arch + ".";
  GgufWriter w;
  w.AddString("general.architecture", o.arch);
  std::string name = o.name;
  if (name.empty()) {
    name = m.path().substr(m.path().find_last_of('/') + 1);
    name = name.substr(0, name.find('.'));
  }
  w.AddString("general.name", name);
  w.AddU32(p + "block_count", c.n_layers);
  w.AddU32(p + "embedding_length", c.dim);
  w.AddU32(p + "feed_forward_length", c.hidden_dim);
  w.AddU32(p + "attention.head_count", c.n_heads);
  w.AddU32(p + "attention.head_count_kv", c.n_kv_heads);
  w.AddU32(p + "attention.key_length", c.head_dim());
  w.AddU32(p + "attention.value_length", c.head_dim());
  w.AddU32(p + "context_length", c.seq_len);
  w.AddU32(p + "rope.dimension_count", c.head_dim());
  w.AddF32(p + "rope.freq_base", c.rope_theta);
  w.AddF32(p + "attention.layer_norm_rms_epsilon", c.rms_eps);
  const bool gemma = o.arch == "gemma3";
  if (gemma && o.gemma3_window > 0) w.AddU32(p + "attention.sliding_window", o.gemma3_window);
  if (gemma && o.gemma3_global_every > 0) {
    w.AddU32(p + "attention.sliding_window_pattern", o.gemma3_global_every);
  }
  Add(&w, "token_embd.weight", m.embedding());
  if (!c.shared_classifier) Add(&w, "output.weight", m.output());
  Add(&w, "output_norm.weight", m.final_norm());
  const std::vector<float> ones_d(c.dim, 1.0f), ones_h(c.head_dim(), 1.0f);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& lw = m.layer(l);
    const std::string b = absl::StrCat("blk.", l, ".");
    Add(&w, b + "attn_norm.weight", lw.attn_norm);
    Add(&w, b + "attn_q.weight", lw.wq);
    Add(&w, b + "attn_k.weight", lw.wk);
    Add(&w, b + "attn_v.weight", lw.wv);
    Add(&w, b + "attn_output.weight", lw.wo);
    Add(&w, b + "ffn_norm.weight", lw.ffn_norm);
    Add(&w, b + "ffn_gate.weight", lw.gate);
    Add(&w, b + "ffn_up.weight", lw.up);
    Add(&w, b + "ffn_down.weight", lw.down);
    if (gemma) {
      Add(&w, b + "attn_q_norm.weight", lw.q_norm.empty() ? ones_h : lw.q_norm);
      Add(&w, b + "attn_k_norm.weight", lw.k_norm.empty() ? ones_h : lw.k_norm);
      Add(&w, b + "post_attention_norm.weight",
          lw.post_attn_norm.empty() ? ones_d : lw.post_attn_norm);
      Add(&w, b + "post_ffw_norm.weight", lw.post_ffn_norm.empty() ? ones_d : lw.post_ffn_norm);
    }
  }
  return w.Write(path);
}

}  // namespace kvtier::model
