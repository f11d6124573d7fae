// kvtier-engine: multi-round conversations served through kvtier-worker,
// against an in-process full cache (refengine/demo.h). `make demo` runs it.
#include <cstdio>
#include <fstream>
#include <string>
#include <tuple>

#include "absl/flags/flag.h"
#include "base/command_line.h"
#include "refengine/demo.h"

ABSL_FLAG(std::string, worker, "", "kvtier-worker address host:port (or --controller).");
ABSL_FLAG(std::string, decode_worker, "",
          "A second kvtier-worker host:port that decodes: each round's prefill on --worker is "
          "handed off to it layer by layer and handed back after EndRound (docs/transfer.md).");
ABSL_FLAG(std::string, controller, "",
          "kvtier-controller address host:port: route every session through the cluster, with "
          "failover to another worker (docs/cluster.md).");
ABSL_FLAG(std::string, store, "",
          "kvtier-store address host:port, for the per-tier bytes of the report (optional).");
ABSL_FLAG(std::string, token, "", "Bearer token for the worker and the store (empty: none).");
ABSL_FLAG(std::string, worker_tls_root_certs, "",
          "PEM file of the CA of the workers' certificates: talk to workers over TLS (empty: "
          "plaintext).");
ABSL_FLAG(std::string, worker_tls_server_name, "",
          "Name expected in the workers' certificates instead of the address's host.");
ABSL_FLAG(std::string, tls_client_cert, "",
          "PEM certificate chain presented to workers that require client certificates "
          "(mutual TLS); with --tls_client_key and --worker_tls_root_certs.");
ABSL_FLAG(std::string, tls_client_key, "", "PEM private key of --tls_client_cert.");
ABSL_FLAG(std::string, store_tls_root_certs, "",
          "PEM file of the CA of --store's certificate: reach it over TLS (presenting "
          "--tls_client_cert when given); empty: plaintext.");
ABSL_FLAG(std::string, controller_tls_root_certs, "",
          "PEM file of the CA of --controller's certificate: route over TLS (presenting "
          "--tls_client_cert when given); empty: plaintext.");
ABSL_FLAG(
    std::string, model, "",
    "GGUF file (llama, gemma3) or llama2.c checkpoint (e.g. ../shared/models/stories260K.bin); "
    "empty runs the embedded "
    "synthetic multi-round chat.");
ABSL_FLAG(std::string, conversations, "",
          "Replay your own conversations: a JSON Lines file, one conversation a line, rounds of "
          "token ids of --model ({\"rounds\": [{\"user\": [...], \"assistant\": [...], "
          "\"score\": [[0, 4]]}]}; docs/replay.md). Each round's user tokens are one prefill, its "
          "assistant tokens are teacher-forced; the report scores the tier against the full cache "
          "and both against the given tokens. --rounds, --question_tokens, --answer_tokens and "
          "--seed do not apply.");
ABSL_FLAG(bool, answer_prefill, false,
          "With --conversations: each round's answer as one prefill step after its question, "
          "every position scored from it, instead of a decode step per token (the same logits up "
          "to rounding, several times faster; not with --speculation, which acts at decode "
          "steps). The report's decode times are then the answer prefill's per token.");
ABSL_FLAG(std::string, teacher_cache, "",
          "With --conversations: a directory of the full cache's logits, keyed by the model file, "
          "this binary and each conversation's tokens. A conversation found there is scored "
          "against them instead of running the full cache again; one that is not is run and "
          "added (about 4 bytes x vocabulary per answer token: 1 MiB a token on Gemma 3). For "
          "replaying the same conversations under several policies; the directory is yours to "
          "remove.");
ABSL_FLAG(int, sessions, 4,
          "Concurrent conversations (with --conversations: how many of the file's run at a "
          "time).");
