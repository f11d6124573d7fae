// Google Benchmark: KV codec kernels and decode attention, single core, each
// shown against memcpy bandwidth measured in the same run (counter
// x_memcpy = this benchmark's bytes/s over memcpy's), and a closing table of
// fused attention over encoded K/V against attention over fp16 K/V.
//
// Bytes counted: encode = fp32 input read; decode = fp32 output written;
// attention = bytes of K and V as stored (codes + metadata, or fp16).
#include <time.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "encoded/encode.h"
#include "kernels/attention.h"
#include "kernels/codec.h"
#include "kernels/codec_internal.h"
#include "kernels/flat_cache.h"
#include "kernels/half.h"

namespace {

using kvtier::KernelLevel;
namespace v1 = kvtier::v1;

constexpr int kHeads = 8, kQHeads = 32, kDim = 128;
constexpr int64_t kCodecTokens = 4096;  // 8 x 4096 x 128 fp32 = 16 MiB per tensor.

double g_memcpy_bps = 0;

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = nd(rng);
  return x;
}

// This thread's CPU time in seconds.
double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Best-of-5 single-core memcpy of `bytes`, the baseline of every ratio. In
// CPU time, as Google Benchmark times the rows (rate counters divide by CPU
// time): a wall-clock baseline would let a loaded machine inflate every ratio.
double MeasureMemcpy(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = ThreadCpuSeconds();
    for (int i = 0; i < 8; ++i) {
      std::memcpy(b.data(), a.data(), bytes);
      benchmark::DoNotOptimize(b.data());
    }
    const double s = ThreadCpuSeconds() - t0;
    if (s > 0) best = std::max(best, 8.0 * bytes / s);
  }
  return best;
}

void SetRatio(benchmark::State& state, double bytes_per_iter) {
  state.SetBytesProcessed(static_cast<int64_t>(bytes_per_iter * state.iterations()));
  state.counters["x_memcpy"] = benchmark::Counter(bytes_per_iter / g_memcpy_bps,
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Memcpy(benchmark::State& state) {
  const size_t n = kHeads * kCodecTokens * kDim * 4;
  std::vector<char> a(n, 1), b(n, 0);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), n);
    benchmark::DoNotOptimize(b.data());
  }
  SetRatio(state, static_cast<double>(n));
}

kvtier::internal::QuantShape Shape(int bits, bool key) {
  kvtier::internal::QuantShape q;
  q.key = key;
  q.bits = bits;
  q.group = 32;
  q.tq = kCodecTokens;
  q.d = kDim;
  return q;
}

// The quantization kernel alone (what the worker runs per block).
void BM_QuantizeKernel(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const bool key = state.range(1) == 0;
  const bool vec = state.range(2) == 1;
  const auto q = Shape(bits, key);
  const std::vector<float> x = Random(kHeads * kCodecTokens * kDim, 1);
  std::vector<uint8_t> codes(kvtier::internal::CodeWords(q) * 4 * kHeads);
  std::vector<uint16_t> scales(kvtier::internal::ScaleCount(q) * kHeads), zeros(scales.size());
  for (auto _ : state) {
    for (int h = 0; h < kHeads; ++h) {
      const float* src = x.data() + h * kCodecTokens * kDim;
      uint8_t* c = codes.data() + h * kvtier::internal::CodeWords(q) * 4;
      uint16_t* s = scales.data() + h * kvtier::internal::ScaleCount(q);
      uint16_t* z = zeros.data() + h * kvtier::internal::ScaleCount(q);
      if (!vec || !kvtier::internal::QuantizeSlabSimd(q, src, c, s, z)) {
        std::memset(c, 0, kvtier::internal::CodeWords(q) * 4);
        kvtier::internal::QuantizeSlabRef(q, src, c, s, z);
      }
    }
    benchmark::DoNotOptimize(codes.data());
  }
  SetRatio(state, static_cast<double>(x.size()) * 4);
  state.SetLabel(std::string(key ? "K" : "V") + (vec ? " vectorized" : " reference"));
}

