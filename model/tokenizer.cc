#include "model/tokenizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <queue>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/gguf.h"

namespace kvtier::model {
namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's space.

int Utf8Length(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;  // A stray continuation byte: a symbol of its own.
}

struct Symbol {
  int prev, next;
  const char* text;
  size_t n;
};

struct Bigram {
  int left, right;
  float score;
  size_t size;
  // The queue pops the highest score; among equal scores the leftmost.
  bool operator<(const Bigram& o) const {
    return score < o.score || (score == o.score && left > o.left);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& f) {
  if (!f.Has("tokenizer.ggml.tokens")) {
    return absl::NotFoundError(absl::StrCat(f.name(), ": no vocabulary (tokenizer.ggml.tokens)"));
  }
  KVT_ASSIGN_OR_RETURN(std::string kind, f.String("tokenizer.ggml.model"));
  if (kind != "llama") {
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(), ": tokenizer.ggml.model = ", kind,
                     " is not supported (kvtier reads SentencePiece vocabularies, \"llama\")"));
  }
  auto t = std::unique_ptr<Tokenizer>(new Tokenizer());
  KVT_ASSIGN_OR_RETURN(const std::vector<std::string>* pieces, f.Strings("tokenizer.ggml.tokens"));
  KVT_ASSIGN_OR_RETURN(const std::vector<double>* scores, f.Numbers("tokenizer.ggml.scores"));
  KVT_ASSIGN_OR_RETURN(const std::vector<double>* types, f.Numbers("tokenizer.ggml.token_type"));
  if (scores->size() != pieces->size() || types->size() != pieces->size()) {
    return absl::InvalidArgumentError(absl::StrCat(f.name(), ": the vocabulary has ",
                                                   pieces->size(), " pieces, ", scores->size(),
                                                   " scores and ", types->size(), " types"));
  }
  const int n = static_cast<int>(pieces->size());
  t->pieces_ = *pieces;
  t->scores_.reserve(n);
  t->types_.reserve(n);
  for (int i = 0; i < n; ++i) {
    const double score = (*scores)[i], type = (*types)[i];
    if (!(std::abs(score) <= std::numeric_limits<float>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat(f.name(), ": piece ", i, " has score ", score, ", not a float"));
    }
    if (!(type >= 0 && type <= kByte) || type != std::floor(type)) {
      return absl::InvalidArgumentError(absl::StrCat(f.name(), ": piece ", i, " has type ", type,
                                                     " (GGUF's token types are 0 to 6)"));
    }
    t->scores_.push_back(static_cast<float>(score));
    t->types_.push_back(static_cast<int>(type));
  }
  t->ids_.reserve(n);
  for (int i = 0; i < n; ++i) t->ids_.emplace(t->pieces_[i], i);  // First id wins.
  auto special = [&](const char* key, int dflt) -> absl::StatusOr<int> {
    if (!f.Has(key)) return dflt;
    KVT_ASSIGN_OR_RETURN(int64_t id, f.Int(key));
    if (id < 0 || id >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat(f.name(), ": ", key, " = ", id, " is outside the vocabulary of ", n));
    }
    return static_cast<int>(id);
  };
  KVT_ASSIGN_OR_RETURN(t->bos_, special("tokenizer.ggml.bos_token_id", -1));
  KVT_ASSIGN_OR_RETURN(t->eos_, special("tokenizer.ggml.eos_token_id", -1));
  KVT_ASSIGN_OR_RETURN(t->unk_, special("tokenizer.ggml.unknown_token_id", -1));
  if (f.Has("tokenizer.ggml.add_bos_token")) {
    KVT_ASSIGN_OR_RETURN(t->add_bos_, f.Bool("tokenizer.ggml.add_bos_token"));
  }
  if (f.Has("tokenizer.ggml.add_space_prefix")) {
    KVT_ASSIGN_OR_RETURN(t->add_space_prefix_, f.Bool("tokenizer.ggml.add_space_prefix"));
  }
  bool all_bytes = true;
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    t->byte_ids_[b] = t->Find(name);
    all_bytes &= t->byte_ids_[b] >= 0;
  }
  if (!all_bytes && t->unk_ < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(),
                     ": the vocabulary has neither all 256 byte pieces (<0x00> .. <0xFF>) nor an "
                     "unknown piece (tokenizer.ggml.unknown_token_id): some text has no tokens"));
  }
  for (int i = 0; i < n; ++i) {
    const int type = t->types_[i];
    if ((type == kControl || type == kUserDefined || type == kUnknown) && !t->pieces_[i].empty()) {
      t->specials_.push_back(i);
    }
  }
  std::stable_sort(t->specials_.begin(), t->specials_.end(),
                   [&](int a, int b) { return t->pieces_[a].size() > t->pieces_[b].size(); });
  return t;
}

int Tokenizer::Find(std::string_view piece) const {
  auto it = ids_.find(std::string(piece));
  return it == ids_.end() ? -1 : it->second;
}