ABSL_FLAG(int, rounds, 24, "Rounds per conversation.");
ABSL_FLAG(int, question_tokens, 0, "Tokens per question (0: 16 synthetic, 10 model).");
ABSL_FLAG(int, answer_tokens, 0, "Tokens per answer (0: 16 synthetic, 11 model).");
ABSL_FLAG(std::string, codec, "raw",
          "raw (the model dtype, lossless), fp16, kivi8, kivi4, kivi2, kcvt4, gear2, ... "
          "(docs/codecs.md).");
ABSL_FLAG(std::string, recall, "mass:0.95",
          "all, topk:K, adaptive:LAMBDA, threshold:THETA or mass:P (top-k with the smallest k "
          "holding P of the watershed attention).");
ABSL_FLAG(std::string, evict, "none",
          "none, or METHOD:BUDGET[:w=..][:k=..][:alpha=..][:beta=..] (snapkv, pyramidkv, "
          "ada-snapkv, ada-pyramidkv, h2o, streaming).");
ABSL_FLAG(int, watershed, -1,
          "Watershed layer L_w; -1: 6 for the synthetic chat (measured by kvtier eval "
          "watershed), the worker's default L/3 for a model.");
ABSL_FLAG(std::string, speculation, "",
          "Speculative token selection (InfiniGen): ALPHA[:BUDGET[:POOL_BYTES[:LOW_BYTES]]], "
          "e.g. 4, 4:64, 4:0:65536 or 4:0:65536:40000. Decode steps attend, from layer 1 on, "
          "only the past-round tokens speculated from the previous layer; POOL_BYTES caps each "
          "session's host pool (the least fetched tokens of the older half leave at EndRound; "
          "0: no cap), and a trim takes it down to LOW_BYTES (0: the cap). Needs "
          "--model and --skew (uploaded to every worker a session runs on). Empty: off.");
ABSL_FLAG(std::string, skew, "",
          "The model's skew file for --speculation (kvtier calibrate infinigen), uploaded to "
          "the worker(s).");
ABSL_FLAG(bool, inproc, false,
          "Run the worker engine in this process over --store (no kvtier-worker, no hop per "
          "layer): the shape of an engine that keeps attention on its own GPU.");
ABSL_FLAG(uint64_t, seed, 1, "Conversation seed.");
ABSL_FLAG(std::string, session_prefix, "",
          "Session ids are PREFIX0, PREFIX1, ...; empty: chat-<run id>-.");
ABSL_FLAG(std::string, report, "", "Also write the report as JSON to this file.");
ABSL_FLAG(bool, quiet, false, "No per-round progress lines.");
ABSL_FLAG(bool, shared_decode_stream, true,
          "All sessions' decode layers on one long-lived Decode stream, batched; false: one "
          "stream per session and round.");

