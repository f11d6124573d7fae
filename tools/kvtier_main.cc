// kvtier: the command-line tool. `kvtier help` lists the commands.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/numbers.h"
#include "base/version.h"
#include "tools/cli_args.h"

namespace kvtier::cli {

int StoreCommand(const Args& args);
int EvalCommand(const Args& args);
int BudgetsCommand(const Args& args);
int PolicyCommand(const Args& args);
int ConversationsCommand(const Args& args);
int CalibrateCommand(const Args& args);
int PlotCommand(const Args& args);
int ModelCommand(const Args& args);

bool ReadClientTls(const Args& args, std::string* root_certs, std::string* cert_chain,
                   std::string* private_key, std::string* error) {
  auto read = [&](const char* flag, std::string* out) {
    if (!args.Has(flag)) return true;
    std::ifstream in(args.Get(flag), std::ios::binary);
    if (!in) {
      *error = std::string("cannot read --") + flag + " " + args.Get(flag);
      return false;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    *out = ss.str();
    return true;
  };
  if (args.Has("tls_cert") != args.Has("tls_key")) {
    *error = "--tls_cert and --tls_key go together";
    return false;
  }
  return read("tls_ca", root_certs) && read("tls_cert", cert_chain) && read("tls_key", private_key);
}

Args::Args(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      size_t eq = a.find('=');
      const bool boolean =
          a == "--unpin" || a == "--help" || a == "--oracle" || a == "--no_bos" || a == "--special";
      if (eq == std::string::npos && !boolean && i + 1 < argc &&
          std::string(argv[i + 1]).rfind("--", 0) != 0) {
        kv_[a.substr(2)] = argv[++i];  // "--flag value"
      } else if (eq == std::string::npos) {
        kv_[a.substr(2)] = "true";
      } else {
        kv_[a.substr(2, eq - 2)] = a.substr(eq + 1);
      }
    } else {
      pos_.push_back(a);
    }
  }
}

std::string Args::Get(const std::string& k, const std::string& def) const {
  auto it = kv_.find(k);
  return it == kv_.end() ? def : it->second;
}

uint64_t Args::GetU64(const std::string& k, uint64_t def) const {
  auto it = kv_.find(k);
  if (it == kv_.end()) return def;
  uint64_t v;
  if (!absl::SimpleAtoi(it->second, &v)) {
    std::fprintf(stderr, "kvtier: --%s must be a non-negative integer, got '%s'\n", k.c_str(),
                 it->second.c_str());
    std::exit(2);
  }
  return v;
}

std::vector<std::string> Args::Unknown(const std::vector<std::string>& known) const {
  std::vector<std::string> out;
  for (const auto& [k, v] : kv_) {
    bool found = false;
    for (const auto& n : known) found |= n == k;
    if (!found) out.push_back(k);
  }
  return out;
}

}  // namespace kvtier::cli

int main(int argc, char** argv) {
  std::string cmd = argc > 1 ? argv[1] : "help";
  if (cmd == "store") return kvtier::cli::StoreCommand(kvtier::cli::Args(argc, argv, 2));
  if (cmd == "eval") return kvtier::cli::EvalCommand(kvtier::cli::Args(argc, argv, 2));
  if (cmd == "budgets") return kvtier::cli::BudgetsCommand(kvtier::cli::Args(argc, argv, 2));
  if (cmd == "policy") return kvtier::cli::PolicyCommand(kvtier::cli::Args(argc, argv, 2));
  if (cmd == "calibrate") return kvtier::cli::CalibrateCommand(kvtier::cli::Args(argc, argv, 2));
  if (cmd == "plot") return kvtier::cli::PlotCommand(kvtier::cli::Args(argc, argv, 2));
  if (cmd == "model") return kvtier::cli::ModelCommand(kvtier::cli::Args(argc, argv, 2));
  if (cmd == "--version" || cmd == "version") {
    std::printf("kvtier %s\n", kvtier::KvtierVersion().c_str());
    return 0;
  }
  if (cmd == "conversations") {
    return kvtier::cli::ConversationsCommand(kvtier::cli::Args(argc, argv, 2));
  }
  std::printf(
      "kvtier: the kvtier command-line tool\n\n"
      "  kvtier store SUBCOMMAND [--target=HOST:PORT] [--token=TOKEN] ...\n"
      "      put | get | ls | drop | rm | pin | stats   (kvtier store help)\n"
      "  kvtier eval codecs [--model=PATH] [--csv=FILE] ...\n"
      "  kvtier eval eviction [--model=PATH] [--csv=FILE] ...\n"
      "  kvtier eval watershed [--model=PATH] [--csv=FILE] ...\n"
      "  kvtier eval speculation --model=PATH [--alpha=2,4,6] ...\n"
      "      codec fidelity / eviction tables         (kvtier eval help)\n"
      "  kvtier budgets search --model=PATH --out=FILE [--budget=C]\n"
      "      EvolKV layer-budget search               (kvtier budgets help)\n"
      "  kvtier policy set|get --model=NAME [--controller=HOST:PORT] ...\n"
      "      per-model policies of kvtier-controller  (kvtier policy help)\n"
      "  kvtier calibrate infinigen --model=PATH --out=FILE [--partial_ratio=0.2]\n"
      "      InfiniGen skew and partial columns       (kvtier calibrate help)\n"
      "  kvtier conversations check FILE [--model=PATH] | sample --model=PATH\n"
      "      conversation files for replay            (kvtier conversations help)\n"
      "  kvtier model info|tokenize|detokenize|dequant|logits FILE ...\n"
      "      model files: shape, tokens, tensors, logits (kvtier model help)\n"
      "  kvtier plot codecs|eviction|demo FILE --out=FILE.svg|png\n"
      "      pictures of the tables (gnuplot)         (kvtier plot help)\n"
      "  kvtier --version\n");
  return cmd == "help" || cmd == "--help" ? 0 : 2;
}
