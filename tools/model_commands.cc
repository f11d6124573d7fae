// `kvtier model`: what a model file holds and what kvtier's forward pass
// makes of it: the shape and layer types, token ids of a text and back,
// dequantized tensors and teacher-forced logits (for checking kvtier against
// other engines, tests/llama_cpp_check.py).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "encoded/encode.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/codec.h"
#include "model/architecture.h"
#include "model/export.h"
#include "model/forward.h"
#include "model/gguf.h"
#include "model/thread_pool.h"
#include "refengine/replay.h"
#include "tools/cli_args.h"

namespace kvtier::cli {
namespace {

constexpr char kHelp[] =
    "kvtier model info FILE\n"
    "  The architecture, shape, layer types, vocabulary and identity of a model file\n"
    "  (GGUF, or a llama2.c checkpoint), and its tensors' types.\n\n"
    "kvtier model tokenize FILE (--text=TEXT | --file=PATH) [--no_bos] [--special]\n"
    "  The token ids of a text, one line, as llama.cpp gives them (--special: control\n"
    "  pieces such as <start_of_turn> written in the text are parsed).\n"
    "kvtier model tokenize FILE --jsonl=PATH\n"
    "  One line of ids for each line of PATH, {\"text\": \"...\", \"bos\": true|false}.\n\n"
    "kvtier model detokenize FILE ID...\n"
    "  The text of token ids.\n"
    "kvtier model detokenize FILE --jsonl=PATH\n"
    "  One JSON string for each line of PATH, a JSON array of ids.\n\n"
    "kvtier model dequant FILE TENSOR --out=PATH [--rows=N]\n"
    "  The tensor's first N rows (default all) as little-endian float32.\n\n"
    "kvtier model export FILE --out=PATH [--arch=llama|gemma3] [--window=N] [--global_every=N]\n"
    "  The model as a float32 GGUF file (a llama2.c checkpoint becomes a llama GGUF;\n"
    "  --arch=gemma3 builds a gemma3-shaped test model with sliding windows from it).\n\n"
    "kvtier model bench FILE [--prefill=512] [--decode=64] [--threads=1]\n"
    "  Prefill and decode speed of kvtier's in-process forward pass (full fp32 cache,\n"
    "  logits of the last token of each step), tokens/s; the ISA it ran with.\n\n"
    "kvtier model logits FILE --tokens=PATH [--out=PATH|-] [--chunk=64] [--threads=1]\n"
    "  Teacher-forced logits of the ids in PATH (whitespace-separated), every position,\n"
    "  full fp32 cache: float32 [positions, vocabulary] to --out (default stdout).\n";

int Fail(const std::string& msg, int code = 1) {
  std::fprintf(stderr, "kvtier model: %s\n", msg.c_str());
  return code;
}

// --threads: the forward pass's threads, the caller's included (1 to 256).
int Threads(const Args& args) {
  return static_cast<int>(std::clamp<uint64_t>(args.GetU64("threads", 1), 1, 256));
}

int Info(const std::string& path) {
  auto m = model::Model::Load(path);
  if (!m.ok()) return Fail(std::string(m.status().message()));
  const model::ModelConfig& c = (*m)->config();
  std::printf("file          %s\n", path.c_str());
  std::printf("architecture  %s\n", model::ArchName(c.arch));
  std::printf("layers        %d (dim %d, FFN %d)\n", c.n_layers, c.dim, c.hidden_dim);
  std::printf("heads         %d query, %d key/value, head_dim %d\n", c.n_heads, c.n_kv_heads,
              c.head_dim());
  std::string types;
  for (int l = 0; l < c.n_layers; ++l) {
    absl::StrAppend(&types, l ? " " : "",
                    c.layer_window(l) > 0 ? absl::StrCat("S", c.layer_window(l)) : "G");
  }
  std::printf("layer types   %s (G global, Sn sliding over n tokens)\n", types.c_str());
  std::printf("rope base     %g global%s\n", c.rope_theta,
              c.sliding() ? absl::StrCat(", ", c.layer_rope(0), " sliding").c_str() : "");
  std::printf("context       %d tokens\n", c.seq_len);
  std::printf("vocabulary    %d%s\n", c.vocab_size,
              (*m)->tokenizer() ? "" : " (no tokenizer in the file)");
  std::printf("identity      %016llx\n", static_cast<unsigned long long>(c.digest));
  auto f = model::GgufFile::Open(path);
  if (f.ok()) {
    std::map<std::string, int> counts;
    for (const auto& t : (*f)->tensors())
      ++counts[model::GgmlTypeName(static_cast<uint32_t>(t.type))];
    std::string s;
    for (const auto& [name, n] : counts) absl::StrAppend(&s, s.empty() ? "" : ", ", n, " ", name);
    std::printf("tensors       %s\n", s.c_str());
  }
  return 0;
}

absl::StatusOr<std::string> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Each non-empty line of a file as a JSON value; INVALID_ARGUMENT naming the
// line when one does not parse.
absl::StatusOr<std::vector<google::protobuf::Value>> JsonLines(const std::string& path) {
  KVT_ASSIGN_OR_RETURN(std::string text, ReadAll(path));
  std::vector<google::protobuf::Value> out;
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++n;
    if (line.empty()) continue;
    google::protobuf::Value v;
    if (!google::protobuf::util::JsonStringToMessage(std::string(line), &v).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": not a JSON value"));
    }
    out.push_back(std::move(v));
  }
  return out;
}

