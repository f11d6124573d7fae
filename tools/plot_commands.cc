// `kvtier plot`: pictures of the tables kvtier writes, drawn by gnuplot
// (Debian's gnuplot-nox): codec fidelity against compression, eviction loss
// against budget, and the demo's working set per round.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "tools/cli_args.h"

namespace kvtier::cli {
namespace {

constexpr char kHelp[] =
    "kvtier plot codecs CSV --out=FILE.svg|png [--trace=NAME] [--y=attn_rel_err|kl|top1_agree]\n"
    "  Fidelity against compression, one point per codec setting, from the CSV of\n"
    "  `kvtier eval codecs --csv` (default trace: the file's first).\n\n"
    "kvtier plot eviction CSV --out=FILE.svg|png [--trace=NAME] [--y=kl|top1_agree|attn_rel_err]\n"
    "  Loss against budget (share of the tokens kept), one line per method, from the CSV of\n"
    "  `kvtier eval eviction --csv`.\n\n"
    "kvtier plot demo REPORT.json --out=FILE.svg|png\n"
    "  The working set against the full cache, per round and session, from the JSON report\n"
    "  of `make demo` (REPORT=file.json) or `kvtier-engine --report`.\n\n"
    "The picture's format follows the --out extension. Needs gnuplot (Debian's gnuplot-nox).\n";

int Fail(const std::string& msg, int code) {
  std::fprintf(stderr, "kvtier plot: %s\n", msg.c_str());
  return code;
}

struct Table {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  int Column(const std::string& name) const {
    for (size_t i = 0; i < header.size(); ++i) {
      if (header[i] == name) return static_cast<int>(i);
    }
    return -1;
  }
};

bool ReadCsv(const std::string& path, Table* t, std::string* err) {
  std::ifstream f(path);
  if (!f) {
    *err = "cannot read " + path;
    return false;
  }
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    std::vector<std::string> cells = absl::StrSplit(line, ',');
    if (t->header.empty()) {
      t->header = cells;
    } else if (cells.size() != t->header.size()) {
      *err = absl::StrCat(path, ": a row of ", cells.size(), " cells under a header of ",
                          t->header.size());
      return false;
    } else {
      t->rows.push_back(cells);
    }
  }
  if (t->rows.empty()) {
    *err = path + ": no rows";
    return false;
  }
  return true;
}

// Runs gnuplot on `script` (data files beside it in `dir`); the terminal
// follows the extension of `out`.
int Gnuplot(const std::string& dir, const std::string& script, const std::string& out) {
  std::string term;
  if (out.size() > 4 && out.substr(out.size() - 4) == ".svg") {
    term = "set terminal svg size 900,560 dynamic enhanced font 'sans,12' background '#ffffff'";
  } else if (out.size() > 4 && out.substr(out.size() - 4) == ".png") {
    term = "set terminal pngcairo size 900,560 enhanced font 'sans,10'";
  } else {
    return Fail("--out must end in .svg or .png, got '" + out + "'", 2);
  }
  const std::string path = dir + "/plot.gp";
  {
    std::ofstream f(path);
    f << term << "\nset output '" << out << "'\nset grid\nset key outside right top\n" << script;
  }
  const std::string cmd = absl::StrCat("cd '", dir, "' && gnuplot plot.gp 2>gnuplot.err");
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    std::ifstream e(dir + "/gnuplot.err");
    std::stringstream ss;
    ss << e.rdbuf();
    std::string msg = ss.str();
    if (rc == 127 * 256 || msg.find("not found") != std::string::npos) {
      return Fail("needs gnuplot (Debian's gnuplot-nox; scripts/kvtier.sh deps installs it)", 1);
    }
    return Fail("gnuplot failed: " + msg, 1);
  }
  std::printf("wrote %s\n", out.c_str());
  return 0;
}

std::string TempDir() {
  char tmpl[] = "/tmp/kvtier-plot-XXXXXX";
  const char* d = mkdtemp(tmpl);
  return d != nullptr ? d : "/tmp";
}

std::string Quote(const std::string& s) {
  std::string out;
  for (char c : s) out += c == '\'' ? '"' : c;
  return out;
}

