// Codec settings: the "kivi4", "gear2:rank=4" texts users write, their
// names, and the checks every configuration passes before it encodes.
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "kernels/codec.h"
#include "kernels/codec_internal.h"

namespace kvtier {

using internal::IsGear;

absl::StatusOr<CodecConfig> ParseCodecSetting(const std::string& setting) {
  std::vector<std::string> parts = absl::StrSplit(setting, ':');
  CodecConfig c;
  const std::string& name = parts[0];
  auto bits_of = [&](size_t prefix) -> absl::StatusOr<int> {
    int b = 0;
    if (!absl::SimpleAtoi(name.substr(prefix), &b)) {
      return absl::InvalidArgumentError(absl::StrCat("codec '", name, "' needs bits, e.g. kivi4"));
    }
    return b;
  };
  if (name == "raw" || name == "fp16" || name == "bf16" || name == "fp32") {
    c.codec = Codec::kRaw;
    c.dtype = name == "fp32" ? DType::kFp32 : name == "bf16" ? DType::kBf16 : DType::kFp16;
  } else if (name.rfind("kivi", 0) == 0) {
    c.codec = Codec::kKivi;
    KVT_ASSIGN_OR_RETURN(c.bits, bits_of(4));
  } else if (name.rfind("kcvt", 0) == 0) {
    c.codec = Codec::kKcvt;
    KVT_ASSIGN_OR_RETURN(c.bits, bits_of(4));
  } else if (name.rfind("gearl", 0) == 0) {
    c.codec = Codec::kGearL;
    c.outlier_fraction = 0.0f;
    KVT_ASSIGN_OR_RETURN(c.bits, bits_of(5));
  } else if (name.rfind("gear", 0) == 0) {
    c.codec = Codec::kGear;
    KVT_ASSIGN_OR_RETURN(c.bits, bits_of(4));
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown codec '", name, "' (raw, fp16, bf16, fp32, kiviB, kcvtB, gearB, gearlB)"));
  }
  for (size_t i = 1; i < parts.size(); ++i) {
    std::pair<std::string, std::string> kv = absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    const std::string& k = kv.first;
    const std::string& v = kv.second;
    int iv = 0;
    float fv = 0;
    const bool is_int = absl::SimpleAtoi(v, &iv);
    if (k == "g" && is_int) {
      c.group_size = iv;
    } else if (k == "R" && is_int) {
      c.residual_tokens = iv;
    } else if (k == "r" && is_int) {
      c.rank = iv;
    } else if (k == "nb" && is_int) {
      c.block_tokens = iv;
    } else if (k == "s" && absl::SimpleAtof(v, &fv)) {
      c.outlier_fraction = fv;
    } else if (k == "bb" && (v == "kivi" || v == "kcvt")) {
      c.backbone = v == "kivi" ? Codec::kKivi : Codec::kKcvt;
    } else if (k == "dt" && (v == "fp16" || v == "bf16" || v == "fp32")) {
      c.dtype = v == "fp32" ? DType::kFp32 : v == "bf16" ? DType::kBf16 : DType::kFp16;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad codec option '", parts[i], "' in '", setting,
          "' (g=INT, R=INT, r=INT, s=FLOAT, nb=INT, bb=kivi|kcvt, dt=fp16|bf16|fp32)"));
    }
  }
  KVT_RETURN_IF_ERROR(ValidateCodecConfig(c));
  return c;
}

std::string CodecSettingName(const CodecConfig& c) {
  switch (c.codec) {
    case Codec::kRaw:
      return DTypeName(c.dtype);
    case Codec::kKivi:
      return absl::StrCat("kivi", c.bits, ":g=", c.group_size);
    case Codec::kKcvt:
      return absl::StrCat("kcvt", c.bits);
    default: {
      std::string s = absl::StrCat(c.codec == Codec::kGear ? "gear" : "gearl", c.bits);
      if (c.backbone == Codec::kKcvt) {
        absl::StrAppend(&s, ":bb=kcvt");
      } else {
        absl::StrAppend(&s, ":g=", c.group_size);
      }
      absl::StrAppend(&s, ":r=", c.rank);
      if (c.codec == Codec::kGear) absl::StrAppend(&s, ":s=", c.outlier_fraction);
      return s;
    }
  }
}

absl::Status ValidateCodecConfig(const CodecConfig& c) {
  if (DTypeSize(c.dtype) == 0) return absl::InvalidArgumentError("codec dtype must be set");
  if (c.residual_tokens < 0) return absl::InvalidArgumentError("residual_tokens must be >= 0");
  if (c.block_tokens < 0) return absl::InvalidArgumentError("block_tokens must be >= 0");
  switch (c.codec) {
    case Codec::kRaw:
      return absl::OkStatus();
    case Codec::kKivi:
    case Codec::kKcvt:
      if (c.bits != 2 && c.bits != 4 && c.bits != 8) {
        return absl::InvalidArgumentError(absl::StrCat("bits must be 2, 4 or 8, got ", c.bits));
      }
      break;
    case Codec::kGear:
    case Codec::kGearL:
      if (c.bits != 2 && c.bits != 4) {
        return absl::InvalidArgumentError(absl::StrCat("GEAR bits must be 2 or 4, got ", c.bits));
      }
      if (c.backbone != Codec::kKivi && c.backbone != Codec::kKcvt) {
        return absl::InvalidArgumentError("GEAR backbone must be KIVI or KCVT");
      }
      if (c.rank < 0) return absl::InvalidArgumentError("rank must be >= 0");
      if (!(c.outlier_fraction >= 0.0f && c.outlier_fraction <= 0.5f)) {
        return absl::InvalidArgumentError("outlier fraction s must be in [0, 0.5]");
      }
      if (c.codec == Codec::kGearL && c.outlier_fraction != 0.0f) {
        return absl::InvalidArgumentError("GEAR-L has no outliers: s must be 0");
      }
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown codec ", static_cast<int>(c.codec)));
  }
  const bool grouped = c.codec == Codec::kKivi || (IsGear(c.codec) && c.backbone == Codec::kKivi);
  if (grouped && c.group_size < 1) return absl::InvalidArgumentError("group_size must be >= 1");
  return absl::OkStatus();
}

}  // namespace kvtier