void BM_DequantizeKernel(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const bool key = state.range(1) == 0;
  const bool vec = state.range(2) == 1;
  const auto q = Shape(bits, key);
  const std::vector<float> x = Random(kHeads * kCodecTokens * kDim, 2);
  std::vector<uint8_t> codes(kvtier::internal::CodeWords(q) * 4 * kHeads);
  std::vector<uint16_t> scales(kvtier::internal::ScaleCount(q) * kHeads), zeros(scales.size());
  for (int h = 0; h < kHeads; ++h) {
    kvtier::internal::QuantizeSlabRef(q, x.data() + h * kCodecTokens * kDim,
                                      codes.data() + h * kvtier::internal::CodeWords(q) * 4,
                                      scales.data() + h * kvtier::internal::ScaleCount(q),
                                      zeros.data() + h * kvtier::internal::ScaleCount(q));
  }
  std::vector<float> out(x.size());
  for (auto _ : state) {
    for (int h = 0; h < kHeads; ++h) {
      const uint8_t* c = codes.data() + h * kvtier::internal::CodeWords(q) * 4;
      const uint16_t* s = scales.data() + h * kvtier::internal::ScaleCount(q);
      const uint16_t* z = zeros.data() + h * kvtier::internal::ScaleCount(q);
      float* o = out.data() + h * kCodecTokens * kDim;
      if (!vec || !kvtier::internal::DequantRowsSimd(q, c, s, z, 0, kCodecTokens, o)) {
        kvtier::internal::DequantRowsRef(q, c, s, z, 0, kCodecTokens, o);
      }
    }
    benchmark::DoNotOptimize(out.data());
  }
  SetRatio(state, static_cast<double>(out.size()) * 4);
  state.SetLabel(std::string(key ? "K" : "V") + (vec ? " vectorized" : " reference"));
}

// The public Encode(): kernel plus input checks, protobuf buffers and CRC.
void BM_EncodeApi(benchmark::State& state) {
  auto c = kvtier::ParseCodecSetting(state.range(0) == 4 ? "kivi4" : "gear2:r=2");
  const std::vector<float> x = Random(kHeads * kCodecTokens * kDim, 3);
  const int64_t shape[] = {kHeads, kCodecTokens, kDim};
  for (auto _ : state) {
    auto t = kvtier::Encode(*c, kvtier::TensorRole::kKey, shape, x.data());
    benchmark::DoNotOptimize(t);
  }
  SetRatio(state, static_cast<double>(x.size()) * 4);
  state.SetLabel(kvtier::CodecSettingName(*c));
}

// TensorEncoder::EncodeTo from fp16 input, as kvtier-worker's EndRound
// encodes a 16-bit open round: arg 0 widens it into an fp32 scratch first
// and encodes that (the path before fp16 was read directly, the same-run
// baseline); arg 1 hands the fp16 input to EncodeTo. Bytes counted: the
// fp16 input, so the memcpy ratio compares with copying that input.
void BM_EncodeTo16(benchmark::State& state) {
  auto c = kvtier::ParseCodecSetting("kivi4");
  const std::vector<float> x = Random(kHeads * kCodecTokens * kDim, 5);
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = kvtier::FloatToHalf(x[i]);
  const int64_t shape[] = {kHeads, kCodecTokens, kDim};
  auto enc = kvtier::TensorEncoder::Make(*c, kvtier::TensorRole::kKey, shape);
  std::string out(enc->SerializedSize(), '\0');
  std::vector<float> scratch(x.size());
  auto* o = reinterpret_cast<uint8_t*>(out.data());
  for (auto _ : state) {
    if (state.range(0) == 0) {
      // As EncodeTo widened before: F16C when the CPU has it.
      if (!kvtier::internal::WidenSimd(h.data(), false, static_cast<int64_t>(h.size()),
                                       scratch.data())) {
        for (size_t i = 0; i < h.size(); ++i) scratch[i] = kvtier::HalfToFloat(h[i]);
      }
      benchmark::DoNotOptimize(enc->EncodeTo(scratch.data(), o));
    } else {
      benchmark::DoNotOptimize(enc->EncodeTo(h.data(), kvtier::DType::kFp16, o, &scratch));
    }
    benchmark::ClobberMemory();
  }
  SetRatio(state, static_cast<double>(h.size()) * 2);
  state.SetLabel(state.range(0) == 0 ? "kivi4 from fp16, widened first" : "kivi4 from fp16");
}