std::string Absolute(const std::string& p) {
  if (!p.empty() && p[0] == '/') return p;
  char buf[4096];
  return getcwd(buf, sizeof(buf)) != nullptr ? absl::StrCat(buf, "/", p) : p;
}

// Rows of `t` for one trace (the first one when `trace` is empty).
std::vector<const std::vector<std::string>*> TraceRows(const Table& t, std::string* trace) {
  const int col = t.Column("trace");
  std::vector<const std::vector<std::string>*> out;
  if (trace->empty() && col >= 0) *trace = t.rows[0][col];
  for (const auto& r : t.rows) {
    if (col < 0 || r[col] == *trace) out.push_back(&r);
  }
  return out;
}

int Codecs(const Args& args) {
  if (args.positional().size() != 2) return Fail("codecs takes one CSV (see --help)", 2);
  Table t;
  std::string err;
  if (!ReadCsv(args.positional()[1], &t, &err)) return Fail(err, 2);
  const std::string y = args.Get("y", "attn_rel_err");
  const int cx = t.Column("compression_ratio"), cy = t.Column(y), cn = t.Column("codec");
  if (cx < 0 || cy < 0 || cn < 0) {
    return Fail(absl::StrCat("the CSV needs the columns codec, compression_ratio and ", y,
                             " (kvtier eval codecs --csv)"),
                2);
  }
  std::string trace = args.Get("trace");
  const auto rows = TraceRows(t, &trace);
  if (rows.empty()) return Fail("no rows of trace " + trace, 2);
  const std::string dir = TempDir();
  std::ofstream d(dir + "/codecs.dat");
  for (const auto* r : rows) {
    if ((*r)[cx].empty() || (*r)[cy].empty()) continue;
    d << (*r)[cx] << " " << (*r)[cy] << " \"" << (*r)[cn] << "\"\n";
  }
  d.close();
  const bool log_y = y != "top1_agree";
  const std::string script = absl::StrCat(
      "set title 'codec fidelity against compression (", Quote(trace), ")' noenhanced\n",
      "set xlabel 'compression ratio (raw fp16 bytes / stored bytes)'\nset ylabel '", y,
      "' noenhanced\n", log_y ? "set logscale y\n" : "", "unset key\n",
      "plot 'codecs.dat' using 1:2 with points pt 7 ps 1.2 lc rgb '#1f77b4', \\\n"
      "     '' using 1:2:3 with labels offset char 0.6,0.6 left font ',9' tc rgb '#333333' "
      "noenhanced\n");
  return Gnuplot(dir, script, Absolute(args.Get("out")));
}

int Eviction(const Args& args) {
  if (args.positional().size() != 2) return Fail("eviction takes one CSV (see --help)", 2);
  Table t;
  std::string err;
  if (!ReadCsv(args.positional()[1], &t, &err)) return Fail(err, 2);
  const std::string y = args.Get("y", "kl");
  const int cx = t.Column("budget_frac"), cy = t.Column(y), cm = t.Column("method");
  if (cx < 0 || cy < 0 || cm < 0) {
    return Fail(absl::StrCat("the CSV needs the columns method, budget_frac and ", y,
                             " (kvtier eval eviction --csv)"),
                2);
  }
  std::string trace = args.Get("trace");
  const auto rows = TraceRows(t, &trace);
  if (rows.empty()) return Fail("no rows of trace " + trace, 2);
  std::map<std::string, std::vector<std::pair<double, std::string>>> by_method;
  std::vector<std::string> order;
  for (const auto* r : rows) {
    if ((*r)[cy].empty()) continue;
    if (by_method.count((*r)[cm]) == 0) order.push_back((*r)[cm]);
    by_method[(*r)[cm]].push_back({std::atof((*r)[cx].c_str()), (*r)[cy]});
  }
  if (order.empty()) {
    return Fail(absl::StrCat("trace ", trace, " has no ", y,
                             " values; try another --y (kl, top1_agree, attn_rel_err, l1_loss)"),
                2);
  }
  const std::string dir = TempDir();
  std::vector<std::string> plots;
  for (size_t i = 0; i < order.size(); ++i) {
    auto& pts = by_method[order[i]];
    std::sort(pts.begin(), pts.end());
    const std::string file = absl::StrCat("m", i, ".dat");
    std::ofstream d(dir + "/" + file);
    for (const auto& [x, v] : pts) d << x << " " << v << "\n";
    plots.push_back(absl::StrCat("'", file, "' using 1:2 with linespoints lw 2 pt 7 title '",
                                 Quote(order[i]), "' noenhanced"));
  }
  const std::string script = absl::StrCat(
      "set title 'eviction: loss against budget (", Quote(trace), ")' noenhanced\n",
      "set xlabel 'budget (share of the tokens kept per head)'\nset ylabel '", y, "' noenhanced\n",
      "set logscale x\n", y == "top1_agree" ? "" : "set logscale y\n", "plot ",
      absl::StrJoin(plots, ", \\\n     "), "\n");
  return Gnuplot(dir, script, Absolute(args.Get("out")));
}

