// The codec fidelity harness behind `kvtier eval codecs`: for a codec setting
// on a trace, the compression ratio, K/V reconstruction error and attention
// output error for the trace's decode queries; on a model, the teacher-forced
// KL divergence and top-1 agreement against the full-precision cache.
#ifndef KVTIER_EVAL_CODEC_EVAL_H_
#define KVTIER_EVAL_CODEC_EVAL_H_

#include <cmath>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codec.h"
#include "kernels/kv_stream.h"
#include "model/forward.h"
#include "traces/trace.h"

namespace kvtier::eval {

struct CodecRow {
  std::string trace;
  std::string setting;
  CodecConfig config;
  double compression_ratio = NAN;  // fp16 bytes / encoded bytes (all metadata included).
  double k_rel_err = NAN;          // ||K - K^||_F / ||K||_F over all layers and heads.
  double v_rel_err = NAN;
  double attn_rel_err = NAN;  // ||O - O^||_F / ||O||_F over the trace's decode queries.
  double kl = NAN;            // Mean KL(p_full || p_codec) per position, nats.
  double top1_agree = NAN;    // Fraction of positions whose argmax agrees.
};

// Streams every layer of `t` through a KvStream with `c` and measures it.
absl::StatusOr<CodecRow> EvalCodecOnTrace(const traces::KvTrace& t, const CodecConfig& c);

// Runs each sequence twice, teacher-forced: with the full fp32 cache, and
// with every layer's cache in a KvStream with `c` (each position attends over
// the encoded past plus the full-precision tail, exactly as decoding would).
// Returns {mean KL, top-1 agreement} over all positions.
absl::StatusOr<std::pair<double, double>> EvalCodecOnModel(
    const model::Model& m, const std::vector<std::vector<int>>& seqs, const CodecConfig& c);

// Attention that keeps each layer's cache in a KvStream (for the model runs
// above and for anything else that decodes over a compressed cache).
class StreamAttention : public model::AttentionBackend {
 public:
  static absl::StatusOr<std::unique_ptr<StreamAttention>> Create(const model::ModelConfig& mc,
                                                                 const CodecConfig& c);
  absl::Status Attend(int layer, int pos, const float* q, const float* k, const float* v,
                      float* out) override;
  int64_t bytes() const;

 private:
  model::ModelConfig mc_;
  std::vector<KvStream> streams_;
};

// The settings `kvtier eval codecs` runs by default.
std::vector<std::string> DefaultCodecSettings();

// A CSV cell: empty for NaN (a metric that does not apply), else `fmt`.
std::string CsvCell(double x, const char* fmt = "%.6g");

// CSV header and row in the documented column order.
std::string CsvHeader();
std::string CsvRow(const CodecRow& r);

}  // namespace kvtier::eval

#endif  // KVTIER_EVAL_CODEC_EVAL_H_
