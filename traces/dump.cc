// .npy and .safetensors import of K/V dumps, and a .safetensors writer.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/half.h"
#include "traces/trace.h"

namespace kvtier::traces {
namespace {

struct Array {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Converts `count` little-endian elements of `dtype` ("f4", "f2", "bf16", "f8").
absl::Status Convert(const std::string& dtype, const char* src, int64_t count,
                     std::vector<float>* out) {
  out->resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    if (dtype == "f4") {
      std::memcpy(&(*out)[i], src + i * 4, 4);
    } else if (dtype == "f8") {
      double x;
      std::memcpy(&x, src + i * 8, 8);
      (*out)[i] = static_cast<float>(x);
    } else if (dtype == "f2" || dtype == "bf16") {
      uint16_t h;
      std::memcpy(&h, src + i * 2, 2);
      (*out)[i] = dtype == "f2" ? HalfToFloat(h) : Bf16ToFloat(h);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unsupported element type ", dtype));
    }
  }
  return absl::OkStatus();
}

int ElementSize(const std::string& dtype) {
  return dtype == "f8" ? 8 : dtype == "f4" ? 4 : (dtype == "f2" || dtype == "bf16") ? 2 : 0;
}

absl::StatusOr<int64_t> Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 1 || d > (int64_t{1} << 31))
      return absl::InvalidArgumentError("dimension out of range");
    n *= d;
    if (n > (int64_t{1} << 34)) return absl::InvalidArgumentError("array too large");
  }
  return n;
}

absl::StatusOr<Array> ReadNpy(const std::string& path) {
  KVT_ASSIGN_OR_RETURN(std::string b, ReadFile(path));
  if (b.size() < 10 || b.compare(0, 6, "\x93NUMPY") != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not an .npy file"));
  }
  const int major = static_cast<unsigned char>(b[6]);
  size_t hlen, hstart;
  if (major == 1) {
    hlen = static_cast<unsigned char>(b[8]) | (static_cast<unsigned char>(b[9]) << 8);
    hstart = 10;
  } else {
    if (b.size() < 12) return absl::InvalidArgumentError(absl::StrCat(path, ": truncated header"));
    uint32_t l;
    std::memcpy(&l, b.data() + 8, 4);
    hlen = l;
    hstart = 12;
  }
  if (hstart + hlen > b.size())
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated header"));
  const std::string header = b.substr(hstart, hlen);
  auto field = [&](const std::string& key) -> std::string {
    const size_t k = header.find("'" + key + "'");
    if (k == std::string::npos) return "";
    size_t s = header.find(':', k);
    if (s == std::string::npos) return "";
    ++s;
    while (s < header.size() && header[s] == ' ') ++s;
    if (s < header.size() && header[s] == '(')
      return header.substr(s + 1, header.find(')', s) - s - 1);
    if (s < header.size() && header[s] == '\'')
      return header.substr(s + 1, header.find('\'', s + 1) - s - 1);
    return header.substr(s, header.find_first_of(",}", s) - s);
  };
  const std::string descr = field("descr");
  if (field("fortran_order") != "False") {
    return absl::InvalidArgumentError(absl::StrCat(path, ": only C-order arrays are supported"));
  }
  std::string dtype;
  if (descr == "<f4" || descr == "<f2" || descr == "<f8") dtype = descr.substr(1);
  if (dtype.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": element type '", descr, "' (want little-endian float16/32/64)"));
  }
  Array a;
  for (absl::string_view part : absl::StrSplit(field("shape"), ',', absl::SkipWhitespace())) {
    int64_t d;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &d)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad shape"));
    }
    a.shape.push_back(d);
  }
  KVT_ASSIGN_OR_RETURN(int64_t n, Elements(a.shape));
  const size_t data_at = hstart + hlen;
  if (b.size() - data_at != static_cast<size_t>(n * ElementSize(dtype))) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": data size does not match its shape"));
  }
  KVT_RETURN_IF_ERROR(Convert(dtype, b.data() + data_at, n, &a.data));
  return a;
}

absl::StatusOr<std::map<std::string, Array>> ReadSafetensors(const std::string& path) {
  KVT_ASSIGN_OR_RETURN(std::string b, ReadFile(path));
  if (b.size() < 8)
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a .safetensors file"));
  uint64_t n;
  std::memcpy(&n, b.data(), 8);
  if (n > b.size() - 8 || n > (uint64_t{100} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header size out of range"));
  }
  google::protobuf::Struct header;
  if (!google::protobuf::util::JsonStringToMessage(b.substr(8, n), &header).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header is not JSON"));
  }
  const size_t base = 8 + n;
  std::map<std::string, Array> out;
  for (const auto& [name, value] : header.fields()) {
    if (name == "__metadata__") continue;
    if (value.kind_case() != google::protobuf::Value::kStructValue) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": entry ", name, " is not an object"));
    }
    const auto& f = value.struct_value().fields();
    if (!f.contains("dtype") || !f.contains("shape") || !f.contains("data_offsets")) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": entry ", name, " lacks dtype/shape/data_offsets"));
    }
    const std::string st = f.at("dtype").string_value();
    const std::string dtype = st == "F32"    ? "f4"
                              : st == "F16"  ? "f2"
                              : st == "BF16" ? "bf16"
                              : st == "F64"  ? "f8"
                                             : "";
    if (dtype.empty())
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", name, " has dtype ", st));
    Array a;
    for (const auto& d : f.at("shape").list_value().values())
      a.shape.push_back(static_cast<int64_t>(d.number_value()));
    const auto& off = f.at("data_offsets").list_value().values();
    if (off.size() != 2)
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad data_offsets"));
    const double begin = off[0].number_value(), end = off[1].number_value();
    KVT_ASSIGN_OR_RETURN(int64_t count, Elements(a.shape));
    if (begin < 0 || end < begin || base + end > b.size() ||
        static_cast<int64_t>(end - begin) != count * ElementSize(dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": ", name, " has offsets outside the file or not matching its shape"));
    }
    KVT_RETURN_IF_ERROR(
        Convert(dtype, b.data() + base + static_cast<size_t>(begin), count, &a.data));
    out[name] = std::move(a);
  }
  return out;
}