int main(int argc, char** argv) {
  kvtier::ParseKvtierCommandLine(
      argc, argv,
      "Serves multi-round conversations through kvtier-worker and compares them with an "
      "in-process full cache.\n  kvtier-engine --worker=HOST:PORT | --inproc [--store=HOST:PORT] "
      "[--model=PATH [--conversations=FILE]] [--codec=..] [--recall=..] [--evict=..] "
      "[--speculation=ALPHA[:BUDGET[:POOL_BYTES[:LOW_BYTES]]] --skew=FILE] [--report=FILE]");
  kvtier::refengine::DemoOptions o;
  o.shared_decode_stream = absl::GetFlag(FLAGS_shared_decode_stream);
  o.worker = absl::GetFlag(FLAGS_worker);
  o.decode_worker = absl::GetFlag(FLAGS_decode_worker);
  o.controller = absl::GetFlag(FLAGS_controller);
  o.store = absl::GetFlag(FLAGS_store);
  o.token = absl::GetFlag(FLAGS_token);
  if (const std::string f = absl::GetFlag(FLAGS_worker_tls_root_certs); !f.empty()) {
    std::ifstream in(f);
    o.worker_tls_root_certs.assign(std::istreambuf_iterator<char>(in), {});
    if (o.worker_tls_root_certs.empty()) {
      std::fprintf(stderr, "kvtier-engine: --worker_tls_root_certs=%s is missing or empty\n",
                   f.c_str());
      return 2;
    }
  }
  o.worker_tls_server_name = absl::GetFlag(FLAGS_worker_tls_server_name);
  {
    const std::string cert = absl::GetFlag(FLAGS_tls_client_cert);
    const std::string key = absl::GetFlag(FLAGS_tls_client_key);
    for (auto [flag, name, out] :
         {std::tuple{&FLAGS_controller_tls_root_certs, "controller_tls_root_certs",
                     &o.controller_tls_root_certs},
          std::tuple{&FLAGS_store_tls_root_certs, "store_tls_root_certs",
                     &o.store_tls_root_certs}}) {
      const std::string f = absl::GetFlag(*flag);
      if (f.empty()) continue;
      std::ifstream in(f);
      out->assign(std::istreambuf_iterator<char>(in), {});
      if (out->empty()) {
        std::fprintf(stderr, "kvtier-engine: --%s=%s is missing or empty\n", name, f.c_str());
        return 2;
      }
    }
    if (cert.empty() != key.empty() || (!cert.empty() && o.worker_tls_root_certs.empty())) {
      std::fprintf(stderr,
                   "kvtier-engine: --tls_client_cert and --tls_client_key go together, with "
                   "--worker_tls_root_certs\n");
      return 2;
    }
    std::ifstream c(cert), k(key);
    if (!cert.empty()) {
      o.tls_cert_chain.assign(std::istreambuf_iterator<char>(c), {});
      o.tls_private_key.assign(std::istreambuf_iterator<char>(k), {});
      if (o.tls_cert_chain.empty() || o.tls_private_key.empty()) {
        std::fprintf(stderr,
                     "kvtier-engine: --tls_client_cert or --tls_client_key is missing or "
                     "empty\n");
        return 2;
      }
    }
  }
  o.model = absl::GetFlag(FLAGS_model);
  o.conversations = absl::GetFlag(FLAGS_conversations);
  o.answer_prefill = absl::GetFlag(FLAGS_answer_prefill);
  o.teacher_cache = absl::GetFlag(FLAGS_teacher_cache);
  o.sessions = absl::GetFlag(FLAGS_sessions);
  o.rounds = absl::GetFlag(FLAGS_rounds);
  o.question_tokens = absl::GetFlag(FLAGS_question_tokens);
  o.answer_tokens = absl::GetFlag(FLAGS_answer_tokens);
  o.codec = absl::GetFlag(FLAGS_codec);
  o.recall = absl::GetFlag(FLAGS_recall);
  o.evict = absl::GetFlag(FLAGS_evict);
  o.watershed = absl::GetFlag(FLAGS_watershed);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.speculation = absl::GetFlag(FLAGS_speculation);
  o.skew = absl::GetFlag(FLAGS_skew);
  o.inproc = absl::GetFlag(FLAGS_inproc);
  o.session_prefix = absl::GetFlag(FLAGS_session_prefix);
  if (!o.inproc && o.worker.empty() == o.controller.empty()) {
    std::fprintf(stderr,
                 "kvtier-engine: give --worker or --controller, or --inproc with --store (see "
                 "--help)\n");
    return 2;
  }
  const bool quiet = absl::GetFlag(FLAGS_quiet);
  auto report = kvtier::refengine::RunDemo(o, [quiet](const std::string& line) {
    if (!quiet) std::printf("  %s\n", line.c_str());
    std::fflush(stdout);
  });
  if (!report.ok()) {
    std::fprintf(stderr, "kvtier-engine: %s\n", report.status().ToString().c_str());
    return 1;
  }
  std::printf("%s", kvtier::refengine::RenderText(*report).c_str());
  const std::string path = absl::GetFlag(FLAGS_report);
  if (!path.empty()) {
    std::ofstream f(path);
    f << kvtier::refengine::RenderJson(*report);
    if (!f) {
      std::fprintf(stderr, "kvtier-engine: cannot write %s\n", path.c_str());
      return 1;
    }
    std::printf("JSON report: %s\n", path.c_str());
  }
  return 0;
}