// Decode attention, 32 query heads over 8 KV heads of dim 128, T tokens.
struct AttnData {
  std::vector<v1::EncodedTensor> tensors;
  std::vector<kvtier::KvBlock> blocks;
  double bytes = 0;
};

AttnData* GetAttnData(const std::string& setting, int64_t tokens) {
  static std::map<std::pair<std::string, int64_t>, AttnData> cache;
  auto key = std::make_pair(setting, tokens);
  auto it = cache.find(key);
  if (it != cache.end()) return &it->second;
  AttnData& d = cache[key];
  auto c = kvtier::ParseCodecSetting(setting);
  const int64_t chunk = 4096;  // Encoded in 4096-token blocks, as a stream would hold them.
  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const std::vector<float> k = Random(kHeads * chunk * kDim, static_cast<uint32_t>(t0 + 1));
    const std::vector<float> v = Random(kHeads * chunk * kDim, static_cast<uint32_t>(t0 + 2));
    const int64_t shape[] = {kHeads, chunk, kDim};
    d.tensors.push_back(*kvtier::Encode(*c, kvtier::TensorRole::kKey, shape, k.data()));
    d.tensors.push_back(*kvtier::Encode(*c, kvtier::TensorRole::kValue, shape, v.data()));
  }
  for (size_t i = 0; i < d.tensors.size(); i += 2) {
    d.blocks.push_back(
        {*kvtier::ParseEncoded(d.tensors[i]), *kvtier::ParseEncoded(d.tensors[i + 1])});
    for (int j = 0; j < 2; ++j) {
      for (const auto& b : d.tensors[i + j].buffers())
        d.bytes += static_cast<double>(b.data().size());
    }
  }
  return &d;
}

// GEAR at its defaults (rank 4, 2% outliers): the backbone's fused kernel
// plus the low-rank and outlier corrections.
const char* kAttnSettings[] = {"fp16", "kivi4", "kivi2", "kivi8", "gear4", "gear2"};

void BM_DecodeAttention(benchmark::State& state) {
  const std::string setting = kAttnSettings[state.range(0)];
  const int64_t tokens = state.range(1);
  AttnData* d = GetAttnData(setting, tokens);
  const std::vector<float> q = Random(kQHeads * kDim, 9);
  std::vector<float> out(q.size());
  // Arg 2: 1 runs the fp32-product kernels (kVectorized) instead of kBest's
  // integer dot products, 2 kBest's AVX2 integer kernels where the CPU has
  // AVX-512 VNNI (kBest's own choice there), for the same-run comparisons.
  const bool fp32 = state.range(2) == 1, avx2 = state.range(2) == 2;
  const auto level = fp32 ? kvtier::KernelLevel::kVectorized : kvtier::KernelLevel::kBest;
  const bool vnni_was = kvtier::internal::SetVnni(!avx2);
  for (auto _ : state) {
    if (!kvtier::DecodeAttention({kQHeads, kHeads, kDim}, q.data(), d->blocks, out.data(), level)
             .ok()) {
      state.SkipWithError("attention failed");
      break;
    }
    benchmark::DoNotOptimize(out.data());
  }
  kvtier::internal::SetVnni(vnni_was);
  SetRatio(state, d->bytes);
  state.SetLabel(setting + " T=" + std::to_string(tokens) + (fp32 ? " fp32" : "") +
                 (avx2 ? " avx2" : ""));
}

void AttnArgs(benchmark::internal::Benchmark* b) {
  for (int64_t t : {4096, 32768, 131072}) {
    for (int s = 0; s < 6; ++s) b->Args({s, t, 0});
    b->Args({1, t, 1});
    b->Args({2, t, 1});
    b->Args({3, t, 1});
    if (kvtier::internal::VnniCpu()) {
      b->Args({1, t, 2});
      b->Args({2, t, 2});
    }
  }
}

// Ada-KV flattened cache: one decode step = append to every head + attention,
// against attention over a dense fp32 cache of the same total length.
constexpr int64_t kFlatTokens = 4096;  // Mean per KV head.

