// Text to token ids and back, from a GGUF file's SentencePiece-style
// vocabulary (tokenizer.ggml.model = "llama": pieces with scores and types,
// byte fallback). Gives the ids llama.cpp gives for the same text:
//
//   1. User-defined pieces (type 4: Gemma's runs of newlines, for example)
//      are split out of the text first, longest first, leftmost first; with
//      `parse_special` control pieces (type 3, "<start_of_turn>") and the
//      unknown piece are too.
//   2. Each remaining run of text, with spaces written as U+2581 (and a
//      leading one when the file asks for add_space_prefix), starts as one
//      symbol per UTF-8 character; the adjacent pair whose concatenation is
//      the highest-scoring piece is merged, leftmost first among equals,
//      until no pair forms a piece.
//   3. Each symbol left becomes its piece, or is split back along the merges
//      that built it, and whatever is still not a piece becomes byte pieces
//      ("<0x0A>").
//
// Thread safety: immutable once built.
#ifndef KVTIER_MODEL_TOKENIZER_H_
#define KVTIER_MODEL_TOKENIZER_H_

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier::model {

class GgufFile;

class Tokenizer {
 public:
  // NOT_FOUND when the file has no vocabulary (tokenizer.ggml.tokens);
  // INVALID_ARGUMENT for another tokenizer model than "llama", arrays of
  // different lengths, a score that is not a float or a type outside 0..6,
  // special ids outside the vocabulary, or a vocabulary with neither every
  // byte piece nor an unknown piece.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& f);

  // The ids of `text`, after BOS when `add_bos` (and the file adds one).
  std::vector<int> Encode(std::string_view text, bool add_bos, bool parse_special = false) const;
  // The text of one piece: spaces restored, byte pieces as their byte,
  // control and unknown pieces as nothing unless `special`.
  std::string Decode(int id, bool special = false) const;
  std::string Decode(const std::vector<int>& ids, bool special = false) const;

  int size() const { return static_cast<int>(pieces_.size()); }
  int bos() const { return bos_; }
  int eos() const { return eos_; }
  // The id of a piece by its text, or -1.
  int Find(std::string_view piece) const;

 private:
  Tokenizer() = default;
  void EncodeRun(const std::string& text, std::vector<int>* out) const;

  enum Type { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<int> types_;
  std::unordered_map<std::string, int> ids_;
  std::vector<int> specials_;  // Split out before SentencePiece; longest first.
  int byte_ids_[256];
  int bos_ = -1, eos_ = -1, unk_ = -1;
  bool add_bos_ = true;
  bool add_space_prefix_ = true;
};

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_TOKENIZER_H_
