#include "eval/codec_eval.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "kernels/attention.h"

namespace kvtier::eval {
std::string CsvCell(double x, const char* fmt) {
  return std::isnan(x) ? std::string() : absl::StrFormat(fmt, x);
}

std::vector<std::string> DefaultCodecSettings() {
  return {"fp16",
          "kivi8",
          "kivi4",
          "kivi2",
          "kcvt4",
          "kcvt2",
          "gear4:bb=kcvt:r=4:s=0.02",
          "gear2:r=4:s=0.02",
          "gear2:r=2:s=0.02",
          "gear2:r=4:s=0.01",
          "gear2:r=1:s=0.01",
          "gearl2:r=4",
          "gearl2:r=2",
          "gearl2:r=1"};
}

absl::StatusOr<CodecRow> EvalCodecOnTrace(const traces::KvTrace& t, const CodecConfig& c) {
  CodecRow row;
  row.trace = t.name;
  row.setting = CodecSettingName(c);
  row.config = c;
  const int d = t.head_dim, h = t.kv_heads;
  double kn = 0, ke = 0, vn = 0, ve = 0, on = 0, oe = 0;
  int64_t bytes = 0;
  std::vector<float> krow(static_cast<size_t>(h) * d), vrow(krow.size()), dec;
  for (int l = 0; l < t.layers; ++l) {
    KVT_ASSIGN_OR_RETURN(KvStream s, KvStream::Create(c, h, d));
    for (int64_t tok = 0; tok < t.tokens; ++tok) {
      for (int hh = 0; hh < h; ++hh) {
        std::copy_n(t.K(l, hh) + tok * d, d, krow.begin() + hh * d);
        std::copy_n(t.V(l, hh) + tok * d, d, vrow.begin() + hh * d);
      }
      KVT_RETURN_IF_ERROR(s.Append(krow.data(), vrow.data(), 1));
    }
    bytes += s.bytes();
    const std::vector<KvBlock> blocks = s.Blocks();
    // Reconstruction error, block by block.
    for (int hh = 0; hh < h; ++hh) {
      int64_t pos = 0;
      for (const KvBlock& b : blocks) {
        dec.resize(static_cast<size_t>(b.k.tokens) * d);
        for (int which = 0; which < 2; ++which) {
          DecodeRows(which == 0 ? b.k : b.v, hh, 0, b.k.tokens, dec.data());
          const float* ref = (which == 0 ? t.K(l, hh) : t.V(l, hh)) + pos * d;
          double& n = which == 0 ? kn : vn;
          double& e = which == 0 ? ke : ve;
          for (int64_t i = 0; i < b.k.tokens * d; ++i) {
            n += static_cast<double>(ref[i]) * ref[i];
            e += (static_cast<double>(ref[i]) - dec[i]) * (static_cast<double>(ref[i]) - dec[i]);
          }
        }
        pos += b.k.tokens;
      }
    }
    // Attention output error for the real decode queries.
    if (!t.q.empty()) {
      const AttentionShape shape{t.q_heads, t.kv_heads, d};
      KvBlock full{EncodedView::Raw(DType::kFp32, t.K(l, 0), h, t.tokens, d, t.tokens * d, d),
                   EncodedView::Raw(DType::kFp32, t.V(l, 0), h, t.tokens, d, t.tokens * d, d)};
      std::vector<float> q(static_cast<size_t>(t.q_heads) * d), o_ref(q.size()), o(q.size());
      for (int64_t i = 0; i < t.queries; ++i) {
        for (int qh = 0; qh < t.q_heads; ++qh)
          std::copy_n(t.Q(l, qh) + i * d, d, q.begin() + qh * d);
        KVT_RETURN_IF_ERROR(DecodeAttention(shape, q.data(), {&full, 1}, o_ref.data()));
        KVT_RETURN_IF_ERROR(DecodeAttention(shape, q.data(), blocks, o.data()));
        for (size_t j = 0; j < o.size(); ++j) {
          on += static_cast<double>(o_ref[j]) * o_ref[j];
          oe += (static_cast<double>(o_ref[j]) - o[j]) * (static_cast<double>(o_ref[j]) - o[j]);
        }
      }
      row.attn_rel_err = std::sqrt(oe / on);
    }
  }
  const double fp16_bytes = 2.0 * 2.0 * t.layers * h * static_cast<double>(t.tokens) * d;
  row.compression_ratio = fp16_bytes / static_cast<double>(bytes);
  row.k_rel_err = std::sqrt(ke / kn);
  row.v_rel_err = std::sqrt(ve / vn);
  return row;
}

absl::StatusOr<std::unique_ptr<StreamAttention>> StreamAttention::Create(
    const model::ModelConfig& mc, const CodecConfig& c) {
  auto a = std::unique_ptr<StreamAttention>(new StreamAttention());
  a->mc_ = mc;
  for (int l = 0; l < mc.n_layers; ++l) {
    KVT_ASSIGN_OR_RETURN(KvStream s, KvStream::Create(c, mc.n_kv_heads, mc.head_dim()));
    a->streams_.push_back(std::move(s));
  }
  return a;
}

absl::Status StreamAttention::Attend(int layer, int pos, const float* q, const float* k,
                                     const float* v, float* out) {
  KvStream& s = streams_[layer];
  if (s.tokens() != pos) return absl::FailedPreconditionError("positions must be fed in order");
  KVT_RETURN_IF_ERROR(s.Append(k, v, 1));
  return DecodeAttention({mc_.n_heads, mc_.n_kv_heads, mc_.head_dim()}, q, s.Blocks(), out);
}

int64_t StreamAttention::bytes() const {
  int64_t b = 0;
  for (const KvStream& s : streams_) b += s.bytes();
  return b;
}

absl::StatusOr<std::pair<double, double>> EvalCodecOnModel(
    const model::Model& m, const std::vector<std::vector<int>>& seqs, const CodecConfig& c) {
  const model::ModelConfig& mc = m.config();
  double kl = 0;
  int64_t agree = 0, n = 0;
  std::vector<float> lr(mc.vocab_size), lc(mc.vocab_size);
  for (const std::vector<int>& seq : seqs) {
    model::FullCacheAttention full(mc);
    KVT_ASSIGN_OR_RETURN(std::unique_ptr<StreamAttention> enc, StreamAttention::Create(mc, c));
    model::Forward fr(m), fc(m);
    for (size_t pos = 0; pos + 1 < seq.size(); ++pos) {
      KVT_RETURN_IF_ERROR(fr.Step(seq[pos], static_cast<int>(pos), &full, lr.data()));
      KVT_RETURN_IF_ERROR(fc.Step(seq[pos], static_cast<int>(pos), enc.get(), lc.data()));
      kl += model::KlDivergence(model::Softmax(lr.data(), mc.vocab_size),
                                model::Softmax(lc.data(), mc.vocab_size));
      agree += model::Argmax(lr.data(), mc.vocab_size) == model::Argmax(lc.data(), mc.vocab_size);
      ++n;
    }
  }
  if (n == 0) return absl::InvalidArgumentError("no positions to evaluate");
  return std::make_pair(kl / n, static_cast<double>(agree) / n);
}

std::string CsvHeader() {
  return "trace,codec,bits,group,rank,outlier_frac,compression_ratio,k_rel_err,v_rel_err,"
         "attn_rel_err,kl,top1_agree";
}

std::string CsvRow(const CodecRow& r) {
  const CodecConfig& c = r.config;
  const bool raw = c.codec == Codec::kRaw;
  const bool grouped =
      c.codec == Codec::kKivi ||
      ((c.codec == Codec::kGear || c.codec == Codec::kGearL) && c.backbone == Codec::kKivi);
  const bool gear = c.codec == Codec::kGear || c.codec == Codec::kGearL;
  return absl::StrCat(r.trace, ",", r.setting, ",", raw ? 8 * DTypeSize(c.dtype) : c.bits, ",",
                      grouped ? absl::StrCat(c.group_size) : std::string(), ",",
                      gear ? absl::StrCat(c.rank) : std::string(), ",",
                      c.codec == Codec::kGear ? absl::StrCat(c.outlier_fraction) : std::string(),
                      ",", CsvCell(r.compression_ratio, "%.4f"), ",", CsvCell(r.k_rel_err), ",",
                      CsvCell(r.v_rel_err), ",", CsvCell(r.attn_rel_err), ",", CsvCell(r.kl), ",",
                      CsvCell(r.top1_agree, "%.4f"));
}

}  // namespace kvtier::eval