void BM_DenseFp32Attention(benchmark::State& state) {
  const std::vector<float> k = Random(kHeads * kFlatTokens * kDim, 11), v = Random(k.size(), 12);
  const std::vector<float> q = Random(kQHeads * kDim, 13);
  std::vector<float> out(q.size());
  const kvtier::KvBlock b{kvtier::EncodedView::Raw(kvtier::DType::kFp32, k.data(), kHeads,
                                                   kFlatTokens, kDim, kFlatTokens * kDim, kDim),
                          kvtier::EncodedView::Raw(kvtier::DType::kFp32, v.data(), kHeads,
                                                   kFlatTokens, kDim, kFlatTokens * kDim, kDim)};
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        kvtier::DecodeAttention({kQHeads, kHeads, kDim}, q.data(), {&b, 1}, out.data()));
  }
  SetRatio(state, 2.0 * k.size() * 4);
}

void BM_FlatAppendAndAttention(benchmark::State& state) {
  const std::vector<float> k = Random(kHeads * 2 * kFlatTokens * kDim, 11),
                           v = Random(k.size(), 12);
  // Heads keep between 1/4 and 7/4 of the mean, same total as the dense case.
  std::vector<std::vector<int64_t>> keep(kHeads);
  for (int h = 0; h < kHeads; ++h) {
    const int64_t n = kFlatTokens / 4 + (kFlatTokens * 3 / 2) * h / (kHeads - 1);
    for (int64_t t = 0; t < n; ++t) keep[h].push_back(t);
  }
  // Arg 2: no slack, so every append re-packs the layer (Ada-KV's own way).
  kvtier::FlatCacheOptions opt;
  if (state.range(0) == 2) opt.slack_tokens = 0;
  auto cache =
      kvtier::FlatKvCache::Gather(kHeads, kDim, 2 * kFlatTokens, k.data(), v.data(), keep, opt);
  const std::vector<float> q = Random(kQHeads * kDim, 13), nk = Random(kHeads * kDim, 14);
  std::vector<float> out(q.size());
  const bool append = state.range(0) >= 1;
  for (auto _ : state) {
    if (append) benchmark::DoNotOptimize(cache->Append(nk.data(), nk.data()));
    benchmark::DoNotOptimize(cache->Attend(kQHeads, q.data(), out.data()));
  }
  SetRatio(state, 2.0 * cache->total_tokens() * kDim * 4);
  state.SetLabel(std::string(state.range(0) == 2   ? "append (re-pack)+attend, "
                             : state.range(0) == 1 ? "append+attend, "
                                                   : "attend only, ") +
                 std::to_string(cache->total_tokens()) + " tokens at the end");
}

BENCHMARK(BM_Memcpy);
BENCHMARK(BM_DenseFp32Attention)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlatAppendAndAttention)->Arg(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlatAppendAndAttention)->Arg(0)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlatAppendAndAttention)->Arg(2)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_QuantizeKernel)
    ->ArgsProduct({{2, 4, 8}, {0, 1}, {1}})
    ->Args({4, 0, 0})
    ->Args({4, 1, 0});
BENCHMARK(BM_DequantizeKernel)
    ->ArgsProduct({{2, 4, 8}, {0, 1}, {1}})
    ->Args({4, 0, 0})
    ->Args({4, 1, 0});
BENCHMARK(BM_EncodeApi)->Arg(4)->Arg(2);
BENCHMARK(BM_EncodeTo16)->Arg(0)->Arg(1);
BENCHMARK(BM_DecodeAttention)->Apply(AttnArgs)->Unit(benchmark::kMillisecond);

// Keeps each attention run's time so the closing table can compare them.
// With --benchmark_repetitions the median of the repetitions stands for a
// benchmark (it comes after them and replaces them); the other aggregates
// (mean, stddev, cv) are not times and are skipped.
class Recorder : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.error_occurred) continue;
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name != "median") continue;
      if (r.benchmark_name().rfind("BM_DecodeAttention", 0) == 0) {
        times[r.report_label] = r.GetAdjustedRealTime();
      }
      auto it = r.counters.find("x_memcpy");
      if (it != r.counters.end()) ratios[r.benchmark_name()] = it->second.value;
    }
    ConsoleReporter::ReportRuns(runs);
  }
  std::map<std::string, double> times;
  std::map<std::string, double> ratios;  // x_memcpy by benchmark name.
};