std::vector<int> Tokenizer::Encode(std::string_view text, bool add_bos, bool parse_special) const {
  // Fragments: a run of text (id -1) or a special piece.
  struct Fragment {
    int id;
    std::string_view text;
  };
  std::vector<Fragment> frags = {{-1, text}};
  for (int id : specials_) {
    if (!parse_special && types_[id] != kUserDefined) continue;
    const std::string& s = pieces_[id];
    std::vector<Fragment> next;
    for (const Fragment& fr : frags) {
      if (fr.id >= 0) {
        next.push_back(fr);
        continue;
      }
      std::string_view rest = fr.text;
      for (size_t at; (at = rest.find(s)) != std::string_view::npos;) {
        if (at > 0) next.push_back({-1, rest.substr(0, at)});
        next.push_back({id, {}});
        rest.remove_prefix(at + s.size());
      }
      if (!rest.empty()) next.push_back({-1, rest});
    }
    frags = std::move(next);
  }
  std::vector<int> out;
  if (add_bos && add_bos_ && bos_ >= 0) out.push_back(bos_);
  bool prev_special = true;
  for (const Fragment& fr : frags) {
    if (fr.id >= 0) {
      out.push_back(fr.id);
      prev_special = true;
      continue;
    }
    std::string run;
    if (add_space_prefix_ && prev_special) run = kSpace;
    for (char c : fr.text) {
      if (c == ' ') {
        run += kSpace;
      } else {
        run += c;
      }
    }
    EncodeRun(run, &out);
    prev_special = false;
  }
  return out;
}

void Tokenizer::EncodeRun(const std::string& text, std::vector<int>* out) const {
  std::vector<Symbol> sym;
  for (size_t at = 0; at < text.size();) {
    const size_t len =
        std::min<size_t>(Utf8Length(static_cast<unsigned char>(text[at])), text.size() - at);
    const int i = static_cast<int>(sym.size());
    sym.push_back({i - 1, i + 1, text.data() + at, len});
    at += len;
  }
  if (sym.empty()) return;
  sym.back().next = -1;
  std::priority_queue<Bigram> queue;
  std::map<std::string, std::pair<int, int>> merged_from;
  auto try_pair = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    std::string s(sym[left].text, sym[left].n + sym[right].n);
    auto it = ids_.find(s);
    if (it == ids_.end()) return;
    queue.push({left, right, scores_[it->second], s.size()});
    merged_from[s] = {left, right};
  };
  for (size_t i = 1; i < sym.size(); ++i) try_pair(static_cast<int>(i) - 1, static_cast<int>(i));
  while (!queue.empty()) {
    const Bigram b = queue.top();
    queue.pop();
    Symbol& l = sym[b.left];
    Symbol& r = sym[b.right];
    if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;  // Stale.
    l.n += r.n;
    r.n = 0;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = b.left;
    try_pair(l.prev, b.left);
    try_pair(b.left, l.next);
  }
  // A symbol is its piece, or splits back along the merges that built it;
  // what is still no piece becomes bytes.
  std::vector<int> stack;
  for (int i = 0; i != -1; i = sym[i].next) {
    stack.push_back(i);
    while (!stack.empty()) {
      const Symbol& s = sym[stack.back()];
      stack.pop_back();
      const std::string piece(s.text, s.n);
      if (auto it = ids_.find(piece); it != ids_.end()) {
        out->push_back(it->second);
        continue;
      }
      if (auto m = merged_from.find(piece); m != merged_from.end()) {
        stack.push_back(m->second.second);
        stack.push_back(m->second.first);
        continue;
      }
      for (size_t j = 0; j < s.n; ++j) {
        const int id = byte_ids_[static_cast<unsigned char>(s.text[j])];
        out->push_back(id >= 0 ? id : unk_);
      }
    }
  }
}

std::string Tokenizer::Decode(int id, bool special) const {
  if (id < 0 || id >= size()) return "";
  const std::string& p = pieces_[id];
  switch (types_[id]) {
    case kByte: {
      // "<0xAB>": the byte 0xAB. A byte piece spelled otherwise is its text.
      auto hex = [](char c) {
        return c >= '0' && c <= '9'   ? c - '0'
               : c >= 'A' && c <= 'F' ? c - 'A' + 10
               : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                      : -1;
      };
      if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>' && hex(p[3]) >= 0 &&
          hex(p[4]) >= 0) {
        return std::string(1, static_cast<char>(hex(p[3]) * 16 + hex(p[4])));
      }
      return p;
    }
    case kControl:
    case kUnknown:
    case kUnused:
      return special ? p : "";
    default: {
      std::string s;
      for (size_t i = 0; i < p.size();) {
        if (p.compare(i, kSpace.size(), kSpace) == 0) {
          s += ' ';
          i += kSpace.size();
        } else {
          s += p[i++];
        }
      }
      return s;
    }
  }
}

std::string Tokenizer::Decode(const std::vector<int>& ids, bool special) const {
  std::string s;
  for (int id : ids) s += Decode(id, special);
  return s;
}

}  // namespace kvtier::model