std::string IdLine(const std::vector<int>& ids) {
  std::string line;
  for (int id : ids) absl::StrAppend(&line, line.empty() ? "" : " ", id);
  return line;
}

// The vocabulary of a GGUF file, without loading its weights.
absl::StatusOr<std::unique_ptr<model::Tokenizer>> LoadTokenizer(const std::string& path) {
  KVT_ASSIGN_OR_RETURN(std::unique_ptr<model::GgufFile> f, model::GgufFile::Open(path));
  return model::Tokenizer::FromGguf(*f);
}

int Tokenize(const std::string& path, const Args& args) {
  auto tok = LoadTokenizer(path);
  if (!tok.ok()) return Fail(std::string(tok.status().message()));
  const model::Tokenizer& t = **tok;
  if (args.Has("jsonl")) {
    auto lines = JsonLines(args.Get("jsonl"));
    if (!lines.ok()) return Fail(std::string(lines.status().message()), 2);
    for (const auto& v : *lines) {
      const auto& f = v.struct_value().fields();
      auto text = f.find("text");
      auto bos = f.find("bos");
      if (text == f.end()) return Fail("each line needs a \"text\"", 2);
      const std::vector<int> ids =
          t.Encode(text->second.string_value(), bos != f.end() && bos->second.bool_value(),
                   args.Has("special"));
      std::printf("%s\n", IdLine(ids).c_str());
    }
    return 0;
  }
  std::string text = args.Get("text");
  if (args.Has("file")) {
    auto t = ReadAll(args.Get("file"));
    if (!t.ok()) return Fail(std::string(t.status().message()));
    text = *t;
  } else if (!args.Has("text")) {
    return Fail("give --text=TEXT or --file=PATH", 2);
  }
  const std::vector<int> ids = t.Encode(text, !args.Has("no_bos"), args.Has("special"));
  std::printf("%s\n", IdLine(ids).c_str());
  return 0;
}

absl::StatusOr<std::vector<int>> ParseIds(const std::string& text) {
  std::vector<int> ids;
  for (absl::string_view w : absl::StrSplit(text, absl::ByAnyChar(" \t\r\n"), absl::SkipEmpty())) {
    int id;
    if (!absl::SimpleAtoi(w, &id)) {
      return absl::InvalidArgumentError(absl::StrCat("not a token id: ", std::string(w)));
    }
    ids.push_back(id);
  }
  return ids;
}