// Issue 18's targets, from the rows of this run that measured them.
void PrintTargets(const Recorder& rec) {
  std::printf("\ntargets (issue 18), this run:\n");
  auto line = [](const char* what, double value, double goal) {
    std::printf("  %-44s %6.2fx  %s\n", what, value, value >= goal ? "met" : "not met");
  };
  auto ratio = [&](const char* name) {
    auto it = rec.ratios.find(name);
    return it == rec.ratios.end() ? NAN : it->second;
  };
  auto time = [&](const char* label) {
    auto it = rec.times.find(label);
    return it == rec.times.end() ? NAN : it->second;
  };
  const double fp16 = time("fp16 T=32768"), k4 = time("kivi4 T=32768"), k2 = time("kivi2 T=32768");
  if (!std::isnan(fp16) && !std::isnan(k4)) {
    line("KIVI-4 attention at 32K >= 2x fp16", fp16 / k4, 2.0);
    if (!std::isnan(k2)) line("KIVI-2 attention at 32K faster than KIVI-4", k4 / k2, 1.0);
  }
  const double qk = ratio("BM_QuantizeKernel/4/0/1"), qv = ratio("BM_QuantizeKernel/4/1/1"),
               enc = ratio("BM_EncodeApi/4");
  if (!std::isnan(qk)) line("KIVI-4 quantize K (vectorized) >= 0.5x memcpy", qk, 0.5);
  if (!std::isnan(qv)) line("KIVI-4 quantize V (vectorized) >= 0.5x memcpy", qv, 0.5);
  if (!std::isnan(enc)) line("Encode() kivi4 >= 0.4x memcpy", enc, 0.4);
}

}  // namespace

int main(int argc, char** argv) {
  g_memcpy_bps = MeasureMemcpy(static_cast<size_t>(kHeads) * kCodecTokens * kDim * 4);
  std::printf(
      "single-core memcpy baseline (16 MiB, best of 5): %.2f GB/s; ISA: %s; integer attention: "
      "%s\n",
      g_memcpy_bps / 1e9, kvtier::VectorIsaName(), kvtier::IntegerDotIsa());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  Recorder rec;
  benchmark::RunSpecifiedBenchmarks(&rec);
  if (!rec.times.empty()) {
    std::printf(
        "\nfused decode attention vs fp16 K/V (same run, wall time; >1 = faster than fp16).\n"
        "kivi4/kivi2/kivi8: integer dot products (kBest: %s); 'fp32': the same codes with "
        "fp32 products; 'avx2': kBest's AVX2 integer kernels (run where the CPU has VNNI)\n",
        kvtier::IntegerDotIsa());
    std::printf("%-8s %9s %8s %12s %12s %8s %12s %12s %8s %12s %8s %8s\n", "tokens", "fp16 ms",
                "kivi4 x", "kivi4 fp32 x", "kivi4 avx2 x", "kivi2 x", "kivi2 fp32 x",
                "kivi2 avx2 x", "kivi8 x", "kivi8 fp32 x", "gear4 x", "gear2 x");
    for (int64_t t : {4096, 32768, 131072}) {
      auto get = [&](const std::string& s, const char* suffix = "") {
        auto it = rec.times.find(s + " T=" + std::to_string(t) + suffix);
        return it == rec.times.end() ? NAN : it->second;
      };
      const double base = get("fp16");
      std::printf("%-8lld %9.3f %8.2f %12.2f %12.2f %8.2f %12.2f %12.2f %8.2f %12.2f %8.2f %8.2f\n",
                  static_cast<long long>(t), base, base / get("kivi4"),
                  base / get("kivi4", " fp32"), base / get("kivi4", " avx2"), base / get("kivi2"),
                  base / get("kivi2", " fp32"), base / get("kivi2", " avx2"), base / get("kivi8"),
                  base / get("kivi8", " fp32"), base / get("gear4"), base / get("gear2"));
    }
  }
  PrintTargets(rec);
  benchmark::Shutdown();
  return 0;
}
