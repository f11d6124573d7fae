#!/usr/bin/env python3
"""kvtier's in-process forward pass against llama.cpp on one model file.

Prefill (one batch of --prefill tokens) and decode (--decode greedy tokens,
one at a time, logits each step) with the same thread count, same run,
interleaved --repeat times; prints a table with the median tokens/s of each
and kvtier's ratio to llama.cpp. Run with the evaluation venv:
  $(scripts/kvtier.sh venv)/bin/python bench/model_bench.py \\
      --kvtier build/tools/kvtier --model "$(scripts/kvtier.sh model)"
"""
import argparse
import os
import platform
import re
import statistics
import subprocess
import time

import numpy as np
import llama_cpp


def llama_run(llm, prefill, decode, vocab):
    ids = [int((i * 7919 + 13) % vocab) for i in range(prefill)]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    for _ in range(decode):
        p = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        tok = int(np.argmax(np.ctypeslib.as_array(p, shape=(vocab,))))
        llm.eval([tok])
    t2 = time.perf_counter()
    return prefill / (t1 - t0), decode / (t2 - t1)


def kvtier_run(kvtier, model, prefill, decode, threads):
    out = subprocess.run([kvtier, "model", "bench", model, f"--prefill={prefill}",
                          f"--decode={decode}", f"--threads={threads}"], check=True,
                         capture_output=True, text=True).stdout
    p = float(re.search(r"^prefill .* ([0-9.]+) tokens/s", out, re.M).group(1))
    d = float(re.search(r"^decode .* ([0-9.]+) tokens/s", out, re.M).group(1))
    isa = re.search(r"^isa (.*?),", out, re.M).group(1)
    return p, d, isa


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvtier", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=a.prefill + a.decode + 8, n_batch=512,
                          n_ubatch=512, n_threads=a.threads, n_threads_batch=a.threads,
                          flash_attn=False, verbose=False)
    vocab = llm.n_vocab()
    rows = {"llama.cpp": ([], []), "kvtier": ([], [])}
    isa = "?"
    for _ in range(a.repeat):
        p, d = llama_run(llm, a.prefill, a.decode, vocab)
        rows["llama.cpp"][0].append(p)
        rows["llama.cpp"][1].append(d)
        p, d, isa = kvtier_run(a.kvtier, a.model, a.prefill, a.decode, a.threads)
        rows["kvtier"][0].append(p)
        rows["kvtier"][1].append(d)
    med = {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in rows.items()}
    print(f"model {os.path.basename(a.model)}; {a.threads} thread(s); CPU {cpu_name()}; "
          f"kvtier ISA {isa}; median of {a.repeat} interleaved runs")
    print(f"| engine | prefill {a.prefill} tokens, tokens/s | decode {a.decode} tokens, tokens/s |")
    print("|---|---|---|")
    for k, (p, d) in med.items():
        print(f"| {k} | {p:.1f} | {d:.1f} |")
    print(f"| kvtier / llama.cpp | {med['kvtier'][0] / med['llama.cpp'][0]:.2f}x | "
          f"{med['kvtier'][1] / med['llama.cpp'][1]:.2f}x |")


if __name__ == "__main__":
    main()