absl::StatusOr<KvTrace> Assemble(const std::string& name, Array k, Array v, Array* q) {
  auto norm4 = [](Array* a) {
    if (a->shape.size() == 3) a->shape.insert(a->shape.begin(), 1);
  };
  norm4(&k);
  norm4(&v);
  if (k.shape.size() != 4 || k.shape != v.shape) {
    return absl::InvalidArgumentError(
        "k and v must have the same shape [layers, kv_heads, tokens, head_dim] (or without "
        "layers)");
  }
  KvTrace t;
  t.name = name;
  t.layers = static_cast<int>(k.shape[0]);
  t.kv_heads = static_cast<int>(k.shape[1]);
  t.tokens = k.shape[2];
  t.head_dim = static_cast<int>(k.shape[3]);
  t.q_heads = t.kv_heads;
  t.k = std::move(k.data);
  t.v = std::move(v.data);
  if (q != nullptr) {
    norm4(q);
    if (q->shape.size() != 4 || q->shape[0] != t.layers || q->shape[3] != t.head_dim ||
        q->shape[1] % t.kv_heads != 0) {
      return absl::InvalidArgumentError(
          "q must be [layers, q_heads, queries, head_dim] with q_heads a multiple of kv_heads");
    }
    t.q_heads = static_cast<int>(q->shape[1]);
    t.queries = q->shape[2];
    t.q = std::move(q->data);
  }
  return t;
}

}  // namespace

absl::StatusOr<KvTrace> LoadTraceDump(const std::string& path) {
  const std::filesystem::path p(path);
  const std::string name =
      absl::StrCat("import-", p.filename().string().empty() ? p.parent_path().filename().string()
                                                            : p.filename().string());
  if (std::filesystem::is_directory(p)) {
    KVT_ASSIGN_OR_RETURN(Array k, ReadNpy((p / "k.npy").string()));
    KVT_ASSIGN_OR_RETURN(Array v, ReadNpy((p / "v.npy").string()));
    if (std::filesystem::exists(p / "q.npy")) {
      KVT_ASSIGN_OR_RETURN(Array q, ReadNpy((p / "q.npy").string()));
      return Assemble(name, std::move(k), std::move(v), &q);
    }
    return Assemble(name, std::move(k), std::move(v), nullptr);
  }
  if (p.extension() == ".safetensors") {
    KVT_ASSIGN_OR_RETURN(auto m, ReadSafetensors(path));
    if (!m.contains("k") || !m.contains("v")) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": needs tensors named k and v"));
    }
    Array* q = m.contains("q") ? &m["q"] : nullptr;
    return Assemble(name, std::move(m["k"]), std::move(m["v"]), q);
  }
  if (!std::filesystem::exists(p)) return absl::NotFoundError(absl::StrCat("no such dump: ", path));
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": want a directory of k.npy/v.npy[/q.npy] or a .safetensors file"));
}

absl::Status SaveSafetensors(const KvTrace& t, const std::string& path) {
  struct Entry {
    const char* name;
    const std::vector<float>* data;
    std::vector<int64_t> shape;
  };
  std::vector<Entry> entries = {{"k", &t.k, {t.layers, t.kv_heads, t.tokens, t.head_dim}},
                                {"v", &t.v, {t.layers, t.kv_heads, t.tokens, t.head_dim}}};
  if (!t.q.empty()) entries.push_back({"q", &t.q, {t.layers, t.q_heads, t.queries, t.head_dim}});
  std::string header = "{";
  int64_t off = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const int64_t bytes = static_cast<int64_t>(entries[i].data->size()) * 4;
    absl::StrAppend(&header, i ? "," : "", "\"", entries[i].name,
                    "\":{\"dtype\":\"F32\",\"shape\":[", absl::StrJoin(entries[i].shape, ","),
                    "],\"data_offsets\":[", off, ",", off + bytes, "]}");
    off += bytes;
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header;
  for (const Entry& e : entries) {
    out.write(reinterpret_cast<const char*>(e.data->data()),
              static_cast<std::streamsize>(e.data->size() * 4));
  }
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace kvtier::traces
