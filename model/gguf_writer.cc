#include "model/gguf_writer.h"

#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace kvtier::model {
namespace {

constexpr uint64_t kAlignment = 32;

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

void PutString(std::string* out, const std::string& s) {
  Put<uint64_t>(out, s.size());
  out->append(s);
}

}  // namespace

void GgufWriter::AddU32(const std::string& key, uint32_t v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, 4);
  Put(&kv_, v);
  ++n_kv_;
}

void GgufWriter::AddI32(const std::string& key, int32_t v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, 5);
  Put(&kv_, v);
  ++n_kv_;
}

void GgufWriter::AddF32(const std::string& key, float v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, 6);
  Put(&kv_, v);
  ++n_kv_;
}

void GgufWriter::AddBool(const std::string& key, bool v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, 7);
  Put<uint8_t>(&kv_, v ? 1 : 0);
  ++n_kv_;
}

void GgufWriter::AddString(const std::string& key, const std::string& v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, 8);
  PutString(&kv_, v);
  ++n_kv_;
}

void GgufWriter::AddStrings(const std::string& key, const std::vector<std::string>& v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, 9);
  Put<uint32_t>(&kv_, 8);
  Put<uint64_t>(&kv_, v.size());
  for (const std::string& s : v) PutString(&kv_, s);
  ++n_kv_;
}

void GgufWriter::AddF32s(const std::string& key, const std::vector<float>& v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, 9);
  Put<uint32_t>(&kv_, 6);
  Put<uint64_t>(&kv_, v.size());
  for (float f : v) Put(&kv_, f);
  ++n_kv_;
}

void GgufWriter::AddI32s(const std::string& key, const std::vector<int32_t>& v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, 9);
  Put<uint32_t>(&kv_, 5);
  Put<uint64_t>(&kv_, v.size());
  for (int32_t i : v) Put(&kv_, i);
  ++n_kv_;
}

void GgufWriter::AddTensor(const std::string& name, GgmlType type, const std::vector<int64_t>& dims,
                           std::string data) {
  tensors_.push_back({name, type, dims, std::move(data)});
}

std::string GgufWriter::Serialize() const {
  std::string out;
  Put<uint32_t>(&out, 0x46554747);
  Put<uint32_t>(&out, 3);
  Put<uint64_t>(&out, tensors_.size());
  Put<uint64_t>(&out, n_kv_);
  out += kv_;
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    PutString(&out, t.name);
    Put<uint32_t>(&out, static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) Put<uint64_t>(&out, static_cast<uint64_t>(d));
    Put<uint32_t>(&out, static_cast<uint32_t>(t.type));
    Put<uint64_t>(&out, offset);
    offset += (t.data.size() + kAlignment - 1) / kAlignment * kAlignment;
  }
  out.resize((out.size() + kAlignment - 1) / kAlignment * kAlignment, '\0');
  for (const Tensor& t : tensors_) {
    out += t.data;
    out.resize((out.size() + kAlignment - 1) / kAlignment * kAlignment, '\0');
  }
  return out;
}

absl::Status GgufWriter::Write(const std::string& path) const {
  const std::string tmp = path + ".partial";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    const std::string bytes = Serialize();
    if (!f || !f.write(bytes.data(), static_cast<std::streamsize>(bytes.size())) || !f.flush()) {
      std::remove(tmp.c_str());
      return absl::InternalError(absl::StrCat("cannot write ", tmp));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace kvtier::model
