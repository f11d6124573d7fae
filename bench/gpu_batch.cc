// kvtier-gpu-bench --batch=SxT (docs/gpu.md): one decode step of S
// sessions in one launch of SegmentedAttention, their KV heads side by
// side, against S launches, one a session.
#include <cmath>

#include "bench/gpu_step.h"
#include "kernels/cuda/cuda_kernels.h"

namespace kvtier::bench::gpu {
namespace {

// One decode step of `sessions` sessions of `t` tokens each: S launches of
// SegmentedAttention (one a session, as a worker decoding them one by one
// makes) against one launch over all of them, their KV heads side by side
// (kv_heads S * 8, query heads S * 32: the kernel takes each head's blocks
// as they are, whatever its session, token count or codec). Both checked
// against each session's float64 reference; prints one table row.
struct BatchRow {
  std::string codec;
  double separate_ms = 0, one_ms = 0, x_copy = 0, rel_error = 0;
};
BatchRow MeasureBatch(const std::string& setting, int sessions, int64_t t, double copy_gbps,
                      const Options& o) {
  const std::function<void()> flush = o.flush ? std::function<void()>(FlushL2) : nullptr;
  const int d = kDim;
  std::vector<Step> steps;
  for (int s = 0; s < sessions; ++s) steps.push_back(Prepare(setting, t, 1 + s));
  const size_t q_per = static_cast<size_t>(kQHeads) * d,
               open_per = static_cast<size_t>(kKvHeads) * d;
  float *dev_q = nullptr, *dev_out = nullptr, *dev_open = nullptr, *dev_scratch = nullptr;
  const size_t qbytes = sessions * q_per * sizeof(float);
  GPU_CHECK(cudaMalloc(&dev_q, qbytes));
  GPU_CHECK(cudaMalloc(&dev_out, qbytes));
  GPU_CHECK(cudaMalloc(&dev_open, sessions * 2 * open_per * sizeof(float)));
  std::vector<uint8_t*> staged(sessions);
  std::vector<cuda::SegBlock> all;  // Every session's blocks, session by session.
  std::vector<int> all_first;
  std::vector<std::vector<cuda::SegBlock>> one(sessions);
  double bytes = 0;
  for (int s = 0; s < sessions; ++s) {
    const Step& st = steps[s];
    bytes += FloorBytes(st);
    GPU_CHECK(cudaMalloc(&staged[s], st.staged.size()));
    GPU_CHECK(cudaMemcpy(staged[s], st.staged.data(), st.staged.size(), cudaMemcpyHostToDevice));
    GPU_CHECK(
        cudaMemcpy(dev_q + s * q_per, st.q.data(), q_per * sizeof(float), cudaMemcpyHostToDevice));
    float* open = dev_open + s * 2 * open_per;
    GPU_CHECK(cudaMemcpy(open, st.open_k.data(), open_per * sizeof(float), cudaMemcpyHostToDevice));
    GPU_CHECK(cudaMemcpy(open + open_per, st.open_v.data(), open_per * sizeof(float),
                         cudaMemcpyHostToDevice));
    for (int h = 0; h < kKvHeads; ++h) {
      all_first.push_back(static_cast<int>(all.size()));
      cuda::SegBlock past;
      past.tokens = t;
      past.k = worker::PlaceStaged(st.heads[h].first, staged[s]);
      past.v = worker::PlaceStaged(st.heads[h].second, staged[s]);
      cuda::SegBlock cur;  // The open round's row, fp32, as the worker's mirror.
      cur.tokens = 1;
      cur.causal = 1;
      cur.k.token_stride = cur.v.token_stride = static_cast<int64_t>(kKvHeads) * d;
      cur.k.raw = open + h * d;
      cur.v.raw = open + open_per + h * d;
      for (const cuda::SegBlock& b : {past, cur}) {
        all.push_back(b);
        one[s].push_back(b);
      }
    }
  }
  all_first.push_back(static_cast<int>(all.size()));
  std::vector<int> one_first;
  for (int h = 0; h <= kKvHeads; ++h) one_first.push_back(2 * h);
  auto upload = [](const auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    T* p = nullptr;
    GPU_CHECK(cudaMalloc(&p, v.size() * sizeof(T)));
    GPU_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  };
  cuda::SegBlock* dev_all = upload(all);
  int* dev_all_first = upload(all_first);
  int* dev_one_first = upload(one_first);
  std::vector<cuda::SegBlock*> dev_one;
  for (const auto& b : one) dev_one.push_back(upload(b));
  cuda::SegDims g1;  // One session.
  g1.n = 1;
  g1.q_heads = kQHeads;
  g1.kv_heads = kKvHeads;
  g1.d = d;
  g1.max_tokens = t + 1;
  cuda::SegDims gb = g1;  // The batch.
  gb.q_heads = sessions * kQHeads;
  gb.kv_heads = sessions * kKvHeads;
  GPU_CHECK(
      cudaMalloc(&dev_scratch, static_cast<size_t>(std::max(cuda::SegmentedScratchFloats(g1),
                                                            cuda::SegmentedScratchFloats(gb))) *
                                   sizeof(float)));
  auto run = [](int err) {
    if (err != 0) {
      std::fprintf(stderr, "kvtier-gpu-bench: SegmentedAttention: %s\n", cuda::ErrorString(err));
      std::exit(2);
    }
  };
  auto separate = [&] {
    for (int s = 0; s < sessions; ++s) {
      run(cuda::SegmentedAttention(g1, dev_one[s], dev_one_first, dev_q + s * q_per, dev_scratch,
                                   dev_out + s * q_per, nullptr));
    }
  };
  auto batched = [&] {
    run(cuda::SegmentedAttention(gb, dev_all, dev_all_first, dev_q, dev_scratch, dev_out, nullptr));
  };
  std::vector<std::vector<double>> want;
  for (const Step& st : steps) want.push_back(Reference(st));
  auto check = [&](const std::function<void()>& launch) {
    GPU_CHECK(cudaMemset(dev_out, 0xff, qbytes));  // NaN: every element must be written.
    launch();
    GPU_CHECK(cudaGetLastError());
    GPU_CHECK(cudaDeviceSynchronize());
    std::vector<float> out(sessions * q_per);
    GPU_CHECK(cudaMemcpy(out.data(), dev_out, qbytes, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int s = 0; s < sessions; ++s) {
      const std::vector<float> part(out.begin() + s * q_per, out.begin() + (s + 1) * q_per);
      worst = std::max(worst, RelError(part, want[s]));
    }
    return worst;
  };
  const double sep_error = check(separate), one_error = check(batched);
  const double sep_ms = MedianMs(o.reps, separate, flush);
  const double one_ms = MedianMs(o.reps, batched, flush);
  const double gbps = bytes / (one_ms * 1e6);
  std::printf("| %s | %d x %lld | %.4f | %.4f | %.2f | %.0f | %.0f | %.2f | %.2e | %.2e |\n",
              setting.c_str(), sessions, static_cast<long long>(t), sep_ms, one_ms, sep_ms / one_ms,
              bytes, gbps, gbps / copy_gbps, sep_error, one_error);
  std::fflush(stdout);
  for (uint8_t* p : staged) GPU_CHECK(cudaFree(p));
  for (cuda::SegBlock* p : dev_one) GPU_CHECK(cudaFree(p));
  for (void* p :
       {static_cast<void*>(dev_q), static_cast<void*>(dev_out), static_cast<void*>(dev_open),
        static_cast<void*>(dev_scratch), static_cast<void*>(dev_all),
        static_cast<void*>(dev_all_first), static_cast<void*>(dev_one_first)}) {
    GPU_CHECK(cudaFree(p));
  }
  return BatchRow{setting, sep_ms, one_ms, gbps / copy_gbps, std::max(sep_error, one_error)};
}

}  // namespace

int RunBatch(const Options& o, double copy) {
  std::printf(
      "Batched decode: %d sessions of %lld tokens (32 q / 8 kv heads each, head_dim 128), "
      "one decode step: %d launches (one a session) against one launch over all their "
      "heads; median of %d, %s\n",
      o.batch_sessions, static_cast<long long>(o.batch_tokens), o.batch_sessions, o.reps,
      o.flush ? "L2 flushed before each" : "L2 not flushed");
  std::printf(
      "| codec | sessions x tokens | separate ms | one launch ms | separate / one | bytes "
      "read (floor) | GB/s, one launch | x copy bandwidth | rel error, separate | rel "
      "error, one launch |\n|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<BatchRow> rows;
  for (const std::string& c : o.codecs) {
    std::fprintf(stderr, "%s, %d x %lld tokens...\n", c.c_str(), o.batch_sessions,
                 static_cast<long long>(o.batch_tokens));
    rows.push_back(MeasureBatch(c, o.batch_sessions, o.batch_tokens, copy, o));
  }
  // Issue 53's: one launch at 0.8x the copy bandwidth or more, and 4x the
  // separate launches or more.
  std::printf(
      "\nTargets (issue 53, batched decode), this run\n| target | figure | met |\n"
      "|---|---|---|\n");
  bool right = true;
  for (const BatchRow& r : rows) {
    std::printf("| %s, one launch: x copy bandwidth, >= 0.8 | %.2f | %s |\n", r.codec.c_str(),
                r.x_copy, r.x_copy >= 0.8 ? "yes" : "NO");
    const double faster = r.separate_ms / r.one_ms;
    std::printf("| %s: separate ms / one launch ms, >= 4 | %.2f | %s |\n", r.codec.c_str(), faster,
                faster >= 4.0 ? "yes" : "NO");
    if (!(r.rel_error <= 1e-3)) right = false;
  }
  std::printf("\n");
  if (!right) std::printf("FAILED: a relative error over 1e-3\n");
  return right ? 0 : 1;
}

}  // namespace kvtier::bench::gpu