int Detokenize(const std::string& path, const std::vector<std::string>& words, const Args& args) {
  auto tok = LoadTokenizer(path);
  if (!tok.ok()) return Fail(std::string(tok.status().message()));
  const model::Tokenizer& t = **tok;
  if (args.Has("jsonl")) {
    auto lines = JsonLines(args.Get("jsonl"));
    if (!lines.ok()) return Fail(std::string(lines.status().message()), 2);
    for (const auto& v : *lines) {
      std::vector<int> ids;
      for (const auto& x : v.list_value().values()) {
        const double id = x.number_value();
        if (!(id >= 0 && id < t.size())) {
          return Fail(absl::StrCat("token id ", id, " is outside the vocabulary"), 2);
        }
        ids.push_back(static_cast<int>(id));
      }
      std::printf("%s\n", refengine::JsonQuote(t.Decode(ids)).c_str());
    }
    return 0;
  }
  std::string joined;
  for (const auto& w : words) absl::StrAppend(&joined, w, " ");
  auto ids = ParseIds(joined);
  if (!ids.ok()) return Fail(std::string(ids.status().message()), 2);
  for (int id : *ids) {
    if (id < 0 || id >= t.size()) {
      return Fail(absl::StrCat("token id ", id, " is outside the vocabulary"), 2);
    }
  }
  std::printf("%s\n", t.Decode(*ids).c_str());
  return 0;
}

int Dequant(const std::string& path, const std::string& name, const Args& args) {
  auto f = model::GgufFile::Open(path);
  if (!f.ok()) return Fail(std::string(f.status().message()));
  const model::GgufTensor* t = (*f)->tensor(name);
  if (t == nullptr) return Fail(absl::StrCat(path, " has no tensor ", name));
  if (!args.Has("out")) return Fail("give --out=PATH", 2);
  const int64_t rows = std::min<int64_t>(args.GetU64("rows", t->rows()), t->rows());
  std::ofstream out(args.Get("out"), std::ios::binary | std::ios::trunc);
  std::vector<float> row(t->row_length());
  for (int64_t r = 0; r < rows; ++r) {
    model::DequantizeRow(t->type, t->row(r), row.data(), t->row_length());
    out.write(reinterpret_cast<const char*>(row.data()),
              static_cast<std::streamsize>(row.size() * 4));
  }
  if (!out.flush()) return Fail("cannot write " + args.Get("out"));
  return 0;
}

int Logits(const std::string& path, const Args& args) {
  auto m = model::Model::Load(path);
  if (!m.ok()) return Fail(std::string(m.status().message()));
  if (!args.Has("tokens")) return Fail("give --tokens=PATH", 2);
  auto text = ReadAll(args.Get("tokens"));
  if (!text.ok()) return Fail(std::string(text.status().message()));
  auto ids = ParseIds(*text);
  if (!ids.ok()) return Fail(std::string(ids.status().message()), 2);
  const std::string out_path = args.Get("out", "-");
  FILE* out = out_path == "-" ? stdout : std::fopen(out_path.c_str(), "wb");
  if (out == nullptr) return Fail("cannot write " + out_path);
  const model::ModelConfig& c = (*m)->config();
  const int chunk = static_cast<int>(std::max<uint64_t>(1, args.GetU64("chunk", 64)));
  model::FullCacheAttention cache(c);
  model::PerTokenLayerAttention layered(c, &cache);
  model::ThreadPool pool(Threads(args));
  model::Forward fwd(**m, &pool);
  std::vector<float> logits;
  const int n = static_cast<int>(ids->size());
  for (int at = 0; at < n; at += chunk) {
    const int k = std::min(chunk, n - at);
    std::vector<int> part(ids->begin() + at, ids->begin() + at + k);
    logits.resize(static_cast<size_t>(k) * c.vocab_size);
    absl::Status s = fwd.RunAllLogits(part, at, &layered, logits.data());
    if (!s.ok()) return Fail(std::string(s.message()));
    if (std::fwrite(logits.data(), 4, logits.size(), out) != logits.size()) {
      return Fail("cannot write " + out_path);
    }
    std::fflush(out);
  }
  if (out != stdout) std::fclose(out);
  return 0;
}