int Demo(const Args& args) {
  if (args.positional().size() != 2) return Fail("demo takes one REPORT.json (see --help)", 2);
  std::ifstream f(args.positional()[1]);
  if (!f) return Fail("cannot read " + args.positional()[1], 2);
  std::stringstream ss;
  ss << f.rdbuf();
  google::protobuf::Struct report;
  if (!google::protobuf::util::JsonStringToMessage(ss.str(), &report).ok()) {
    return Fail(args.positional()[1] + ": not a JSON report", 2);
  }
  const auto& fields = report.fields();
  auto it = fields.find("per_session");
  if (it == fields.end() || !it->second.has_list_value()) {
    return Fail("the report has no per_session list (make demo REPORT=file.json)", 2);
  }
  const std::string dir = TempDir();
  std::vector<std::string> plots;
  int n = 0;
  for (const auto& s : it->second.list_value().values()) {
    const auto& sf = s.struct_value().fields();
    auto ws = sf.find("working_set_per_round");
    auto full = sf.find("full_cache_per_round");
    if (ws == sf.end() || full == sf.end()) {
      return Fail("the report lacks working_set_per_round (written by this version's demo)", 2);
    }
    const std::string file = absl::StrCat("s", n, ".dat");
    std::ofstream d(dir + "/" + file);
    const auto& a = ws->second.list_value().values();
    const auto& b = full->second.list_value().values();
    for (int r = 0; r < a.size() && r < b.size(); ++r) {
      if (b[r].number_value() > 0)
        d << r << " " << a[r].number_value() / b[r].number_value() << "\n";
    }
    auto id = sf.find("id");
    plots.push_back(absl::StrCat("'", file, "' using 1:2 with linespoints lw 2 pt 7 title '",
                                 Quote(id != sf.end() ? id->second.string_value() : file),
                                 "' noenhanced"));
    ++n;
  }
  if (n == 0) return Fail("the report has no sessions", 2);
  auto pol = fields.find("policy");
  const std::string script = absl::StrCat(
      "set title 'working set against the full cache, per round (",
      Quote(pol != fields.end() ? pol->second.string_value() : ""), ")' noenhanced\n",
      "set xlabel 'round'\nset ylabel 'working set / full cache'\nset yrange [0:*]\nplot ",
      absl::StrJoin(plots, ", \\\n     "), "\n");
  return Gnuplot(dir, script, Absolute(args.Get("out")));
}

}  // namespace

int PlotCommand(const Args& args) {
  const std::string sub = args.positional().empty() ? "help" : args.positional()[0];
  if (sub == "help" || args.Has("help")) {
    std::printf("%s", kHelp);
    return 0;
  }
  for (const std::string& u : args.Unknown({"out", "trace", "y", "help"})) {
    return Fail("unknown flag --" + u + " (see kvtier plot help)", 2);
  }
  if (!args.Has("out")) return Fail("--out=FILE.svg|png is required", 2);
  if (sub == "codecs") return Codecs(args);
  if (sub == "eviction") return Eviction(args);
  if (sub == "demo") return Demo(args);
  return Fail("unknown subcommand '" + sub + "' (codecs, eviction, demo)", 2);
}

}  // namespace kvtier::cli