int Export(const std::string& path, const Args& args) {
  if (!args.Has("out")) return Fail("give --out=PATH", 2);
  auto m = model::Model::Load(path);
  if (!m.ok()) return Fail(std::string(m.status().message()));
  model::ExportOptions o;
  o.arch = args.Get("arch", "llama");
  o.gemma3_window = static_cast<int>(args.GetU64("window", 0));
  o.gemma3_global_every = static_cast<int>(args.GetU64("global_every", 0));
  absl::Status s = model::ExportGguf(**m, o, args.Get("out"));
  if (!s.ok()) return Fail(std::string(s.message()));
  return 0;
}

int Bench(const std::string& path, const Args& args) {
  auto m = model::Model::Load(path);
  if (!m.ok()) return Fail(std::string(m.status().message()));
  const model::ModelConfig& c = (*m)->config();
  const int prefill = static_cast<int>(args.GetU64("prefill", 512));
  const int decode = static_cast<int>(args.GetU64("decode", 64));
  if (prefill < 1 || prefill + decode > c.seq_len) {
    return Fail(absl::StrCat("--prefill and --decode must fit the context of ", c.seq_len), 2);
  }
  // Deterministic ids spread over the vocabulary (the speed does not depend
  // on which tokens run).
  std::vector<int> ids(prefill);
  for (int i = 0; i < prefill; ++i) ids[i] = static_cast<int>((i * 7919L + 13) % c.vocab_size);
  model::FullCacheAttention cache(c);
  model::PerTokenLayerAttention layered(c, &cache);
  model::ThreadPool pool(Threads(args));
  model::Forward fwd(**m, &pool);
  std::vector<float> logits(c.vocab_size);
  auto t0 = std::chrono::steady_clock::now();
  absl::Status s = fwd.Run(ids, 0, &layered, logits.data());
  if (!s.ok()) return Fail(std::string(s.message()));
  auto t1 = std::chrono::steady_clock::now();
  int next = model::Argmax(logits.data(), c.vocab_size);
  for (int i = 0; i < decode; ++i) {
    s = fwd.Step(next, prefill + i, &cache, logits.data());
    if (!s.ok()) return Fail(std::string(s.message()));
    next = model::Argmax(logits.data(), c.vocab_size);
  }
  auto t2 = std::chrono::steady_clock::now();
  const double p_s = std::chrono::duration<double>(t1 - t0).count();
  const double d_s = std::chrono::duration<double>(t2 - t1).count();
  std::printf("isa %s, %d thread(s)\n", VectorIsaName(), pool.threads());
  std::printf("prefill %d tokens %.3f s %.1f tokens/s\n", prefill, p_s, prefill / p_s);
  std::printf("decode %d tokens %.3f s %.1f tokens/s %.2f ms/token\n", decode, d_s, decode / d_s,
              1000 * d_s / std::max(decode, 1));
  return 0;
}

}  // namespace

int ModelCommand(const Args& args) {
  const std::vector<std::string>& p = args.positional();
  if (p.empty() || p[0] == "help" || args.Has("help")) {
    std::printf("%s", kHelp);
    return p.empty() && !args.Has("help") ? 2 : 0;
  }
  if (p.size() < 2) return Fail(absl::StrCat("kvtier model ", p[0], " needs a model FILE"), 2);
  const std::string& sub = p[0];
  if (sub == "info") return Info(p[1]);
  if (sub == "tokenize") return Tokenize(p[1], args);
  if (sub == "detokenize") return Detokenize(p[1], {p.begin() + 2, p.end()}, args);
  if (sub == "dequant") {
    if (p.size() < 3) return Fail("kvtier model dequant FILE TENSOR --out=PATH", 2);
    return Dequant(p[1], p[2], args);
  }
  if (sub == "logits") return Logits(p[1], args);
  if (sub == "export") return Export(p[1], args);
  if (sub == "bench") return Bench(p[1], args);
  return Fail(absl::StrCat("unknown subcommand ", sub, "\n", kHelp), 2);
}

}  // namespace kvtier::cli
